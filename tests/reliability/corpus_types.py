"""The hostile-input corpus's types: a case is ``(kind, name, build)``, and
``build(seeds, work)`` writes what the case needs under ``work`` and returns the
command's arguments; ``seeds`` are the valid inputs the cases start from."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

Seeds = dict[str, Path]
Build = Callable[[Seeds, Path], list[str]]
Case = tuple[str, str, Build]
SYN = "synthetic:blocks=2,experts=2,top_k=1,hidden=64,decoder=0"
