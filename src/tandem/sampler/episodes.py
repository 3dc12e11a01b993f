"""Multi-turn episodes with tools (agentic RL, `agent.*`): the policy writes, its tool calls run, their
results join the conversation as the chat template's tool messages, and the policy continues, until
it answers without a call, `agent.max_turns` is reached or the episode would pass
`agent.max_episode_tokens`.

Token in, token out: the policy's tokens are kept exactly as sampled, with their log-probs; only the
tool messages (and the template's turn markers around them) are tokenized and appended, with
`policy_mask` 0 and log-prob 0, so the loss never sees them (trainer/batching.py). The text of a turn
is decoded for parsing and for the rewards, never re-tokenized.

Tool calls are parsed in the Hermes format (`<tool_call>{json}</tool_call>`), or with the tokenizer's
own response_template where it has one (`agent.tool_call_format`). Where the chat template
renders tools itself (it uses a `tools` variable, as Qwen2.5's does), the tools' schemas go through
it; otherwise a system-prompt block lists them in the same format (SmolLM2's template has no tools).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tandem.agent.calls import ToolCall, parse_hermes, parse_with_template
from tandem.agent.runner import ToolRunner, truncate_text
from tandem.agent.tools import EnvironmentClass, Tool, check_unique, reset_environment
from tandem.config import AgentConfig
from tandem.types import Example

# `generate(prompts, num_generations, max_new_tokens)`: the engine's sampled ids, log-probs, finished
Generate = Callable[[list[list[int]], int, int], Any]


@dataclass
class Episodes:
    """Episodes ordered prompt by prompt (index p * G + g), everything after the prompt."""

    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)  # 0.0 on tool tokens
    policy_masks: list[list[int] | None] = field(default_factory=list)  # None: no tool tokens
    finished: list[bool] = field(default_factory=list)  # ended with an answer (False: cut)
    messages: list[list[dict]] = field(default_factory=list)  # assistant and tool turns (TRL's completions)
    turns: list[int] = field(default_factory=list)
    tool_calls: list[int] = field(default_factory=list)
    tool_errors: list[Counter] = field(default_factory=list)
    tool_seconds: list[float] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)  # stopped by agent.max_episode_tokens
    environments: list[Any] | None = None  # the episodes' environment instances (rewards may read them)
    prompts: list[list[int]] = field(default_factory=list)  # each prompt's ids (with any observation)
    prompt_texts: list[str] = field(default_factory=list)


def hermes_system_block(schemas: list[dict]) -> str:
    """How the tools are offered where the chat template cannot render them itself."""
    listed = "\n".join(json.dumps(schema, ensure_ascii=False) for schema in schemas)
    return (
        "You can call tools. The tools are described here as JSON schemas:\n<tools>\n"
        f"{listed}\n</tools>\nTo call a tool, write in your reply\n"
        '<tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}</tool_call>\n'
        "and stop; its result comes back in the next message. Answer without a tool call when you are done."
    )


class EpisodeRunner:
    """Runs a batch's episodes: built once per rollout with the run's tools and environment class."""

    def __init__(
        self, cfg: AgentConfig, tokenizer, tools: list[Tool], environment: EnvironmentClass | None
    ) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.tools, self.environment = tools, environment
        probe = environment.new() if environment is not None else None
        self.schemas = [t.schema for t in tools] + (
            [t.schema for t in environment.tools(probe)] if environment is not None else []
        )
        check_unique(tools + (environment.tools(probe) if environment is not None else []))
        self.runner = ToolRunner(cfg.tool_timeout_s, cfg.max_tool_workers)
        self.template_has_tools = "tools" in (getattr(tokenizer, "chat_template", None) or "")
        has_parser = getattr(tokenizer, "response_template", None) is not None
        if cfg.tool_call_format == "template" and not has_parser:
            raise ValueError(
                "agent.tool_call_format is template but the tokenizer has no response_template to read "
                "tool calls with; set agent.tool_call_format: hermes (or auto)"
            )
        self.use_template_parser = cfg.tool_call_format == "template" or (
            cfg.tool_call_format == "auto" and has_parser
        )

    # ------------------------------------------------------------------ prompts

    def render(self, messages: list[dict]) -> str:
        """The prompt text of chat `messages` with the tools offered."""
        if self.template_has_tools:
            return self.tokenizer.apply_chat_template(
                messages, tools=self.schemas, tokenize=False, add_generation_prompt=True
            )
        block = hermes_system_block(self.schemas)
        if messages and messages[0]["role"] == "system":
            messages = [{**messages[0], "content": f"{messages[0]['content']}\n\n{block}"}, *messages[1:]]
        else:
            messages = [{"role": "system", "content": block}, *messages]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def tool_suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        """The tokens that follow an assistant turn ending in eos: the tool messages as the template
        renders them, then the next assistant turn's header. Computed as the difference of two
        renderings of a small conversation (the way TRL does it), cut after the assistant turn's eos."""
        dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "dummy"}]
        before = self.tokenizer.apply_chat_template(dummy, tokenize=False)
        full = self.tokenizer.apply_chat_template(
            dummy + tool_messages, tokenize=False, add_generation_prompt=True
        )
        eos = self.tokenizer.eos_token or ""
        cut = before.rfind(eos) + len(eos) if eos and eos in before else len(before)
        if not full.startswith(before[:cut]):
            raise ValueError(
                "the chat template renders a conversation differently when a tool message follows"
            )
        return self.tokenizer(full[cut:], add_special_tokens=False)["input_ids"]

    # ------------------------------------------------------------------ episodes

    def run(
        self,
        generate: Generate,
        examples: list[Example],
        prompt_of: Callable[[Example], tuple[str, list[int]]],
        num_generations: int,
        max_new_tokens: int,
    ) -> Episodes:
        G = num_generations
        budget = self.cfg.episode_tokens(max_new_tokens)
        out = Episodes()
        # one environment per episode; reset with the row; its observation joins the last user message
        environments = None
        if self.environment is not None:
            environments = [self.environment.new() for _ in range(len(examples) * G)]
        for p, example in enumerate(examples):
            observations = set()
            if environments is not None:
                row = {"prompt_id": example.prompt_id, "question": example.question, "answer": example.answer}
                row.update(example.columns)
                observations = {reset_environment(env, row) for env in environments[p * G : (p + 1) * G]}
                if len(observations) > 1:
                    raise ValueError(
                        f"the environment's reset returned different observations for the {G} episodes of "
                        f"prompt {example.prompt_id!r}: a group shares its prompt, so reset's text must "
                        "depend on the row only"
                    )
            observation = next(iter(observations), None)
            text, ids = prompt_of(with_observation(example, observation) if observation else example)
            out.prompt_texts.append(text)
            out.prompts.append(ids)
        E = len(examples) * G
        tokens: list[list[int]] = [[] for _ in range(E)]
        logprobs: list[list[float]] = [[] for _ in range(E)]
        masks: list[list[int]] = [[] for _ in range(E)]
        messages: list[list[dict]] = [[] for _ in range(E)]
        finished, truncated = [False] * E, [False] * E
        turns, calls = [0] * E, [0] * E
        errors = [Counter() for _ in range(E)]
        seconds = [0.0] * E
        toolboxes = [self._toolbox(environments[e] if environments else None) for e in range(E)]
        active = list(range(E))
        for turn in range(1, self.cfg.max_turns + 1):
            if not active:
                break
            room = {e: budget - len(tokens[e]) for e in active}
            n_new = min(max_new_tokens, max(room.values()))
            if turn == 1:
                gen = generate(out.prompts, G, n_new)
            else:
                gen = generate([out.prompts[e // G] + tokens[e] for e in active], 1, n_new)
            pending = []
            for k, e in enumerate(active):
                ids, lps = gen.token_ids[k], gen.logprobs[k]
                cut = len(ids) > room[e]
                ids, lps = ids[: room[e]], lps[: room[e]]
                tokens[e] += ids
                logprobs[e] += lps
                masks[e] += [1] * len(ids)
                turns[e] = turn
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                messages[e].append({"role": "assistant", "content": text})
                if cut:
                    truncated[e] = True
                    continue
                if not gen.finished[k]:  # cut at max_new_tokens inside the turn
                    continue
                found = self.parse(text, out.prompt_texts[e // G], tokens[e][: len(tokens[e]) - len(ids)])
                readable = [
                    {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in found
                    if isinstance(c, ToolCall)
                ]
                if readable:  # as chat templates and TRL's messages carry them
                    messages[e][-1]["tool_calls"] = readable
                if not found or turn == self.cfg.max_turns:
                    finished[e] = True  # an answer (or a call that gets no more turns)
                    continue
                pending.append((e, found))
            results = self.runner.run([(toolboxes[e], found) for e, found in pending]) if pending else []
            active = []
            for (e, _calls), answers in zip(pending, results):
                tool_messages = []
                for result in answers:
                    calls[e] += 1
                    seconds[e] += result.seconds
                    if result.error is not None:
                        errors[e][result.error] += 1
                    content, _ = truncate_text(
                        result.content, self.tokenizer, self.cfg.max_tool_response_tokens
                    )
                    tool_messages.append({"role": "tool", "name": result.name, "content": content})
                suffix = self.tool_suffix_ids(tool_messages)
                if len(tokens[e]) + len(suffix) >= budget:  # no room for the results and a reply
                    truncated[e] = True
                    continue
                tokens[e] += suffix
                logprobs[e] += [0.0] * len(suffix)
                masks[e] += [0] * len(suffix)
                messages[e] += tool_messages
                active.append(e)
        out.token_ids, out.logprobs, out.messages = tokens, logprobs, messages
        out.policy_masks = [m if 0 in m else None for m in masks]
        out.finished, out.truncated, out.turns, out.tool_calls = finished, truncated, turns, calls
        out.tool_errors, out.tool_seconds, out.environments = errors, seconds, environments
        return out

    def parse(self, text: str, prompt_text: str, before: list[int]):
        """The calls of a turn's text: with the tokenizer's response_template (given the conversation
        before the turn: the prompt and the episode's earlier tokens), or in the Hermes format."""
        if not self.use_template_parser:
            return parse_hermes(text)
        prefix = prompt_text + self.tokenizer.decode(before) if before else prompt_text
        return parse_with_template(self.tokenizer, text, prefix, self.schemas)

    def _toolbox(self, environment: Any | None) -> dict[str, Tool]:
        tools = list(self.tools)
        if environment is not None:
            tools += self.environment.tools(environment)
        return {t.name: t for t in tools}

    def close(self) -> None:
        self.runner.close()


def with_observation(example: Example, observation: str) -> Example:
    """The example with an environment's observation appended to its last user message (TRL's rule)."""
    if example.prompt is None:
        return replace(example, question=f"{example.question}{observation}")
    if isinstance(example.prompt, str):
        return replace(example, prompt=f"{example.prompt}{observation}")
    messages = [dict(m) for m in example.prompt]
    for message in reversed(messages):
        if message.get("role") == "user":
            message["content"] = f"{message.get('content') or ''}{observation}"
            break
    return replace(example, prompt=messages)


def episode_fields(groups) -> dict:
    """A trainer row's agent fields over the step's groups (each group's `metadata["agent"]`)."""
    stats = [g.metadata.get("agent") for g in groups]
    stats = [s for s in stats if s]
    if not stats:
        return {}
    episodes = sum(s["episodes"] for s in stats)
    errors: Counter = Counter()
    for s in stats:
        errors.update(s["tool_errors"])
    return {
        "turns_mean": sum(s["turns"] for s in stats) / episodes,
        "tool_calls_mean": sum(s["tool_calls"] for s in stats) / episodes,
        "tool_errors": sum(errors.values()),
        **{f"tool_errors_{kind}": n for kind, n in sorted(errors.items())},
        "tool_seconds": sum(s["tool_seconds"] for s in stats),
        "episode_tokens_mean": sum(s["tokens"] for s in stats) / episodes,
        "episodes_truncated": sum(s["truncated"] for s in stats),
    }
