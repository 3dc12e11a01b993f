"""A trained reward model (`tandem rm`'s final/) as a GRPO/PPO reward: `rewards: [{type: model, path: ...}]`.

The sampler loads it once, on its own device, and scores a batch's completions in a few padded
forwards (called in TRL's convention, rewards/calling.py): the reward model sees the prompt's last
user turn as the question, as `tandem rm` trained it, and the completion as the answer.
"""

from __future__ import annotations

import json
from pathlib import Path

from tandem.rewards.calling import completion_text

INFO_FILE = "tandem_reward.json"  # written by `tandem rm` next to the model


class ModelReward:
    """fn(prompts=..., completions=...) -> one float per completion: the reward model's scalar score."""

    def __init__(self, path: str, *, device: str = "cpu", batch_size: int = 16) -> None:
        folder = Path(path).expanduser()
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"reward model {path!r} is not a model folder (no config.json); give the final/ folder "
                "of a `tandem rm` run, e.g. path: runs/rm_helpful/final"
            )
        # the heavy part (transformers) loads only when a run uses a reward model
        from tandem.models.reward import RewardScorer

        max_length = 1024
        if (folder / INFO_FILE).is_file():
            max_length = max(max_length, int(json.loads((folder / INFO_FILE).read_text())["max_length"]))
        self.scorer = RewardScorer(str(folder), device=device, batch_size=batch_size, max_length=max_length)

    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        questions = [[{"role": "user", "content": last_user_turn(prompt)}] for prompt in prompts]
        return self.scorer.score(questions, [completion_text(c) for c in completions]).tolist()


def last_user_turn(prompt: str | list[dict]) -> str:
    """The question a prompt asks: a text prompt itself, or its last user message's content."""
    if isinstance(prompt, str):
        return prompt
    users = [message.get("content") or "" for message in prompt if message.get("role") == "user"]
    if not users:
        raise ValueError(
            f"a chat prompt without a user message cannot be scored by a reward model: {prompt!r}"
        )
    return users[-1]
