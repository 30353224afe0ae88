"""User-facing errors.

Every error that reaches a user at a boundary (CLI, config file, HTTP body, plan) is a
:class:`MoefleetError`: one line that names the bad value, plus a hint that names the fix.
The CLI prints ``error: <message>`` and ``hint: <hint>`` and exits with ``exit_code``.
"""

from __future__ import annotations

from typing import Any


class MoefleetError(Exception):
    """A problem the user can fix; ``hint`` says how."""

    exit_code = 2

    def __init__(self, message: str, hint: str = "") -> None:
        # One line each, whatever a wrapped library message held (a parser's "\n").
        message, hint = " ".join(str(message).split()), " ".join(str(hint).split())
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class UnknownNameError(MoefleetError):
    """A name (model, dataset, platform, policy ...) that is not in its registry."""


class UnsupportedModelError(MoefleetError):
    """A checkpoint whose architecture moefleet has no adapter for."""


class DataError(MoefleetError):
    """Missing, empty or malformed input data."""


class MissingExtraError(MoefleetError):
    """An optional dependency group is not installed."""

    def __init__(self, module: str, extra: str) -> None:
        super().__init__(
            f"this feature needs the optional package '{module}'",
            f"install it with: pip install 'moefleet[{extra}]'",
        )


class OutputPathError(MoefleetError):
    """An output path that cannot be written (a directory, no permission, ...)."""


class LimitError(MoefleetError):
    """A user number that would size work past a documented bound."""


def check_limit(name: str, value: float, limit: float, unit: str = "",
                hint: str = "") -> None:
    """Raise ``LimitError`` naming ``name`` when ``value`` exceeds ``limit``."""
    if not value <= limit:  # also catches NaN
        raise LimitError(
            f"{name} = {value:g}{unit} exceeds the limit {limit:g}{unit}",
            hint or f"use at most {limit:g}{unit} (see README, 'Limits')",
        )


def validation_message(err: Any, source: str) -> str:
    """``<source>: field 'a.b': <msg>`` for the first problem of a pydantic ValidationError."""
    errors = err.errors()
    first = errors[0]
    loc = ".".join(str(p) for p in first["loc"]) or "<root>"
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    msg = str(first["msg"]).removeprefix("Value error, ")
    return f"{source}: field '{loc}': {msg}{more}"
