"""The invariants of a :class:`~moefleet.plan.problem.PlanningProblem`, checked when one
is built: shapes agree with the model (blocks, MoE layers, experts per layer), counts are
non-negative integers and zero beyond each layer's experts, memory options are offered by
the platform and ascending, per-token times are finite and positive, sizes are >= 0.
Each failure is a :class:`~moefleet.errors.DataError` naming the value and the fix."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from moefleet.errors import DataError

if TYPE_CHECKING:
    from moefleet.plan.problem import PlanningProblem


def _finite_positive(values: np.ndarray, what: str) -> None:
    if values.size and (not np.all(np.isfinite(values)) or np.any(values <= 0)):
        bad = values[~(np.isfinite(values) & (values > 0))].ravel()[:3].tolist()
        raise DataError(
            f"{what} must be finite and positive, got {bad}",
            "re-measure the compute profile (moefleet profile) or fix the explicit values",
        )


def check_problem(p: PlanningProblem) -> None:
    """Raise DataError on the first field that breaks the module's invariants."""
    n_l = len(p.moe_layers)
    if p.num_blocks < 1 or n_l < 1:
        raise DataError(
            f"model needs >= 1 block and >= 1 MoE layer, got {p.num_blocks} blocks, "
            f"{n_l} MoE layers",
            "check the model summary / profile",
        )
    if len(p.num_experts) != n_l or any(e < 1 for e in p.num_experts):
        raise DataError(
            f"num_experts {list(p.num_experts)} must give >= 1 expert for each of the "
            f"{n_l} MoE layers",
            "pass one expert count per MoE layer",
        )
    if any(not 0 <= b < p.num_blocks for b in p.moe_layers):
        raise DataError(
            f"MoE layers {list(p.moe_layers)} outside 0..{p.num_blocks - 1}",
            "the profile and the model disagree; re-profile",
        )
    c = p.counts_LE
    max_e = max(p.num_experts)
    if c.ndim != 2 or c.shape[0] != n_l or c.shape[1] < max_e:
        raise DataError(
            f"counts have shape {tuple(c.shape)}, the model needs ({n_l}, {max_e}) "
            f"({n_l} MoE layers, up to {max_e} experts)",
            "use counts recorded on this model (moefleet profile / predict)",
        )
    if not np.issubdtype(c.dtype, np.integer) or np.any(c < 0):
        raise DataError("counts must be non-negative integers", "round predicted counts up")
    for li, e in enumerate(p.num_experts):
        if np.any(c[li, e:] != 0):
            raise DataError(
                f"MoE layer {p.moe_layers[li]} has {e} experts but counts for more",
                "the counts were recorded on another model",
            )
    if p.intermediate_bytes_per_token and len(p.intermediate_bytes_per_token) != n_l:
        raise DataError(
            f"intermediate_bytes_per_token needs {n_l} values (one per MoE layer), got "
            f"{len(p.intermediate_bytes_per_token)}")
    if min(p.runtime_bytes, p.intermediate_bytes,
           *p.intermediate_bytes_per_token, p.inline_limit_bytes) < 0:
        raise DataError("memory and payload sizes must be >= 0")
    if len(p.expert_param_bytes) != n_l or min(p.expert_param_bytes) <= 0:
        raise DataError("expert_param_bytes needs one positive value per MoE layer")
    if p.bytes_in <= 0 or p.bytes_out <= 0:
        raise DataError(f"bytes per token must be > 0, got {p.bytes_in}/{p.bytes_out}")
    opts = list(p.memory_options_mb)
    if not opts or opts != sorted(set(opts)):
        raise DataError(f"memory options {opts} must be non-empty and ascending")
    for m in opts:
        p.platform.check_memory(m)
    if p.per_token_s_LJ.shape != (n_l, len(opts)):
        raise DataError(
            f"per_token_s_LJ has shape {p.per_token_s_LJ.shape}, expected "
            f"({n_l}, {len(opts)})"
        )
    _finite_positive(p.per_token_s_LJ, "per-token expert times U_j")
    for mem, row in p.extra_per_token_s.items():
        _finite_positive(np.asarray(row, dtype=float), f"per-token times at {mem} MB")
    if not (math.isfinite(p.slo_s) and p.slo_s > 0):
        raise DataError(f"the SLO must be a positive number of seconds, got {p.slo_s}")
    seg = np.asarray(p.segment_time_s, dtype=float)
    if len(seg) != p.num_blocks or not np.all(np.isfinite(seg)) or np.any(seg < 0):
        raise DataError(f"segment times need {p.num_blocks} finite values >= 0")
    if len(p.segment_param_bytes) != p.num_blocks:
        raise DataError(f"segment_param_bytes needs {p.num_blocks} values")
    if p.positions and p.positions < p.tokens:
        raise DataError(f"positions ({p.positions}) must be >= tokens ({p.tokens})",
                        "count padding positions too (B x T), or pass 0")
    if p.max_replicas < 1 or p.tokens < 1:
        raise DataError(
            f"max_replicas ({p.max_replicas}) and tokens ({p.tokens}) must be >= 1"
        )
