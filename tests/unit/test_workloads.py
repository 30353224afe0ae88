"""Arrival processes: determinism, rates, CV targets, Azure trace replays, specs, errors."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from moefleet.errors import DataError, MoefleetError, UnknownNameError
from moefleet.workloads import (
    KINDS,
    Arrival,
    AzureFunctionsWorkload,
    AzureLLMWorkload,
    BurstyWorkload,
    Pattern,
    PoissonWorkload,
    StepWorkload,
    Workload,
    classify_windows,
    find_windows,
    load_azure_functions,
    load_azure_llm,
    load_workload,
    read_arrivals_csv,
    spread_per_minute,
    window_cv,
    write_arrivals_csv,
)


def times(arrivals: list[Arrival]) -> np.ndarray:
    return np.array([a.t_s for a in arrivals])


def write_invocations(path: Path, rows: list[tuple[str, list[int]]]) -> Path:
    """A miniature invocations.csv (minute columns 480...): one (HashFunction, counts) a row."""
    header = ["HashOwner", "HashApp", "HashFunction", "Trigger"]
    lines = [",".join(header + [str(480 + i) for i in range(len(rows[0][1]))])]
    lines += [",".join(["own", "app", h, "http", *map(str, c)]) for h, c in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def tiny_fn(tmp_path: Path) -> Path:
    return write_invocations(tmp_path / "invocations.csv", [  # busiest (rank 0): bbbbbb22
        ("aaaaaa11", [1, 0, 3, 2, 0]), ("bbbbbb22", [5, 7, 0, 9, 4]),
        ("aaaaaa33", [0, 2, 2, 0, 1])])


def need_traces() -> None:
    try:
        load_azure_functions(), load_azure_llm("conv"), load_azure_llm("code")
    except DataError:
        pytest.skip("shared Azure traces not available")


SYNTHETIC: list[Workload] = [
    PoissonWorkload(20.0), BurstyWorkload(20.0, 0.5), BurstyWorkload(20.0, 3.0),
    BurstyWorkload(20.0, 0.0), StepWorkload(10.0, 30.0, 3.0),
]


@pytest.mark.parametrize("wl", SYNTHETIC, ids=repr)
def test_synthetic_invariants(wl: Workload) -> None:
    a = wl.arrivals(100.0, seed=7)
    t = times(a)
    assert len(a) > 100
    assert np.all(np.diff(t) >= 0) and t[0] >= 0 and t[-1] < 100.0
    assert len({x.request_id for x in a}) == len(a)
    assert a == wl.arrivals(100.0, seed=7)  # deterministic under the seed
    if not (isinstance(wl, BurstyWorkload) and wl.cv == 0):
        assert times(wl.arrivals(100.0, seed=8)).tolist() != t.tolist()
    longer = wl.arrivals(250.0, seed=7)  # prefix consistency
    assert [x for x in longer if x.t_s < 100.0] == a
    assert wl.arrivals(0.0, seed=7) == []
    assert wl.describe()["kind"] == wl.name


@pytest.mark.parametrize(("wl", "cv"), [(PoissonWorkload(100.0), 1.0),
                                        *((BurstyWorkload(100.0, c), c) for c in (0.5, 1, 3))])
def test_long_samples_hit_target_rate_and_cv(wl: Workload, cv: float) -> None:
    t = times(wl.arrivals(2000.0, seed=3))
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.03)
    assert len(t) / 2000.0 == pytest.approx(100.0, rel=0.03)


def test_degenerate_parameters() -> None:
    t = times(BurstyWorkload(4.0, 0.0).arrivals(10.0, seed=0))  # cv = 0: periodic
    np.testing.assert_allclose(t, np.arange(1, 40) * 0.25)
    assert BurstyWorkload(4.0, 1.0).gamma_shape == 1.0  # cv = 1: exponential gaps
    t = times(StepWorkload(5.0, 0.0, 4.0).arrivals(1000.0, seed=2))  # step at 0
    assert len(t) / 1000.0 == pytest.approx(20.0, rel=0.03)


@pytest.mark.parametrize("factor", [2.0, 0.5])
def test_step_multiplies_rate_at_step(factor: float) -> None:
    wl = StepWorkload(20.0, step_at_s=500.0, factor=factor)
    t = times(wl.arrivals(1000.0, seed=11))
    before, after = np.sum(t < 500.0) / 500.0, np.sum(t >= 500.0) / 500.0
    assert before == pytest.approx(20.0, rel=0.04)
    assert after == pytest.approx(20.0 * factor, rel=0.04)
    assert wl.rate_at(499.9) == 20.0 and wl.rate_at(500.0) == 20.0 * factor


BAD: list[tuple[Callable[[], object], str]] = [
    *((lambda r=r: PoissonWorkload(r), "rate_rps") for r in (0.0, -1.0, math.nan, "5")),
    (lambda: BurstyWorkload(1.0, -0.5), "cv"), (lambda: BurstyWorkload(0.0, 1.0), "rate_rps"),
    (lambda: StepWorkload(1.0, -1.0), "step_at_s"), (lambda: StepWorkload(1, 5, 0), "factor"),
    (lambda: StepWorkload(math.inf, 5.0), "base_rps"),
    *((lambda d=d: PoissonWorkload(1).arrivals(d, 0), "duration_s")
      for d in (-1.0, math.nan, math.inf)),
    *((lambda s=s: PoissonWorkload(1).arrivals(9, s), "seed") for s in (-1, 1.5, True, "0")),
]


@pytest.mark.parametrize(("make", "match"), BAD)
def test_bad_input_raises(make: Callable[[], object], match: str) -> None:
    with pytest.raises(MoefleetError, match=match):
        make()


def test_azure_fn_reproduces_per_minute_counts_exactly(tiny_fn: Path) -> None:
    wl = AzureFunctionsWorkload([0, 1, 2], path=tiny_fn)
    a = wl.arrivals(math.inf, seed=5)
    trace = load_azure_functions(tiny_fn)
    for row, h in enumerate(trace.functions):
        t = np.array([x.t_s for x in a if x.function == h])
        np.testing.assert_array_equal(np.bincount((t // 60).astype(int), minlength=5),
                                      trace.counts[row])
    assert np.all(np.diff(times(a)) >= 0)
    assert [x.request_id for x in a] == [f"azure-fn-{i}" for i in range(len(a))]
    assert a == wl.arrivals(math.inf, seed=5) and a != wl.arrivals(math.inf, seed=6)
    assert wl.arrivals(150.0, seed=5) == [x for x in a if x.t_s < 150.0]  # prefix-consistent
    assert wl.arrivals(0.0, seed=5) == []


def test_azure_fn_real_busiest_function_counts_exact() -> None:
    need_traces()
    wl = AzureFunctionsWorkload(0, start_minute=100)
    trace, row = wl.trace, int(wl.trace.order[0])
    assert trace.counts[row].sum() == trace.counts.sum(axis=1).max()
    t = times(wl.arrivals(1200.0, seed=0))  # 20 minutes
    np.testing.assert_array_equal(np.bincount((t // 60).astype(int), minlength=20),
                                  trace.counts[row, 100:120])
    d = wl.describe()
    assert d == load_workload("azure-fn:rank=0,start=100").describe()
    assert (d["ranks"], d["start_minute_label"], d["trace_duration_s"]) == ([0], 580, 380 * 60)


def test_azure_fn_selection_by_rank_hash_and_prefix(tiny_fn: Path) -> None:
    assert AzureFunctionsWorkload(0, path=tiny_fn).describe()["functions"] == ["bbbbbb22"]
    assert AzureFunctionsWorkload("aaaaaa33", path=tiny_fn).describe()["ranks"] == [2]
    assert AzureFunctionsWorkload("bbbbbb", path=tiny_fn).describe()["functions"] == ["bbbbbb22"]
    bad: list[tuple[object, type[Exception], str]] = [
        ("cccccc", UnknownNameError, "unknown function hash"), ("aaaaaa", MoefleetError,
        "matches 2"), (3, MoefleetError, "out of range"), (True, MoefleetError, "rank"),
        ([0, "bbbbbb22"], MoefleetError, "twice"), ([], MoefleetError, "no function")]
    for selector, error, match in bad:
        with pytest.raises(error, match=match):
            AzureFunctionsWorkload(selector, path=tiny_fn)  # type: ignore[arg-type]


def test_azure_fn_start_duration_and_trace_end(tiny_fn: Path) -> None:
    wl = AzureFunctionsWorkload(0, path=tiny_fn, start_minute=2)
    t = times(wl.arrivals(90.0, seed=1))
    assert wl.trace_duration_s == 180.0 and np.all((t >= 60.0) & (t < 90.0)) and len(t) <= 9
    full = times(wl.arrivals(10_000.0, seed=1))  # ends where the sample ends
    assert len(full) == 0 + 9 + 4 and full[-1] < 180.0
    for bad in (-1, 5, 1.5, True):
        with pytest.raises(MoefleetError, match="start_minute"):
            AzureFunctionsWorkload(0, path=tiny_fn, start_minute=bad)  # type: ignore[arg-type]


def test_azure_fn_scale(tiny_fn: Path) -> None:
    doubled = AzureFunctionsWorkload(0, path=tiny_fn, scale=2.0).arrivals(math.inf, seed=0)
    np.testing.assert_array_equal(np.bincount((times(doubled) // 60).astype(int)),
                                  [10, 14, 0, 18, 8])
    need_traces()
    halved = AzureFunctionsWorkload(0, scale=0.5)
    n = len(halved.arrivals(600.0, seed=0))
    assert n == pytest.approx(0.5 * halved.trace.counts[halved.rows[0], :10].sum(), rel=0.01)
    with pytest.raises(MoefleetError, match="scale"):
        AzureFunctionsWorkload(0, path=tiny_fn, scale=0.0)


def test_azure_fn_bad_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad, head = tmp_path / "a.csv", "HashOwner,HashApp,HashFunction,Trigger,480,481\n"
    for body, match in (("HashOwner,HashApp,Trigger,480\no,a,http,1\n", "HashFunction"),
                        (head + "o,a,f,http,1,x\n", ":2: counts must be integers"),
                        (head + "o,a,f,http,1,-2\n", ":2: negative"),
                        (head + "o,a,f,http,1\n", "fields"), (head, "no function rows")):
        bad.write_text(body)
        with pytest.raises(DataError, match=match):
            load_azure_functions(bad)
    with pytest.raises(DataError, match="not found"):
        load_azure_functions(tmp_path / "missing.csv")
    monkeypatch.setattr("moefleet.workloads._data.shared_data_dirs", lambda: [tmp_path])
    with pytest.raises(DataError, match="azure_functions_2019_sample500") as err:
        load_azure_functions()
    assert "MOEFLEET_DATA_DIR" in err.value.hint
    with pytest.raises(DataError, match="MOEFLEET_DATA_DIR"):
        load_workload("azure-llm:trace=conv")


def test_window_cv_exact_small_case() -> None:
    # three minutes, one arrival each: E[var of the 2 gaps] = 1/8, E[mean gap] = 1 minute.
    assert window_cv([1, 1, 1]) == pytest.approx(math.sqrt(1 / 8))
    assert math.isnan(window_cv([0, 1, 0])) and math.isnan(window_cv([0, 0]))
    assert window_cv([0, 2, 0]) == pytest.approx(0.0)  # one gap: no spread


def test_classify_windows_known_patterns() -> None:
    steady = [1] * 60                         # timer-like: gaps ~U-shaped around 1 min
    pulses = ([10] + [0] * 4) * 12            # 10 every 5th minute
    spike = [int(m % 10 == 0) + 600 * (m == 30) for m in range(60)]  # background + burst
    quiet = [0] * 59 + [2]
    stats = classify_windows(steady + pulses + spike + quiet)
    assert [w.start_minute for w in stats] == [0, 60, 120, 180]
    assert [w.pattern for w in stats] == ["slow", "normal", "bursty", "idle"]
    assert 0.35 < stats[0].cv < 0.45 and 1.5 < stats[1].cv < 3.0 and stats[2].cv > 5.0
    assert [w.arrivals for w in stats] == [60, 120, 606, 2]


def test_classify_windows_stride_partial_and_thresholds() -> None:
    counts = [1] * 150
    assert len(classify_windows(counts)) == 2          # trailing 30 minutes skipped
    assert len(classify_windows(counts, 60, stride_minutes=30)) == 4
    assert classify_windows(counts, 60, min_arrivals=61)[0].pattern == "idle"
    assert classify_windows(counts[:30], 60) == []


@pytest.mark.parametrize("counts", [[0, 0, 5, 0, 40, 1, 0, 0, 3, 2] * 6, [10] * 60,
                                    ([30] + [0] * 9) * 6])
def test_window_cv_matches_generated_arrivals(counts: list[int]) -> None:
    gaps = [np.diff(spread_per_minute(np.array(counts), np.random.default_rng(seed)))
            for seed in range(20)]
    empirical = [g.std() / g.mean() for g in gaps]
    assert np.mean(empirical) == pytest.approx(window_cv(counts), rel=0.05)


def test_classify_windows_rejects_bad_input() -> None:
    for bad in ([[1, 2]], [1, -1], [1.5, 2], [math.nan]):
        with pytest.raises(MoefleetError, match="counts_per_minute"):
            classify_windows(bad, 1)  # type: ignore[arg-type]
    for kwargs in ({"window_minutes": 0}, {"stride_minutes": -1}, {"min_arrivals": -1}):
        with pytest.raises(MoefleetError, match=next(iter(kwargs))):
            classify_windows([1, 2, 3], **kwargs)


def test_find_windows_on_synthetic_sample(tmp_path: Path) -> None:
    pulses = ([10] + [0] * 4) * 12
    path = write_invocations(tmp_path / "invocations.csv", [
        ("steady01", [3] * 60 + pulses), ("pulsed02", pulses + pulses), ("tiny0003", [0] * 120),
    ])
    slow = find_windows("slow", path=path)
    assert [(w.function, w.start_minute) for w in slow] == [("steady01", 0)]
    normal = find_windows("normal", path=path)
    assert [(w.function, w.start_minute) for w in normal] == [  # ties: rank, then start
        ("steady01", 60), ("pulsed02", 0), ("pulsed02", 60)]
    assert find_windows("bursty", path=path) == []
    assert len(find_windows("normal", path=path, limit=1)) == 1
    w = normal[0]
    assert w.start_minute_label == 540 and w.rank == 0 and slow[0].arrivals == 180
    t = times(w.workload(path=path).arrivals(w.minutes * 60.0, seed=0))
    assert len(t) == w.arrivals
    for kwargs in ({"pattern": "spiky"}, {"margin": 2.0}, {"limit": -1}):
        with pytest.raises(MoefleetError, match=next(iter(kwargs))):
            find_windows(**{"pattern": "slow", "path": path, **kwargs})  # type: ignore[arg-type]


def test_find_windows_real_sample_respects_bands() -> None:
    need_traces()
    bands: list[tuple[Pattern, Callable[[float], bool]]] = [
        ("slow", lambda c: c <= 0.9), ("normal", lambda c: 1.1 <= c <= 2.9),
        ("bursty", lambda c: c >= 3.1)]
    for pattern, ok in bands:
        found = find_windows(pattern, limit=5)
        assert found, pattern
        assert all(w.pattern == pattern and ok(w.cv) and w.arrivals >= 60 for w in found)
        assert [w.arrivals for w in found] == sorted((w.arrivals for w in found), reverse=True)


@pytest.mark.parametrize(("trace", "rows"), [("conv", 19_366), ("code", 8_819)])
def test_azure_llm_rows_and_relative_times(trace: str, rows: int) -> None:
    need_traces()
    wl = AzureLLMWorkload(trace)
    a = wl.arrivals(math.inf, seed=0)
    assert len(a) == rows == wl.describe()["requests"]
    t = times(a)
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0) and 3000 < t[-1] < 3600
    assert all(x.prompt_tokens is not None and x.output_tokens is not None for x in a)
    assert a[0].request_id == f"azure-llm-{trace}-0"


def test_azure_llm_conv_values_truncation_and_speedup() -> None:
    need_traces()
    wl = AzureLLMWorkload("conv")
    a = wl.arrivals(60.0, seed=0)
    # rows 1-2: 18:15:46.6805900 (374, 44), 18:15:50.9951690 (396, 109)
    assert (a[0].prompt_tokens, a[0].output_tokens) == (374, 44)
    assert a[1].t_s == pytest.approx(4.314579, abs=1e-9) and a[1].prompt_tokens == 396
    assert all(x.t_s < 60.0 for x in a) and len(a) == int(np.sum(wl.trace.t_s < 60.0))
    fast = AzureLLMWorkload("conv", speedup=2.0).arrivals(30.0, seed=9)
    assert [x.t_s * 2 for x in fast] == pytest.approx([x.t_s for x in a])
    assert wl.arrivals(60.0, seed=1) == a  # the replay ignores the seed
    spec = load_workload("azure-llm:trace=conv,speedup=2")
    assert spec.arrivals(30.0, seed=0) == fast


def test_azure_llm_bad_input(tmp_path: Path) -> None:
    f, head = tmp_path / "t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    for body, match in (
        (head + "2023-11-16 18:00:01.5,10,2\n2023-11-16 18:00:00.25,5,1\n", ":3: timestamp"),
        ("TIMESTAMP,ContextTokens\n2023-11-16 18:00:01,10\n", "GeneratedTokens"),
        (head + "yesterday,10,2\n", ":2: cannot parse"), (head + "2023-11-16 18:00:01,-1,2\n",
        "negative"), (head, "no requests")):
        f.write_text(body)
        with pytest.raises(DataError, match=match):
            load_azure_llm("conv", f)
    with pytest.raises(MoefleetError, match="unknown Azure LLM trace"):
        AzureLLMWorkload("chat", path=f)
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:00:00.2500000,5,1\n2023-11-16 18:00:01.5000000,10,2\n")
    slow = AzureLLMWorkload("code", path=f, speedup=0.5).arrivals(math.inf, seed=0)
    assert times(slow).tolist() == [0.0, 2.5] and slow[1].request_id == "azure-llm-code-1"
    with pytest.raises(MoefleetError, match="speedup"):
        AzureLLMWorkload("code", path=f, speedup=0.0)


def test_arrivals_csv_round_trip(tmp_path: Path) -> None:
    arrivals = [*PoissonWorkload(3.0).arrivals(5.0, seed=1),
                Arrival(6.0, "llm-1", 12, 3), Arrival(6.0, "fn-1", function="abc")]
    out = tmp_path / "sub" / "arrivals.csv"
    write_arrivals_csv(out, arrivals)
    assert read_arrivals_csv(out) == arrivals  # exact, None preserved
    assert sorted(p.name for p in out.parent.iterdir()) == ["arrivals.csv"]  # no temp left
    (tmp_path / "b.csv").write_text("t_s,request_id\n2.0,a\n1.0,b\n")
    assert [a.request_id for a in read_arrivals_csv(tmp_path / "b.csv", sort=True)] == ["b", "a"]
    with pytest.raises(DataError, match="not found"):
        read_arrivals_csv(tmp_path / "nope.csv")


@pytest.mark.parametrize(("body", "match"), [
    ("time,request_id\n1.0,a\n", "missing column"),
    ("t_s,request_id\n2.0,a\n1.0,b\n", ":3: t_s=1.0 is earlier"),
    ("t_s,request_id\nsoon,a\n", "not a number"), ("t_s,request_id\n-1,a\n", ">= 0"),
    ("t_s,request_id\n1,a\n2,a\n", "duplicate request_id"),
    ("t_s,request_id,prompt_tokens\n1,a,many\n", "not an integer"),
    ("t_s,request_id\n1,\n", "empty request_id"),
])
def test_read_arrivals_csv_errors(tmp_path: Path, body: str, match: str) -> None:
    f = tmp_path / "a.csv"
    f.write_text(body)
    with pytest.raises(DataError, match=match):
        read_arrivals_csv(f)


def test_load_workload_specs(tiny_fn: Path) -> None:
    assert isinstance(p := load_workload("poisson:rate=5"), PoissonWorkload) and p.rate_rps == 5
    b = load_workload(" Bursty : rate=5 , cv=3 ")
    assert isinstance(b, BurstyWorkload) and (b.rate_rps, b.cv) == (5.0, 3.0)
    s = load_workload("step:rate=2,at=60,factor=3")
    assert isinstance(s, StepWorkload) and (s.base_rps, s.step_at_s, s.factor) == (2, 60, 3)
    assert load_workload("step:rate=2,at=60").describe()["factor"] == 2.0
    assert load_workload({"kind": "bursty", "rate_rps": 4, "cv": 0.5}).describe()["cv"] == 0.5
    assert load_workload(p) is p
    fn = load_workload(f"azure-fn:top=2,scale=2,start=1,path={tiny_fn}")
    assert fn.describe()["ranks"] == [0, 1] and fn.describe()["start_minute"] == 1
    both = load_workload({"kind": "azure-fn", "function": "aaaaaa11+aaaaaa33",
                          "path": tiny_fn.as_posix()})
    assert both.describe()["functions"] == ["aaaaaa11", "aaaaaa33"]
    assert load_workload(f"azure-fn:path={tiny_fn}").describe()["ranks"] == [0]
    assert set(KINDS) == {"poisson", "bursty", "step", "azure-fn", "azure-llm"}


@pytest.mark.parametrize(("spec", "error", "match"), [
    ("gaussian:rate=1", UnknownNameError, "poisson, bursty, step, azure-fn, azure-llm"),
    ("poisson:rps=1", MoefleetError, "no parameter 'rps'"),
    ("poisson", MoefleetError, "needs rate"), ("bursty:rate=1", MoefleetError, "needs cv"),
    ("poisson:rate=fast", MoefleetError, "rate='fast' is not valid"),
    ("poisson:rate", MoefleetError, "not key=value"), ("", MoefleetError, "non-empty"),
    ("poisson:rate=1,rate=2", MoefleetError, "given twice"),
    ("poisson:rate=1,rate_rps=2", MoefleetError, "given twice"),
    ("poisson:rate=-1", MoefleetError, "rate_rps must be"),
    ("bursty:rate=1,cv=-2", MoefleetError, "cv must be"),
    ("azure-fn:rank=0,top=2", MoefleetError, "one of rank, function, top"),
    ("azure-fn:top=0", MoefleetError, "top=0"), ("azure-fn:rank=1.5", MoefleetError, "valid"),
    ({"rate": 1}, MoefleetError, "needs a string 'kind'"),
    ({"kind": "poisson", "rate": True}, MoefleetError, "not valid"),
])
def test_load_workload_errors(spec: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        load_workload(spec)  # type: ignore[arg-type]
