"""An endless, seeded, resumable stream of prompt batches over a list of examples."""

from __future__ import annotations

import random

from tandem.config import DataConfig
from tandem.data.prompt_sets import load_examples
from tandem.types import Example


class PromptStream:
    """Epoch e visits the examples in a permutation fixed by (seed, e); the position is two ints."""

    def __init__(self, examples: list[Example], batch_size: int, *, seed: int, shuffle: bool = True) -> None:
        if not examples:
            raise ValueError("the data set is empty: check data.dataset and data.num_examples")
        self.examples = examples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, size: int | None = None) -> list[Example]:
        batch: list[Example] = []
        while len(batch) < (size or self.batch_size):
            if self.index == len(self._order):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            batch.append(self.examples[self._order[self.index]])
            self.index += 1
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)


def prompt_stream(data: DataConfig, batch_size: int, *, seed: int, stream_seed: int) -> PromptStream:
    """Batches of `batch_size` prompts of `data.*`: the examples drawn with `seed` (the run's), their
    order with `stream_seed` (a sampler's own)."""
    examples = load_examples(
        data.dataset,
        data.split,
        data.num_examples,
        seed,
        difficulty=data.difficulty,
        prompt_column=data.prompt_column,
    )
    return PromptStream(examples, batch_size, seed=stream_seed, shuffle=data.shuffle)
