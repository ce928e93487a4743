"""Typed config sections: dataclasses that convert and check every field by its annotation when
built, so a wrong value (``train.lr=abc``) or an unknown key (``rollout.max_token=8``) is an error
naming the key before anything is built. Reading files and the command line is
:mod:`nopad.recipes.config`; ``--help`` and the shipped YAMLs are :mod:`nopad.recipes.config_docs`."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, Union

C = TypeVar("C")


class ConfigError(ValueError):
    """A config value that is wrong; ``key`` is its dotted name (``train.lr``)."""

    def __init__(self, key: str, detail: str):
        super().__init__(f"{key} {detail}")
        self.key, self.detail = key, detail

    def under(self, section: str) -> ConfigError:
        return ConfigError(f"{section}.{self.key}", self.detail)


class Section:
    """Base of every config dataclass: ``__post_init__`` converts and type-checks each field by its
    annotation (a nested mapping becomes its section's dataclass), then runs ``check()``."""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, _coerce(f.name, hints[f.name], getattr(self, f.name)))
        self.check()

    def check(self) -> None:
        """Checks that span fields or need ranges; raise :class:`ConfigError` naming the field."""

    def at_least(self, name: str, minimum: int | float) -> None:
        """``name`` must be ``>= minimum`` (``None`` passes where the type allows it)."""
        value = getattr(self, name)
        if value is not None and value < minimum:
            optional = type(None) in typing.get_args(_hints(type(self))[name])
            kind = "an integer" if isinstance(value, int) else "a number"
            or_null = " or null" if optional else ""
            raise ConfigError(name, f"must be {kind} >= {minimum}{or_null}, got {value!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@functools.cache
def _hints(cls) -> dict:
    """The field annotations of ``cls``, resolved (they are strings under postponed evaluation)."""
    return typing.get_type_hints(cls)


def from_dict(cls: type[C], data: Mapping) -> C:
    """``cls`` built from a (nested) mapping; keys it does not have are errors naming them."""
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in data:
        if key not in names:
            raise ConfigError(str(key), f"is not a config key here; known keys: {', '.join(names)}")
    return cls(**data)


def _describe(hint) -> str:
    """``bool | Literal["auto"]`` -> ``"true, false or 'auto'"``, for error messages."""
    words = []
    for option in typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,):
        if typing.get_origin(option) is Literal:
            words += [repr(a) for a in typing.get_args(option)]
        elif dataclasses.is_dataclass(option):
            words.append("a section")
        else:
            words += {
                bool: ["true", "false"],
                int: ["an integer"],
                float: ["a number"],
                str: ["a string"],
                type(None): ["null"],
            }.get(option, [getattr(option, "__name__", str(option))])
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _coerce(name: str, hint, value):
    """``value`` checked (and converted: an int to float, a mapping to its section) for a field
    annotated ``hint``; a :class:`ConfigError` naming ``name`` otherwise."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(name, f"is a section; set its fields as {name}.<field>=...")
        try:
            return from_dict(hint, value)
        except ConfigError as err:
            raise err.under(name) from None
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in args:
            if option is type(None):
                continue
            if dataclasses.is_dataclass(option) and isinstance(value, Mapping):
                return _coerce(name, option, value)  # an optional section: its own error, naming its key
            try:
                return _coerce(name, option, value)
            except ConfigError:
                pass
        raise ConfigError(name, f"must be {_describe(hint)}, got {value!r}")
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise ConfigError(name, f"must be {_describe(hint)}, got {value!r}")
    if origin is Callable or hint is Callable:
        if callable(value):
            return value
        raise ConfigError(name, f"must be a function, got {value!r}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(name, f"must be true or false, got {value!r}")
    if hint is float and isinstance(value, str):
        try:  # YAML 1.1 reads ``lr: 1e-5`` (no dot) as a string
            value = float(value)
        except ValueError:
            pass
    if hint in (int, float):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if hint is int and number and float(value).is_integer():
            return int(value)
        if hint is float and number:
            return float(value)
        raise ConfigError(name, f"must be {'an integer' if hint is int else 'a number'}, got {value!r}")
    if hint is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)  # a directory named 2024 reads as a number in YAML
        if isinstance(value, str):
            return value
        raise ConfigError(name, f"must be a string, got {value!r}")
    raise TypeError(f"internal: config field {name} has an annotation the loader does not know: {hint}")
