"""Incremental detokenization with stop strings.

Decoding a whole output every step costs O(n) per token; instead each step decodes a
short window of recent tokens and emits what the new token added (a byte-level BPE
token may complete a character started by earlier tokens, so the window starts a few
tokens back). With stop strings, the last ``max(len(stop)) - 1`` characters are held
back until they can no longer start a stop string, so a stream never shows text that
the stop string later cuts off.
"""

from __future__ import annotations

from typing import Any

_WINDOW = 6  # tokens decoded before the new one, enough to finish any UTF-8 character


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of ``text`` already emitted
        self._stop_at: int | None = None
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def add(self, token: int, stops: tuple[str, ...], final: bool) -> tuple[str, bool]:
        """Add a token; return (text safe to emit now, whether a stop string matched)."""
        self.ids.append(token)
        # text of [prefix, read) was emitted; decoding from ``prefix`` gives the tokens
        # before ``read`` as context, so a token that completes a character shows it
        prefix_text = self._decode(self.ids[self._prefix: self._read])
        full = self._decode(self.ids[self._prefix:])
        new = ""
        if len(full) > len(prefix_text) and (final or not full.endswith("\ufffd")):
            new = full[len(prefix_text):]
            self._prefix, self._read = max(0, len(self.ids) - _WINDOW), len(self.ids)
        self.text += new
        if stops:
            # search only where a new match can be: the held-back tail plus the new text
            lo = max(0, self.sent - max(len(s) for s in stops))
            hits = [i for i in (self.text.find(s, lo) for s in stops) if i >= 0]
            if hits:
                self._stop_at = min(hits)
                return "", True
        hold = 0 if final or not stops else max(len(s) for s in stops) - 1
        upto = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent: upto], upto
        return out, False

    def flush_before_stop(self) -> str:
        """The text not yet emitted up to (not including) the matched stop string."""
        end = self._stop_at if self._stop_at is not None else len(self.text)
        out = self.text[self.sent: max(self.sent, end)]
        self.sent = max(self.sent, end)
        return out
