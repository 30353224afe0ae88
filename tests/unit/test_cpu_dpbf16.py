"""The AVX512-BF16 kernel for few rows per expert (issue #24's CPU bars).

The results and the rule, not the speed (benchmarks/engine_scale.py and
benchmarks/cpu_expert_kernel.py measure that): the kernel equals the float32 product of
the segments to one bf16 rounding, with empty segments, segments split into several
passes (equal ones, at each width's cap), strided weights and marked rows (0); a linear
through it equals ``F.linear``; the rule keeps it to bf16 on the CPU, rows a multiple of
32 wide and few rows per expert; a machine without AVX512-BF16 measures "does not pay";
an engine's decode steps through it read the host at most twice, with brownout on and
off; a bf16 model's linears take it and say so; the kernel benchmark writes both sides
and refuses bad arguments. The tests that run the kernel skip on machines where it
cannot run (no AVX512-BF16, no C compiler).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from moefleet.experts import kernels
from moefleet.models import cpu_dpbf16
from tests.bench_helpers import load_benchmark

BF16 = torch.bfloat16


def _can_run() -> bool:
    try:
        cpu_dpbf16._library()
        return True
    except Exception:
        return False


needs_kernel = pytest.mark.skipif(not _can_run(), reason="no AVX512-BF16 or no C compiler")


@pytest.fixture
def forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOEFLEET_CPU_DPBF16", "1")
    monkeypatch.setenv("MOEFLEET_CPU_BF16_UPCAST", "0")


def _reference(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return kernels._segments(a.float(), w.float(), ends.tolist())  # a matmul per segment


@needs_kernel
@pytest.mark.parametrize(("n_in", "counts"), [
    (96, [2, 0, 11, 1, 0]),  # an empty segment; 11 rows in one pass (cap 16 at 96 wide)
    (64, [40, 3, 17]),  # 40 rows: three passes of 14, 13 and 13
    (2048, [13, 1, 8]),  # cap 8 at 2048 wide: 13 rows as 7 and 6
    (9216, [5, 2]),  # wider than 8192: cap 2, passes of 2, 2 and 1
])
def test_segments_equal_the_float32_product(n_in: int, counts: list[int]) -> None:
    g = torch.Generator().manual_seed(0)
    E, n_out = len(counts), 40
    big = torch.randn(E, n_out + 3, n_in, generator=g).to(BF16)
    w = big[:, 1:n_out + 1]  # strided: rows and experts apart as in a view
    ends = torch.cumsum(torch.tensor(counts), 0)
    a = torch.randn(int(ends[-1]) + 3, n_in, generator=g).to(BF16)  # 3 marked rows
    got = cpu_dpbf16.segments(a, w, ends)
    want = _reference(a, w, ends)
    assert got.dtype == BF16 and got.shape == want.shape
    scale = n_in ** 0.5 / 10  # sums of n_in products: their bf16 rounding grows with it
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-2 * scale)
    assert got[int(ends[-1]):].abs().sum() == 0


@needs_kernel
@pytest.mark.parametrize("threads", [2, 3])
def test_split_between_threads_the_result_is_the_same(threads: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 200, 64, generator=g).to(BF16)  # 200 outputs: 128 + 72, or 3 x 64 + 8
    ends = torch.tensor([4, 4, 9])
    a = torch.randn(11, 64, generator=g).to(BF16)  # 2 marked rows
    one = cpu_dpbf16.segments(a, w, ends)
    monkeypatch.setattr(cpu_dpbf16, "MIN_SPLIT_ELEMENTS", 0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        split = cpu_dpbf16.segments(a, w, ends)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(split, one)  # each output computed the same way, by some thread
    assert split[9:].abs().sum() == 0


@needs_kernel
def test_a_compiler_without_openmp_builds_the_one_thread_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.randn(2, 64, 64, generator=g).to(BF16)
    a = torch.randn(5, 64, generator=g).to(BF16)
    ends = torch.tensor([2, 5])
    want = cpu_dpbf16.segments(a, w, ends)
    monkeypatch.setattr(cpu_dpbf16, "_OPENMP", ("-fno-such-flag-here",))  # the build fails
    monkeypatch.setattr(cpu_dpbf16, "MIN_SPLIT_ELEMENTS", 0)
    cpu_dpbf16._library.cache_clear()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        got = cpu_dpbf16.segments(a, w, ends)
    finally:
        torch.set_num_threads(before)
        cpu_dpbf16._library.cache_clear()
    assert torch.equal(got, want)


@needs_kernel
def test_a_linear_through_it_equals_f_linear() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 64, generator=g).to(BF16)
    w = torch.randn(48, 64, generator=g).to(BF16)
    bias = torch.randn(48, generator=g).to(BF16)
    got = cpu_dpbf16.linear(x, w, bias)
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float(), bias.float()),
                               rtol=2 ** -6, atol=2e-2)


def test_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_dpbf16._PAYS, "memo", True)
    monkeypatch.setattr(cpu_dpbf16, "_buildable", lambda: True)
    monkeypatch.delenv("MOEFLEET_CPU_DPBF16", raising=False)
    x = torch.zeros(4, 64, dtype=BF16)
    w = torch.empty(8, 16, 64, dtype=BF16)
    most = cpu_dpbf16.MAX_ROWS_PER_EXPERT * 8
    assert cpu_dpbf16.runs(x, most, w) and cpu_dpbf16.runs(x, 1, w)
    assert not cpu_dpbf16.runs(x, most + 1, w)  # more rows per expert: oneDNN
    assert not cpu_dpbf16.runs(x, 0, w)
    assert not cpu_dpbf16.runs(x.float(), 4, w.float())
    assert not cpu_dpbf16.runs(x[:, :48], 4, w[..., :48])  # not a multiple of 32 wide
    assert not cpu_dpbf16.runs(x, 4, w.transpose(1, 2))  # not unit stride along I
    rows = cpu_dpbf16.MAX_ROWS_PER_EXPERT
    assert cpu_dpbf16.runs_linear(x, rows, w[0]) and not cpu_dpbf16.runs_linear(x, rows + 1, w[0])
    monkeypatch.setenv("MOEFLEET_CPU_DPBF16", "0")
    assert not cpu_dpbf16.runs(x, 4, w)
    monkeypatch.setenv("MOEFLEET_CPU_DPBF16", "")
    monkeypatch.setattr(cpu_dpbf16._PAYS, "memo", False)  # measured: does not pay
    assert not cpu_dpbf16.runs(x, 4, w)


def test_a_machine_without_bf16_units_does_not_pay(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu_dpbf16._library.cache_clear()
    monkeypatch.setattr(cpu_dpbf16, "cpu_has_bf16_units", lambda: False)
    try:
        got = cpu_dpbf16._measure(reps=1)
    finally:
        cpu_dpbf16._library.cache_clear()
    assert got["pays"] is False and "AVX512-BF16" in got["error"]


@needs_kernel
@pytest.mark.parametrize("ways", [None, 4])
def test_decode_steps_through_it_read_the_host_at_most_twice(
        bf16_olmoe: Any, forced: None, ways: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    from moefleet.compose.presets import brownout_engine
    from tests.engine_helpers import decode_step_reads

    assert bf16_olmoe.hidden_size % 32 == 0
    taken: list[int] = []
    real = cpu_dpbf16.segments
    monkeypatch.setattr(cpu_dpbf16, "segments",
                        lambda *a: taken.append(a[0].shape[0]) or real(*a))
    opened = brownout_engine(bf16_olmoe, ways=ways, threshold=0.4, mode="full", kernel="fused")
    taken.clear()
    reads = [c.count for c in decode_step_reads(opened.engine, requests=2, max_tokens=5)]
    assert reads and max(reads) <= 2, reads
    assert taken  # both with and without brownout: marked pairs cost it nothing


@needs_kernel
def test_a_bf16_models_linears_take_it_and_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from moefleet.models.cpu_bf16 import UpcastLinear
    from moefleet.models.registry import load_adapter

    monkeypatch.setenv("MOEFLEET_CPU_DPBF16", "1")
    monkeypatch.setenv("MOEFLEET_CPU_BF16_UPCAST", "0")
    adapter = load_adapter("olmoe-1b-7b:layers=1", dtype="bfloat16")
    assert any("AVX512-BF16 kernel" in n for n in adapter.notes)
    assert type(adapter.lm_head) is UpcastLinear
    h = torch.randn(2, adapter.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = adapter.lm_head(h.to(BF16))  # two rows: a decode step's, through the kernel
        monkeypatch.setenv("MOEFLEET_CPU_DPBF16", "0")
        want = adapter.lm_head(h.to(BF16))
    torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.05)


def _bench() -> Any:
    return load_benchmark("cpu_expert_kernel")


@pytest.mark.parametrize("args", [["--shapes", "64x48"], ["--rows", "0"], ["--shapes", "x"],
                                  ["--weights", "1000"]])
def test_the_kernel_benchmark_refuses_bad_arguments(args: list[str], tmp_path: Any) -> None:
    with pytest.raises(SystemExit) as exc:
        _bench().main([*args, "--out", str(tmp_path / "k.json")])
    assert exc.value.code == 2 and not (tmp_path / "k.json").exists()


@needs_kernel
def test_the_kernel_benchmark_writes_both_sides(tmp_path: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    monkeypatch.setenv("MOEFLEET_CPU_DPBF16", "1")  # runs where it builds, paying or not
    out = tmp_path / "k.json"
    assert _bench().main(["--shapes", "64x64", "--rows", "1,3", "--weights", "8",
                          "--reps", "1", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert [(r["rows"], r["weights"]) for r in got["results"]] == [(1, 8), (3, 4)]
    assert all(r["kernel_ms_per_weight"] > 0 and r["grouped_ms_per_weight"] > 0
               for r in got["results"])
