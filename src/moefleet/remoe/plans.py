"""Remoe plan files by hand: a main function and given remote experts per layer.

``moefleet plan --policy remoe`` plans from a model's shape, timing and prices
(:mod:`moefleet.plan.remoe`); this builds the same kind of plan file from an explicit
choice, for tests and for measuring fixed layouts (the CPU / MIX baselines keep every
expert local: ``remote={}``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from moefleet.models.shape import ModelShape
from moefleet.plan.plan import DeploymentPlan, ExpertConfig, ExpertGroup, LayerPlan, MainFunction


def manual_plan(shape: ModelShape, platform: str, remote: Mapping[int, Sequence[int]], *,
                main_memory_mb: int, remote_memory_mb: int = 1024, replicas: int = 1,
                gpu_gb: float = 0.0, policy: str = "remoe-manual",
                replica_experts: Mapping[int, Sequence[Sequence[int]]] | None = None
                ) -> DeploymentPlan:
    """One group per layer in ``remote`` (its experts, ``replicas`` instances); every
    other expert is the main function's. Layers use the ``direct`` method.
    ``replica_experts[layer]`` (optional) gives each replica its own experts, as
    Remoe's LPT does; without it every replica serves every expert."""
    groups, layers = [], []
    for li, layer in enumerate(shape.moe_layers):
        rem = sorted({int(e) for e in remote.get(layer, ())})
        if rem:
            rx = (replica_experts or {}).get(layer)
            groups.append(ExpertGroup(
                layer=layer, experts=rem, memory_mb=remote_memory_mb, replicas=replicas,
                replica_experts=None if rx is None else [[int(e) for e in g] for g in rx]))
        layers.append(LayerPlan(layer=layer, method="direct", beta=1, experts=[
            ExpertConfig(memory_mb=remote_memory_mb if e in rem else main_memory_mb,
                         replicas=replicas if e in rem else 1)
            for e in range(shape.num_experts[li])]))
    return DeploymentPlan(model=shape.name, platform=platform, segment_memory_mb=[],
                          layers=layers, policy=policy,
                          main=MainFunction(memory_mb=main_memory_mb, gpu_gb=gpu_gb),
                          groups=groups)
