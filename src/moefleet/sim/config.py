"""Simulator settings (the model shape it runs is :class:`moefleet.models.ModelShape`), and
how a measured :class:`Calibration` of a backend enters them (:func:`apply_calibration`;
the measuring is :mod:`moefleet.calibration`'s).

Units: seconds, tokens, MB. Every field is validated on construction; a bad value is a
:class:`SimError` naming it (the CLI prints it without a traceback).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from moefleet.errors import MoefleetError
from moefleet.platform.spec_blocks import Network, Storage
from moefleet.platform.specs import PlatformSpec
from moefleet.profiles.gpu import GpuRoofline

Scaling = Literal["on-demand", "replicas"]
DecodeMode = Literal["batched", "per-request"]


class SimError(MoefleetError):
    """Bad simulator input: a negative duration, unsorted arrivals, a mismatched plan."""


def _check_non_negative(name: str, value: float | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise SimError(f"{name} must be a finite number >= 0, got {value!r}",
                       f"pass a non-negative {name}")


@dataclass(frozen=True)
class SimConfig:
    """How the simulated platform and serving behave, beyond the PlatformSpec.

    scaling       ``on-demand`` (Lambda): a call that finds no free warm slot starts a
                  new instance (cold start), up to the platform's ``max_replicas`` per
                  function, and an expert's ``replicas`` split each of its calls' tokens
                  into that many parallel invocations (ODS/BO's g). ``replicas``
                  (OpenFaaS/k8s pods, sMoE's phi_rep): a function has at most
                  ``replicas`` instances, a call goes whole to one of them and waits FIFO
                  for a free slot; this is what autoscale policies resize.
    keep_alive_s  an idle instance dies this long after its last call (scale to zero).
                  Not in PlatformSpec yet; 600 s is in the range providers use.
    decode        ``batched``: requests join an engine replica (the engine's own
                  Scheduler: FCFS continuous batching, up to ``max_decode_batch``
                  sequences, ``max_batched_tokens`` per step (None: no chunking));
                  every step is one pipeline pass of its tokens, prefills and decodes
                  together; a full replica opens another. ``per-request``: every
                  request runs its own passes. Either way the prefill pass yields the
                  first output token and each further token takes one decode step.
    interval_s    metrics / timeline / policy interval.
    apply_delay_s a policy decision takes effect this much later (config propagation);
                  new instances then cold-start on first use.
    prewarm       start every function with ``replicas`` warm instances at t = 0
                  (provisioned; their initialisation is not billed).
    reload_params every call downloads its parameters (T_acc + P/B_s, billed), as in
                  ODS/BO's T_head; by default only a cold start does.
    cold_start_s / warm_start_s   override the platform's (calibration).
    call_overhead_s  fixed extra handler time per call, or per kind of function
                  (``{"segment": s, "expert": s}``): calibration of serialisation and
                  framework overhead the compute profile does not include.
    compute_scale  factor on the profile's compute time, one or per kind (calibration:
                  < 1 where the profile, measured under other load, is slower than the
                  backend's calls); 1 by default.
    caller_overhead_s  per-call time at the caller after the handler (unpacking the
                  reply, thread hand-off): delays whoever waits for the call, holds no
                  instance and no node slot (unlike ``warm_start_s``, which is paid inside
                  the instance's and the node's slot); 0 by default.
    result_bytes_per_token  what the last block returns per token: None = the hidden
                  state (the profile's bytes_per_token); vocabulary x 4 for full fp32
                  logits, as the runtime's executor receives them.
    node_slots    calls that run at once across all functions (a self-hosted node's
                  cores, the local runtime's workers); None = unlimited (public FaaS).
    keep_records  keep every InvocationRecord in a ``Meter`` (memory grows with the
                  run); off by default: costs are streamed through the same prices.
    keep_requests keep one row per request (id, arrival, latency, TTFT) in the result;
                  off by default (streamed percentiles only).
    gpu           the GPU time model of a function with a GPU share (emulated: a
                  datasheet roofline, :mod:`moefleet.profiles.gpu`); CPU-only
                  functions never read it.
    """

    scaling: Scaling = "on-demand"
    keep_alive_s: float = 600.0
    concurrency: int = 1
    decode: DecodeMode = "batched"
    max_decode_batch: int = 256
    max_batched_tokens: int | None = None
    prompt_tokens: int = 128
    output_tokens: int = 0
    slo_s: float | None = None
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    interval_s: float = 10.0
    apply_delay_s: float = 1.0
    prewarm: bool = False
    reload_params: bool = False
    cold_start_s: float | None = None
    warm_start_s: float | None = None
    call_overhead_s: float | Mapping[str, float] = 0.0
    compute_scale: float | Mapping[str, float] = 1.0
    caller_overhead_s: float = 0.0
    result_bytes_per_token: int | None = None
    node_slots: int | None = None
    keep_records: bool = False
    keep_requests: bool = False
    gpu: GpuRoofline = field(default_factory=GpuRoofline)

    def overhead_s(self, kind: str) -> float:
        """The calibrated extra handler seconds of one call of a ``kind`` function."""
        ov = self.call_overhead_s
        return float(ov.get(kind, 0.0)) if isinstance(ov, Mapping) else float(ov)

    def scale_of(self, kind: str) -> float:
        """The calibrated factor on a ``kind`` function's profiled compute time."""
        sc = self.compute_scale
        return float(sc.get(kind, 1.0)) if isinstance(sc, Mapping) else float(sc)

    def __post_init__(self) -> None:
        sc = self.compute_scale
        for kind, value in (sc.items() if isinstance(sc, Mapping) else [("", sc)]):
            if not (math.isfinite(value) and value > 0):
                raise SimError(f"compute_scale{'[' + kind + ']' if kind else ''} must be "
                               f"> 0, got {value!r}")
        if self.scaling not in ("on-demand", "replicas"):
            raise SimError(f"scaling must be 'on-demand' or 'replicas', got {self.scaling!r}")
        if self.decode not in ("batched", "per-request"):
            raise SimError(f"decode must be 'batched' or 'per-request', got {self.decode!r}")
        for name in ("keep_alive_s", "apply_delay_s", "caller_overhead_s"):
            _check_non_negative(name, getattr(self, name))
        ov = self.call_overhead_s
        for kind, value in (ov.items() if isinstance(ov, Mapping) else [("", ov)]):
            _check_non_negative(f"call_overhead_s{'[' + kind + ']' if kind else ''}", value)
        for name in ("slo_s", "ttft_slo_s", "tpot_slo_s", "cold_start_s", "warm_start_s"):
            _check_non_negative(name, getattr(self, name), allow_none=True)
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise SimError(f"interval_s must be > 0, got {self.interval_s!r}")
        for name in ("concurrency", "max_decode_batch", "prompt_tokens"):
            if getattr(self, name) < 1:
                raise SimError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.result_bytes_per_token is not None and self.result_bytes_per_token < 1:
            raise SimError(f"result_bytes_per_token must be >= 1, got "
                           f"{self.result_bytes_per_token!r}")
        if self.max_batched_tokens is not None and self.max_batched_tokens < 1:
            raise SimError(f"max_batched_tokens must be >= 1 (or None), got "
                           f"{self.max_batched_tokens!r}")
        if self.node_slots is not None and self.node_slots < 1:
            raise SimError(f"node_slots must be >= 1 (or None), got {self.node_slots!r}")
        if self.output_tokens < 0:
            raise SimError(f"output_tokens must be >= 0, got {self.output_tokens!r}")


@dataclass(frozen=True)
class Calibration:
    """Measured overheads of a backend; None keeps the platform spec's value."""

    warm_start_s: float | None = None
    cold_start_s: float | None = None
    call_overhead_s: float | Mapping[str, float] = 0.0
    compute_scale: float | Mapping[str, float] = 1.0
    function_bandwidth_bytes_per_s: float | None = None
    storage_access_s: float | None = None
    storage_bandwidth_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        ov = self.call_overhead_s
        values = [(n, getattr(self, n)) for n in ("warm_start_s", "cold_start_s",
                                                  "storage_access_s")]
        values += [(f"call_overhead_s[{k}]", v) for k, v in ov.items()] if isinstance(
            ov, Mapping) else [("call_overhead_s", ov)]
        for name, v in values:
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise SimError(f"calibration {name} must be >= 0, got {v!r}")
        for name in ("function_bandwidth_bytes_per_s", "storage_bandwidth_bytes_per_s"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise SimError(f"calibration {name} must be > 0, got {v!r}")


def apply_calibration(spec: PlatformSpec, config: SimConfig,
                      cal: Calibration) -> tuple[PlatformSpec, SimConfig]:
    """The spec and config that simulate the calibrated backend (prices unchanged; the
    calibration's call overhead replaces the config's)."""
    update: dict[str, object] = {}
    if cal.function_bandwidth_bytes_per_s is not None:
        update["network"] = Network(
            function_bandwidth_bytes_per_s=float(cal.function_bandwidth_bytes_per_s))
    if spec.storage is not None and (cal.storage_access_s is not None
                                     or cal.storage_bandwidth_bytes_per_s is not None):
        store: Storage = spec.storage
        update["storage"] = store.model_copy(update={
            k: float(v) for k, v in (("access_latency_s", cal.storage_access_s),
                                     ("bandwidth_bytes_per_s",
                                      cal.storage_bandwidth_bytes_per_s)) if v is not None})
    new_spec = spec.model_copy(update=update) if update else spec
    new_cfg = replace(
        config,
        warm_start_s=cal.warm_start_s if cal.warm_start_s is not None else config.warm_start_s,
        cold_start_s=cal.cold_start_s if cal.cold_start_s is not None else config.cold_start_s,
        call_overhead_s=cal.call_overhead_s, compute_scale=cal.compute_scale)
    return new_spec, new_cfg
