"""A runner that wraps another (emulations around the engine's forward): everything but
``execute`` is the inner runner's (sizes, cache, adapter, ``free``)."""

from __future__ import annotations

from typing import Any

from moefleet.engine.runner import ModelRunner


class WrappedRunner:
    """Delegates to ``inner``; subclasses override :meth:`execute`."""

    def __init__(self, inner: ModelRunner) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:  # sizes, cache, adapter: the inner runner's
        return getattr(self.inner, name)

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def free(self, seq_ids: list[int]) -> None:
        self.inner.free(seq_ids)
