"""The reward functions of a run, built from its reward specs: built-in GSM8K rules, user
functions given by import path "package.module:function", or a trained reward model (`type:
model`, scored in batches by rewards/model.py), each with a weight.
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.config import RewardSpec, check_rewards
from tandem.rewards.gsm8k import answer_reward, format_partial_reward, format_reward
from tandem.rewards.model import ModelReward  # light: it imports the model code only when built
from tandem.types import Example

RewardFn = Callable[[str, Example], float]
BatchRewardFn = Callable[[list[str], list[Example]], list[float]]

# the built-in types of config.RewardType
_BUILTINS: dict[str, RewardFn] = {
    "answer": lambda response, example: answer_reward(response, example.answer),
    "format": lambda response, example: format_reward(response),
    "format_partial": lambda response, example: format_partial_reward(response),
}


def load_function(path: str) -> RewardFn:
    """Import a reward function from "package.module:function" (called as fn(response, example))."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function {path!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward function {path!r}: cannot import module {module_name!r} ({err})") from err
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward function {path!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"reward function {path!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


@dataclass(frozen=True)
class _Component:
    name: str
    weight: float
    fn: BatchRewardFn
    label: str  # what error messages call it: the type, the import path, or the model folder


def _per_item(fn: RewardFn) -> BatchRewardFn:
    return lambda responses, examples: [fn(r, ex) for r, ex in zip(responses, examples)]


class RewardSet:
    """Weighted reward components; `score` gives the total and each unweighted component."""

    def __init__(self, components: list[_Component]) -> None:
        self._components = components

    @classmethod
    def from_specs(cls, specs: Sequence[RewardSpec], *, device: Any = "cpu") -> RewardSet:
        """From reward specs (config.RewardSpec: type, weight, function "module:attr" for type
        function, path of a `tandem rm` folder for type model, loaded once on `device`, and name),
        checked by config.check_rewards: a bad spec raises ConfigError naming `rewards[i]`.
        """
        check_rewards(specs)
        return cls([_component(spec, device) for spec in specs])

    @property
    def names(self) -> list[str]:
        return [component.name for component in self._components]

    def score(self, response: str, example: Example) -> tuple[float, dict[str, float]]:
        """(sum of weight * component, {name: unweighted component value})."""
        return self.score_batch([response], [example])[0]

    def score_batch(
        self, responses: list[str], examples: list[Example]
    ) -> list[tuple[float, dict[str, float]]]:
        """`score` of each (response, example); a reward model scores them all in batched forwards."""
        infos: list[dict[str, float]] = [{} for _ in responses]
        totals = [0.0] * len(responses)
        for component in self._components:
            values = component.fn(responses, examples)
            assert len(values) == len(responses), f"reward {component.label!r} lost responses"
            for i, value in enumerate(values):
                if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                    raise ValueError(
                        f"reward {component.label!r} returned {value!r}; it must return a finite number"
                    )
                infos[i][component.name] = float(value)
                totals[i] += component.weight * float(value)
        return list(zip(totals, infos))


def _component(spec: RewardSpec, device: Any) -> _Component:
    """A checked spec's reward function (check_rewards holds the rules)."""
    name, weight = spec.resolved_name, float(spec.weight)
    if spec.type == "model":
        return _Component(name, weight, ModelReward(spec.path, device=device).score, spec.path)
    if spec.type == "function":
        return _Component(name, weight, _per_item(load_function(spec.function)), spec.function)
    return _Component(name, weight, _per_item(_BUILTINS[spec.type]), spec.type)
