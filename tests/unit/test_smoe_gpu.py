"""The GPU share as an sMoE knob: config space, simulator, backends, exports (emulated)."""

from __future__ import annotations

import pytest
import simpy

from moefleet.autoscale.errors import AutoscaleError
from moefleet.autoscale.smoe.harness import build_scenario, run_episode
from moefleet.autoscale.smoe.popularity import PlanPolicy
from moefleet.autoscale.smoe.space import ConfigSpace
from moefleet.control import ControlError, FunctionConfig
from moefleet.errors import MoefleetError
from moefleet.plan import DeploymentPlan
from moefleet.plan.export import FORMATS, export, parse_export
from moefleet.plan.remoe.shapes import Timing
from moefleet.platform import Meter, load_platform
from moefleet.profiles.gpu import GpuRoofline
from moefleet.sim import SimConfig, SimError
from moefleet.sim.functions import FunctionPool
from moefleet.sim.synthetic import parse_synthetic
from moefleet.sim.timing import Links
from moefleet.workloads.base import Arrival

GPU = load_platform("openfaas-k8s-gpu")
CPU = load_platform("openfaas-k8s")
SHARES = (0.0, 0.25, 0.5, 1.0)


def test_default_space_and_its_fingerprint_are_unchanged() -> None:
    # Computed before the GPU axis existed: existing checkpoints carry these ids.
    space = ConfigSpace()
    assert space.fingerprint() == "aa2083c29806f191"
    assert space.without_concurrency().fingerprint() == "e0280b267a8fb9ef"
    assert space.size == 60 and not space.has_gpu
    assert space.vectors().shape == (60, 4)
    assert all(c.gpu_share == 0.0 for c in space.configs)
    assert ConfigSpace(gpu_share=SHARES).fingerprint() != space.fingerprint()


def test_gpu_axis_order_vectors_and_neighbours() -> None:
    space = ConfigSpace(gpu_share=SHARES)
    assert space.size == 240 and space.vectors().shape == (240, 6)
    for i, cfg in enumerate(space.configs):
        assert space.index_of(cfg) == i
    assert space.index_of(FunctionConfig(1024, 2, 1, 0.3)) == space.index_of(
        FunctionConfig(1024, 2, 1, 0.5))  # rounded up to the next option
    a = space.index_of(FunctionConfig(1024, 2, 1, 0.25))
    b = space.index_of(FunctionConfig(1024, 2, 1, 0.5))
    assert not space.neighbours()[a, b]  # a share step restarts cold: not explored
    assert space.neighbours(gpu=True)[a, b]
    assert space.without_concurrency().gpu_share == SHARES
    with pytest.raises(AutoscaleError):
        ConfigSpace(gpu_share=(0.5, 0.25))
    with pytest.raises(ControlError):
        FunctionConfig(1024, gpu_share=1.5)


def test_memory_filter_masks_slices_too_small_for_the_weights() -> None:
    import torch

    space = ConfigSpace(memory_mb=(1024, 9300, 16384), replicas=(1,), concurrency=(1,),
                        gpu_share=(0.0, 0.25, 0.5))
    # 8000 MB of weights: the host needs 300 + 8000 <= 0.9 x memory (9300: 8370 MB, yes),
    # and with a GPU share also the CUDA runtime's 1280 MB (16384 only); a slice needs
    # 300 + 8000 <= 0.9 x share x 24576 MB (0.5: 11059 MB yes; 0.25: 5530 MB no).
    mask = space.valid_mask(torch.tensor([8000 * 2**20]), torch.tensor([0.0]), 2048)[0]
    ok = {(c.memory_mb, c.gpu_share) for c, v in zip(space.configs, mask.tolist(),
                                                     strict=True) if v}
    assert ok == {(9300, 0.0), (16384, 0.0), (16384, 0.5)}


def _pool(share: float) -> FunctionPool:
    prof = parse_synthetic("synthetic:blocks=4,experts=8,top_k=2,hidden=512").profile()
    return FunctionPool(simpy.Environment(), "exp-0-0", "expert", 0, 0,
                        FunctionConfig(1024, 1, 1, share), profile=prof.experts[0], spec=GPU,
                        sim=SimConfig(), links=Links.of(GPU, prof.bytes_per_token))


def test_simulated_call_time_falls_and_price_rises_with_the_share() -> None:
    pools = {s: _pool(s) for s in SHARES}
    t = {s: p.compute_s(16, p.vcpus, s) for s, p in pools.items()}
    # 2.1M parameters (8 MiB fp32): bf16 read 4 MiB / 420 GB/s = 9.986 us on the card
    # (bandwidth-bound; 16 tokens of FLOPs take 1.79 us), / share.
    kernel = 2**21 * 2 / (600e9 * 0.7)
    assert t[0.25] - t[1.0] == pytest.approx(kernel * 3, rel=1e-6)
    assert t[0.5] - t[1.0] == pytest.approx(kernel, rel=1e-6)
    assert t[0.0] > t[0.25] > t[0.5] > t[1.0]
    # 1 GB + 0.25 vCPU at openfaas-k8s rates, plus share x the A10G's $0.77416/h.
    cpu = 2.0125e-6 + 0.25 * 8.05e-6
    for s, p in pools.items():
        assert p.rate == pytest.approx(cpu + s * 0.00021504, rel=1e-9)
    assert Timing(1e9, 1e9).roofline() == GpuRoofline()  # Remoe and the simulator: one model


def test_scenario_runs_experts_on_gpu_slices_and_refuses_cpu_platforms() -> None:
    sc = build_scenario(platform="openfaas-k8s-gpu")
    arrivals = [Arrival(15.0 * (i + 1), f"r{i}", prompt_tokens=64) for i in range(6)]
    on_gpu = {f.name: FunctionConfig(1024, 1, 1, 0.25)
              for f in sc.plan.placement().functions if f.role == "expert"}
    cpu = run_episode(sc, None, arrivals, 100.0)
    gpu = run_episode(sc, PlanPolicy("gpu", on_gpu), arrivals, 100.0)
    assert gpu["p50_s"] < cpu["p50_s"] and gpu["cost_usd"] > cpu["cost_usd"]
    with pytest.raises(SimError, match="no GPU"):
        run_episode(build_scenario(), PlanPolicy("gpu", on_gpu), arrivals, 100.0)


def test_local_backend_carries_and_clamps_the_share() -> None:
    from moefleet.runtime import FunctionSpec, HandlerRef
    from moefleet.runtime.control import ControlConfig, ControlLoop
    from moefleet.runtime.local import LocalBackend
    from moefleet.runtime.payload import pack

    now = [100.0]
    with LocalBackend(GPU, workers=1, retry_backoff_s=0.01, limits=True) as b:
        b.deploy(FunctionSpec("exp-0-0", "expert", HandlerRef(
            "moefleet.runtime.handlers:debug_handler"), memory_mb=2048, layer=0, experts=(0,)))
        ping = pack(meta={"op": "pid"})
        b.invoke("exp-0-0", ping)
        # 0.3 is not a quarter: rounded up to 0.5, logged, and the next call is cold.
        loop = ControlLoop(b, PlanPolicy("gpu", {"exp-0-0": FunctionConfig(2048, 1, 1, 0.3)}),
                           ControlConfig(interval_s=10, apply_delay_s=1), clock=lambda: now[0])
        now[0] += 10
        loop.tick()
        now[0] += 1
        loop.tick()
        assert [c for _, _, c in loop.applied] == [FunctionConfig(2048, 1, 1, 0.5)]
        assert loop.clamped[0][2:] == (FunctionConfig(2048, 1, 1, 0.3),
                                       FunctionConfig(2048, 1, 1, 0.5))
        rec = b.invoke("exp-0-0", ping).record
        assert rec.cold and rec.gpu_share == 0.5
        bill = Meter(GPU, [rec]).bill()
        assert bill.total.total == pytest.approx(GPU.compute_cost(
            2048, GPU.invocation_billed_s(rec.duration_s, rec.init_s), rec.vcpus, 0.5))
        # The emulated share is charged what CUDA adds to host memory (1,024 MB): in
        # 1024 MB it does not start, as on the platform.
        b.reconfigure("exp-0-0", FunctionConfig(1024, 1, 1, 0.25))
        with pytest.raises(MoefleetError, match="memory"):
            b.invoke("exp-0-0", ping)
    # A CPU-only platform clamps a share to 0: the backend contract test checks it on
    # every backend (tests/contracts/test_function_backend.py).


def _gpu_plan() -> DeploymentPlan:
    return DeploymentPlan.uniform("synthetic:blocks=2,experts=2", "openfaas-k8s-gpu", [0, 1],
                                  [2, 2], 2, 1024, replicas=2, segment_memory_mb=2048)


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_writes_and_reads_back_a_gpu_share(fmt: str) -> None:
    dec = {"exp-0-1": FunctionConfig(1024, 1, 1, 0.25)}
    text = export(_gpu_plan(), fmt, GPU, image="img:1", decisions=dec)
    got = parse_export(text, fmt)
    assert got["exp-0-1"] == FunctionConfig(1024, 1, 1, 0.25)
    assert got["exp-0-0"].gpu_share == 0.0
    if fmt != "ray-serve":
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in text and "0=6144M" in text
    assert ("nvidia.com/gpu" in text) == (fmt == "knative")
    assert ("com.openfaas.profile" in text) == (fmt == "openfaas")


def test_export_clamps_a_share_the_platform_does_not_offer(
        caplog: pytest.LogCaptureFixture) -> None:
    plan = DeploymentPlan.uniform("synthetic:blocks=2,experts=2", "openfaas-k8s", [0, 1],
                                  [2, 2], 2, 1024, replicas=2, segment_memory_mb=2048)
    with caplog.at_level("WARNING"):
        got = parse_export(export(plan, "knative", CPU, image="i", decisions={
            "exp-0-1": FunctionConfig(1024, 1, 1, 0.5)}), "knative")
    assert got["exp-0-1"].gpu_share == 0.0 and "GPU share 0" in caplog.text
    got = parse_export(export(_gpu_plan(), "ray-serve", GPU, image="i", decisions={
        "exp-0-1": FunctionConfig(1024, 1, 1, 0.3)}), "ray-serve")
    assert got["exp-0-1"].gpu_share == 0.5
