"""The scenario every policy of a ``compare`` run shares.

Model shape (:mod:`moefleet.compare.shapes`), platform, traffic (arrivals with lengths),
SLOs, the CPU FLOP rates measured here at the shape's expert size (cached per shape in
the run), and the expert routing:

- ``real_LE``: the routing requests really take. No routing trace exists at these
  shapes, so it is synthetic and stated as such: per MoE layer a Zipf(``skew``) popularity
  over the experts in a seeded random order (real MoE routers are skewed; Remoe's and
  sMoE's gains depend on it);
- ``pred_LE``: what a predictor knows: the routing of a ``sample_tokens`` sample of
  tokens drawn from ``real_LE`` (its sampling error stands in for a predictor's error).

Invariants: both matrices are (MoE layers x experts), rows sum to 1, every entry > 0.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moefleet.compare.shapes import ENCODERS, resolve_dims
from moefleet.compare.traffic import Traffic, load_traffic
from moefleet.errors import MoefleetError
from moefleet.plan.remoe.shapes import ModelDims, Timing, measure_cpu
from moefleet.platform.catalog import load_platform
from moefleet.platform.specs import PlatformSpec
from moefleet.profiles.gpu import RUNTIME_MB

_TIMING: dict[str, Timing] = {}
CAL_SHOWN = ("nonexpert_decode_s", "expert_token_s", "call_overhead_s", "handler_fixed_s")


def timing_for(dims: ModelDims) -> Timing:
    """CPU FLOP rates at this shape's expert size: measured once per machine and cached
    (``<cache>/compare/timing-<shape>.json``), so that two runs of one command agree (a
    measurement on a loaded machine moves every CPU row; delete the file to re-measure)."""
    if dims.name in _TIMING:
        return _TIMING[dims.name]
    from moefleet.io import write_json_atomic
    from moefleet.paths import cache_dir

    size = f"{dims.hidden}x{dims.expert_intermediate}"
    path = cache_dir() / "compare" / f"timing-{dims.name}-{size}.json"
    t: Timing | None = None
    if path.is_file():
        try:
            t = Timing(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            t = None  # a damaged cache file is measured again
    if t is None:
        t = measure_cpu(dims, repeats=7)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, t.to_dict())
    _TIMING[dims.name] = t
    return t


def skewed_routing(dims: ModelDims, skew: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed + 11)
    ranks = np.arange(1, dims.experts + 1, dtype=np.float64)
    base = ranks ** -skew
    rows = [base[rng.permutation(dims.experts)] for _ in range(dims.moe_layers)]
    m = np.array(rows)
    return m / m.sum(axis=1, keepdims=True)


def predicted_routing(real_LE: np.ndarray, top_k: int, tokens: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed + 13)
    counts = np.array([rng.multinomial(tokens * top_k, row) for row in real_LE], np.float64)
    counts += 0.5  # no expert is predicted never to be used
    return counts / counts.sum(axis=1, keepdims=True)


@dataclass
class Scenario:
    model: str
    dims: ModelDims
    spec: PlatformSpec
    traffic: Traffic
    slo_ttft_s: float
    slo_tpot_s: float
    timing: Timing
    real_LE: np.ndarray
    pred_LE: np.ndarray
    seed: int = 0
    quick: bool = False
    interval_s: float = 10.0
    keep_alive_s: float = 600.0
    skew: float = 1.0
    notes: list[str] = field(default_factory=list)
    #: Memory a function's runtime (interpreter, torch, handlers) holds before any
    #: parameter: every plan, Remoe's and ODS/BO's alike, leaves room for it.
    runtime_mb: float = RUNTIME_MB
    #: The engine's CPU times measured on this machine (a
    #: :class:`moefleet.calibration.remoe.RemoeCalibration`; ``--measure`` sets it), which
    #: replace the FLOP-scaled CPU times of Remoe's rows; None: FLOP-scaled.
    cpu_cal: Any = None

    @property
    def duration_s(self) -> float:
        return self.traffic.duration_s

    @property
    def n_in(self) -> int:
        p = self.traffic.prompts
        return max(1, round(float(p.mean()))) if len(p) else 1

    @property
    def n_out(self) -> int:
        o = self.traffic.outputs
        return max(1, round(float(o.mean()))) if len(o) else 1

    def describe(self) -> dict[str, Any]:
        return {"model": self.model, "platform": self.spec.name,
                "traffic": self.traffic.spec, "duration_s": self.duration_s,
                "requests": len(self.traffic.arrivals), "mean_prompt_tokens": self.n_in,
                "mean_output_tokens": self.n_out, "slo_ttft_s": self.slo_ttft_s,
                "slo_tpot_s": self.slo_tpot_s, "seed": self.seed, "quick": self.quick,
                "routing": f"synthetic Zipf({self.skew:g}) per layer, seeded order; "
                           "predictions from a 2,048-token sample of it",
                "cpu_timing": self.timing.source if self.cpu_cal is None else
                "Remoe's CPU times: the engine's, measured on this machine (" +
                ", ".join(f"{k} {getattr(self.cpu_cal, k) * 1e3:.3g} ms" for k in CAL_SHOWN)
                + "".join(f", held to {v:g} vCPU x{d:.3g} decode x{p:.3g} prefill"
                          for v, d, p in self.cpu_cal.held)
                + f"); else {self.timing.source}", "traffic_detail": self.traffic.described,
                "runtime_footprint_mb": self.runtime_mb,
                "notes": self.notes}


def build_scenario(model: str, platform: str, traffic: str, *, slo_ttft_s: float,
                   slo_tpot_s: float, duration_s: float, rate_scale: float = 1.0,
                   seed: int = 0, quick: bool = False, interval_s: float = 10.0,
                   skew: float = 1.0, dims: ModelDims | None = None,
                   runtime_mb: float | None = None) -> Scenario:
    """Resolve every input (a bad one raises a one-line error before any work).
    ``dims`` (optional) is the shape of ``model`` when the caller has it already."""
    for name, v in (("--slo-ttft", slo_ttft_s), ("--slo-tpot", slo_tpot_s)):
        if not (math.isfinite(v) and 0 < v <= 3600):
            raise MoefleetError(f"{name} must be in (0, 3600] seconds, got {v!r}",
                                f"e.g. {name} 1.0")
    dims = dims or resolve_dims(model)
    spec = load_platform(platform)
    tr = load_traffic(traffic, duration_s, rate_scale=rate_scale, seed=seed,
                      interval_s=interval_s)
    if not tr.arrivals:
        raise MoefleetError(f"traffic '{traffic}' has no arrivals in {duration_s:g} s",
                            "pass a longer --duration or a larger --rate-scale")
    notes = []
    if dims.name in ENCODERS:  # an encoder runs one pass per request: no decode
        tr = Traffic(tr.spec, [dataclasses.replace(a, output_tokens=1) for a in tr.arrivals],
                     tr.duration_s, {**tr.described, "outputs": "1 (encoder model)"})
        notes.append(f"{dims.name} is an encoder: every request is one pass (TPOT n/a)")
    real = skewed_routing(dims, skew, seed)
    pred = predicted_routing(real, dims.top_k, 2048, seed)
    return Scenario(model, dims, spec, tr, slo_ttft_s, slo_tpot_s, timing_for(dims), real,
                    pred, seed, quick, interval_s, skew=skew, notes=notes,
                    runtime_mb=RUNTIME_MB if runtime_mb is None else runtime_mb)
