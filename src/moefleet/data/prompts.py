"""Prompts and the rules that turn raw text or records into prompts.

A :class:`Prompt` is the unit a profiling run feeds to a model. Every prompt a loader in
this package returns satisfies:

- ``request_id`` is non-empty, and unique among the prompts of one load;
- ``text`` contains at least one non-whitespace character;
- ``reference`` is ``None`` or a string (an answer / continuation the dataset provides).

Two parsing rules live here so named datasets and user files share them:

- :func:`paragraphs` — plain text: one prompt per non-empty line, stripped, skipping
  WikiText-style ``= Heading =`` / ``= = Section = =`` lines.
- :func:`record_text` — one JSON object: the first field present among ``text``,
  ``prompt``, ``instruction`` (+ ``input``), ``goal``, ``conversations`` / ``messages``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moefleet.errors import DataError

# Fields tried in this order; the first one present decides how the record is read.
RECORD_FIELDS: tuple[str, ...] = (
    "text",
    "prompt",
    "instruction",
    "goal",
    "conversations",
    "messages",
)

# Speaker tags: ShareGPT uses "from"/"value" with human|gpt, OpenAI chat "role"/"content"
# with user|assistant. A reference is the turn right after the prompt, if not a user turn.
_USER_SPEAKERS = frozenset({"human", "user"})
_NON_ANSWER_SPEAKERS = frozenset({"human", "user", "system"})


@dataclass(frozen=True)
class Prompt:
    """One request to profile.

    ``request_id`` is stable across runs: a dataset's own id where it has one, else
    ``"<dataset>:<index>"`` with a zero-padded index that does not depend on ``split`` or
    ``limit``: the paragraph's number in a text file, the record's position in a JSON file.
    """

    request_id: str
    text: str
    reference: str | None = None

    def __post_init__(self) -> None:
        if not self.request_id:
            raise DataError(
                f"prompt with text {self.text[:40]!r} has an empty request_id",
                "give every prompt a non-empty id",
            )
        if not self.text.strip():
            raise DataError(
                f"prompt {self.request_id!r} has empty text",
                "drop empty prompts before building Prompt objects",
            )


class RecordError(ValueError):
    """A record that cannot be read; the caller adds the file and line to the message."""


def is_heading(line: str) -> bool:
    """True for a stripped WikiText heading line such as ``= Title =`` or ``= = Career = =``."""
    return len(line) >= 3 and line.startswith("= ") and line.endswith(" =")


def paragraphs(text: str) -> list[str]:
    """Non-empty, non-heading lines of ``text``, stripped, in file order.

    Lines are split on ``\\n`` only (a trailing ``\\r`` is stripped with the other
    whitespace), so CRLF and LF files give the same result.
    """
    out: list[str] = []
    for line in text.split("\n"):
        stripped = line.strip()
        if stripped and not is_heading(stripped):
            out.append(stripped)
    return out


def _optional_str(record: Mapping[str, Any], key: str) -> str | None:
    """The string under ``key``; ``None`` when absent or null; RecordError for other types."""
    value = record.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise RecordError(f"field {key!r} must be a string, got {type(value).__name__}")
    return value


def _required_str(record: Mapping[str, Any], key: str) -> str:
    value = _optional_str(record, key)
    if value is None:
        raise RecordError(f"field {key!r} is null")
    return value


def _first_str(record: Mapping[str, Any], keys: tuple[str, ...]) -> str | None:
    for key in keys:
        value = _optional_str(record, key)
        if value is not None:
            return value
    return None


def _turn(turn: Any, index: int) -> tuple[str, str]:
    """(speaker, text) of one conversation turn, in either ShareGPT or OpenAI shape."""
    if not isinstance(turn, Mapping):
        raise RecordError(f"conversation turn {index} is {type(turn).__name__}, not an object")
    speaker = turn.get("from", turn.get("role"))
    text = turn.get("value", turn.get("content"))
    if not isinstance(speaker, str) or not isinstance(text, str):
        raise RecordError(
            f"conversation turn {index} needs string 'from'/'role' and 'value'/'content'"
        )
    return speaker.lower(), text


def _conversation(turns: Any, key: str) -> tuple[str, str | None]:
    """First user turn and, as reference, the answer right after it (if any)."""
    if not isinstance(turns, list):
        raise RecordError(f"field {key!r} must be a list of turns, got {type(turns).__name__}")
    parsed = [_turn(t, i) for i, t in enumerate(turns)]
    for i, (speaker, text) in enumerate(parsed):
        if speaker in _USER_SPEAKERS:
            reference = None
            if i + 1 < len(parsed) and parsed[i + 1][0] not in _NON_ANSWER_SPEAKERS:
                reference = parsed[i + 1][1]
            return text, reference
    # No user turn: nothing to prompt with; the caller skips empty text.
    return "", None


def _goal(record: Mapping[str, Any]) -> tuple[str, str | None]:
    """PIQA shape: ``goal`` with ``sol1``/``sol2`` and, when present, an integer ``label``."""
    goal = _required_str(record, "goal")
    label = record.get("label")
    if isinstance(label, int) and not isinstance(label, bool) and label in (0, 1):
        return goal, _optional_str(record, f"sol{label + 1}")
    return goal, None


def record_text(record: Mapping[str, Any]) -> tuple[str, str | None]:
    """``(text, reference)`` of one record by the first field in :data:`RECORD_FIELDS`.

    - ``text``: the text; reference from ``reference``.
    - ``prompt``: the prompt; reference from ``reference``/``completion``/``response``/``output``.
    - ``instruction``: instruction, plus ``"\\n\\n" + input`` when ``input`` is non-empty;
      reference from ``output``.
    - ``goal``: the goal; reference ``sol1``/``sol2`` by an integer ``label`` (0/1).
    - ``conversations`` / ``messages``: the first human/user turn; reference the next turn
      when it is an answer (not user/system).

    The returned text may be empty or whitespace; callers skip such records. Raises
    :class:`RecordError` when no field matches or a field has the wrong type.
    """
    explicit_ref = _optional_str(record, "reference")
    if "text" in record:
        return _required_str(record, "text"), explicit_ref
    if "prompt" in record:
        ref = explicit_ref or _first_str(record, ("completion", "response", "output"))
        return _required_str(record, "prompt"), ref
    if "instruction" in record:
        text = _required_str(record, "instruction")
        extra = _optional_str(record, "input")
        if extra and extra.strip():
            text = f"{text}\n\n{extra}"
        return text, explicit_ref or _optional_str(record, "output")
    if "goal" in record:
        text, ref = _goal(record)
        return text, explicit_ref or ref
    for key in ("conversations", "messages"):
        if key in record:
            text, ref = _conversation(record[key], key)
            return text, explicit_ref or ref
    keys = ", ".join(sorted(map(str, record))) or "none"
    raise RecordError(f"no prompt field (fields present: {keys})")


def record_id(record: Mapping[str, Any]) -> str | None:
    """The record's own ``id`` as a string, or ``None`` when it has none."""
    value = record.get("id")
    if value is None:
        return None
    # bool is an int subclass; an id of true/false is almost surely a mistake.
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise RecordError(f"field 'id' must be a string or integer, got {type(value).__name__}")
    text = str(value).strip()
    if not text:
        raise RecordError("field 'id' is empty")
    return text
