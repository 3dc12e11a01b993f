"""Rollout: prompts -> scored groups (sampled completions, sampler and reference log-probs, rewards, advantages).

The colocated loop and the sampler process both call `Rollout.run`, so the two pipelines share
every line of the algorithm.
"""

from __future__ import annotations

import gc
import math
import time
import uuid
from dataclasses import dataclass, field

import torch

from tandem.algorithms.grpo import group_advantages
from tandem.config import Config, ConfigError
from tandem.data.prompts import (
    PromptStyle,
    example_messages,
    prompt_style,
    render_example,
    set_chat_template,
)
from tandem.distributed.runtime import trim_memory
from tandem.models.forward import pack_rows, packed_logprobs
from tandem.models.loading import (
    check_same_tokenizer,
    load_causal_lm,
    load_tokenizer,
    model_kwargs,
    resolve_model_path,
)
from tandem.models.lora import BaseOfAdapter, apply_lora, is_lora
from tandem.rewards.registry import RewardSet
from tandem.sampler.episodes import EpisodeRunner, Episodes, hermes_system_block
from tandem.sampler.generation import Generation, generate_groups
from tandem.sampler.vllm_engine import VLLMEngine
from tandem.types import Completion, Example, Group


@dataclass
class RolloutTimings:
    generate: float = 0.0
    reference: float = 0.0
    reward: float = 0.0


@dataclass
class Rollout:
    """Everything needed to turn examples into groups; `policy` is the rollout copy of the policy."""

    policy: torch.nn.Module
    reference: torch.nn.Module | OffloadedModel | None
    tokenizer: object
    rewards: RewardSet
    # the prompt format (data/prompts.py) of rows built from a question (synthetic, GSM8K) and of
    # rows with their own prompt
    question_style: PromptStyle
    row_style: PromptStyle
    num_generations: int
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    batch_size: int = 32
    # sequences per reference forward: the training micro-batch (a packed row is a prompt and its
    # G completions, so its attention is quadratic in G x length: 8 rows of 4 cost 12% more here)
    score_batch_size: int = 8
    scale_rewards: str = "group"
    adv_eps: float = 1e-4
    sampler_id: str = "local"
    generator: torch.Generator | None = None
    # sampling.backend=vllm: the engine that generates; `policy` then only receives the weights
    # (and is the reference of a LoRA run), and each version is loaded into the engine
    engine: VLLMEngine | None = None
    # with an engine: the first `engine_check_groups` groups of each batch are scored again by the
    # sampler's own copy of the policy (the same weights), to measure the engine's log-prob gap
    engine_check_groups: int = 1
    engine_gap: dict | None = None  # the last batch's measure (engine_logprob_* fields), None without
    # agent.*: a rollout is a multi-turn episode with tools (sampler/episodes.py)
    agent: EpisodeRunner | None = None
    timings: RolloutTimings = field(default_factory=RolloutTimings)
    _prompt_cache: dict = field(default_factory=dict)

    def style(self, example: Example) -> PromptStyle:
        return self.question_style if example.prompt is None else self.row_style

    def prompt(self, example: Example) -> tuple[str, list[int]]:
        """(text, token ids) the model continues; rendered once per distinct prompt."""
        key = example.question if example.prompt is None else repr(example.prompt)
        if key not in self._prompt_cache:
            if self.agent is not None:  # the tools offered in the prompt
                messages = example_messages(example, self.style(example))
                if isinstance(messages, str):
                    text = f"{hermes_system_block(self.agent.schemas)}\n\n{messages}"
                else:
                    text = self.agent.render(messages)
                text += self.style(example).prefill
            else:
                text = render_example(self.tokenizer, example, self.style(example))
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            self._prompt_cache[key] = (text, ids)
        return self._prompt_cache[key]

    def reward_prompt(self, example: Example) -> str | list[dict]:
        """The prompt as reward functions receive it (TRL's `prompts`): the row's own (with the
        configured system prompt and shots around a chat), or the chat messages its question is
        rendered from (system prompt, shots, question)."""
        return example_messages(example, self.style(example))

    def run(self, examples: list[Example], policy_version: int) -> list[Group]:
        """One group of num_generations completions per example, in example order."""
        timings = RolloutTimings()
        prompts = [self.prompt(ex) for ex in examples]
        t0 = time.perf_counter()
        self.policy.eval()
        sampling = dict(
            num_generations=self.num_generations,
            max_new_tokens=self.max_new_tokens,
            eos_token_ids=eos_token_ids(self.tokenizer, self.policy),
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            generator=self.generator,
        )
        episodes = None
        if self.agent is not None:

            def turn(ids: list[list[int]], g: int, n: int) -> Generation:
                """One turn of the episodes: G of each prompt (the first), or one continuation each."""
                settings = {**sampling, "num_generations": g, "max_new_tokens": n}
                if self.engine is not None:
                    return self.engine.generate(ids, **settings)
                return generate_groups(
                    self.policy,
                    ids,
                    pad_token_id=self.tokenizer.pad_token_id,
                    batch_size=self.batch_size,
                    **settings,
                )

            episodes = self.agent.run(
                turn,
                examples,
                self.prompt,
                self.num_generations,
                self.max_new_tokens,
            )
            prompts = list(zip(episodes.prompt_texts, episodes.prompts))
            gen = Generation(episodes.token_ids, episodes.logprobs, episodes.finished)
        elif self.engine is not None:
            gen = self.engine.generate([ids for _, ids in prompts], **sampling)
        else:
            gen = generate_groups(
                self.policy,
                [ids for _, ids in prompts],
                pad_token_id=self.tokenizer.pad_token_id,
                batch_size=self.batch_size,
                **sampling,
            )
        trim_memory()  # the KV caches are free now
        timings.generate = time.perf_counter() - t0

        t0 = time.perf_counter()
        prompt_ids = [ids for _, ids in prompts for _ in range(self.num_generations)]
        if self.engine is not None:
            masks = episodes.policy_masks if episodes is not None else None
            self.engine_gap = self.measure_engine(prompt_ids, gen, masks)
        else:
            self.engine_gap = None
        ref_logprobs = self.reference_logprobs(prompt_ids, gen.token_ids)
        if ref_logprobs is not None and episodes is not None:
            # tool tokens carry log-prob 0, as the sampler's (out of place: the scores are inference
            # tensors, which refuse in-place writes outside inference mode)
            for i, mask in enumerate(episodes.policy_masks):
                if mask is not None:
                    tool = torch.tensor(mask, device=ref_logprobs[i].device) == 0
                    ref_logprobs[i] = ref_logprobs[i].masked_fill(tool, 0.0)
        trim_memory()
        timings.reference = time.perf_counter() - t0

        t0 = time.perf_counter()
        completions = []
        G = self.num_generations
        reward_prompts = [self.reward_prompt(ex) for ex in examples]
        prefills = [self.style(examples[i // G]).prefill for i in range(len(gen.token_ids))]
        if episodes is None:
            texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in gen.token_ids]
            responses = [prefill + text for prefill, text in zip(prefills, texts)]
            episode_messages = environments = None
        else:  # rewards read the episode's messages; the built-in rules its last answer
            texts = [conversation_text(m) for m in episodes.messages]
            responses = [
                last_answer(m, prefill, turns)
                for m, prefill, turns in zip(episodes.messages, prefills, episodes.turns)
            ]
            episode_messages, environments = episodes.messages, episodes.environments
        # all at once, in TRL's convention: each reward is called once for the whole batch
        scored = self.rewards.score_batch(
            responses,
            [examples[i // G] for i in range(len(texts))],
            gen.token_ids,
            prompts=[reward_prompts[i // G] for i in range(len(texts))],
            completions=episode_messages,
            environments=environments,
        )
        for i, (token_ids, text, (reward, info)) in enumerate(zip(gen.token_ids, texts, scored)):
            completions.append(
                Completion(
                    text=text,
                    generated_token_ids=token_ids,
                    is_finished=gen.finished[i],
                    reward=reward,
                    reward_info=info,
                    old_policy_log_probs=torch.tensor(gen.logprobs[i], dtype=torch.float32),
                    ref_policy_log_probs=None if ref_logprobs is None else ref_logprobs[i],
                    policy_mask=None if episodes is None else episodes.policy_masks[i],
                )
            )
        # group statistics live here; batch scaling (if chosen) is redone by the trainer
        scale = "none" if self.scale_rewards == "batch" else self.scale_rewards
        if self.num_generations == 1:  # PPO's groups of one: advantage 0, no std of a single reward
            scale = "none"
        # an unscored completion (every reward None) enters as NaN: out of its group's statistics
        rewards = torch.tensor([c.reward if c.scored else math.nan for c in completions])
        advantages = group_advantages(rewards, self.num_generations, scale=scale, eps=self.adv_eps)
        for c, a in zip(completions, advantages.tolist()):
            c.advantage = a
        timings.reward = time.perf_counter() - t0
        self.timings = timings

        share = {  # each group's equal part of this batch's time
            name: seconds / max(len(examples), 1)
            for name, seconds in (
                ("generate", timings.generate),
                ("reference", timings.reference),
                ("reward", timings.reward),
            )
        }
        return [
            Group(
                group_id=uuid.uuid4().hex,
                prompt_id=ex.prompt_id,
                prefix=text,
                prefix_token_ids=ids,
                completions=completions[j * G : (j + 1) * G],
                policy_version=policy_version,
                sampler_id=self.sampler_id,
                created_at=time.time(),
                metadata={
                    "answer": ex.answer,
                    **ex.metadata,
                    "prefill": self.style(ex).prefill,
                    **({"columns": loggable_columns(ex.columns)} if ex.columns else {}),
                    **({"agent": episode_stats(episodes, j, G)} if episodes is not None else {}),
                },
                timings=dict(share),
            )
            for j, (ex, (text, ids)) in enumerate(zip(examples, prompts))
        ]

    @torch.inference_mode()
    def measure_engine(self, prompt_ids: list[list[int]], gen, masks: list | None = None) -> dict:
        """How far the engine's log-probs are from a plain forward of the same weights (the sampler's
        copy of the policy, the trainer's forward code) on the first engine_check_groups groups:
        token means of |r| and Schulman's k3 exp(r) - r - 1 (KL(engine || policy) on the engine's
        tokens), r = logp_policy - logp_engine; the trainer logs the same as sampler_logprob_*
        where it holds the weights that made a batch. `masks`: episodes' policy masks (agent runs),
        whose tool tokens are nobody's samples and stay out of the measure."""
        n = min(self.engine_check_groups, len(prompt_ids) // self.num_generations) * self.num_generations
        if n == 0:
            return {"engine_logprob_diff": None, "engine_logprob_kl": None, "engine_logprob_tokens": 0}
        policy = self._logprobs_of(self.policy, prompt_ids[:n], gen.token_ids[:n])
        gaps = []
        for i, p in enumerate(policy):
            gap = p.double() - torch.tensor(gen.logprobs[i], dtype=torch.float64)
            if masks is not None and masks[i] is not None:
                gap = gap[torch.tensor(masks[i]) == 1]
            gaps.append(gap)
        r = torch.cat(gaps)
        tokens = r.numel()
        return {
            "engine_logprob_diff": float(r.abs().sum()) / tokens if tokens else None,
            "engine_logprob_kl": float((torch.expm1(r) - r).sum()) / tokens if tokens else None,
            "engine_logprob_tokens": tokens,
        }

    @torch.inference_mode()
    def reference_logprobs(
        self, prompts: list[list[int]], completions: list[list[int]]
    ) -> list[torch.Tensor] | None:
        """Frozen reference log-probs; each group is one packed row (its prompt computed once)."""
        if self.reference is None:
            return None
        if isinstance(self.reference, (OffloadedModel, BaseOfAdapter)):
            with self.reference as reference:
                return self._logprobs_of(reference, prompts, completions)
        return self._logprobs_of(self.reference, prompts, completions)

    def _logprobs_of(self, model, prompts, completions) -> list[torch.Tensor]:
        """`model`'s log-probs of each completion; each group is one packed row (its prompt once)."""
        reference = model
        device = next(reference.parameters()).device
        G = self.num_generations
        groups_per_batch = max(1, self.score_batch_size // G)
        out: list[torch.Tensor] = []
        for start in range(0, len(prompts), groups_per_batch * G):
            rows = [
                (prompts[i], completions[i : i + G])
                for i in range(start, min(start + groups_per_batch * G, len(prompts)), G)
            ]
            logprobs = packed_logprobs(
                reference, pack_rows(rows).to(device), temperature=self.temperature
            ).cpu()
            lengths = [len(c) for _, cs in rows for c in cs]
            out += [logprobs[k, :n].clone() for k, n in enumerate(lengths)]
        return out


def conversation_text(messages: list[dict]) -> str:
    """An episode as the sample logs show it: each turn with its role (and tool name)."""
    parts = []
    for m in messages:
        who = m["role"] if m["role"] != "tool" else f"tool {m.get('name', '')}".rstrip()
        parts.append(f"[{who}] {m['content']}")
    return "\n".join(parts)


def last_answer(messages: list[dict], prefill: str, turns: int) -> str:
    """What the built-in rules score in an episode: its last assistant turn (with the prefill when
    the episode is that one turn, as a single-turn completion is scored)."""
    answer = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
    return prefill + answer if turns <= 1 else answer


def episode_stats(episodes: Episodes, group: int, G: int) -> dict:
    """One group's episode counts, carried in its metadata to the trainer's row (episode_fields)."""
    span = range(group * G, (group + 1) * G)
    errors: dict[str, int] = {}
    for e in span:
        for kind, n in episodes.tool_errors[e].items():
            errors[kind] = errors.get(kind, 0) + n
    return {
        "episodes": G,
        "turns": sum(episodes.turns[e] for e in span),
        "tool_calls": sum(episodes.tool_calls[e] for e in span),
        "tool_errors": errors,
        "tool_seconds": sum(episodes.tool_seconds[e] for e in span),
        "tokens": sum(len(episodes.token_ids[e]) for e in span),
        "truncated": sum(episodes.truncated[e] for e in span),
    }


class OffloadedModel:
    """A frozen model that lives on disk between uses (`model.reference_offload`): loaded when a
    `with` block enters, dropped when it leaves. Trades a reload per batch (from the page cache:
    0.06 s for the embedded model's 135M parameters once cached) for the model's whole size off the process's peak."""

    def __init__(self, load) -> None:
        self._load = load
        self._model = None

    def __enter__(self) -> torch.nn.Module:
        self._model = self._load()
        return self._model

    def __exit__(self, *exc_info) -> None:
        self._model = None
        gc.collect()


def eos_token_ids(tokenizer, model) -> list[int]:
    """The ids that end a completion: the tokenizer's eos plus the generation config's."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif gen_eos:
        ids.update(gen_eos)
    return sorted(i for i in ids if i is not None)


def build_rollout(cfg: Config, policy, tokenizer, generator, device, *, sampler_id: str = "local") -> Rollout:
    """The sampling side: the rollout copy of the policy (or the policy itself when the dtypes
    agree), the frozen reference, the rewards and the prompt format (data.chat_template replaces the
    tokenizer's template here: the exported model keeps the one it was trained with)."""
    set_chat_template(tokenizer, cfg.data.chat_template)
    lora = cfg.model.lora
    rollout_model = policy
    engine = None
    if cfg.sampling.backend == "vllm":
        # before any other model: vLLM sets this process's threads (and on the CPU binds them)
        engine = VLLMEngine(
            resolve_model_path(cfg.model.policy),
            spec=cfg.sampling.vllm,
            dtype=cfg.sampling.dtype,
            device=torch.device(device),
            seed=cfg.seed,
            max_new_tokens=cfg.completion_tokens[0],  # an agent run's: its prompts grow by turns
            batch_size=cfg.sampling.batch_size,
            num_threads=cfg.sampling.num_threads,
            trust_remote_code=cfg.model.trust_remote_code,
        )
    if policy is None or cfg.sampling.dtype != cfg.model.dtype:
        rollout_model = load_causal_lm(
            cfg.model.policy, dtype=cfg.sampling.dtype, trainable=False, **model_kwargs(cfg.model, device)
        )
        # the rollout copy has the policy's adapters when it receives adapters (or copies them here)
        if lora.enabled and (policy is not None or lora.sync == "adapter"):
            rollout_model = apply_lora(rollout_model, lora).eval().requires_grad_(False)
    reference = None
    kl_coef = cfg.ppo.kl_coef if cfg.method == "ppo" else cfg.grpo.kl_coef  # no KL: no reference
    if kl_coef != 0 and is_lora(rollout_model) and not cfg.model.reference:
        reference = BaseOfAdapter(rollout_model)  # the base weights under the adapters: no second copy
    elif kl_coef != 0:

        def load_reference():
            return load_causal_lm(
                cfg.model.reference or cfg.model.policy,
                dtype=cfg.sampling.dtype,
                trainable=False,
                **model_kwargs(cfg.model, device),
            )

        reference = OffloadedModel(load_reference) if cfg.model.reference_offload else load_reference()
        if cfg.model.reference:
            check_same_tokenizer(tokenizer, load_tokenizer(cfg.model.reference))
    rewards = RewardSet.from_specs(cfg.rewards, device=device, max_new_tokens=cfg.sampling.max_new_tokens)
    agent = build_agent(cfg, tokenizer, rewards) if cfg.agent.enabled else None
    return Rollout(
        policy=rollout_model,
        reference=reference,
        tokenizer=tokenizer,
        rewards=rewards,
        agent=agent,
        question_style=prompt_style(cfg.data, from_question=True),
        row_style=prompt_style(cfg.data, from_question=False),
        num_generations=cfg.sampling.num_generations,
        max_new_tokens=cfg.sampling.max_new_tokens,
        temperature=cfg.sampling.temperature,
        top_k=cfg.sampling.top_k,
        top_p=cfg.sampling.top_p,
        batch_size=cfg.sampling.batch_size,
        score_batch_size=cfg.training.micro_batch_size,
        scale_rewards=cfg.grpo.scale_rewards,
        adv_eps=cfg.grpo.adv_eps,
        sampler_id=sampler_id,
        generator=generator,
        engine=engine,
        engine_check_groups=cfg.sampling.vllm.check_groups,
    )


def build_agent(cfg: Config, tokenizer, rewards: RewardSet) -> EpisodeRunner:
    """agent.*: the run's tools and environment class, loaded and checked now (a bad one is a
    ConfigError naming the key); an environment with get_reward() scores episodes, weight 1."""
    from tandem.agent.tools import ToolSpecError, load_environment, load_tools

    try:
        tools = load_tools(cfg.agent.tools)
        environment = load_environment(cfg.agent.environment) if cfg.agent.environment else None
        runner = EpisodeRunner(cfg.agent, tokenizer, tools, environment)
    except ToolSpecError as err:
        raise ConfigError(f"`agent`: {err}") from err
    if environment is not None and environment.has_reward:
        rewards.add_environment_reward(environment.cls.__name__)
    return runner


COLUMN_TEXT_CHARS = 2000  # a column's text in a group's metadata (sample logs), at most
COLUMNS_BYTES = 16 * 2**10


def loggable_columns(columns: dict) -> dict:
    """A row's other columns as the sample logs show them: JSON values, each text cut to
    COLUMN_TEXT_CHARS, and no more than COLUMNS_BYTES in all (the wire caps a group's metadata);
    what is left out is named in `_omitted`."""
    import json

    out, omitted, size = {}, [], 0
    for key, value in columns.items():
        if isinstance(value, str) and len(value) > COLUMN_TEXT_CHARS:
            value = value[:COLUMN_TEXT_CHARS] + "..."
        try:
            text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError):
            omitted.append(str(key))
            continue
        if size + len(text.encode()) > COLUMNS_BYTES:
            omitted.append(str(key))
            continue
        out[str(key)] = value
        size += len(text.encode())
    if omitted:
        out["_omitted"] = omitted
    return out
