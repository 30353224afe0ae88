"""Invocation payloads: tensors as safetensors bytes, control data as JSON metadata.

A *packet* is one safetensors blob. Its header metadata holds one JSON document under
``"moefleet"`` with ``meta`` (plain JSON arguments/results) and ``refs`` (tensor name →
object-store key, for tensors that travel through the store instead of inline). Nothing is
ever pickled: a packet decodes to tensors and JSON, or raises :class:`PayloadError`.

``pack_spilling`` keeps a packet under a byte budget by moving the largest tensors to the
store (one PUT each); ``resolve`` fetches referenced tensors back (one GET each).

Shape legend: B batch, T sequence, N tokens, D hidden, K top-k.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from moefleet.models.base import ForwardContext
from moefleet.platform import ObjectStore
from moefleet.platform.inline import spill_budget, spill_names
from moefleet.runtime.errors import PayloadError
from moefleet.torch_io import safetensors_ready

_KEY = "moefleet"


@dataclass
class Packet:
    """Decoded payload: inline tensors, store references, JSON metadata."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def names(self) -> set[str]:
        return set(self.tensors) | set(self.refs)



def pack(
    tensors: Mapping[str, torch.Tensor] | None = None,
    meta: Mapping[str, Any] | None = None,
    refs: Mapping[str, str] | None = None,
) -> bytes:
    """Encode a packet. ``meta`` must be JSON-able (raises TypeError otherwise)."""
    doc = json.dumps({"meta": dict(meta or {}), "refs": dict(refs or {})})
    return bytes(st_save(safetensors_ready(tensors or {}), metadata={_KEY: doc}))


def unpack(data: bytes) -> Packet:
    """Decode a packet; anything else raises :class:`PayloadError`."""
    try:
        tensors = st_load(bytes(data))
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + header_len])
        doc = json.loads(header.get("__metadata__", {}).get(_KEY, "{}"))
    except (SafetensorError, ValueError, UnicodeDecodeError) as err:
        raise PayloadError(
            f"payload of {len(data)} bytes is not a moefleet packet: {err}",
            "encode payloads with moefleet.runtime.payload.pack",
        ) from None
    return Packet(tensors=dict(tensors), refs=dict(doc.get("refs", {})), meta=doc.get("meta", {}))


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def pack_spilling(
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    refs: Mapping[str, str] | None,
    *,
    max_bytes: int,
    store: ObjectStore | None,
    prefix: str,
) -> bytes:
    """Like :func:`pack`, but tensors that do not fit ``max_bytes`` go to ``store`` under
    ``prefix/<name>`` (largest first). Invariant: the result is <= ``max_bytes`` unless the
    metadata alone exceeds it (then the caller's payload check reports it)."""
    inline = dict(tensors)
    all_refs = dict(refs or {})
    if store is None:  # no store to spill to: the payload check will name the size
        return pack(inline, meta, all_refs)
    budget = spill_budget(max_bytes, len(json.dumps({"meta": dict(meta), "refs": all_refs})))
    for name in spill_names([(n, tensor_bytes(t)) for n, t in inline.items()], budget):
        key = f"{prefix}/{name}"
        store.put(key, pack({name: inline[name]}))
        del inline[name]
        all_refs[name] = key
    return pack(inline, meta, all_refs)


def resolve(packet: Packet, store: ObjectStore | None, names: set[str] | None = None) -> None:
    """Fetch referenced tensors (all, or only ``names``) into ``packet.tensors``."""
    for name in list(packet.refs):
        if names is not None and name not in names:
            continue
        if store is None:
            raise PayloadError(
                f"tensor {name!r} was passed by reference ({packet.refs[name]}) but no "
                "object store is configured",
                "configure the backend with a store",
            )
        packet.tensors[name] = unpack(store.get(packet.refs.pop(name))).tensors[name]


def need(src: Packet | Mapping[str, torch.Tensor], *names: str) -> list[torch.Tensor]:
    """The named inline tensors, or a clear error naming the missing one."""
    tensors = src.tensors if isinstance(src, Packet) else src
    missing = [n for n in names if n not in tensors]
    if missing:
        raise PayloadError(
            f"payload lacks tensor(s) {missing} (has {sorted(tensors)})",
            "the caller and the handler disagree on the protocol; redeploy both",
        )
    return [tensors[n] for n in names]


# -- ForwardContext <-> tensors + JSON skeleton -------------------------------------------
def flatten_context(ctx: ForwardContext) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors named ``ctx.<i>`` plus a JSON skeleton rebuilding ``ctx`` from them.

    Handles tensors, None, numbers, strings, lists, tuples and str-keyed dicts (what the
    adapters put in ``extras``: masks, rotary tables). Anything else is an error naming it.
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(x: Any, where: str) -> Any:
        if isinstance(x, torch.Tensor):
            name = f"ctx.{len(tensors)}"
            tensors[name] = x
            return {"t": name}
        if x is None or isinstance(x, bool | int | float | str):
            return {"v": x}
        if isinstance(x, list | tuple):
            kind = "list" if isinstance(x, list) else "tuple"
            return {kind: [walk(y, f"{where}[{i}]") for i, y in enumerate(x)]}
        if isinstance(x, dict) and all(isinstance(k, str) for k in x):
            return {"dict": {k: walk(v, f"{where}.{k}") for k, v in x.items()}}
        raise PayloadError(
            f"forward context field {where} is a {type(x).__name__}, which cannot travel "
            "between functions",
            "adapters must keep ForwardContext.extras to tensors, numbers, lists and dicts",
        )

    skeleton = {
        "input_ids_BT": walk(ctx.input_ids_BT, "input_ids_BT"),
        "attention_mask_BT": walk(ctx.attention_mask_BT, "attention_mask_BT"),
        "position_ids_BT": walk(ctx.position_ids_BT, "position_ids_BT"),
        "extras": walk(ctx.extras, "extras"),
    }
    return tensors, skeleton


def unflatten_context(tensors: Mapping[str, torch.Tensor], skeleton: dict[str, Any]):
    """Inverse of :func:`flatten_context` (returns a ForwardContext)."""

    def build(node: dict[str, Any]) -> Any:
        if "t" in node:
            return tensors[node["t"]]
        if "v" in node:
            return node["v"]
        if "list" in node:
            return [build(y) for y in node["list"]]
        if "tuple" in node:
            return tuple(build(y) for y in node["tuple"])
        return {k: build(v) for k, v in node["dict"].items()}

    try:
        return ForwardContext(
            input_ids_BT=build(skeleton["input_ids_BT"]),
            attention_mask_BT=build(skeleton["attention_mask_BT"]),
            position_ids_BT=build(skeleton["position_ids_BT"]),
            extras=build(skeleton["extras"]),
        )
    except (KeyError, TypeError) as err:
        raise PayloadError(f"malformed forward context: {err!r}", "redeploy") from err
