"""Monolithic rows: one GPU engine scaled to zero, an always-on GPU server, CPU functions
(one replica each) scaled on requests, and BrownoutServe's SALC on the GPU engine.

The fleets are :class:`~moefleet.compare.fastfleet.FastFleet` (the engine scheduler's
rule with decode strides; equal to the per-token ``Fleet`` over the real ``Scheduler``,
tested). Step time of a batch (``tokens`` through every layer, bf16 weights):

    GPU: sum over layers of roofline(2 x active params x tokens, weights read) / cards
         where the weights read are the non-experts plus, per MoE layer, the distinct
         experts the batch's tokens touch (expected, under the real routing)
    CPU: 2 x active params x tokens / the FLOP rate measured here at the shape's expert
         size (1-token rate for decode-only steps, the 64-token rate otherwise), sped up
         by the function's vCPUs with Amdahl's law (serial fraction from the timing)

Brownout at threshold t keeps each layer's most popular experts covering t of the
routing mass and sends the rest to ``ways``-way united experts, so a step reads fewer
distinct experts; SALC (BrownoutServe's controller, ``brownout.salc``) moves t from the
run's own TTFT/TPOT samples. Accuracy cost is the distillation report's top-1 agreement
at the run's mean decode threshold (measured on tiny-moe-lm-e32, 8-way index grouping).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import numpy as np

from moefleet.compare.fastfleet import FastFleet
from moefleet.compare.fleet import FleetResult
from moefleet.compare.rows import Row, absent, fill_latency
from moefleet.compare.scenario import Scenario
from moefleet.compare.shapes import model_bytes
from moefleet.platform.catalog import load_platform
from moefleet.platform.specs import PlatformSpec
from moefleet.profiles.gpu import GpuRoofline

# A100 80GB (the gpu-server): bf16 312 TFLOP/s x 30%, 2,039 GB/s x 70% (ASSUMPTIONS, as
# the A10 defaults of profiles/gpu.py).
A100 = GpuRoofline(312e12 * 0.3, 2039e9 * 0.7)
STEP_OVERHEAD_S = 0.002  # host-side scheduling and launches per engine step (ASSUMPTION)
MAX_SEQS = 64
CPU_SEQS = 4  # HPA target: requests per CPU replica
WAYS = 8


class SalcDriver:
    """BrownoutServe's SALC fed by the simulated engine's steps: the TTFT of every request
    whose first token a step produced (queueing and cold starts included) is a prefill
    sample, a decode step's duration a TPOT sample (5 s window)."""

    def __init__(self, slo_ttft_s: float, slo_tpot_s: float) -> None:
        from moefleet.brownout.salc import SALC, SALCPairState

        self.salc, self.state = SALC(slo_ttft_s, slo_tpot_s), SALCPairState()
        self.t_pre = self.t_dec = 1.0
        self.pre: list[tuple[float, float]] = []
        self.dec: list[tuple[float, float]] = []
        self.area = self.time = self.area_pre = self.time_pre = 0.0

    def on_step(self, now: float, pre: bool, dt: float, ttfts: list[float]) -> None:
        from moefleet.brownout.salc import LatencyWindow

        self.pre.extend((now, t) for t in ttfts)
        if not pre:
            self.dec.append((now, dt))
            self.area += dt * self.t_dec
            self.time += dt
        else:
            self.area_pre += dt * self.t_pre
            self.time_pre += dt
        self.pre = [x for x in self.pre if now - x[0] < 5.0]
        self.dec = [x for x in self.dec if now - x[0] < 5.0]
        _, self.state = self.salc.decide(LatencyWindow(now, self.pre, self.dec), self.state)
        self.t_pre, self.t_dec = self.state.prefill.threshold, self.state.decode.threshold

    @property
    def mean_decode_threshold(self) -> float:
        return self.area / self.time if self.time else 1.0

    @property
    def mean_prefill_threshold(self) -> float:
        return self.area_pre / self.time_pre if self.time_pre else 1.0


def _distinct(real_LE: np.ndarray, top_k: int) -> Callable[[int], float]:
    @lru_cache(maxsize=4096)
    def touched(tokens: int) -> float:
        # expected experts with >= 1 of tokens x top_k draws (top-k ~ independent draws)
        return float(np.sum(1.0 - (1.0 - real_LE) ** (tokens * top_k)))
    return touched


def gpu_step(sc: Scenario, roof: GpuRoofline, cards: int, keep_LE: np.ndarray | None = None
             ) -> Callable[..., float]:
    d = sc.dims
    B = d.bytes_per_param
    touched = _distinct(sc.real_LE, d.top_k)
    flops_tok = 2.0 * (d.nonexpert_params + d.moe_layers * d.top_k * d.expert_params)

    def step(tokens: int, threshold: float = 1.0) -> float:
        experts = touched(tokens)
        if threshold < 1.0 and keep_LE is not None:
            kept = float(np.sum(np.minimum(keep_row(threshold), experts / d.moe_layers)))
            experts = min(experts, kept + d.moe_layers * math.ceil(d.experts / WAYS))
        read = B * (d.nonexpert_params + experts * d.expert_params)
        return roof.kernel_s(flops_tok * tokens, read) / cards + STEP_OVERHEAD_S

    def keep_row(threshold: float) -> np.ndarray:
        assert keep_LE is not None
        return np.array([np.searchsorted(c, threshold - 1e-12) + 1 for c in keep_LE], float)
    return step


def _startup(spec: PlatformSpec) -> float:
    return spec.startup.cold_start_s if spec.startup is not None else 0.0


def _cards(sc: Scenario, card_gb: float) -> int:
    return max(1, math.ceil(model_bytes(sc.dims) * 1.1 / (card_gb * 2**30)))


def _fill(sc: Scenario, row: Row, res: FleetResult, cost: float, bill: dict[str, float],
          gpu_s: float) -> Row:
    tr = sc.traffic
    fill_latency(row, res.ttft_s, res.tpot_s, tr.outputs, sc.slo_ttft_s, sc.slo_tpot_s)
    row.cost_usd, row.bill, row.gpu_s = cost, bill, gpu_s
    row.output_tokens = int(tr.outputs.sum())
    row.cold_starts = res.cold_starts
    return row


def gpu_engine_row(sc: Scenario, brownout: bool = False) -> Row:
    spec, name = sc.spec, "brownout-salc" if brownout else "mono-gpu-engine"
    family = "brownout" if brownout else "monolithic"
    cmd = (f"moefleet serve --model {sc.model}" + (" --brownout ways=8,slo-ttft="
           f"{sc.slo_ttft_s:g},slo-tpot={sc.slo_tpot_s:g}" if brownout else ""))
    if spec.gpu is None:
        return absent(name, family, spec.name, f"platform {spec.name} has no GPU functions",
                      cmd)
    cards = _cards(sc, spec.gpu.memory_gb)
    order = np.sort(sc.real_LE, axis=1)[:, ::-1].cumsum(axis=1)
    step = gpu_step(sc, GpuRoofline(), cards, order if brownout else None)
    ctl = SalcDriver(sc.slo_ttft_s, sc.slo_tpot_s) if brownout else None

    def step_time(tokens: int, rows: int, pre: bool) -> float:
        th = 1.0 if ctl is None else (ctl.t_pre if pre else ctl.t_dec)
        return step(tokens, th)

    load = spec.storage.bandwidth_bytes_per_s if spec.storage is not None else 1e9
    cold = _startup(spec) + model_bytes(sc.dims) / load
    tr = sc.traffic
    res = FastFleet(step_time, max_seqs=MAX_SEQS, cold_s=cold,
                    keep_alive_s=sc.keep_alive_s, on_step=None if ctl is None else ctl.on_step
                ).run(tr.times, tr.prompts, tr.outputs)
    mem = min(spec.memory_options_mb()[-1], max(spec.memory_options_mb()[0], 16384))
    per_s = spec.compute_cost(mem, 1.0, None, 1.0) * cards
    cost = res.alive_s * per_s + spec.request_cost(len(tr.arrivals))
    row = Row(name, family, spec.name, fidelity="emulated", command=cmd)
    row.notes.append(f"GPU emulated: {spec.gpu.model} roofline x {cards} card(s); an idle "
                     f"warm instance is billed; cold start {cold:.0f} s (weights loaded)")
    _fill(sc, row, res, cost, {"GPU instance time": cost}, res.alive_s * cards)
    if ctl is not None:
        dec, pre = ctl.mean_decode_threshold, ctl.mean_prefill_threshold
        row.accuracy_cost = accuracy_at(min(dec, pre))  # the lower: the worse phase
        row.notes.append(f"mean thresholds (SALC, time-weighted): prefill {pre:.2f}, "
                         f"decode {dec:.2f}; accuracy cost at the lower, from the "
                         "tiny-moe-lm-e32 distillation report (8-way)")
    return row


@lru_cache(maxsize=1)
def _accuracy_rows() -> list[tuple[float, float]]:
    path = Path(__file__).resolve().parents[3] / "benchmarks/results/brownout_accuracy.json"
    if not path.is_file():
        return []
    rows = json.loads(path.read_text())["rows"]
    return sorted((float(r["threshold"]), float(r["top1_agreement"])) for r in rows
                  if r.get("ways") == str(WAYS) and r.get("grouping") == "index")


def accuracy_at(threshold: float) -> str:
    pts = _accuracy_rows()
    if threshold >= 0.999:
        return "none"
    if not pts:
        return "unmeasured"
    xs, ys = zip(*pts, strict=True)
    agree = float(np.interp(threshold, xs, ys))
    return f"{100 * (1 - agree):.1f}% top-1 disagree"


def gpu_server_row(sc: Scenario) -> Row:
    srv = load_platform("gpu-server")
    h = srv.hourly
    assert h is not None
    cmd = f"moefleet serve --model {sc.model} (one rented A100 server)"
    cards = _cards(sc, 80.0)
    if cards > max(1, h.gpus):
        return absent("mono-gpu-server", "monolithic", srv.name,
                      f"the model needs {cards} x 80 GB cards, the server has {h.gpus}", cmd)
    step = gpu_step(sc, A100, 1)
    tr = sc.traffic
    res = FastFleet(lambda tokens, rows, pre: step(tokens), max_seqs=MAX_SEQS, cold_s=0.0,
                    keep_alive_s=math.inf).run(tr.times, tr.prompts, tr.outputs)
    wall = max(res.makespan_s, sc.duration_s)
    cost = srv.hourly_billed_s(wall) * h.price_per_hour / 3600.0
    row = Row("mono-gpu-server", "monolithic", srv.name, fidelity="emulated", command=cmd)
    row.notes.append("always on (started before the first request); GPU emulated: A100 "
                     "roofline; billed per started hour")
    row = _fill(sc, row, res, cost, {"rented hours": cost}, wall)
    row.cold_starts = 0
    return row


def cpu_function_row(sc: Scenario) -> Row:
    spec, d = sc.spec, sc.dims
    cmd = f"moefleet serve --model {sc.model} (CPU functions, HPA on requests)"
    need_mb = model_bytes(d) * 2 / 2**20 + 512  # fp32 on CPU + the runtime
    opts = [m for m in spec.memory_options_mb() if m >= need_mb]
    if not opts:
        return absent("mono-cpu-hpa", "monolithic", spec.name,
                      f"the model needs {need_mb / 1024:.1f} GB, a {spec.name} function "
                      f"has at most {spec.memory_options_mb()[-1] / 1024:.1f} GB", cmd)
    mem = opts[0]
    v = spec.vcpus(mem)
    f = sc.timing.serial_fraction
    speed = 1.0 / (f + (1 - f) / max(v, 1e-9)) if v >= 1 else v
    flops_tok = 2.0 * (d.nonexpert_params + d.moe_layers * d.top_k * d.expert_params)
    t = sc.timing

    def step_time(n: int, rows: int, pre: bool) -> float:
        rate = t.cpu_flops_1 if n <= rows else t.cpu_flops_batch
        return flops_tok * n / (rate * speed) + STEP_OVERHEAD_S

    load = spec.storage.bandwidth_bytes_per_s if spec.storage is not None else 1e9
    cold = _startup(spec) + model_bytes(d) / load
    limits = spec.limits
    tr = sc.traffic
    res = FastFleet(step_time, max_seqs=CPU_SEQS, cold_s=cold, keep_alive_s=sc.keep_alive_s,
                    max_replicas=limits.max_replicas if limits is not None else 1000
                ).run(tr.times, tr.prompts, tr.outputs)
    cost = spec.compute_cost(mem, res.alive_s) + spec.request_cost(len(tr.arrivals))
    row = Row("mono-cpu-hpa", "monolithic", spec.name, command=cmd)
    row.notes.append(f"{mem} MB ({v:g} vCPU) per replica, {CPU_SEQS} requests each; "
                     "an idle warm replica is billed")
    return _fill(sc, row, res, cost, {"CPU instance time": cost}, 0.0)


def engine_rows(sc: Scenario) -> list[Row]:
    return [gpu_engine_row(sc), cpu_function_row(sc), gpu_server_row(sc)]
