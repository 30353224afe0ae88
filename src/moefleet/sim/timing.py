"""Transfer and handler times of one call (pure functions; the formulas of the simulator).

Notation (ODS/BO, see papers/READING-NOTES.md): D bytes per token each way (the
profile's ``bytes_per_token``), T_acc object-store access latency, B_s store bandwidth,
B_f function-to-function bandwidth, beta the pipeline minibatch, c(m) the compute time
of m tokens on the instance's vCPUs (the profile's law, per-call overhead included).

Expert replica with r tokens, handler (billed) time:
    direct     r·D/B_f + c(r)                                      ; 0 GET, 0 PUT
               then its response r·D/B_f travels back (latency, not billed)
    storage    T_acc + r·D/B_s + c(r) + T_acc + r·D/B_s            ; 1 GET, 1 PUT
    pipelined  q = ceil(r/beta) minibatches m_1..m_q (beta each, the last the rest):
               Σ_j [T_acc + max(m_j·D/B_s + c(m_j), m_{j-1}·D/B_s)] + T_acc + m_q·D/B_s
               with m_0 = 0: download and compute of minibatch j overlap the upload of
               j-1; the last upload is the tail                     ; q GET, q PUT
These are ODS/BO's t_rep (a = 3, 2, 1) without T_head, which the simulator adds as the
start delay (warm start, or cold start + parameter download). When r is a multiple of
beta and c is linear they equal the paper's formulas; the paper's first pipelined block
takes max(.., beta·D/B_s) with nothing to upload yet, which we read as m_0 = 0.

Segment of block b with n tokens, k experts per token, in two calls per MoE block as
the runtime's executor makes them (one for a dense block):
    pre   input h from the executor (block 0: token ids, free) + compute c(n) + for
          storage/pipelined the scatter upload T_acc + n·k·D/B_s (one PUT per object:
          one per replica, or one per beta tokens when pipelined); its output returns
          to the executor.
    post  input from the executor + for storage/pipelined the gather download
          T_acc + n·k·D/B_s (one GET per object) + combine/residual (no profiled
          compute; ``call_overhead_s`` covers it); its output returns to the executor.
Executor <-> function transfers move n·D bytes at B_f, or through the store when over
the payload limit (:func:`payload_s`).
Units: seconds, bytes, bytes/s, tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moefleet.plan.plan import Method
from moefleet.platform.specs import PlatformSpec


@dataclass(frozen=True, slots=True)
class Links:
    """The platform's data paths as one function sees them."""

    access_s: float  # T_acc, object-store access latency (s)
    storage_bps: float  # B_s (bytes/s)
    function_bps: float  # B_f (bytes/s)
    bytes_per_token: int  # D
    payload_limit: int  # synchronous invocation payload limit (bytes)

    @classmethod
    def of(cls, spec: PlatformSpec, bytes_per_token: int) -> Links:
        if spec.storage is None or spec.network is None or spec.limits is None:
            raise ValueError(f"platform {spec.name!r} is not a FaaS platform")
        return cls(
            access_s=spec.storage.access_latency_s,
            storage_bps=spec.storage.bandwidth_bytes_per_s,
            function_bps=spec.network.function_bandwidth_bytes_per_s,
            bytes_per_token=bytes_per_token,
            payload_limit=spec.limits.sync_payload_bytes,
        )

    def store_s(self, tokens: int) -> float:
        """Moving ``tokens`` tokens to or from object storage, bandwidth only."""
        return tokens * self.bytes_per_token / self.storage_bps

    def direct_s(self, tokens: int) -> float:
        """Moving ``tokens`` tokens in an invocation payload."""
        return tokens * self.bytes_per_token / self.function_bps

    def fits_payload(self, tokens: int) -> bool:
        return tokens * self.bytes_per_token <= self.payload_limit


def minibatches(r: int, beta: int) -> int:
    return -(-r // beta) if r > 0 else 0


def expert_storage_ops(method: Method, r: int, beta: int) -> tuple[int, int]:
    """(GETs, PUTs) of one expert replica call with r tokens."""
    if method == "direct":
        return 0, 0
    if method == "storage":
        return 1, 1
    q = minibatches(r, beta)
    return q, q


def expert_handler_s(method: Method, r: int, beta: int, compute: Callable[[int], float],
                     links: Links) -> float:
    """Billed handler time of an expert replica with ``r`` > 0 tokens (formulas above)."""
    if method == "direct":
        return links.direct_s(r) + compute(r)
    acc = links.access_s
    if method == "storage":
        return 2 * acc + 2 * links.store_s(r) + compute(r)
    q = minibatches(r, beta)
    last = r - (q - 1) * beta
    if q == 1:
        return acc + links.store_s(r) + compute(r) + acc + links.store_s(r)
    full_s = links.store_s(beta) + compute(beta)
    up_full = links.store_s(beta)
    total = acc + full_s  # first minibatch: nothing to upload yet
    total += (q - 2) * (acc + max(full_s, up_full))
    total += acc + max(links.store_s(last) + compute(last), up_full)
    return total + acc + links.store_s(last)


def expert_response_s(method: Method, r: int, links: Links) -> float:
    """Latency after the handler until the replica's output is where the next stage
    reads it: the response payload for ``direct``; 0 for storage (the PUT is in the
    handler)."""
    return links.direct_s(r) if method == "direct" else 0.0


def store_io_s(tokens: int, links: Links) -> float:
    """One side of an object-store scatter or gather of ``tokens`` token slots:
    T_acc + tokens·D/B_s (the objects move in parallel; one access latency)."""
    return links.access_s + links.store_s(tokens)


def payload_s(tokens: int, links: Links, bytes_per_token: int | None = None
              ) -> tuple[float, bool]:
    """Moving ``tokens`` tokens (of ``bytes_per_token``, default D) between the executor
    and a function: in the payload at B_f, or, over the payload limit, spilled through
    the store (T_acc + bytes/B_s, one PUT and one GET), as the runtime does. Returns
    (seconds, spilled)."""
    nbytes = tokens * (links.bytes_per_token if bytes_per_token is None else bytes_per_token)
    if nbytes <= links.payload_limit:
        return nbytes / links.function_bps, False
    return links.access_s + nbytes / links.storage_bps, True


def split_tokens(d: int, g: int) -> list[int]:
    """``d`` tokens over ``g`` replicas in contiguous chunks of ceil(d/g), as the runtime
    assigns them (ODS/BO); replicas whose chunk is empty are not called."""
    if d <= 0:
        return []
    chunk = -(-d // g)
    full, rest = divmod(d, chunk)
    return [chunk] * full + ([rest] if rest else [])
