"""How reward functions are called: TRL's batch convention (or the old per-item one), async functions
awaited together, and every returned value checked, a bad one reported as a RewardError that names
the reward and the sample. Standard library only.

TRL's convention (GRPOTrainer): once per batch, fn(prompts=..., completions=..., completion_ids=...,
**columns) -> one float, or None where the reward does not apply, per completion.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from tandem.types import Example

BATCH_ARGS = ("prompts", "completions", "completion_ids")  # what the convention passes besides the columns
# what TRL's trainer also passes, and tandem does not: its TrainerState, the hooks into its completions
# table and metrics, its tool environments. A function that requires one cannot run here.
NOT_PASSED = ("trainer_state", "log_extra", "log_metric")
SHOWN_CHARS = 60  # of a completion, in error messages

Convention = Literal["batch", "per_item"]


class RewardError(ValueError):
    """A reward function raised, or returned something other than one number (or None) per
    completion. The message names the reward and the sample; it is the user's code to fix."""

    # `tandem sample` stopped by one exits with this code, and the launcher does not start it again:
    # a restart would load the models and meet the same error
    exit_code = 4


def completion_text(completion: str | list[dict]) -> str:
    """A completion as the convention passes it, as text: the string, or its assistant message's content."""
    if isinstance(completion, str):
        return completion
    return "".join(message.get("content") or "" for message in completion)


def convention(fn: Callable, label: str) -> Convention:
    """How `fn` is called, read from its signature; ValueError when it fits neither form.

    batch (TRL's): it has a parameter named prompts, completions or completion_ids, or takes **kwargs
    and fewer than two required positional parameters. per_item (tandem's old form, fn(response,
    example) -> float): otherwise, when two positional arguments bind. A signature that cannot be read
    (a builtin) is taken as batch.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return "batch"
    params = signature.parameters.values()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in params if p.kind in positional and p.default is inspect.Parameter.empty]
    var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    if any(p.name in BATCH_ARGS for p in params) or (var_keyword and len(required) < 2):
        for p in params:
            if p.name in NOT_PASSED and p.default is inspect.Parameter.empty:
                raise ValueError(
                    f"reward {label}: its parameter {p.name!r} has no default, and tandem does not pass "
                    f"{p.name} (TRL's trainer does); give it a default, e.g. {p.name}=None"
                )
        return "batch"
    try:
        signature.bind("response", None)
    except TypeError:
        raise ValueError(
            f"reward {label} has the signature {signature}, which fits neither way a reward is called: "
            "TRL's fn(prompts, completions, completion_ids, **columns) -> list[float | None] (take "
            "completions and **kwargs), or fn(response: str, example: Example) -> float"
        ) from None
    return "per_item"


@dataclass(frozen=True)
class RewardBatch:
    """One scoring call's inputs, one entry per completion (a row's values repeat for its completions).

    `prompts`: a row's prompt as TRL passes it (its text, or its chat messages); `completions`: the text
    (prefill + generated) for a text prompt, [{"role": "assistant", "content": text}] for a chat one;
    `columns`: every other column of the rows, by name (None where a row lacks one).
    """

    texts: list[str]
    examples: list[Example]
    prompts: list[str | list[dict]]
    completions: list[str | list[dict]]
    completion_ids: list[list[int]]
    columns: dict[str, list]
    # agent runs: each episode's environment instance (passed as `environments`), else None
    environments: list | None = None

    @classmethod
    def build(
        cls,
        texts: list[str],
        examples: list[Example],
        completion_ids: list[list[int]],
        prompts: list[str | list[dict]],
        completions: list[list[dict]] | None = None,
        environments: list | None = None,
    ) -> RewardBatch:
        """`completions`: an agent run's episodes as messages (TRL's convention for tool use); by
        default each text as the convention passes a single-turn completion."""
        if not len(texts) == len(examples) == len(completion_ids) == len(prompts):
            raise ValueError(
                f"a reward batch needs one example, token-id list and prompt per completion: {len(texts)} "
                f"completions, {len(examples)} examples, {len(completion_ids)} id lists, {len(prompts)} prompts"
            )
        names: dict[str, None] = {}  # every row's column names, in the order first seen
        for example in examples:
            for name in example.columns:
                if name in BATCH_ARGS:
                    raise ValueError(
                        f"row {example.prompt_id!r} has a column named {name!r}, which TRL's calling "
                        "convention passes itself; rename that column"
                    )
                names.setdefault(name)
        if completions is None:
            completions = [
                [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text
                for text, prompt in zip(texts, prompts)
            ]
        columns = {name: [ex.columns.get(name) for ex in examples] for name in names}
        return cls(
            texts,
            examples,
            list(prompts),
            list(completions),
            [list(ids) for ids in completion_ids],
            columns,
            environments,
        )

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of a batch call (each list is the caller's to read, not to keep)."""
        return dict(
            prompts=self.prompts,
            completions=self.completions,
            completion_ids=self.completion_ids,
            **({"environments": self.environments} if self.environments is not None else {}),
            **self.columns,
        )

    def gold_answers(self) -> list[str]:
        """Each row's gold answer: its `solution` column where it has one, else Example.answer."""
        return [
            ex.answer if ex.columns.get("solution") is None else str(ex.columns["solution"])
            for ex in self.examples
        ]

    def where(self, index: int) -> str:
        """Sample `index` for a message: its prompt id and the start of its completion."""
        text = self.texts[index]
        shown = text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."
        return f"prompt {self.examples[index].prompt_id!r}, completion {shown!r}"


# --- calling


def batch_call(fn: Callable, label: str) -> Callable[[RewardBatch], Any]:
    """TRL's call: once for the batch, with everything by keyword."""
    try:
        signature: inspect.Signature | None = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None

    def call(batch: RewardBatch) -> Any:
        kwargs = batch.kwargs()
        if signature is not None:
            try:  # a parameter no argument fills is most likely a column the data lacks: say which exist
                signature.bind(**kwargs)
            except TypeError as err:
                raise RewardError(
                    f"reward {label} cannot be called with this batch ({err}); it is given prompts, "
                    f"completions, completion_ids and the rows' columns {sorted(batch.columns)}"
                ) from None
        return fn(**kwargs)

    return call


def per_item_call(fn: Callable, label: str) -> Callable[[RewardBatch], Any]:
    """The old call, fn(response, example), once per completion; an async fn's calls run together."""

    def call(batch: RewardBatch) -> Any:
        results = []
        for i, (text, example) in enumerate(zip(batch.texts, batch.examples)):
            try:
                results.append(fn(text, example))
            except Exception as err:
                raise RewardError(f"reward {label} raised {_describe(err)} on {batch.where(i)}") from err
        if any(inspect.isawaitable(r) for r in results):
            return _gather_list(results)
        return results

    return call


async def _gather_list(awaitables: list) -> list:
    return list(await asyncio.gather(*awaitables))


def call_all(calls: list[tuple[str, Callable[[RewardBatch], Any]]], batch: RewardBatch) -> list[list]:
    """Each (label, call)'s values for `batch`, checked: one finite number or None per completion.

    The synchronous functions run one after another in this thread; those that return an awaitable
    (async def, or an instance with an async __call__) are then awaited together (asyncio.gather),
    on one event loop that lives as long as the process, so their clients may keep connections.
    """
    results: list[Any] = []
    for label, call in calls:
        try:
            results.append(call(batch))
        except Exception as err:
            for result in results:  # started, never to be awaited
                if inspect.iscoroutine(result):
                    result.close()
            if isinstance(err, RewardError):
                raise
            raise RewardError(f"reward {label} raised {_describe(err)} {_on_batch(batch)}") from err
    pending = [i for i, result in enumerate(results) if inspect.isawaitable(result)]
    if pending:
        awaited = _run(_gather_all([results[i] for i in pending]))
        for i, value in zip(pending, awaited):
            if isinstance(value, BaseException):
                label = calls[i][0]
                raise RewardError(f"reward {label} raised {_describe(value)} {_on_batch(batch)}") from value
            results[i] = value
    return [check_values(label, result, batch) for (label, _), result in zip(calls, results)]


async def _gather_all(awaitables: list) -> list:
    return await asyncio.gather(*awaitables, return_exceptions=True)


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _run(coroutine) -> Any:
    """Run `coroutine` on the process's reward event loop (a daemon thread), wherever the caller is,
    even inside a running loop of its own (a notebook)."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="tandem-rewards", daemon=True).start()
    return asyncio.run_coroutine_threadsafe(coroutine, _loop).result()


def check_values(label: str, values: Any, batch: RewardBatch) -> list[float | None]:
    """`values` as one float or None per completion of `batch`; RewardError naming what is wrong."""
    n = len(batch.texts)
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # a numpy array, a tensor
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardError(
            f"reward {label} returned {_type(values)} {_on_batch(batch)}; it must return a list of "
            f"{n} values, one per completion (a number, or None where it does not apply)"
        )
    if len(values) != n:
        raise RewardError(
            f"reward {label} returned {len(values)} values for {n} completions {_on_batch(batch)}"
        )
    checked: list[float | None] = []
    for i, value in enumerate(values):
        if value is None:
            checked.append(None)
        elif isinstance(value, numbers.Real) and math.isfinite(value):
            checked.append(float(value))
        else:
            raise RewardError(
                f"reward {label} returned {value!r} ({_type(value)}) for {batch.where(i)}; each value must "
                "be a finite number, or None where the reward does not apply"
            )
    return checked


def _on_batch(batch: RewardBatch) -> str:
    if not batch.texts:
        return "on an empty batch"
    return f"on a batch of {len(batch.texts)} completions (the first: {batch.where(0)})"


def _describe(err: BaseException) -> str:
    """The exception and where it was raised (the innermost frame: usually the user's own line)."""
    frames = traceback.extract_tb(err.__traceback__)
    at = f" at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    return f"{type(err).__name__}: {err}{at}"


def _type(value: Any) -> str:
    return "None" if value is None else f"a {type(value).__name__}"
