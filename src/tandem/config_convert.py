"""Conversion for the config tree: a nested dict (YAML) into dataclasses, checked key by key against the
type hints (Literal choices included), dotted `key=value` overrides, and ConfigError. `config.py` holds the
fields and their rules; this module knows no field by name.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A user mistake in the config; the message names the dotted key and the fix."""


# ---------------------------------------------------------------- dict -> dataclasses


def from_dict(d: Any, cls: type[T], prefix: str = "") -> T:
    """Build `cls` from a nested dict, checking every key and type against the dataclass hints."""
    if not isinstance(d, dict):
        where = f"`{prefix}`" if prefix else "the config"
        raise ConfigError(f"{where} must be a mapping of keys to values, got {d!r} ({type(d).__name__})")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in d.items():
        if key not in fields:
            raise ConfigError(_unknown_key_message(str(key), cls, prefix))
        kwargs[key] = _convert(value, hints[key], join(prefix, key))
    for f in fields.values():
        no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if no_default and f.name not in kwargs:
            raise ConfigError(
                f"`{join(prefix, f.name)}` is required; add it (expects {_type_name(hints[f.name])})"
            )
    return cls(**kwargs)


def join(prefix: str, key: str) -> str:
    """The dotted key of `key` in the section at `prefix` ("" = the top level)."""
    return f"{prefix}.{key}" if prefix else key


def _unknown_key_message(key: str, cls: type, prefix: str) -> str:
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(key, names, n=1)
    if not close:  # a key one section too high, e.g. `learning_rate` for `training.learning_rate`
        sections = [
            (f.name, [g.name for g in dataclasses.fields(sub)])
            for f in dataclasses.fields(cls)
            if dataclasses.is_dataclass(sub := typing.get_type_hints(cls)[f.name])
        ]
        exact = [f"{section}.{key}" for section, keys in sections if key in keys]
        near = [
            (difflib.SequenceMatcher(None, key, match).ratio(), f"{section}.{match}")
            for section, keys in sections
            for match in difflib.get_close_matches(key, keys, n=1)
        ]
        if exact:  # the first section that has it (grpo before ppo for kl_coef)
            close = exact[:1]
        elif near:
            close = [max(near)[1]]
    hint = f"did you mean `{join(prefix, close[0])}`?" if close else f"valid keys here: {', '.join(names)}"
    return f"unknown config key `{join(prefix, key)}`; {hint}"


def _convert(value: Any, tp: Any, key: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(value, inner, key)
    if origin is list:
        if not isinstance(value, list):
            hint = f"write it as a list, e.g. [{value}]" if isinstance(value, (str, int, float)) else ""
            raise _type_error(key, tp, value, hint)
        return [_convert(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is Literal:  # a choice of strings: any string converts, the section's check() says which
        assert all(isinstance(a, str) for a in args), f"config field `{key}`: choices must be strings"
        if value is False and "no" in args:  # YAML 1.1 reads a bare `no` as false
            return "no"
        tp = str
    if dataclasses.is_dataclass(tp):
        return from_dict(value, tp, key)
    if origin is dict:  # free-form keyword arguments: a mapping whose values are any YAML
        if not isinstance(value, dict):
            raise _type_error(key, tp, value, "write it as a mapping, e.g. {name: value}")
        return copy.deepcopy(value)
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads `1e-5` (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp is str and isinstance(value, str):
        return value
    assert tp in (bool, int, float, str), f"config field `{key}` has an unsupported type {tp}"
    hint = "quote the value so YAML reads it as a string" if tp is str and value is not None else ""
    raise _type_error(key, tp, value, hint)


def _type_error(key: str, tp: Any, value: Any, hint: str = "") -> ConfigError:
    fix = f"; {hint}" if hint else ""
    return ConfigError(
        f"config key `{key}` expects {_type_name(tp)}, got {value!r} ({type(value).__name__}){fix}"
    )


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args if a is not type(None)) + " or null"
    if typing.get_origin(tp) is list:
        return f"a list of ({_type_name(args[0])})"
    if typing.get_origin(tp) is dict:
        return "a mapping"
    if typing.get_origin(tp) is Literal:
        return "a string"
    if dataclasses.is_dataclass(tp):
        return f"a mapping with keys {', '.join(f.name for f in dataclasses.fields(tp))}"
    return {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}[tp]


# ---------------------------------------------------------------- YAML files, overrides


def read_yaml(path: Path) -> dict[str, Any]:
    """The mapping a YAML config file holds (an empty file: {})."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass an existing YAML file (see configs/)")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML; fix the syntax: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys to values at the top level")
    return raw


def apply_overrides(d: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of `d` with dotted `key=value` pairs set; values are parsed as YAML."""
    out = copy.deepcopy(d) if d else {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(
                f"override {item!r} must have the form key=value, e.g. training.learning_rate=1e-5"
            )
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"override `{key}`: cannot parse {raw!r} as YAML ({e}); quote the value") from e
        _set_dotted(out, key, value)
    return out


def _set_dotted(d: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    if "" in parts:
        raise ConfigError(f"override key `{key}` has an empty part; write it like training.learning_rate")
    node: Any = d
    for i, part in enumerate(parts[:-1]):
        here = ".".join(parts[: i + 1])
        if isinstance(node, dict) and node.get(part) is None:
            if parts[i + 1].isdigit():
                raise ConfigError(f"override `{key}`: the list `{here}` is not in the file; set it whole")
            node[part] = {}  # a section absent from the file (or left empty)
        node = node[_index(node, part, key, here)]
    node[_index(node, parts[-1], key, key)] = value


def _index(node: Any, part: str, key: str, here: str) -> str | int:
    if isinstance(node, list):  # e.g. rewards.0.weight=2
        if not part.isdigit() or int(part) >= len(node):
            raise ConfigError(f"override `{key}`: `{here}` must index the list (0..{len(node) - 1})")
        return int(part)
    if not isinstance(node, dict):
        raise ConfigError(f"override `{key}`: `{here.rpartition('.')[0]}` is a value, not a section")
    return part
