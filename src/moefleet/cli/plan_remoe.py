"""``moefleet plan --policy remoe|cpu|gpu|mix|fetch``: Remoe's planner behind the plan
command (see ``moefleet.plan.remoe``)."""

from __future__ import annotations

import json
from pathlib import Path
from tokenize import TokenError  # np.load's header parser raises it on a mangled header
from typing import Any

from moefleet.errors import DataError, MoefleetError

REMOE_POLICIES = ("remoe", "remoe-sweep", "cpu", "gpu", "mix", "fetch")
#: Largest activation file we read (a 61 x 256 matrix in JSON is ~1 MB).
MAX_ACTIVATION_BYTES = 64 * 2**20


def load_activation(path: Path, model: str) -> Any:
    """s_LE from ``.npy`` (layers x experts) or ``.json`` ({"model", "s_LE"}); a JSON
    file made for another model is refused by name."""
    import numpy as np

    from moefleet.io import check_input_file

    check_input_file(path, "activation file",
                     "save SPS's predict_distribution(...)[0] with np.save")
    if path.stat().st_size > MAX_ACTIVATION_BYTES:
        raise DataError(f"activation file {path} is larger than 64 MB",
                        "pass one (layers, experts) matrix")
    if path.suffix == ".npy":
        try:
            arr = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError, SyntaxError, TokenError) as err:
            raise DataError(f"{path} is not a readable .npy array: {err}") from None
        if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "iuf" or arr.ndim != 2:
            raise DataError(f"{path} holds a {getattr(arr, 'dtype', type(arr).__name__)} "
                            f"array of shape {getattr(arr, 'shape', '?')}; the activation "
                            "distribution is a 2-D numeric (layers, experts) array",
                            "np.save SPS's predict_distribution(...)[0]")
        return arr.astype(np.float64)
    if path.suffix == ".json":
        from moefleet.io import load_json_input

        data = load_json_input(path, "activation file")
        if not isinstance(data, dict) or "s_LE" not in data:
            raise DataError(f"{path} needs a mapping with 's_LE' (and 'model')",
                            '{"model": "deepseek-v2-lite", "s_LE": [[...], ...]}')
        other = data.get("model")
        if other is not None and other != model:
            raise MoefleetError(
                f"the activation matrix in {path} was predicted for '{other}', the plan is "
                f"for '{model}'", f"predict the activations of {model}, or pass --model "
                f"{other}")
        try:
            return np.asarray(data["s_LE"], dtype=np.float64)
        except (TypeError, ValueError) as err:
            raise DataError(f"{path}: s_LE is not a numeric matrix: {err}") from None
    raise DataError(f"--activation {path}: expected .npy or .json",
                    "np.save the (layers, experts) activation distribution")


def _dims(name: str, dtype: str | None = None) -> Any:  # -> ModelDims
    """The planner's published shape, else the dimensions of the model itself (zoo), its
    weights in ``dtype`` (None: the published shape's bf16, the checkpoint's)."""
    import dataclasses

    from moefleet.errors import UnknownNameError
    from moefleet.models.dtypes import DTYPES, concrete_cpu_dtype
    from moefleet.plan.remoe.shapes import model_dims

    concrete = concrete_cpu_dtype(dtype)
    try:
        dims = model_dims(name)
    except (UnknownNameError, MoefleetError) as err:
        from moefleet.models.registry import load_adapter
        from moefleet.models.zoo import has_entry
        from moefleet.remoe.dims import dims_from_adapter

        if not has_entry(name):
            raise err from None
        return dims_from_adapter(load_adapter(name, dtype=concrete))
    if concrete is None:
        return dims
    return dataclasses.replace(dims, bytes_per_param=DTYPES[concrete].itemsize)


def make_remoe_plan(*, policy: str, model: str | None, platform: str,
                    remote_platform: str | None, activation: Path | None,
                    ttft: float | None, tpot: float | None, n_in: int, n_out: int,
                    main_memory: list[int] | None, remote_memory: list[int] | None,
                    timing: Path | None, max_replicas: int,
                    dtype: str | None = None) -> Any:  # -> DeploymentPlan
    """The library calls behind ``moefleet plan --policy remoe`` (and its baselines)."""
    from moefleet.plan.remoe import plan_policy
    from moefleet.plan.remoe.shapes import Timing, measure_cpu, problem_for
    from moefleet.platform import load_platform

    if ttft is None or tpot is None or activation is None:
        raise MoefleetError(
            f"--policy {policy} needs --ttft, --tpot and --activation",
            "e.g. moefleet plan --policy remoe --model deepseek-v2-lite --platform "
            "alibaba-fc-gpu --ttft 30 --tpot 1 --activation s.npy -o plan.yaml")
    name = model or "deepseek-v2-lite"
    dims = _dims(name, dtype)
    s_LE = load_activation(activation, name)
    spec = load_platform(platform)
    rspec = load_platform(remote_platform) if remote_platform is not None else None
    if timing is not None:
        try:
            t = Timing(**json.loads(timing.read_text()))
        except (OSError, json.JSONDecodeError, TypeError) as err:
            raise DataError(f"--timing {timing} is not a timing JSON: {err}",
                            "benchmarks/remoe_cost.py writes one: "
                            "benchmarks/results/remoe_timing.json") from None
    else:
        t = measure_cpu(dims)
    problem = problem_for(dims, t, spec, s_LE, n_in=n_in, n_out=n_out, ttft_slo_s=ttft,
                          tpot_slo_s=tpot, main_memory_mb=main_memory,
                          remote_memory_mb=remote_memory, gpu=policy != "cpu",
                          max_replicas=max_replicas, remote_spec=rspec)
    result = plan_policy(problem, policy)
    plan = result.to_plan(problem)
    plan.meta["timing"] = t.to_dict()
    return plan


def remoe_table(plan: Any) -> Any:  # -> rich Table
    """Main function and remote groups of a Remoe plan, with its predicted numbers."""
    from rich.table import Table

    pred = plan.predicted
    cap = (f"predicted ${pred.get('cost_usd', 0):.6g} per request; TTFT "
           f"{pred.get('ttft_s', 0):.4g} s (SLO {pred.get('ttft_slo_s', 0):.4g}), TPOT "
           f"{pred.get('tpot_s', 0):.4g} s (SLO {pred.get('tpot_slo_s', 0):.4g}); planned in "
           f"{pred.get('solve_s', 0):.3g} s")
    if "gpu" in plan.meta:
        cap += "; GPU emulated"
    t = Table(title=f"{plan.model} on {plan.platform} ({plan.policy})", caption=cap)
    for col in ("function", "holds", "memory", "replicas"):
        t.add_column(col, overflow="fold")
    main = plan.main
    if main is not None:
        local = sum(len(plan.main_expert_ids(lp.layer)) for lp in plan.layers)
        gpu = f" + {main.gpu_gb:g} GB GPU" if main.gpu_gb else ""
        t.add_row("main", f"non-experts, KV cache, {local} local experts",
                  f"{main.memory_mb} MB{gpu}", "1")
    for g in plan.groups:
        # Group function names list or hash their experts (plan.placement); the table
        # shows the prefix only, as "exp-L-*", so it never reads like a value cut short.
        t.add_row(f"exp-{g.layer}-*", f"layer {g.layer}: {len(g.experts)} experts",
                  f"{g.memory_mb} MB", str(g.replicas))
    return t
