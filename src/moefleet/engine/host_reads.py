"""Count host reads of tensor values: the synchronisations a step's layers must not make.

A value read on the host (``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``int`` /
``float`` / ``bool`` of a tensor, ``nonzero``, indexing with a boolean mask, whose result
size is data) makes a GPU stream wait for everything queued before it; a decode step
should make at most two (the sampled tokens, the step's statistics).

:class:`HostReads` is a ``TorchFunctionMode`` that counts them (by name, on any device, so
a CPU run checks the same code path a GPU run takes). ``where`` keeps the first call
site of each, for finding the one that slipped in.
"""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
    torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.nonzero_static,
    torch.argwhere, torch.masked_select, torch.Tensor.masked_select,
}
_MASKED = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}


def _bool_index(args: tuple[Any, ...]) -> bool:
    if len(args) < 2:
        return False
    idx = args[1]
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class HostReads(TorchFunctionMode):
    """``with HostReads() as reads: ...`` then ``reads.count`` (and ``reads.by_name``)."""

    def __init__(self, keep_sites: bool = False) -> None:
        super().__init__()
        self.count = 0
        self.by_name: Counter[str] = Counter()
        self.keep_sites = keep_sites
        self.where: dict[str, str] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func in _READS or (func in _MASKED and _bool_index(args)):
            name = getattr(func, "__name__", str(func))
            self.count += 1
            self.by_name[name] += 1
            if self.keep_sites and name not in self.where:
                frames = [f for f in traceback.extract_stack()[:-1]
                          if "torch/" not in f.filename and "host_reads" not in f.filename]
                self.where[name] = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
                                               for f in frames[-3:][::-1])
        return func(*args, **(kwargs or {}))
