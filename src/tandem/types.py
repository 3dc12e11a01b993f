"""The shared vocabulary of tandem: the records that cross module boundaries.

Data loaders produce `Example`s; rewards and the sampler consume them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Example:
    """One prompt row.

    `question` is the user's text (for a chat prompt, its last user turn); `answer` the gold final
    answer where the task has one ("72"; "" where it has none); `metadata` carries bookkeeping such
    as the full gold solution text (`solution`) and where the row came from (`source`).
    `prompt` is the row's own prompt, a string (plain text, continued as is) or a list of chat
    messages; None means "build it from `question`" with the configured system prompt and shots.
    `columns` holds every other column of the row by name: rewards receive them as keyword
    arguments, one value per completion (TRL's calling convention), and sample logs show them.
    """

    prompt_id: str
    question: str
    answer: str
    metadata: dict = field(default_factory=dict)
    prompt: str | list[dict] | None = None
    columns: dict = field(default_factory=dict)


@dataclass
class Completion:
    """One sampled completion with everything the trainer needs (DESIGN.md section 2).

    Log-prob arrays are float32 [len(generated_token_ids)], aligned with the generated tokens;
    `old_policy_log_probs` come from the policy version that sampled it. `reward_info` holds each
    reward component's unweighted value, None where that component does not apply to this sample;
    `reward` is the weighted sum of the others (0.0 when none applies: see `scored`).
    """

    text: str
    generated_token_ids: list[int]
    is_finished: bool
    reward: float
    reward_info: dict[str, float | None]
    old_policy_log_probs: torch.Tensor
    ref_policy_log_probs: torch.Tensor | None
    advantage: float = 0.0
    # a multi-turn episode (agentic RL): 1 for each token the policy sampled, 0 for the tool and
    # environment tokens between its turns (their log-probs are 0 and the loss never sees them).
    # None: every token is the policy's (a single-turn completion)
    policy_mask: list[int] | None = None

    @property
    def scored(self) -> bool:
        """False when every reward component returned None: the sample then has advantage 0 and stays
        out of its group's baseline and of the reward statistics (TRL's GRPOTrainer does the same)."""
        return not self.reward_info or any(v is not None for v in self.reward_info.values())


GROUP_TIMINGS = ("generate", "reference", "reward")  # the sampler's phases a group carries seconds of


@dataclass
class Group:
    """All G completions of one prompt: the unit on the wire, never split across ranks."""

    group_id: str
    prompt_id: str
    prefix: str  # prompt text after the chat template (and any prefill)
    prefix_token_ids: list[int]
    completions: list[Completion]
    policy_version: int
    sampler_id: str = "local"
    created_at: float = 0.0
    metadata: dict = field(default_factory=dict)  # the data row's, e.g. the gold answer
    prefix_tokens: list[str] = field(default_factory=list)  # prompt tokens as strings (seed field)
    # the sampler's seconds spent on this group: its equal share of its generation batch's
    # `generate`, `reference` and `reward` time (a trainer sums them over the groups of a step)
    timings: dict[str, float] = field(default_factory=dict)
    # dynamic sampling (grpo.dynamic_sampling): the groups its sampler made and did not send (zero
    # reward variance) since its previous sent group, {"groups": n, "tokens": generated tokens}
    filtered: dict[str, int] = field(default_factory=dict)

    @property
    def rewards(self) -> list[float]:
        return [c.reward for c in self.completions]

    @property
    def scored_rewards(self) -> list[float]:
        """The rewards of the completions that are scored (Completion.scored)."""
        return [c.reward for c in self.completions if c.scored]

    def whole_token_ids(self, index: int) -> list[int]:
        return self.prefix_token_ids + self.completions[index].generated_token_ids


@dataclass(frozen=True)
class TensorSpec:
    """Where one named tensor lies in a flat weights buffer (bytes, little-endian)."""

    name: str
    dtype: str  # float32 | bfloat16 | float16
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class WeightsManifest:
    """A published policy version: its tensors in one flat buffer, cut into hashed chunks.

    `version` counts publications (0 = initial weights) and never repeats within a run, even
    across trainer restarts; `run_id` changes with every trainer process.
    """

    version: int
    run_id: str
    total_bytes: int
    tensors: tuple[TensorSpec, ...]
    chunks: tuple[tuple[int, int, str], ...]  # (offset, nbytes, xxh3-64 hex) covering the buffer


@dataclass(frozen=True)
class TrainerStatus:
    """What a sampler learns from the trainer: its newest weights and whether it wants data."""

    version: int  # newest published version, -1 = none yet
    run_id: str
    starved: bool = False  # the trainer has been waiting for groups
    finished: bool = False  # training is over: samplers may exit
    # the trainer's schedule, for pacing: it has taken `batches` batches of groups so far and will
    # take the next ones while holding these versions (one entry per batch, nondecreasing)
    batches: int = 0
    take_versions: tuple[int, ...] = ()
