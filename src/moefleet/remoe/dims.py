"""Remoe planner dimensions of a model this project can load (zoo or checkpoint).

The planner's :class:`~moefleet.plan.remoe.shapes.ModelDims` table holds published shapes
(DeepSeek-V2-Lite, GPT2-moe); a model that runs here gets its dimensions from its own
weights instead, so ``moefleet plan --policy remoe --model tiny-moe-lm-e32`` plans the
model that ``moefleet run`` then executes. Bytes per parameter are the weights' own
(fp32 for the zoo's tiny models).
"""

from __future__ import annotations

from moefleet.models.base import MoEModelAdapter
from moefleet.plan.remoe.shapes import ModelDims


def dims_from_adapter(adapter: MoEModelAdapter) -> ModelDims:
    """ModelDims measured from ``adapter``: expert size from its first routed expert
    (a SwiGLU expert has 3·hidden·intermediate parameters), the rest from its summary."""
    shape = adapter.summary()
    layer = shape.moe_layers[0]
    params = list(adapter.expert(layer, 0).parameters())
    n_params = sum(p.numel() for p in params)
    bytes_per_param = params[0].element_size()
    hidden = int(shape.hidden_size)
    return ModelDims(
        name=shape.name, moe_layers=len(shape.moe_layers), experts=int(shape.num_experts[0]),
        top_k=int(shape.top_k), hidden=hidden,
        expert_intermediate=max(1, round(n_params / (3 * hidden))),
        nonexpert_params=shape.non_expert_param_bytes / bytes_per_param,
        kv_bytes_per_token=float(adapter.kv_layout().bytes_per_token),
        bytes_per_param=bytes_per_param)
