"""Tools and environments as TRL defines them, loaded by import path.

- A **tool** is a plain Python function (sync or async) with type hints and a Google-style docstring;
  its JSON schema is built from them the way transformers builds it for chat templates
  (`transformers.utils.get_json_schema`), so a function written for TRL's `GRPOTrainer(tools=[...])`
  runs unchanged. `agent.tools: ["pkg.mod:function", ...]`.
- An **environment** is a class (TRL's `environment_factory`): one instance per episode, `reset(**row)`
  with the dataset row's columns (those its signature accepts, all of them when it takes **kwargs),
  whose return value (None or a string) is appended to the last user message; its public methods,
  other than `reset` and `get_reward`, are the episode's tools; `get_reward()`, when defined, scores
  the finished episode from the environment's state. `agent.environment: "pkg.mod:Class"`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

RESERVED_METHODS = ("reset", "get_reward")


class ToolSpecError(ValueError):
    """A tool or environment that cannot be used, with what to change."""


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters", ...}}
    is_async: bool

    @property
    def parameters(self) -> dict:
        return self.schema["function"].get("parameters", {"type": "object", "properties": {}})


def tool_from_callable(fn: Callable[..., Any], where: str = "") -> Tool:
    """A Tool with the schema transformers makes of `fn`'s signature and docstring."""
    from transformers.utils import get_json_schema

    label = where or getattr(fn, "__qualname__", repr(fn))
    try:
        schema = get_json_schema(fn)
    except Exception as err:  # DocstringParsingException, TypeHintParsingException, ...
        raise ToolSpecError(
            f"tool {label}: its JSON schema cannot be built from its signature and docstring ({err}). "
            "A tool needs a type hint on every argument and a Google-style docstring with a line per "
            "argument under 'Args:', as for transformers chat templates and TRL's GRPOTrainer(tools=...)"
        ) from err
    return Tool(schema["function"]["name"], fn, schema, inspect.iscoroutinefunction(fn))


def load_object(path: str, what: str, form: str = "name") -> Any:
    """The object "package.module:attr" names; ToolSpecError (a ValueError) saying what is wrong,
    `what` naming the setting in the message and `form` the attribute in its example."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ToolSpecError(f"{what} {path!r} must look like 'package.module:{form}'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ToolSpecError(f"{what} {path!r}: cannot import module {module_name!r} ({err})") from err
    obj = getattr(module, attr, None)
    if obj is None:
        raise ToolSpecError(f"{what} {path!r}: module {module_name!r} has no attribute {attr!r}")
    return obj


def load_tools(paths: list[str]) -> list[Tool]:
    """`agent.tools`: each path names a function; two tools may not share a name."""
    tools = []
    for i, path in enumerate(paths):
        fn = load_object(path, f"agent.tools[{i}]")
        if not callable(fn) or inspect.isclass(fn):
            raise ToolSpecError(f"agent.tools[{i}] {path!r} is a {type(fn).__name__}, not a function")
        tools.append(tool_from_callable(fn, f"agent.tools[{i}] {path!r}"))
    check_unique(tools)
    return tools


def check_unique(tools: list[Tool]) -> None:
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise ToolSpecError(f"two tools are named {tool.name!r}: the model could not tell them apart")
        seen.add(tool.name)


@dataclass(frozen=True)
class EnvironmentClass:
    """`agent.environment`: the class, its tool methods' names and whether it scores episodes."""

    cls: type
    methods: tuple[str, ...]
    has_reward: bool

    def new(self) -> Any:
        return self.cls()

    def tools(self, instance: Any) -> list[Tool]:
        """The instance's bound tool methods (one instance per episode: state never leaks between them)."""
        name = self.cls.__name__
        return [tool_from_callable(getattr(instance, m), f"{name}.{m}") for m in self.methods]


def load_environment(path: str) -> EnvironmentClass:
    """Load and check an environment class: it must be a class with a callable `reset`; its tool
    methods are the public functions defined on the class (not properties), as TRL lists them."""
    cls = load_object(path, "agent.environment")
    if not inspect.isclass(cls):
        raise ToolSpecError(f"agent.environment {path!r} is a {type(cls).__name__}, not a class")
    members = dict(inspect.getmembers(cls, predicate=inspect.isfunction))
    if "reset" not in members:
        raise ToolSpecError(
            f"agent.environment {path!r} has no reset method: define reset(self, **row) (it gets the "
            "dataset row's columns, and may return a string appended to the prompt)"
        )
    methods = tuple(m for m in members if not m.startswith("_") and m not in RESERVED_METHODS)
    env = EnvironmentClass(cls, methods, "get_reward" in members)
    probe = env.new()  # the schemas are checked once, at start-up, not at the first episode
    check_unique(env.tools(probe))
    return env


def reset_environment(instance: Any, row: dict) -> str | None:
    """Call `reset` with the row's columns it accepts (every column when it takes **kwargs); its
    return value must be None or a string (the observation appended to the last user message)."""
    signature = inspect.signature(instance.reset)
    params = signature.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        kwargs = dict(row)
    else:
        accepted = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        kwargs = {k: v for k, v in row.items() if k in accepted}
    observation = instance.reset(**kwargs)
    if observation is not None and not isinstance(observation, str):
        raise ToolSpecError(
            f"{type(instance).__name__}.reset returned a {type(observation).__name__}; it must return "
            "None or a string (appended to the last user message)"
        )
    return observation
