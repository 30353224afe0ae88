"""What a tensor packet may weigh when sent inline, per wire format (torch-free).

The platform's synchronous payload limit (``limits.sync_payload_bytes``) bounds the whole
request or response. A backend whose wire format wraps the packet (aws: base64 inside a
JSON event) can carry less: ``(limit - envelope) * 3 // 4`` bytes of packet. Planners use
:func:`planning_inline_bytes` (the strictest format any backend uses), so that a plan
that passes eq. 12f runs inline on every backend.

Direct-method packets (remote dispatch, :mod:`moefleet.experts.remote`): per token the
request carries its activations (``D_in``) plus its gate weight (one fp32); the packet
adds a safetensors header with per-request metadata, bounded here by
``PACKET_ENVELOPE_BYTES``.
"""

from __future__ import annotations

EVENT_OVERHEAD = 1024  # JSON around the base64 packet in aws events and results (generous)
PACKET_ENVELOPE_BYTES = 64 * 1024  # safetensors header + metadata of one direct packet
GATE_WEIGHT_BYTES = 4  # one fp32 gate weight per token in a direct request


def base64_inline_bytes(limit_bytes: int) -> int:
    """Largest packet whose base64 JSON envelope fits ``limit_bytes``."""
    return max(0, (limit_bytes - EVENT_OVERHEAD) * 3 // 4)


def planning_inline_bytes(limit_bytes: int) -> int:
    """The inline budget planners assume: the base64 (aws) budget, the strictest."""
    return base64_inline_bytes(limit_bytes)


# -- spilling: which tensors of a packet travel through the object store -----------------
SPILL_HEADER_BYTES = 4096  # kept free for the safetensors header when a packet spills


def spill_budget(max_bytes: int, meta_json_bytes: int) -> int:
    """Tensor bytes a packet may carry inline under ``max_bytes`` with its JSON metadata."""
    return max_bytes - SPILL_HEADER_BYTES - meta_json_bytes


def spill_names(sizes: list[tuple[str, int]], budget: int) -> list[str]:
    """The tensors a packet moves to the store, in order: the largest first (ties keep the
    packet's order) until the rest fits ``budget``. One rule for the runtime
    (``payload.pack_spilling``, one PUT each) and the cost model (``plan.transfers``)."""
    total = sum(n for _, n in sizes)
    out: list[str] = []
    for name, n in sorted(sizes, key=lambda s: s[1], reverse=True):
        if total <= budget:
            break
        out.append(name)
        total -= n
    return out
