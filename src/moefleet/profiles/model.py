"""Compute profiles: how long a segment or an expert takes for n tokens on v vCPUs.

Two fitted laws per function kind, measured on real execution (``measure.py``):

- batch law, at one thread:   t1(n) = a + b·n          (seconds; a = fixed overhead,
                                                          b = marginal time per token)
- thread law, per token:      T(v)  = θ1·exp(−θ2·v) + θ3  (seconds per token at a large
                                                          batch; Remoe's form)

and the prediction combines them as ``t(n, v) = t1(n) · T(v) / T(1)``: thread scaling
is a speed factor that applies to the whole call. ``v`` may be fractional (a 128 MB
Lambda gets ~0.07 vCPU: time scales like 1/v below one vCPU, since the function gets
that share of one core). Invariants: every fitted time is positive and non-increasing
in v for v ≥ 1.

Sizes in bytes: parameters per expert and per segment, activation bytes per token
(hidden size × 4 for fp32 — what one token costs on the wire each way), and the memory
eq. 12c needs besides them (:mod:`moefleet.profiles.footprint`): the runtime footprint of a
function process per backend (``runtime_bytes``) and an expert's intermediate bytes per
token per MoE layer (``intermediate_bytes_per_token``). Both are empty in profiles saved
before they were measured; ``profile_for`` fills them in.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moefleet.errors import DataError
from moefleet.io import read_text_input, write_json_atomic

PROFILE_VERSION = 1


@dataclass(frozen=True)
class ThreadLaw:
    theta1: float
    theta2: float
    theta3: float

    def per_token_s(self, vcpus: float) -> float:
        if vcpus < 1.0:
            # A fraction of one core: the function runs 1/v times slower than on a core.
            return self.per_token_s(1.0) / max(vcpus, 1e-6)
        return self.theta1 * math.exp(-self.theta2 * vcpus) + self.theta3

    def speed_factor(self, vcpus: float) -> float:
        """Time multiplier relative to one vCPU (1.0 at v = 1)."""
        return self.per_token_s(vcpus) / self.per_token_s(1.0)


@dataclass(frozen=True)
class BatchLaw:
    overhead_s: float
    per_token_s: float

    def time_s(self, tokens: int) -> float:
        return self.overhead_s + self.per_token_s * tokens if tokens > 0 else 0.0


@dataclass(frozen=True)
class FunctionProfile:
    """Fitted laws plus fit quality for one kind of function."""

    batch: BatchLaw
    threads: ThreadLaw
    param_bytes: int
    batch_r2: float = float("nan")
    threads_r2: float = float("nan")

    def time_s(self, tokens: int, vcpus: float) -> float:
        return self.batch.time_s(tokens) * self.threads.speed_factor(vcpus)

    def per_token_s(self, vcpus: float) -> float:
        """Marginal time per token at ``vcpus`` (ODS/BO's U_j for that memory option)."""
        return self.batch.per_token_s * self.threads.speed_factor(vcpus)


@dataclass
class ComputeProfile:
    """Profiles of one model: a law for its experts (per MoE layer) and its segments."""

    model: str
    hidden_size: int
    moe_layers: list[int]
    experts: dict[int, FunctionProfile]  # MoE layer -> profile of its (identical) experts
    segments: list[FunctionProfile]  # one per block
    bytes_per_token: int  # activation bytes one token carries each way (fp32 hidden)
    machine: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)
    runtime_bytes: dict[str, int] = field(default_factory=dict)  # backend -> RSS bytes
    intermediate_bytes_per_token: dict[int, int] = field(default_factory=dict)  # MoE layer

    @property
    def has_memory(self) -> bool:
        """Whether the footprint and every MoE layer's intermediate memory are measured."""
        return bool(self.runtime_bytes) and set(self.intermediate_bytes_per_token) >= set(
            self.moe_layers)

    @property
    def footprint_bytes(self) -> int:
        """The runtime footprint a plan must leave room for: the largest over backends
        (a plan has to start on every backend it may be deployed on); 0 if unmeasured."""
        return max(self.runtime_bytes.values(), default=0)

    def expert(self, layer: int) -> FunctionProfile:
        if layer not in self.experts:
            raise KeyError(f"profile has no MoE layer {layer} (has {sorted(self.experts)})")
        return self.experts[layer]

    def expert_time_s(self, layer: int, tokens: int, vcpus: float) -> float:
        return self.expert(layer).time_s(tokens, vcpus)

    def segment_time_s(self, block: int, tokens: int, vcpus: float) -> float:
        return self.segments[block].time_s(tokens, vcpus)

    # -- persistence -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PROFILE_VERSION,
            "model": self.model,
            "hidden_size": self.hidden_size,
            "moe_layers": self.moe_layers,
            "experts": {str(k): asdict(v) for k, v in self.experts.items()},
            "segments": [asdict(s) for s in self.segments],
            "bytes_per_token": self.bytes_per_token,
            "machine": self.machine,
            "raw": self.raw,
            "runtime_bytes": dict(self.runtime_bytes),
            "intermediate_bytes_per_token": {
                str(k): v for k, v in self.intermediate_bytes_per_token.items()},
        }

    def save(self, path: str | Path) -> Path:
        write_json_atomic(path, self.to_dict())
        return Path(path)

    @classmethod
    def from_dict(cls, d: Any, source: str = "<profile>") -> ComputeProfile:
        if not isinstance(d, dict):
            raise DataError(f"{source}: a compute profile is a JSON object, got "
                            f"{type(d).__name__}", "re-measure it with moefleet profile-compute")
        try:
            if d.get("version", 0) != PROFILE_VERSION:
                raise DataError(
                    f"{source}: compute profile version {d.get('version')} is not "
                    f"{PROFILE_VERSION}",
                    "re-measure it with moefleet profile-compute",
                )

            def fp(x: dict[str, Any]) -> FunctionProfile:
                law = FunctionProfile(
                    batch=BatchLaw(**x["batch"]),
                    threads=ThreadLaw(**x["threads"]),
                    param_bytes=_int_field(x["param_bytes"], "param_bytes", 0, MAX_PARAM_BYTES),
                    batch_r2=_r2(x.get("batch_r2")),
                    threads_r2=_r2(x.get("threads_r2")),
                )
                _check_law(law, source)
                return law

            prof = cls(
                model=_str_field(d["model"], "model"),
                hidden_size=_int_field(d["hidden_size"], "hidden_size", 1, 1 << 20),
                moe_layers=[_int_field(x, "moe_layers", 0, 1 << 16) for x in d["moe_layers"]],
                experts={_int_field(int(k), "experts", 0, 1 << 16): fp(v)
                         for k, v in d["experts"].items()},
                segments=[fp(s) for s in d["segments"]],
                bytes_per_token=_int_field(d["bytes_per_token"], "bytes_per_token", 1, 1 << 24),
                machine=dict(d.get("machine", {})),
                raw=dict(d.get("raw", {})),
                runtime_bytes={str(k): _nonneg(v, source)
                               for k, v in d.get("runtime_bytes", {}).items()},
                intermediate_bytes_per_token={
                    int(k): _nonneg(v, source)
                    for k, v in d.get("intermediate_bytes_per_token", {}).items()},
            )
        except DataError:
            raise
        except KeyError as err:
            raise DataError(f"{source}: compute profile is missing field {err}",
                            "re-measure it with moefleet profile-compute") from None
        except (TypeError, ValueError, AttributeError) as err:
            raise DataError(
                f"{source} is not a valid compute profile: {err}",
                "re-measure it with moefleet profile-compute",
            ) from None
        if not prof.segments:
            raise DataError(f"{source}: field 'segments' is empty", "re-measure it")
        if sorted(set(prof.moe_layers)) != prof.moe_layers or set(prof.experts) != set(
                prof.moe_layers):
            raise DataError(f"{source}: field 'moe_layers' {prof.moe_layers} must be increasing "
                            f"and match the keys of 'experts' {sorted(prof.experts)}",
                            "re-measure it with moefleet profile-compute")
        if prof.moe_layers and prof.moe_layers[-1] >= len(prof.segments):
            raise DataError(f"{source}: MoE layer {prof.moe_layers[-1]} is past the "
                            f"{len(prof.segments)} segments", "re-measure it")
        return prof

    @classmethod
    def load(cls, path: str | Path) -> ComputeProfile:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"compute profile {p} does not exist", "moefleet profile-compute")
        # NaN is allowed: older profiles stored an unknown fit quality (r2) as NaN.
        text = read_text_input(p, "compute profile", "re-measure it: moefleet profile-compute")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{p} is not valid JSON: {err}", "re-measure it") from err
        return cls.from_dict(data, source=str(p))


#: A function's parameters at most (1 TiB): bounds memory estimates made from a profile.
MAX_PARAM_BYTES = 1 << 40


def _int_field(value: Any, name: str, lo: int, hi: int) -> int:
    # bool is an int in Python; a profile never means True by a size.
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise ValueError(f"field '{name}' must be an integer, got {value!r}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"field '{name}' must be in [{lo}, {hi}], got {value!r}")
    return int(value)


def _str_field(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"field '{name}' must be a non-empty string, got {value!r}")
    return value


def _r2(value: Any) -> float:
    return float("nan") if value is None else float(value)


def _check_law(law: FunctionProfile, source: str) -> None:
    """Times positive and finite, overhead >= 0, and thread scaling that does not make a
    function slower with more vCPUs (theta1, theta2 >= 0: T(v) non-increasing)."""
    b, t = law.batch, law.threads
    values = [b.overhead_s, b.per_token_s, t.theta1, t.theta2, t.theta3]
    if any(isinstance(v, bool) or not isinstance(v, int | float) for v in values):
        raise DataError(f"{source}: compute profile has a non-numeric law ({values})",
                        "re-measure it with moefleet profile-compute")
    if any(not math.isfinite(v) for v in values) or b.per_token_s <= 0:
        raise DataError(
            f"{source}: compute profile has a non-positive or NaN time ({values})",
            "re-measure it with moefleet profile-compute",
        )
    if b.overhead_s < 0 or b.overhead_s > 3600:
        raise DataError(f"{source}: batch overhead_s = {b.overhead_s} is outside [0, 3600] s",
                        "re-measure it with moefleet profile-compute")
    if t.theta1 < 0 or t.theta2 < 0 or t.theta3 < 0 or t.theta2 > 100:
        raise DataError(
            f"{source}: thread law theta1={t.theta1}, theta2={t.theta2}, theta3={t.theta3} "
            "is implausible (needs 0 <= theta1, 0 <= theta2 <= 100, 0 <= theta3)",
            "re-measure it with moefleet profile-compute")
    if law.threads.per_token_s(1.0) <= 0:
        raise DataError(f"{source}: thread law gives a non-positive time", "re-measure it")


def _nonneg(value: Any, source: str) -> int:
    out = int(value)
    if out < 0:
        raise DataError(f"{source}: negative memory size {out} in the compute profile",
                        "re-measure it with moefleet profile-compute")
    return out
