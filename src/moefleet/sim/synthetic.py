"""Synthetic models for the simulator: a shape plus an estimated compute profile.

For sizes no machine here can run (and for benchmarks), a model can be described as
``synthetic:blocks=12,experts=8,top_k=2,hidden=768`` and simulated with an estimated
profile: 2 FLOPs per fp32 parameter per token at ``gflops_per_vcpu`` sustained on one
vCPU, a fixed overhead per call, and a thread law with diminishing returns (3.8x at 6
vCPUs). Measured profiles (``moefleet profile-compute``) replace these estimates.
"""

from __future__ import annotations

from dataclasses import dataclass

from moefleet.errors import MoefleetError
from moefleet.profiles.model import BatchLaw, ComputeProfile, FunctionProfile, ThreadLaw

# speed_factor(v) = T(v)/T(1): 1.46x at 2 vCPUs, 2.65x at 4, 3.79x at 6 (no measurement).
DEFAULT_THREADS = ThreadLaw(theta1=1.0, theta2=0.5, theta3=0.15)
FP32 = 4


@dataclass(frozen=True)
class SyntheticModel:
    blocks: int = 12
    experts: int = 8
    top_k: int = 2
    hidden: int = 768
    ffn: int = 0  # expert intermediate size; 0 = 4 x hidden
    gflops_per_vcpu: float = 10.0
    overhead_ms: float = 1.0
    decoder: bool = True

    @property
    def name(self) -> str:
        return (f"synthetic:blocks={self.blocks},experts={self.experts},top_k={self.top_k},"
                f"hidden={self.hidden}")

    def profile(self) -> ComputeProfile:
        h = self.hidden
        f = self.ffn or 4 * h
        expert_params = 2 * h * f  # up and down projections
        segment_params = 4 * h * h + h * self.experts  # attention + router

        def law(params: int) -> FunctionProfile:
            per_token = 2 * params / (self.gflops_per_vcpu * 1e9)
            return FunctionProfile(BatchLaw(self.overhead_ms / 1e3, per_token), DEFAULT_THREADS,
                                   param_bytes=params * FP32)

        moe = list(range(self.blocks))
        return ComputeProfile(
            model=self.name, hidden_size=h, moe_layers=moe,
            experts={b: law(expert_params) for b in moe},
            segments=[law(segment_params) for _ in range(self.blocks)],
            bytes_per_token=h * FP32, machine={"synthetic": True},
        )


def parse_synthetic(spec: str) -> SyntheticModel:
    """``synthetic:key=value,...`` (keys: blocks, experts, top_k, hidden, ffn,
    gflops_per_vcpu, overhead_ms, decoder=0/1)."""
    kind, _, rest = spec.partition(":")
    if kind.strip() != "synthetic":
        raise MoefleetError(f"not a synthetic model spec: {spec!r}",
                            "e.g. synthetic:blocks=12,experts=8,top_k=2,hidden=768")
    ints = {"blocks", "experts", "top_k", "hidden", "ffn"}
    floats = {"gflops_per_vcpu", "overhead_ms"}
    kw: dict[str, int | float | bool] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, _, value = item.partition("=")
        key = key.strip()
        try:
            if key in ints:
                kw[key] = int(value)
            elif key in floats:
                kw[key] = float(value)
            elif key == "decoder":
                kw[key] = value.strip() not in ("0", "false", "no")
            else:
                raise MoefleetError(f"synthetic model has no parameter {key!r}",
                                    f"use: {', '.join(sorted(ints | floats | {'decoder'}))}")
        except ValueError:
            raise MoefleetError(f"synthetic model: {item!r} is not a valid number",
                                "e.g. synthetic:blocks=12,experts=8") from None
    model = SyntheticModel(**kw)  # type: ignore[arg-type]
    if min(model.blocks, model.experts, model.top_k, model.hidden) < 1 or model.ffn < 0 or (
            model.top_k > model.experts or model.gflops_per_vcpu <= 0 or model.overhead_ms < 0):
        raise MoefleetError(f"synthetic model {spec!r} has an impossible size",
                            "blocks, experts, hidden >= 1; 1 <= top_k <= experts")
    for key, top in SYNTHETIC_BOUNDS.items():
        if getattr(model, key) > top:
            raise MoefleetError(f"synthetic model: {key}={getattr(model, key)} is above "
                                f"{top}", f"use {key} <= {top} (real MoE models are smaller)")
    if model.blocks * model.experts > MAX_SYNTHETIC_FUNCTIONS:
        # One simulated function (and its pool) per expert: the event loop's memory and
        # time grow with this product.
        raise MoefleetError(f"synthetic model: {model.blocks} blocks x {model.experts} "
                            f"experts is more than {MAX_SYNTHETIC_FUNCTIONS} expert functions",
                            "use fewer blocks or experts")
    return model


#: Largest value of each synthetic size (DeepSeek-V3: 61 blocks, 256 experts, 7168 hidden).
SYNTHETIC_BOUNDS = {"blocks": 1024, "experts": 4096, "top_k": 4096, "hidden": 65_536,
                    "ffn": 1 << 20}
MAX_SYNTHETIC_FUNCTIONS = 65_536


def synthetic_profile(**kw: int | float | bool) -> ComputeProfile:
    """The estimated profile of ``SyntheticModel(**kw)``."""
    return SyntheticModel(**kw).profile()  # type: ignore[arg-type]
