"""Record how a model's routers send tokens to experts, with forward hooks.

The recorder never touches ``forward``: it registers hooks on each MoE layer's router
(output ``(logits_NE, weights_NK, ids_NK)``) and attention block (output
``(out, probs_BHTT)``), runs the model's own forward, and turns what the hooks saw into
trace rows. Attention probabilities exist only in eager attention, so recording runs
inside ``adapter.eager_attention()``.

Attention id (ODS/BO feature f3, see READING-NOTES): for query token t, sum the attention
probabilities over heads and take the arg-max key position; the feature is the token id
at that key. We use post-softmax probabilities (what "attention score" means once masks
apply): padded and (for decoders) future keys have probability 0 and can never win.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from moefleet.models.base import MoEModelAdapter
from moefleet.traces.schema import Trace, arrow_schema


class RoutingRecorder:
    """Collects routing rows batch by batch; ``trace()`` returns them as a table.

    Invariant: each recorded token of each request yields exactly one row per MoE layer.
    """

    def __init__(self, adapter: MoEModelAdapter, attention_ids: bool = True) -> None:
        self.adapter = adapter
        self.attention_ids = attention_ids
        self._handles: list[RemovableHandle] = []
        self._route: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._keypos: dict[int, torch.Tensor] = {}
        self._chunks: list[dict[str, np.ndarray]] = []
        self.num_requests = 0
        self.num_tokens = 0

    # -- hooks -----------------------------------------------------------------------
    def attach(self) -> RoutingRecorder:
        if self._handles:
            return self
        for layer in self.adapter.moe_layers:
            router = self.adapter.router_module(layer)
            self._handles.append(router.register_forward_hook(self._router_hook(layer)))
            if self.attention_ids:
                attn = self.adapter.attention_module(layer)
                self._handles.append(attn.register_forward_hook(self._attention_hook(layer)))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> RoutingRecorder:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def _router_hook(self, layer: int):
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            _, weights_NK, ids_NK = out
            self._route[layer] = (ids_NK.detach(), weights_NK.detach())

        return hook

    def _attention_hook(self, layer: int):
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            probs = out[1] if isinstance(out, tuple) and len(out) > 1 else None
            if probs is None:
                raise RuntimeError(
                    f"attention block of layer {layer} returned no probabilities; "
                    "record inside adapter.eager_attention()"
                )
            self._keypos[layer] = probs.detach().sum(dim=1).argmax(dim=-1)  # B,T

        return hook

    # -- recording -------------------------------------------------------------------
    @torch.no_grad()
    def record(
        self,
        request_ids: Sequence[str],
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor | None = None,
    ) -> None:
        """Run one batch (right-padded) through the model and keep its rows."""
        if not self._handles:
            raise RuntimeError("attach the recorder before recording")
        self._route.clear()
        self._keypos.clear()
        if self.attention_ids:
            with self.adapter.eager_attention():
                self.adapter.reference_forward(input_ids_BT, attention_mask_BT)
        else:
            self.adapter.reference_forward(input_ids_BT, attention_mask_BT)
        self._collect(request_ids, input_ids_BT, attention_mask_BT)

    def _collect(
        self, request_ids: Sequence[str], ids_BT: torch.Tensor, mask_BT: torch.Tensor | None
    ) -> None:
        B, T = ids_BT.shape
        K = self.adapter.top_k
        lengths = (mask_BT.sum(dim=1) if mask_BT is not None else torch.full((B,), T)).tolist()
        layers = self.adapter.moe_layers
        tok_BT = ids_BT.cpu().numpy()
        for b, n in enumerate(lengths):
            n = int(n)
            if n == 0:
                continue
            pos = np.arange(n, dtype=np.int32)
            for layer in layers:
                ids_NK, w_NK = self._route[layer]
                ids = ids_NK.reshape(B, T, K)[b, :n].cpu().numpy().astype(np.int16)
                w = w_NK.reshape(B, T, K)[b, :n].float().cpu().numpy()
                if self.attention_ids:
                    key = self._keypos[layer][b, :n].cpu().numpy()
                    att = tok_BT[b, key].astype(np.int32)
                else:
                    att = np.full(n, -1, dtype=np.int32)
                self._chunks.append(
                    {
                        "request_id": np.full(n, request_ids[b], dtype=object),
                        "layer": np.full(n, layer, dtype=np.int16),
                        "position_id": pos,
                        "token_id": tok_BT[b, :n].astype(np.int32),
                        "attention_id": att,
                        "expert_ids": ids,
                        "gate_weights": w.astype(np.float32),
                    }
                )
            self.num_requests += 1
            self.num_tokens += n

    def trace(self, **meta: Any) -> Trace:
        """All rows recorded so far, with metadata describing model and run."""
        K = self.adapter.top_k
        schema = arrow_schema(K)
        cols: dict[str, pa.Array] = {}
        for name in schema.names:
            field = schema.field(name)
            parts = [c[name] for c in self._chunks]
            if name in ("expert_ids", "gate_weights"):
                flat = np.concatenate([p.reshape(-1) for p in parts]) if parts else np.zeros(0)
                values = pa.array(flat, type=field.type.value_type)
                cols[name] = pa.FixedSizeListArray.from_arrays(values, K)
            else:
                data = np.concatenate(parts) if parts else np.zeros(0)
                cols[name] = pa.array(data, type=field.type)
        table = pa.table(cols, schema=schema)
        a = self.adapter
        full_meta = {
            "model": a.name,
            "family": a.family,
            "moe_layers": a.moe_layers,
            "num_experts": [a.num_experts(layer) for layer in a.moe_layers],
            "top_k": K,
            "num_requests": self.num_requests,
            "num_tokens": self.num_tokens,
            "attention_ids": self.attention_ids,
            **meta,
        }
        return Trace(table, full_meta)
