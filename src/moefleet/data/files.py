"""Read a prompt file: plain text, JSON Lines, or a JSON list of objects.

Format choice, extension first, content second:

- ``.txt`` / ``.text`` / ``.md`` / ``.raw`` / ``.tokens``: plain text, one prompt per paragraph line
  (:func:`moefleet.data.prompts.paragraphs`).
- ``.json`` / ``.jsonl`` / ``.ndjson``: JSON family; the content decides between a JSON
  document (starts with ``[``, or an object spread over several lines) and JSON Lines (the
  first line is a complete JSON value). Files named ``.json`` that hold JSON Lines — common
  in the wild — therefore load too, and vice versa.
- no extension: JSON family when the content starts with ``[`` or ``{``, else plain text.
- any other extension: :class:`~moefleet.errors.DataError` (a CSV or Parquet file read as
  text would silently give nonsense prompts).

Records follow :func:`moefleet.data.prompts.record_text`. Records whose prompt text is
empty are skipped; a record with no prompt field, or a malformed line, is an error that
names the file and line (JSON Lines) or item (JSON list). Ids: the record's ``id`` when it
has one, else ``"<prefix>:<index>"`` where index is the record's position in the file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from moefleet.data.prompts import Prompt, RecordError, paragraphs, record_id, record_text
from moefleet.errors import DataError

Format = Literal["text", "jsonl", "json"]

_EXTENSIONS: dict[str, Format | Literal["json-family"]] = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    # WikiText's own names (wiki.test.raw, wiki.test.tokens), so its files load by path too.
    ".raw": "text",
    ".tokens": "text",
    ".json": "json-family",
    ".jsonl": "json-family",
    ".ndjson": "json-family",
}
SUPPORTED_EXTENSIONS: tuple[str, ...] = tuple(_EXTENSIONS)

_FIELDS_HINT = (
    "each object needs one of the fields text, prompt, instruction (+input), goal, "
    "or conversations (ShareGPT) / messages (chat)"
)


#: Largest prompt file read (the shipped datasets are a few MiB); checked before reading.
MAX_PROMPT_FILE_BYTES = 512 * 1024 * 1024


def read_text(path: Path) -> str:
    """The file decoded as UTF-8 (a leading BOM is dropped); DataError when unreadable.

    Only regular files up to :data:`MAX_PROMPT_FILE_BYTES` are read: a device
    (``/dev/zero``), a FIFO or a socket would be read forever or block, so the file's
    type and size are checked before the first byte is read."""
    import stat

    try:
        st = path.stat()
    except FileNotFoundError:
        raise DataError(
            f"file not found: {path}", "check the path, or give a dataset name instead"
        ) from None
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror}", "check the path") from None
    if not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
        raise DataError(f"{path} is not a regular file (a device, FIFO or socket)",
                        "give a .txt, .jsonl or .json file")
    if st.st_size > MAX_PROMPT_FILE_BYTES:
        raise DataError(f"{path} is {st.st_size / 2**20:.0f} MiB; prompt files are read "
                        f"whole, up to {MAX_PROMPT_FILE_BYTES / 2**20:.0f} MiB",
                        "split the file, or take the first prompts with head")
    try:
        # newline="" keeps "\r\n" intact; paragraphs() strips the "\r" itself, and JSON
        # Lines must be split on "\n" only.
        with open(path, encoding="utf-8-sig", newline="") as fh:
            return fh.read()
    except FileNotFoundError:
        raise DataError(
            f"file not found: {path}", "check the path, or give a dataset name instead"
        ) from None
    except IsADirectoryError:
        raise DataError(
            f"{path} is a directory", "give a .txt, .jsonl or .json file inside it"
        ) from None
    except UnicodeDecodeError as err:
        raise DataError(
            f"{path} is not UTF-8 text (byte {err.start})",
            "save the file as UTF-8, or convert it to .txt/.jsonl/.json",
        ) from None
    except OSError as err:
        raise DataError(
            f"cannot read {path}: {err.strerror}", "check the file's permissions"
        ) from None


def detect_format(path: Path, content: str) -> Format:
    """The format to parse ``content`` as (see the module docstring for the rules)."""
    suffix = path.suffix.lower()
    kind = _EXTENSIONS.get(suffix)
    if kind is None and suffix:
        raise DataError(
            f"unsupported prompt file type {suffix!r}: {path}",
            f"use one of {', '.join(SUPPORTED_EXTENSIONS)} (or a file without extension)",
        )
    head = content.lstrip()
    if kind is None:
        kind = "json-family" if head.startswith(("[", "{")) else "text"
    if kind == "text":
        return "text"
    if head.startswith("["):
        return "json"
    first_line = head.split("\n", 1)[0]
    try:
        json.loads(first_line)
    except json.JSONDecodeError:
        # Line one is not a whole value: a pretty-printed document (or broken JSON,
        # which json.loads will report with its line number).
        return "json"
    return "jsonl"


def parse_jsonl(path: Path, content: str) -> list[tuple[str, Any]]:
    """``(location, value)`` per non-blank line; location is ``"line N"`` (1-based)."""
    out: list[tuple[str, Any]] = []
    for lineno, line in enumerate(content.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            out.append((f"line {lineno}", json.loads(line)))
        except json.JSONDecodeError as err:
            raise DataError(
                f"malformed JSON in {path} at line {lineno}, column {err.colno}: {err.msg}",
                "each line of a .jsonl file must be one complete JSON object",
            ) from None
    return out


def parse_json(path: Path, content: str) -> list[tuple[str, Any]]:
    """``(location, value)`` per item of a top-level JSON list; location is ``"item N"``."""
    if not content.strip():
        return []
    try:
        doc = json.loads(content)
    except json.JSONDecodeError as err:
        raise DataError(
            f"malformed JSON in {path} at line {err.lineno}, column {err.colno}: {err.msg}",
            "fix the JSON (a .json prompt file is a list of objects), or use JSON Lines",
        ) from None
    if not isinstance(doc, list):
        raise DataError(
            f"{path} holds a JSON {type(doc).__name__}, not a list of objects",
            "wrap the records in [ ... ], or write one object per line (.jsonl)",
        )
    return [(f"item {i}", value) for i, value in enumerate(doc)]


def prompts_from_records(
    path: Path, records: Iterable[tuple[str, Any]], id_prefix: str
) -> list[Prompt]:
    """Prompts from located records (see the module docstring); ids are unique."""
    out: list[Prompt] = []
    seen: dict[str, str] = {}
    for index, (where, record) in enumerate(records):
        if not isinstance(record, dict):
            raise DataError(
                f"{path} {where}: expected a JSON object, got {type(record).__name__}",
                _FIELDS_HINT,
            )
        try:
            text, reference = record_text(record)
            own_id = record_id(record)
        except RecordError as err:
            raise DataError(f"{path} {where}: {err}", _FIELDS_HINT) from None
        if not text.strip():
            continue  # e.g. a conversation without a user turn: nothing to send
        request_id = own_id if own_id is not None else f"{id_prefix}:{index:06d}"
        if request_id in seen:
            raise DataError(
                f"{path} {where}: duplicate id {request_id!r} (first at {seen[request_id]})",
                "make the ids unique, or drop the 'id' field so records are numbered",
            )
        seen[request_id] = where
        out.append(Prompt(request_id=request_id, text=text, reference=reference))
    return out


def prompts_from_text(content: str, id_prefix: str) -> list[Prompt]:
    """One prompt per paragraph line, ids ``"<prefix>:<paragraph index>"``."""
    return [
        Prompt(request_id=f"{id_prefix}:{i:06d}", text=para)
        for i, para in enumerate(paragraphs(content))
    ]


def load_file(
    path: str | Path, *, id_prefix: str | None = None, fmt: Format | None = None
) -> list[Prompt]:
    """All prompts in the file at ``path``, in file order.

    ``id_prefix`` defaults to the file's stem; ``fmt`` skips format detection (named
    datasets know their format). Raises DataError when the file is missing, unreadable,
    malformed, or yields no prompt.
    """
    path = Path(path).expanduser()
    content = read_text(path)
    prefix = id_prefix if id_prefix is not None else path.stem
    kind = fmt if fmt is not None else detect_format(path, content)
    if kind == "text":
        prompts = prompts_from_text(content, prefix)
    else:
        located = parse_jsonl(path, content) if kind == "jsonl" else parse_json(path, content)
        prompts = prompts_from_records(path, located, prefix)
    if not prompts:
        what = "non-empty, non-heading line" if kind == "text" else "record with prompt text"
        raise DataError(
            f"no usable prompts in {path} (format {kind}: no {what})",
            _FIELDS_HINT if kind != "text" else "put one prompt per line",
        )
    return prompts
