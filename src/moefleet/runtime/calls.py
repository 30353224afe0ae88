"""The messages a caller sends to segment and expert functions (typed; encoded in the
packet meta by :mod:`moefleet.runtime.messages`).

Segment functions (block ``l``'s non-expert part):
- ``segment.pre``: embed (block 0) / attention + gate; ``scatter`` (storage methods) says
  where the gate uploads each replica's input minibatches;
- ``segment.post``: ``gather`` (storage methods: where the replicas' outputs are) or the
  routed output in the packet, then shared experts, residual and the head on the last
  block. ``ctx`` is the flattened forward context (None before block 0 made it);
  ``spill_prefix`` is where an oversized response spills in the object store.

Expert functions (one or more experts of one MoE layer):
- ``expert.direct``: the tokens are in the packet; ``runs`` = ((expert, rows), ...) in
  row order (a group function gets all its experts' shares in one call);
- ``expert.storage`` / ``expert.pipelined``: one input and one output object key per
  minibatch of ``tokens`` token-slots of ``expert``.

Invariants (checked on construction): row counts and token counts are >= 0, keys pair up
one output per input, a scatter/gather spec names a known method with positive β and one
replica count per expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moefleet.runtime.messages import message

METHODS = ("storage", "pipelined")


@dataclass(frozen=True)
class Transfer:
    """Where a layer's token-slots travel through the object store (storage methods)."""

    prefix: str
    method: str
    beta: int
    replicas: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method {self.method!r} is not one of {METHODS}")
        if self.beta < 1 or any(r < 1 for r in self.replicas) or not self.replicas:
            raise ValueError(f"beta {self.beta} and replicas {self.replicas} must be >= 1")

    @classmethod
    def parse(cls, d: dict[str, Any] | None) -> Transfer | None:
        if d is None:
            return None
        return cls(str(d["prefix"]), str(d["method"]), int(d["beta"]),
                   tuple(int(r) for r in d["replicas"]))

    def to_json(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "method": self.method, "beta": self.beta,
                "replicas": list(self.replicas)}


@message("segment.pre")
@dataclass(frozen=True)
class SegmentPre:
    ctx: dict[str, Any] | None
    spill_prefix: str
    scatter: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        Transfer.parse(self.scatter)  # validates

    @property
    def transfer(self) -> Transfer | None:
        return Transfer.parse(self.scatter)


@message("segment.post")
@dataclass(frozen=True)
class SegmentPost:
    ctx: dict[str, Any] | None
    spill_prefix: str
    gather: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        Transfer.parse(self.gather)

    @property
    def transfer(self) -> Transfer | None:
        return Transfer.parse(self.gather)


@message("expert.direct")
@dataclass(frozen=True)
class ExpertDirect:
    runs: tuple[tuple[int, int], ...]  # (expert, rows), in row order

    def __post_init__(self) -> None:
        if not self.runs or any(e < 0 or n < 0 for e, n in self.runs):
            raise ValueError(f"runs {self.runs} must be non-empty (expert >= 0, rows >= 0)")

    @property
    def rows(self) -> int:
        return sum(n for _, n in self.runs)


@dataclass(frozen=True)
class _Keyed:
    expert: int
    in_keys: tuple[str, ...]
    out_keys: tuple[str, ...]
    tokens: int

    def __post_init__(self) -> None:
        if self.expert < 0 or self.tokens < 0:
            raise ValueError(f"expert {self.expert} and tokens {self.tokens} must be >= 0")
        if len(self.in_keys) != len(self.out_keys) or not self.in_keys:
            raise ValueError(f"{len(self.in_keys)} input and {len(self.out_keys)} output "
                             "keys; the caller must pass one output key per input")


@message("expert.storage")
@dataclass(frozen=True)
class ExpertStorage(_Keyed):
    pass


@message("expert.pipelined")
@dataclass(frozen=True)
class ExpertPipelined(_Keyed):
    pass


def expert_call(method: str, expert: int, in_keys: list[str], out_keys: list[str],
                tokens: int) -> ExpertStorage | ExpertPipelined:
    """The storage-method message for ``method``."""
    cls = ExpertPipelined if method == "pipelined" else ExpertStorage
    return cls(expert, tuple(in_keys), tuple(out_keys), tokens)
