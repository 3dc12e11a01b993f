"""Multi-turn episodes (sampler/episodes.py) with a scripted engine: the loop, its tool calls and
results, token in/token out, the policy mask, budgets and turn limits. The engine is the loop's
`generate` argument; here it replays fixed turns, so every branch is reached on purpose."""

from __future__ import annotations

from collections import Counter

import pytest
from transformers import AutoTokenizer

from tandem.agent.tools import EnvironmentClass, tool_from_callable
from tandem.config import AgentConfig
from tandem.sampler.episodes import EpisodeRunner, episode_fields, hermes_system_block
from tandem.sampler.generation import Generation
from tandem.types import Example
from tiny_agent import add


class Tally:
    def reset(self, answer: str, **row) -> str:
        self.answer, self.seen = answer, []
        return " (use tally)"

    def tally(self, value: int) -> str:
        """Record a value.

        Args:
            value: the value
        """
        self.seen.append(value)
        return f"recorded {value}"

    def get_reward(self) -> float:
        return float(str(sum(self.seen)) == self.answer)


class Script:
    """An engine that answers turn k of episode e with script[e][k] (text, then eos), logging calls."""

    def __init__(self, tokenizer, script: list[list[str]], cut: set[tuple[int, int]] = frozenset()):
        self.tokenizer, self.script, self.cut = tokenizer, script, cut
        self.calls = []
        self.turn = 0
        self.order: list[int] = []

    def __call__(self, prompts, num_generations, max_new_tokens):
        self.calls.append((len(prompts), num_generations, max_new_tokens, [list(p) for p in prompts]))
        if self.turn == 0:
            self.order = list(range(len(prompts) * num_generations))
        else:
            self.order = self.next_order
        ids, lps, finished = [], [], []
        for e in self.order:
            text = self.script[e][self.turn]
            tokens = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            done = (e, self.turn) not in self.cut
            tokens = tokens + [self.tokenizer.eos_token_id] if done else tokens
            ids.append(tokens[:max_new_tokens])
            lps.append([-0.5] * len(ids[-1]))
            finished.append(done and len(tokens) <= max_new_tokens)
        self.turn += 1
        return Generation(ids, lps, finished)


@pytest.fixture
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def runner(tokenizer, environment=None, **cfg):
    return EpisodeRunner(
        AgentConfig(tools=["x:add"], **cfg), tokenizer, [tool_from_callable(add)], environment
    )


def prompt_of(tokenizer):
    def prompt(example):
        text = f"Q: {example.question}"
        return text, tokenizer(text, add_special_tokens=False)["input_ids"]

    return prompt


CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def test_an_episode_calls_a_tool_reads_the_result_and_answers(tokenizer):
    r = runner(tokenizer)
    try:
        script = Script(tokenizer, [[f"Let me add. {CALL}", "It is 5."], ["It is 6."]])
        # the second episode answers at once; the first needs a second turn (one episode per call)
        script.next_order = [0]
        ep = r.run(script, [Example("p0", "2 + 3?", "5")], prompt_of(tokenizer), 2, 400)
    finally:
        r.close()
    assert ep.turns == [2, 1] and ep.tool_calls == [1, 0] and ep.finished == [True, True]
    add_call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    assert ep.messages[0] == [
        {"role": "assistant", "content": f"Let me add. {CALL}", "tool_calls": [add_call]},
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": "It is 5."},
    ]
    first = tokenizer(f"Let me add. {CALL}", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    suffix = r.tool_suffix_ids([{"role": "tool", "name": "add", "content": "5"}])
    second = tokenizer("It is 5.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    # token in, token out: the sampled turns exactly as sampled, the tool message between them
    assert ep.token_ids[0] == first + suffix + second
    assert ep.policy_masks[0] == [1] * len(first) + [0] * len(suffix) + [1] * len(second)
    assert ep.logprobs[0] == [-0.5] * len(first) + [0.0] * len(suffix) + [-0.5] * len(second)
    assert ep.policy_masks[1] is None  # no tool tokens: a single-turn completion
    assert tokenizer.decode(suffix).startswith("\n<|im_start|>tool\n5<|im_end|>")
    # the second turn continues the first episode from its own tokens, one completion
    _, g, _, prompts = script.calls[1]
    assert g == 1 and prompts == [ep.prompts[0] + first + suffix]


def test_tool_failures_are_messages_and_the_turn_limit_ends_an_episode(tokenizer):
    r = runner(tokenizer, max_turns=2)
    try:
        bad = '<tool_call>{"name": "mul", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>'
        script = Script(tokenizer, [[bad, CALL]])
        script.next_order = [0]
        ep = r.run(script, [Example("p0", "q", "5")], prompt_of(tokenizer), 1, 400)
    finally:
        r.close()
    assert ep.turns == [2] and ep.tool_calls == [2]
    assert ep.tool_errors[0] == Counter({"unknown_tool": 1, "bad_json": 1})
    assert "there is no tool 'mul'" in ep.messages[0][1]["content"]
    assert ep.finished == [True]  # the second turn's call gets no more turns: the episode ends there
    assert len(ep.messages[0]) == 4


def test_the_episode_budget_and_a_cut_turn_stop_an_episode(tokenizer):
    r = runner(tokenizer, max_episode_tokens=100)
    try:
        script = Script(
            tokenizer, [[f"{CALL} and more words to fill the budget quickly"], ["It is"]], cut={(1, 0)}
        )
        ep = r.run(script, [Example("p0", "q", "5")], prompt_of(tokenizer), 2, 100)
    finally:
        r.close()
    assert ep.truncated[0] and not ep.finished[0]  # its tool results would not fit
    assert not ep.finished[1] and not ep.truncated[1]  # cut at max_new_tokens inside its turn
    assert all(len(t) <= 100 for t in ep.token_ids)


def test_an_environment_per_episode_resets_with_the_row_and_scores_its_state(tokenizer):
    env = EnvironmentClass(Tally, ("tally",), True)
    r = runner(tokenizer, environment=env)
    try:
        tally = '<tool_call>{"name": "tally", "arguments": {"value": 5}}</tool_call>'
        script = Script(tokenizer, [[tally, "done"], ["no"]])
        script.next_order = [0]
        ep = r.run(script, [Example("p0", "q", "5")], prompt_of(tokenizer), 2, 400)
    finally:
        r.close()
    assert [e.get_reward() for e in ep.environments] == [1.0, 0.0]
    assert ep.prompt_texts[0].endswith("q (use tally)")  # the observation joins the last user turn


def test_tools_are_offered_in_the_system_prompt_where_the_template_has_none(tokenizer):
    r = runner(tokenizer)
    try:
        text = r.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3?"}])
    finally:
        r.close()
    assert "Be brief.\n\nYou can call tools" in text and '"name": "add"' in text
    assert hermes_system_block(r.schemas) in text


def test_a_row_of_episode_fields():
    from tandem.types import Group

    groups = [
        Group(
            "a",
            "p",
            "",
            [1],
            [],
            0,
            metadata={
                "agent": {
                    "episodes": 2,
                    "turns": 3,
                    "tool_calls": 2,
                    "tool_errors": {"timeout": 1},
                    "tool_seconds": 0.5,
                    "tokens": 40,
                    "truncated": 1,
                }
            },
        ),
        Group(
            "b",
            "p",
            "",
            [1],
            [],
            0,
            metadata={
                "agent": {
                    "episodes": 2,
                    "turns": 2,
                    "tool_calls": 0,
                    "tool_errors": {},
                    "tool_seconds": 0.0,
                    "tokens": 20,
                    "truncated": 0,
                }
            },
        ),
    ]
    assert episode_fields(groups) == {
        "turns_mean": 1.25,
        "tool_calls_mean": 0.5,
        "tool_errors": 1,
        "tool_errors_timeout": 1,
        "tool_seconds": 0.5,
        "episode_tokens_mean": 15.0,
        "episodes_truncated": 1,
    }
    assert episode_fields([Group("c", "p", "", [1], [], 0)]) == {}


def test_a_rollout_with_a_reference_scores_episodes_and_zeroes_tool_tokens(tiny_model_dir, monkeypatch):
    """The whole sampling side of an agent run (build_rollout: reference model, rewards, wire-ready
    completions) around a scripted engine: episode 0 calls the tool and answers, episode 1 answers at
    once. The reference's log-probs are those of a plain forward over the policy tokens, 0 on tool
    tokens; the built-in rules score the last answer with the prefill only where it is the first turn.
    (The first GPU run of an agent config died here: an in-place write to an inference tensor.)"""
    import torch

    from tandem.config import load_config
    from tandem.models.forward import pack_rows, packed_logprobs
    from tandem.models.loading import load_tokenizer
    from tandem.sampler import rollout as rollout_module

    cfg = load_config(
        None,
        [
            f"model.policy={tiny_model_dir}",
            "agent.tools=['tiny_agent:add']",
            "grpo.kl_coef=0.04",
            "sampling.num_generations=2",
            "training.gradient_accumulation_steps=1",
            "rewards=[{type: format}, {type: answer}]",
        ],
    )
    tok = load_tokenizer(str(tiny_model_dir))
    script = Script(
        tok,
        [
            [f"<think> add </think>{CALL}", "<think> 5 </think><answer> 5 </answer>"],
            [" 6 </think><answer> 6 </answer>"],
        ],
    )
    script.next_order = [0]
    monkeypatch.setattr(
        rollout_module,
        "generate_groups",
        lambda model, ids, *, num_generations, max_new_tokens, **kw: script(
            ids, num_generations, max_new_tokens
        ),
    )
    rollout = rollout_module.build_rollout(cfg, None, tok, torch.Generator().manual_seed(0), "cpu")
    try:
        (group,) = rollout.run([Example("p0", "2 + 3?", "5")], policy_version=0)
    finally:
        rollout.agent.close()
    called, direct = group.completions
    assert called.policy_mask is not None and 0 in called.policy_mask and direct.policy_mask is None
    prompt = group.prefix_token_ids
    with torch.no_grad():
        expected = packed_logprobs(
            rollout.reference, pack_rows([(prompt, [c.generated_token_ids for c in group.completions])])
        )
    for k, c in enumerate(group.completions):
        want = expected[k, : len(c.generated_token_ids)].clone()
        if c.policy_mask is not None:
            want[torch.tensor(c.policy_mask) == 0] = 0.0
        torch.testing.assert_close(c.ref_policy_log_probs, want)
    # the last answer is scored: the called episode's second turn as written (it has both tags),
    # the direct one with the prefill in front of its single turn
    assert called.reward_info == {"format": 1.25, "answer": 1.0}
    assert direct.reward_info == {"format": 1.25, "answer": -1.0}


# A Qwen2.5-style template of our own: the tools in a system block it writes itself, tool results
# wrapped in a user turn (consecutive ones together), ChatML turns otherwise
TOOLS_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n<tools>\\n' }}{%- for t in tools %}{{ t | tojson + '\\n' }}{% endfor %}"
    "{{ '</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- elif m.role != 'system' %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# transformers' declarative response parsing for that format (tokenizer.response_template)
RESPONSE_TEMPLATE = {
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "content": {"close": "<|im_end|>"},
        "tool_calls": {
            "open": "<tool_call>",
            "close": "</tool_call>",
            "content": "json",
            "repeats": True,
            "transform": {"type": "function", "function": "{content}"},
        },
    },
}


def test_a_template_that_renders_tools_gets_them_and_wraps_their_results(tokenizer):
    """Qwen2.5's path: the template writes the tools' schemas itself (no system block of ours), and
    the tool results of one turn become one user turn of <tool_response>s: the suffix appended
    after the policy's eos is exactly that rendering, then the next assistant header."""
    tokenizer.chat_template = TOOLS_TEMPLATE
    r = runner(tokenizer)
    try:
        text = r.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3?"}])
        assert r.template_has_tools and "# Tools" in text and '"name": "add"' in text
        assert "You can call tools" not in text  # our block only where the template has no tools
        two = CALL + CALL.replace('"a": 2', '"a": 4')
        script = Script(tokenizer, [[two, "It is 5 and 7."]])
        script.next_order = [0]
        ep = r.run(script, [Example("p0", "2 + 3?", "5")], prompt_of(tokenizer), 1, 400)
    finally:
        r.close()
    assert ep.tool_calls == [2] and ep.turns == [2]
    first = tokenizer(two, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    suffix = ep.token_ids[0][len(first) : ep.policy_masks[0].index(1, len(first))]
    assert tokenizer.decode(suffix) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n7\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("fmt", ["auto", "template"])
def test_tool_calls_are_read_with_the_tokenizers_response_template(tokenizer, fmt):
    """transformers' parse_response where the tokenizer has a response_template: its calls (with
    arguments cast by the tool's schema: "3" -> 3) run; a turn it cannot read is a bad_json error."""
    tokenizer.response_template = RESPONSE_TEMPLATE
    r = runner(tokenizer, tool_call_format=fmt, max_turns=3)
    try:
        assert r.use_template_parser
        cast = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": "3"}}</tool_call>'
        script = Script(tokenizer, [[cast, "<tool_call>{oops}</tool_call>", "5"]])
        script.next_order = [0]
        ep = r.run(script, [Example("p0", "2 + 3?", "5")], prompt_of(tokenizer), 1, 400)
    finally:
        r.close()
    assert ep.tool_calls == [2] and ep.tool_errors[0] == Counter({"bad_json": 1})
    assert ep.messages[0][1] == {"role": "tool", "name": "add", "content": "5"}
    assert ep.messages[0][0]["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 3}
    assert "could not be read" in ep.messages[0][3]["content"]


def test_the_template_format_needs_a_response_template(tokenizer):
    with pytest.raises(ValueError, match="no response_template .* set agent.tool_call_format: hermes"):
        runner(tokenizer, tool_call_format="template")
    r = runner(tokenizer)  # auto: Hermes where the tokenizer has no response_template
    r.close()
    assert not r.use_template_parser
