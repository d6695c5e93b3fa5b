"""Typed, checked options: every option group (a method's trainer and rule options, ``train``, ``evaluation``,
``model``) is a dataclass with defaults and one-line docs; :func:`build` turns a job's JSON dict into it.

An unknown key is an :class:`OptionError` naming where it was found (job, component), the key and the closest
valid name (``warmup_round`` -> "did you mean 'warmup_rounds'?"); a value of the wrong type or outside a
``Literal`` is one too. Nothing is silently ignored. An option that was renamed is listed in its class's
``RENAMED`` (``{old: new}``, a ``ClassVar``, inherited); the old name is refused with a pointer to the new one.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Iterable, Literal, Union, get_args, get_origin, get_type_hints


class OptionError(ValueError):
    """A configuration key or value that the component does not take."""


def option_names(*classes: type) -> set[str]:
    """Field names of one or more option dataclasses."""
    return {f.name for cls in classes for f in dataclasses.fields(cls)}


def renamed_options(*classes: type) -> dict[str, str]:
    """``{old name: new name}`` of the renamed options of one or more option dataclasses (their ``RENAMED``)."""
    out: dict[str, str] = {}
    for cls in classes:
        for klass in reversed(cls.__mro__):
            out.update(getattr(klass, "__dict__", {}).get("RENAMED", {}))
    return out


def unknown_key_message(key: str, valid: Iterable[str], where: str) -> str:
    valid = sorted(valid)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{where}: unknown option {key!r}{hint} (valid options: {', '.join(valid) or 'none'})"


def check_known(values: dict, valid: Iterable[str], where: str, renamed: dict[str, str] | None = None) -> None:
    """Raise :class:`OptionError` for the first key of ``values`` not in ``valid`` (an old name in ``renamed``:
    the message names the new one)."""
    valid, renamed = set(valid), renamed or {}
    for key in values:
        if key in renamed and key not in valid:
            raise OptionError(f"{where}: option {key!r} was renamed {renamed[key]!r}; use {renamed[key]!r}")
        if key not in valid:
            raise OptionError(unknown_key_message(key, valid, where))


def _matches(value: Any, hint: Any) -> bool:
    origin = get_origin(hint)
    if hint is Any:
        return True
    if origin is Literal:
        return value in get_args(hint)
    if origin in (Union, types.UnionType):
        return any(_matches(value, h) for h in get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple) or hint in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        args = [a for a in get_args(hint) if a is not Ellipsis]
        return all(_matches(v, args[0]) for v in value) if len(args) == 1 else True
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    return True


def _describe(hint: Any) -> str:
    if get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(hint))
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def build(cls: type, values: dict | None, where: str):
    """``cls(**values)`` after checking every key and value type (see the module docstring)."""
    values = dict(values or {})
    check_known(values, option_names(cls), where, renamed_options(cls))
    hints = get_type_hints(cls)
    for key, value in values.items():
        if not _matches(value, hints[key]):
            raise OptionError(f"{where}: option {key!r} must be {_describe(hints[key])}, got {value!r}")
        if isinstance(value, list) and get_origin(hints[key]) is tuple:
            values[key] = tuple(value)
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise OptionError(f"{where}: {e}") from None


def describe(cls: type) -> list[tuple[str, str, Any, str]]:
    """``(name, type, default, doc)`` of every option of ``cls`` (docs from ``field(metadata={"doc": ...})``)."""
    hints = get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        )  # type: ignore[misc]
        out.append((f.name, _describe(hints[f.name]), default, f.metadata.get("doc", "")))
    return out


def opt(default: Any, doc: str) -> Any:
    """A dataclass field with a default and a one-line doc."""
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(
            default_factory=lambda: typing.cast(Any, type(default))(default), metadata={"doc": doc}
        )
    return dataclasses.field(default=default, metadata={"doc": doc})
