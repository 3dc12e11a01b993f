"""The reward functions of a run, built from its reward specs: built-in GSM8K rules or user
functions given by import path "package.module:function", each with a weight.
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.rewards.gsm8k import answer_reward, format_partial_reward, format_reward
from tandem.types import Example

RewardFn = Callable[[str, Example], float]

_BUILTINS: dict[str, RewardFn] = {
    "answer": lambda response, example: answer_reward(response, example.answer),
    "format": lambda response, example: format_reward(response),
    "format_partial": lambda response, example: format_partial_reward(response),
}
TYPES = (*_BUILTINS, "function")


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
    fn: RewardFn
    label: str  # what error messages call it: the type, or the import path


class RewardSet:
    """Weighted reward components; `score` gives the total and each unweighted component."""

    def __init__(self, components: list[_Component]) -> None:
        self._components = components

    @classmethod
    def from_specs(cls, specs: Sequence[Any]) -> RewardSet:
        """From specs with `type` (answer|format|format_partial|function), `weight`, `function`
        ("module:attr", only for type function) and `name` (default: the type, or the attr).
        """
        if not specs:
            raise ValueError("no rewards configured: give at least one reward spec")
        components: list[_Component] = []
        for spec in specs:
            components.append(_component(spec))
        names = [component.name for component in components]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"reward names must be unique, repeated: {duplicates}; set `name` on each")
        return cls(components)

    @property
    def names(self) -> list[str]:
        return [component.name for component in self._components]

    def score(self, response: str, example: Example) -> tuple[float, dict[str, float]]:
        """(sum of weight * component, {name: unweighted component value})."""
        info: dict[str, float] = {}
        total = 0.0
        for component in self._components:
            value = component.fn(response, example)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(
                    f"reward {component.label!r} returned {value!r}; it must return a finite number"
                )
            info[component.name] = float(value)
            total += component.weight * float(value)
        return total, info


def _component(spec: Any) -> _Component:
    kind, weight, path, name = spec.type, spec.weight, spec.function, spec.name
    if kind not in TYPES:
        raise ValueError(f"reward type {kind!r} is unknown; choose one of {list(TYPES)}")
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
        raise ValueError(f"reward {name or kind!r}: weight must be a finite number, got {weight!r}")
    if kind == "function":
        if not path:
            raise ValueError("reward type 'function' needs `function: package.module:function`")
        return _Component(name or path.rpartition(":")[2], float(weight), load_function(path), path)
    if path:
        raise ValueError(
            f"reward type {kind!r} is built in and takes no `function` ({path!r}); use type 'function'"
        )
    return _Component(name or kind, float(weight), _BUILTINS[kind], kind)
