"""Typed messages: what a function's request packet means, instead of string-keyed meta.

A message kind is a small frozen dataclass registered under a ``KIND`` string with
:func:`message`. :func:`encode` turns one into the packet meta (``{"kind": KIND, field:
value, ...}``, JSON-able: tuples become lists); :func:`decode` turns meta back into the
dataclass, checking that the kind is one the handler accepts, that every required field
is there and no unknown one is, and that each value has its declared type (ints, floats,
strings, bools, ``None``, and tuples/lists/dicts of them). A message's own
``__post_init__`` checks its invariants (positive counts, matching lengths ...).

Invariant: ``decode(encode(m), type(m)) == m`` for every registered message ``m``; a bad
message raises :class:`~moefleet.runtime.errors.PayloadError` naming the kind, the field
and the fix, never a ``KeyError`` from deep inside a handler.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints, overload

from moefleet.runtime.errors import PayloadError

T = TypeVar("T")
A = TypeVar("A")
B = TypeVar("B")
C = TypeVar("C")
D = TypeVar("D")
_KINDS: dict[str, type[Any]] = {}


def message(kind: str) -> Any:
    """Class decorator: register a frozen dataclass as message kind ``kind``."""
    def register(cls: type[T]) -> type[T]:
        if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
            raise TypeError(f"{cls.__name__}: a message must be a frozen dataclass")
        if kind in _KINDS and _KINDS[kind] is not cls:
            raise TypeError(f"message kind {kind!r} is already registered")
        _KINDS[kind] = cls
        cls.KIND = kind  # type: ignore[attr-defined]
        return cls
    return register


def kind_of(cls: type[Any]) -> str:
    return str(cls.KIND)


def _plain(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def encode(msg: Any) -> dict[str, Any]:
    """The packet meta of ``msg`` (a registered message)."""
    kind = getattr(type(msg), "KIND", None)
    if kind is None or _KINDS.get(kind) is not type(msg):
        raise TypeError(f"{type(msg).__name__} is not a registered message")
    out: dict[str, Any] = {"kind": kind}
    for f in dataclasses.fields(msg):
        out[f.name] = _plain(getattr(msg, f.name))
    return out


def _convert(value: Any, hint: Any, where: str) -> Any:
    """``value`` checked against type ``hint`` (lists become tuples where declared)."""
    origin = get_origin(hint)
    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        for option in get_args(hint):
            try:
                return _convert(value, option, where)
            except PayloadError:
                continue
        raise PayloadError(f"{where}: {value!r} is none of {hint}", "send the declared type")
    if hint is type(None):
        if value is None:
            return None
        raise PayloadError(f"{where}: expected null, got {value!r}", "send null")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise PayloadError(f"{where}: expected a list, got {type(value).__name__}",
                               "send a JSON list")
        args = get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise PayloadError(f"{where}: expected {len(args)} items, got {len(value)}",
                               "send the declared number of items")
        return tuple(_convert(v, a, f"{where}[{i}]") for i, (v, a)
                     in enumerate(zip(value, args, strict=True)))
    if origin is dict:
        if not isinstance(value, dict):
            raise PayloadError(f"{where}: expected an object, got {type(value).__name__}",
                               "send a JSON object")
        _, vt = get_args(hint) or (str, Any)
        return {str(k): _convert(v, vt, f"{where}.{k}") for k, v in value.items()}
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint in (str, bool):
        if type(value) is hint:
            return value
    else:
        raise PayloadError(f"{where}: unsupported field type {hint}", "fix the message class")
    raise PayloadError(f"{where}: expected {hint.__name__}, got {value!r}",
                       f"send a {hint.__name__}")


@overload
def decode(meta: dict[str, Any], a: type[A], /) -> A: ...
@overload
def decode(meta: dict[str, Any], a: type[A], b: type[B], /) -> A | B: ...
@overload
def decode(meta: dict[str, Any], a: type[A], b: type[B], c: type[C], /) -> A | B | C: ...
@overload
def decode(meta: dict[str, Any], a: type[A], b: type[B], c: type[C], d: type[D], /
           ) -> A | B | C | D: ...


def decode(meta: dict[str, Any], *accepted: type[Any]) -> Any:
    """The message ``meta`` encodes; its kind must be one of ``accepted``."""
    if not isinstance(meta, dict):
        raise PayloadError(f"message meta must be an object, got {type(meta).__name__}",
                           "send a packet made with messages.encode")
    names = [kind_of(c) for c in accepted]
    kind = meta.get("kind")
    if kind not in names:
        raise PayloadError(f"unknown message kind {kind!r}; this function accepts "
                           f"{', '.join(names)}", "send one of the accepted kinds")
    cls = accepted[names.index(kind)]
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    extra = sorted(set(meta) - set(fields) - {"kind"})
    if extra:
        raise PayloadError(f"{kind}: unknown fields {extra}", f"known: {sorted(fields)}")
    values: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in meta:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise PayloadError(f"{kind}: field {name!r} is missing", f"send {name!r}")
            continue
        values[name] = _convert(meta[name], hints[name], f"{kind}.{name}")
    try:
        return cls(**values)
    except (ValueError, TypeError) as err:
        raise PayloadError(f"{kind}: {err}", "fix the message") from err


@message("warm")
@dataclass(frozen=True)
class Warm:
    """Start the instance (its cold start) and do nothing else; every model handler
    answers it with itself."""
