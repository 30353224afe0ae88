"""Property-based fuzzing of every file format and spec moefleet reads: plans, platform
specs, compute profiles, predictor files, routing traces, workload specs and arrivals
CSVs. Property: any generated input either loads, or fails with a one-line
:class:`MoefleetError` that names its source (and, for schema'd files, the field) —
never another exception. 1,150 generated inputs in total (fixed seed, no database)."""

from __future__ import annotations

import copy
import io
import json
import math
from importlib import resources
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moefleet.errors import MoefleetError
from moefleet.plan import DeploymentPlan
from moefleet.platform.catalog import parse_platform
from moefleet.predict.base import load_predictor
from moefleet.profiles.model import ComputeProfile
from moefleet.traces.schema import read_trace, write_trace
from moefleet.workloads import load_workload, read_arrivals_csv
from tests.plan_helpers import bert_profile
from tests.reliability.hostile import make_trace


def fuzz(n: int) -> settings:
    """``n`` examples, reproducible (fixed seed, no example database), no deadline."""
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))

hostile = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.lists(st.one_of(st.integers(-5, 10**13), st.floats(), st.text(max_size=3)), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any], edits: int = 3) -> tuple[dict, list]:
    """``base`` with 1..edits fields replaced, deleted or added; returns (data, keys)."""
    data = copy.deepcopy(base)
    keys: list = []
    for _ in range(draw(st.integers(1, edits))):
        paths = _paths(data)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = data
        for k in path[:-1]:
            parent = parent[k]
        action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        keys.append(path[-1])
        if action == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=6))] = draw(hostile)
        else:
            parent[path[-1]] = draw(hostile)
    return data, keys


def check_error(err: MoefleetError, source: str) -> None:
    assert err.message and "\n" not in err.message, repr(err.message)
    assert source in err.message, err.message


# ---- plans ------------------------------------------------------------------------------
PLAN = DeploymentPlan.uniform("m", "aws-lambda", [0, 1], [4, 4], 2, 1024, "pipelined",
                              beta=8).model_dump(mode="json")
PLAN["predicted"] = {"cost_usd": 1e-5, "latency_s": 1.2}


@fuzz(200)
@given(mutated(PLAN))
def test_fuzz_plan_files(case: tuple[dict, list]) -> None:
    data, _ = case
    try:
        plan = DeploymentPlan.from_yaml(yaml.safe_dump(data), source="fuzz.yaml")
    except MoefleetError as err:
        check_error(err, "fuzz.yaml")
        assert "field" in err.message or "mapping" in err.message
        return
    assert all(e.memory_mb > 0 and e.replicas >= 1 for lp in plan.layers for e in lp.experts)
    assert all(math.isfinite(v) for v in plan.predicted.values())


@fuzz(50)
@given(blob=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode)))
def test_fuzz_plan_bytes(blob: bytes, tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tmp_path_factory.mktemp("plan") / "p.yaml"
    path.write_bytes(blob)
    try:
        DeploymentPlan.load(path)
    except MoefleetError as err:
        check_error(err, "p.yaml")


# ---- platform specs ---------------------------------------------------------------------
PLATFORMS = {n: yaml.safe_load((resources.files("moefleet") / f"embedded/platforms/{n}.yaml")
                               .read_text()) for n in ("aws-lambda", "gpu-server")}


@fuzz(200)
@given(st.sampled_from(sorted(PLATFORMS)).flatmap(lambda n: mutated(PLATFORMS[n])))
def test_fuzz_platform_specs(case: tuple[dict, list]) -> None:
    data, _ = case
    try:
        spec = parse_platform(data, source="fuzz-platform.yaml")
    except MoefleetError as err:
        check_error(err, "fuzz-platform.yaml")
        return
    # Whatever loads is usable: a FaaS platform's memory options are bounded.
    if spec.is_faas:
        assert 0 < len(spec.memory_options_mb()) <= 100_000
        spec.vcpus(spec.baseline_memory())


# ---- compute profiles -------------------------------------------------------------------
PROFILE = json.loads(json.dumps(bert_profile(layers=2).to_dict()))


@fuzz(200)
@given(mutated(PROFILE, edits=2))
def test_fuzz_compute_profiles(case: tuple[dict, list]) -> None:
    data, _ = case
    try:
        prof = ComputeProfile.from_dict(data, source="fuzz-profile.json")
    except MoefleetError as err:
        check_error(err, "fuzz-profile.json")
        return
    for layer in prof.moe_layers:
        t = prof.expert_time_s(layer, 100, 2.0)
        assert math.isfinite(t) and t > 0


# ---- predictor files --------------------------------------------------------------------
@pytest.fixture(scope="module")
def predictor_arrays(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    from moefleet.predict import make_predictors

    path = tmp_path_factory.mktemp("pred") / "p.npz"
    pred = make_predictors(["bayes"], {})["bayes"]
    pred.fit(make_trace(tokens=128))
    pred.save(path)
    with np.load(path) as npz:
        return {k: npz[k] for k in npz.files}


@fuzz(100)
@given(data=st.data())
def test_fuzz_predictor_files(data: st.DataObject, predictor_arrays: dict[str, np.ndarray],
                              tmp_path_factory: pytest.TempPathFactory) -> None:
    arrays = dict(predictor_arrays)
    meta = json.loads(str(arrays["__meta__"]))
    kind = data.draw(st.sampled_from(["meta", "array", "drop", "bytes"]))
    if kind == "meta":
        new_meta, _ = data.draw(mutated(meta, edits=2))
        arrays["__meta__"] = np.array(json.dumps(new_meta))
    elif kind == "array":
        name = data.draw(st.sampled_from(sorted(k for k in arrays if k != "__meta__")))
        arr = arrays[name].astype(np.float64).copy()
        if arr.size:
            arr.flat[data.draw(st.integers(0, arr.size - 1))] = data.draw(
                st.floats(allow_nan=True, allow_infinity=True))
        arrays[name] = arr[: data.draw(st.integers(0, len(arr)))] if arr.ndim else arr
    elif kind == "drop":
        arrays.pop(data.draw(st.sampled_from(sorted(arrays))))
    path = tmp_path_factory.mktemp("pred") / "fuzz.npz"
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    blob = buf.getvalue()
    if kind == "bytes":
        cut = data.draw(st.integers(0, len(blob)))
        blob = blob[:cut] + data.draw(st.binary(max_size=20))
    path.write_bytes(blob)
    try:
        load_predictor(path)
    except MoefleetError as err:
        check_error(err, "fuzz.npz")


# ---- routing traces ---------------------------------------------------------------------
TRACE = make_trace(tokens=64)


@fuzz(100)
@given(data=st.data())
def test_fuzz_traces(data: st.DataObject, tmp_path_factory: pytest.TempPathFactory) -> None:
    from moefleet.traces.schema import Trace

    meta, _ = data.draw(mutated(TRACE.meta, edits=2))
    table = TRACE.table
    if data.draw(st.booleans()):
        import pyarrow as pa

        col = data.draw(st.sampled_from(["layer", "expert_ids", "gate_weights"]))
        idx = table.schema.get_field_index(col)
        values = table.column(col).to_pylist()
        row = data.draw(st.integers(0, len(values) - 1))
        if col == "layer":
            values[row] = data.draw(st.integers(-(2**15), 2**15 - 1))
        elif col == "expert_ids":
            values[row] = [data.draw(st.integers(-(2**15), 2**15 - 1)), values[row][1]]
        else:
            values[row] = [data.draw(st.floats(width=32)), values[row][1]]
        table = table.set_column(idx, table.schema.field(idx),
                                 pa.array(values, type=table.schema.field(idx).type))
    folder = tmp_path_factory.mktemp("trace")
    try:
        path = write_trace(Trace(table, meta), folder / "fuzz.parquet")
    except (TypeError, ValueError):
        return  # metadata json.dumps cannot encode it: not a file anyone can write
    if data.draw(st.booleans()):
        raw = path.read_bytes()
        cut = data.draw(st.integers(0, len(raw)))
        path.write_bytes(raw[:cut] + data.draw(st.binary(max_size=16)) + raw[cut + 16:])
    try:
        trace = read_trace(path)
    except MoefleetError as err:
        check_error(err, "fuzz.parquet")
        return
    assert trace.popularity().sum() == trace.table.num_rows * trace.top_k
    assert pq.ParquetFile(path).metadata.num_rows == trace.table.num_rows


# ---- workload specs and arrivals CSVs ---------------------------------------------------
spec_value = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(str),
                       st.integers(-10, 10**12).map(str), st.text(max_size=6))


@fuzz(150)
@given(kind=st.sampled_from(["poisson", "bursty", "step", "azure-fn", "azure-llm", "bogus", ""]),
       params=st.dictionaries(st.sampled_from(["rate", "cv", "base", "at", "factor", "trace",
                                               "x", ""]), spec_value, max_size=3),
       duration=st.floats(0, 1e6))
def test_fuzz_workload_specs(kind: str, params: dict[str, str], duration: float) -> None:
    spec = kind + (":" + ",".join(f"{k}={v}" for k, v in params.items()) if params else "")
    try:
        wl = load_workload(spec)
        wl.check_budget(duration)
    except MoefleetError as err:
        assert err.message and "\n" not in err.message
        return
    if wl.name in ("azure-fn", "azure-llm"):
        return  # trace replays: data files, covered by their own tests
    arrivals = wl.arrivals(min(duration, 10.0), seed=0)
    assert all(0 <= a.t_s < 10.0 for a in arrivals)


@fuzz(100)
@given(rows=st.lists(st.tuples(spec_value, st.text(max_size=4), spec_value), max_size=6),
       header=st.sampled_from(["t_s,request_id,prompt_tokens", "t_s,request_id", "a,b,c"]))
def test_fuzz_arrivals_csv(rows: list[tuple[str, str, str]], header: str,
                           tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tmp_path_factory.mktemp("csv") / "fuzz.csv"
    body = "\n".join(",".join(r) for r in rows)
    path.write_text(f"{header}\n{body}\n")
    try:
        arrivals = read_arrivals_csv(path)
    except MoefleetError as err:
        check_error(err, "fuzz.csv")
        return
    assert all(math.isfinite(a.t_s) and a.t_s >= 0 for a in arrivals)
