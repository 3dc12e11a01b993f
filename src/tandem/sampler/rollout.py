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
from tandem.config import Config
from tandem.data.prompts import build_messages, render_prompt, worked_shots
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
from tandem.sampler.generation import generate_groups
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
    system_prompt: str
    num_shots: int
    prefill: str
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
    timings: RolloutTimings = field(default_factory=RolloutTimings)
    _prompt_cache: dict = field(default_factory=dict)

    def prompt(self, example: Example) -> tuple[str, list[int]]:
        if example.question not in self._prompt_cache:
            text = render_prompt(
                self.tokenizer, example.question, self.system_prompt, self.num_shots, self.prefill
            )
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            self._prompt_cache[example.question] = (text, ids)
        return self._prompt_cache[example.question]

    def reward_prompt(self, example: Example) -> str | list[dict]:
        """The prompt as reward functions receive it (TRL's `prompts`): the row's own, or the chat
        messages its question is rendered from (system prompt, shots, question)."""
        if example.prompt is not None:
            return example.prompt
        return build_messages(example.question, self.system_prompt, worked_shots(self.num_shots))

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
        if self.engine is not None:
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
        ref_logprobs = self.reference_logprobs(prompt_ids, gen.token_ids)
        trim_memory()
        timings.reference = time.perf_counter() - t0

        t0 = time.perf_counter()
        completions = []
        texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in gen.token_ids]
        # all at once, in TRL's convention: each reward is called once for the whole batch
        G = self.num_generations
        reward_prompts = [self.reward_prompt(ex) for ex in examples]
        scored = self.rewards.score_batch(
            [self.prefill + text for text in texts],
            [examples[i // G] for i in range(len(texts))],
            gen.token_ids,
            prompts=[reward_prompts[i // G] for i in range(len(texts))],
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
                metadata={"answer": ex.answer, **ex.metadata},
                timings=dict(share),
            )
            for j, (ex, (text, ids)) in enumerate(zip(examples, prompts))
        ]

    @torch.inference_mode()
    def reference_logprobs(
        self, prompts: list[list[int]], completions: list[list[int]]
    ) -> list[torch.Tensor] | None:
        """Frozen reference log-probs; each group is one packed row (its prompt computed once)."""
        if self.reference is None:
            return None
        if isinstance(self.reference, (OffloadedModel, BaseOfAdapter)):
            with self.reference as reference:
                return self._reference_logprobs(reference, prompts, completions)
        return self._reference_logprobs(self.reference, prompts, completions)

    def _reference_logprobs(self, reference, prompts, completions) -> list[torch.Tensor]:
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
    agree), the frozen reference, the rewards and the prompt format."""
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
            max_new_tokens=cfg.sampling.max_new_tokens,
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
    return Rollout(
        policy=rollout_model,
        reference=reference,
        tokenizer=tokenizer,
        rewards=RewardSet.from_specs(cfg.rewards, device=device),
        system_prompt=cfg.data.system_prompt,
        num_shots=cfg.data.num_shots,
        prefill=cfg.data.prefill,
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
    )
