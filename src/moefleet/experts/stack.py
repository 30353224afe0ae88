"""The expert stack's one shape (its pieces nest in one order: :mod:`.nest`).

Every piece is an :class:`ExpertStack`: an ``ExpertFn`` (``layer, x_ND, ids_NK, w_NK ->
y_ND``) with a typed surface the runner and the composition root use instead of reaching
into it:

- :meth:`ExpertStack.set_owners` — whose each token row of the following calls is (a
  sequence id per row). A piece that calls an inner piece on other rows (brownout sends a
  subset of pairs on) tells the inner its own owners first, so remote dispatch always
  bills each row's owner.
- :meth:`ExpertStack.parts` — the pieces, outermost first; :func:`find` picks one by type
  (the brownout router for SALC and the metrics, the remote dispatcher for the biller,
  the fault injector's counters).
- :meth:`ExpertStack.close` — stops what the stack started (remote dispatch's threads).

The order (:func:`moefleet.experts.nest.compose`), outermost first::

    retry ∘ faults ∘ brownout ∘ split(local, remote)

Retries see every failure below them; faults are injected where a remote call would fail;
brownout decides which pairs reach the experts at all; the split sends each remaining pair
to the main function's own experts or to the expert functions. Any piece may be absent.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

import torch

from moefleet.models.base import ExpertFn

S = TypeVar("S", bound="ExpertStack")


class ExpertStack:
    """Base of every piece (see the module docstring). ``inners`` are the pieces this one
    calls; a leaf has none."""

    inners: tuple[ExpertStack, ...] = ()

    def __call__(self, layer: int, x_ND: torch.Tensor, ids_NK: torch.Tensor,
                 w_NK: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def skips_marked_pairs(self) -> bool:
        """Whether this piece computes nothing for pairs whose expert id is ``>= E`` (and
        adds 0 for them): then a caller may mark pairs instead of selecting rows, which
        would read their count on the host (``experts.kernels``'s fused kernel does)."""
        return False

    def uniting_pays(self, layer: int, x_ND: torch.Tensor, pairs: int) -> bool:
        """Whether a call of ``pairs`` pairs over the rows ``x_ND`` could get cheaper by
        putting its pairs on fewer experts (brownout's united experts): yes, unless the
        piece pays per pair rather than per expert read for such a call (the fused
        kernel's per-pair path on a CPU: ``experts.cpu_gemv.uniting_pays``)."""
        return True

    def set_owners(self, owners_N: Sequence[str] | None) -> None:
        """Owner of each token row of the following calls (None: one anonymous owner)."""
        for inner in self.inners:
            inner.set_owners(owners_N)

    def parts(self) -> Iterator[ExpertStack]:
        """This piece and every piece below it, outermost first."""
        yield self
        for inner in self.inners:
            yield from inner.parts()

    def close(self) -> None:
        for inner in self.inners:
            inner.close()


class InProcess(ExpertStack):
    """A leaf over a plain ``ExpertFn`` running in this process (a kernel, or the experts
    a Remoe main function holds). It knows no owners: nothing it does is billed apart."""

    def __init__(self, fn: ExpertFn, name: str = "in-process") -> None:
        self.fn, self.name = fn, name

    @property
    def skips_marked_pairs(self) -> bool:
        from moefleet.experts.kernels import SKIPS_MARKED_PAIRS

        return bool(getattr(self.fn, SKIPS_MARKED_PAIRS, False))

    def uniting_pays(self, layer: int, x_ND: torch.Tensor, pairs: int) -> bool:
        from moefleet.experts.kernels import UNITING_PAYS

        check = getattr(self.fn, UNITING_PAYS, None)
        return True if check is None else bool(check(layer, x_ND, pairs))

    def __call__(self, layer: int, x_ND: torch.Tensor, ids_NK: torch.Tensor,
                 w_NK: torch.Tensor) -> torch.Tensor:
        return self.fn(layer, x_ND, ids_NK, w_NK)


def as_stack(fn: ExpertFn | ExpertStack) -> ExpertStack:
    """``fn`` itself when it is a piece already, else an :class:`InProcess` leaf over it."""
    return fn if isinstance(fn, ExpertStack) else InProcess(fn)


def find(stack: ExpertStack, kind: type[S]) -> S | None:
    """The outermost piece of type ``kind`` in ``stack``, or None."""
    for part in stack.parts():
        if isinstance(part, kind):
            return part
    return None
