"""The reward functions of a run, built from its reward specs: built-in GSM8K rules, user functions
given by import path "package.module:function" (or a factory of one, with `kwargs`), or a trained
reward model (`type: model`), each with a weight. Every one is called in TRL's convention (calling.py).
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.agent.tools import load_object
from tandem.config import ConfigError, RewardSpec, check_rewards, overlong_lengths
from tandem.data.prompts import build_messages
from tandem.rewards.calling import (
    Convention,
    RewardBatch,
    RewardError,
    batch_call,
    call_all,
    convention,
    per_item_call,
)
from tandem.rewards.gsm8k import answer_rewards, format_partial_rewards, format_rewards
from tandem.rewards.length import soft_overlong_penalty
from tandem.rewards.model import ModelReward  # light: it imports the model code only when built
from tandem.types import Example

log = logging.getLogger(__name__)


# the built-in rules score `texts`: prefill + generated text (an agent episode's: its last answer,
# sampler/rollout.py last_answer), never the joined turns of an episode's messages


def _answer(batch: RewardBatch) -> list[float]:
    return answer_rewards(batch.texts, batch.gold_answers())


def _format(batch: RewardBatch) -> list[float]:
    return format_rewards(batch.texts)


def _format_partial(batch: RewardBatch) -> list[float]:
    return format_partial_rewards(batch.texts)


def _overlong(max_length: int, cache: int) -> Callable[[RewardBatch], list[float]]:
    """DAPO's soft overlong punishment of each completion's generated token count."""

    def overlong(batch: RewardBatch) -> list[float]:
        lengths = [len(ids) for ids in batch.completion_ids]
        return soft_overlong_penalty(lengths, max_length=max_length, cache=cache)

    return overlong


# the built-in types of config.RewardType, each a builder (spec, sampling.max_new_tokens, key) -> the
# reward of a RewardBatch; the answer rule reads each row's gold (RewardBatch.gold_answers), the
# overlong rule its spec's lengths (config.overlong_lengths)
_BUILTINS: dict[str, Callable[[RewardSpec, int | None, str], Callable[[RewardBatch], Any]]] = {
    "answer": lambda *_: _answer,
    "format": lambda *_: _format,
    "format_partial": lambda *_: _format_partial,
    "overlong": lambda spec, max_new_tokens, key: _overlong(*overlong_lengths(spec, max_new_tokens, key)),
}


def load_function(path: str) -> Callable:
    """Import the object "package.module:attr" names (a reward function, or a factory of one)."""
    fn = load_object(path, "reward function", "function")
    if not callable(fn):
        attr = path.partition(":")[2]
        raise ValueError(f"reward function {path!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


def resolve_function(spec: RewardSpec, key: str = "rewards[0]") -> tuple[Callable, Convention]:
    """A `type: function` spec's reward function and how it is called: imported, built by its factory
    when the spec has `kwargs` (called once with them), its convention read from its signature
    (calling.convention). Anything wrong is a ConfigError naming `key`; the reward itself is not run."""
    path = spec.function or ""
    try:
        target = load_function(path)
    except ValueError as err:
        raise ConfigError(f"`{key}.function`: {err}; {_import_fix(path, err)}") from None
    fn = target
    if spec.kwargs is not None:
        try:
            fn = target(**spec.kwargs)
        except Exception as err:
            raise ConfigError(
                f"`{key}.kwargs`: {path}(**{spec.kwargs!r}) raised {type(err).__name__}: {err}; "
                "kwargs are the keyword arguments of a factory that returns the reward function"
            ) from err
        if not callable(fn):
            raise ConfigError(
                f"`{key}.kwargs`: {path}(**kwargs) returned a {type(fn).__name__}, not a reward function"
            )
    elif inspect.isclass(target):
        raise ConfigError(
            f"`{key}.function`: {path} is a class; add `kwargs:` (kwargs: {{}} for none) to make an instance "
            "that is called as the reward"
        )
    try:
        form = convention(fn, path)
    except ValueError as err:
        raise ConfigError(f"`{key}.function`: {err}") from None
    return fn, form


def _import_fix(path: str, err: ValueError) -> str:
    """What to change when `path` does not import."""
    module = path.partition(":")[0]
    first = module.split(".")[0]
    if "has no attribute" in str(err):
        return f"check the function's name in {module}"
    here = Path(f"{first}.py").is_file() or Path(first, "__init__.py").is_file()
    on_path = {str(Path(p).resolve()) for p in sys.path if p in ("", ".") or Path(p).is_dir()}
    if here and str(Path.cwd()) not in on_path:
        return (
            f"{first} is in the current folder but not on the import path: run with PYTHONPATH=. "
            "(the `tandem` command does not add the current folder)"
        )
    return "fix the module path, or install the package that holds it"


def default_prompt(example: Example) -> str | list[dict]:
    """The prompt rewards see when the caller gives none: the row's own, else its question as one user turn."""
    return example.prompt if example.prompt is not None else build_messages(example.question, "", [])


@dataclass(frozen=True)
class _Component:
    name: str
    weight: float
    call: Callable[[RewardBatch], Any]
    label: str  # what messages call it: its name and the type, import path or model folder


class RewardSet:
    """Weighted reward components; `score_batch` gives each completion's total and unweighted components.

    A component's value may be None (it does not apply to that sample): the total sums the others, and
    a sample where every component is None is unscored (Completion.scored): total 0, advantage 0, left
    out of its group's baseline and of the reward statistics, as TRL's GRPOTrainer treats it (>= 1.6).
    """

    def __init__(self, components: list[_Component]) -> None:
        self._components = components
        self._warned_unscored = False

    @classmethod
    def from_specs(
        cls, specs: Sequence[RewardSpec], *, device: Any = "cpu", max_new_tokens: int | None = None
    ) -> RewardSet:
        """From reward specs (config.RewardSpec: type, weight, function "module:attr" and its factory
        `kwargs` for type function, path of a `tandem rm` folder for type model, loaded once on
        `device`, the lengths of type overlong, whose max_length defaults to `max_new_tokens`, and
        name), checked by config.check_rewards: a bad spec, or a function that does not import,
        raises ConfigError naming `rewards[i]`.
        """
        check_rewards(specs, max_new_tokens)
        return cls(
            [_component(spec, f"rewards[{i}]", device, max_new_tokens) for i, spec in enumerate(specs)]
        )

    @property
    def names(self) -> list[str]:
        return [component.name for component in self._components]

    def score(
        self, response: str, example: Example, completion_ids: Sequence[int] = ()
    ) -> tuple[float, dict[str, float | None]]:
        """`score_batch` of one completion (its token ids, when the caller has none, read as [])."""
        return self.score_batch([response], [example], [list(completion_ids)])[0]

    def score_batch(
        self,
        responses: list[str],
        examples: list[Example],
        completion_ids: list[list[int]],
        *,
        prompts: list[str | list[dict]] | None = None,
        completions: list[list[dict]] | None = None,
        environments: list | None = None,
    ) -> list[tuple[float, dict[str, float | None]]]:
        """(sum of weight * value over the components that apply, {name: unweighted value or None}) of
        each response (prefill + generated text), with the example it answers, its generated token
        ids and its prompt as rewards see it (default: `default_prompt`). Raises RewardError (calling.py)
        when a reward raises or returns something other than a number or None per completion."""
        if prompts is None:
            prompts = [default_prompt(ex) for ex in examples]
        batch = RewardBatch.build(responses, examples, completion_ids, prompts, completions, environments)
        values = call_all([(c.label, c.call) for c in self._components], batch)
        scored = []
        for i in range(len(responses)):
            info = {c.name: column[i] for c, column in zip(self._components, values)}
            total = 0.0
            for c in self._components:
                if info[c.name] is not None:
                    total += c.weight * info[c.name]
            scored.append((total, info))
        self._warn_unscored(batch, [info for _, info in scored])
        return scored

    def add_environment_reward(self, name: str) -> None:
        """An environment class with get_reward(): each episode scored by its own instance, weight 1,
        under the class's name (as TRL adds it)."""

        def call(batch: RewardBatch) -> list:
            if batch.environments is None:
                raise RewardError(f"reward {name} needs the episodes' environments, and this batch has none")
            return [env.get_reward() for env in batch.environments]

        self._components.append(_Component(name, 1.0, call, f"{name} (environment get_reward)"))

    def _warn_unscored(self, batch: RewardBatch, infos: list[dict[str, float | None]]) -> None:
        unscored = [i for i, info in enumerate(infos) if all(v is None for v in info.values())]
        if unscored and not self._warned_unscored:
            self._warned_unscored = True  # once: the metrics count them every step (completions_unscored)
            log.warning(
                "every reward returned None for %d of %d completions (the first: %s); they get advantage 0 "
                "and stay out of the reward statistics. Is a column the rewards need missing from the data?",
                len(unscored),
                len(infos),
                batch.where(unscored[0]),
            )


def _component(spec: RewardSpec, key: str, device: Any, max_new_tokens: int | None = None) -> _Component:
    """A checked spec's reward (check_rewards holds the rules)."""
    name, weight = spec.resolved_name, float(spec.weight)
    if spec.type == "model":
        label = _label(name, spec.path)
        return _Component(name, weight, batch_call(ModelReward(spec.path, device=device), label), label)
    if spec.type == "function":
        fn, form = resolve_function(spec, key)
        label = _label(name, spec.function)
        call = per_item_call(fn, label) if form == "per_item" else batch_call(fn, label)
        return _Component(name, weight, call, label)
    build = _BUILTINS[spec.type]
    return _Component(name, weight, build(spec, max_new_tokens, key), _label(name, spec.type))


def _label(name: str, source: str | None) -> str:
    return repr(name) if name == source else f"{name!r} ({source})"
