"""A trained reward model (`tandem rm`'s final/) as a GRPO/PPO reward: `rewards: [{type: model, path: ...}]`.

The sampler loads it once, on its own device, and scores a batch's completions in a few padded
forwards: the reward model sees the question as a user message and the completion as the answer.
"""

from __future__ import annotations

import json
from pathlib import Path

from tandem.types import Example

INFO_FILE = "tandem_reward.json"  # written by `tandem rm` next to the model


class ModelReward:
    """score(responses, examples) -> one float per response: the reward model's scalar score."""

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

    def score(self, responses: list[str], examples: list[Example]) -> list[float]:
        prompts = [[{"role": "user", "content": ex.question}] for ex in examples]
        return self.scorer.score(prompts, responses).tolist()
