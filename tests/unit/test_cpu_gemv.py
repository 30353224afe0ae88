"""One matrix-vector product per pair for small bf16 decode steps on CPUs with bf16 units.

The results and the rule, not the speed (benchmarks/engine_scale.py measures that): the
per-pair kernel equals the grouped GEMM (float32 to 1e-5, bf16 to one rounding), marked
pairs come out 0, empty segments are fine; the fused kernel takes it only for bf16 on the
CPU at most one pair per expert and where it pays; a decode step through it reads the host
at most twice, with brownout on and off, and brownout's calls (marked pairs) keep the
grouped GEMM; a machine that cannot compile measures "does not
pay"; the switch is honoured both ways; partial brownout leaves steps where uniting saves
nothing to the original experts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moefleet.compose.presets import brownout_engine
from moefleet.engine.host_reads import HostReads
from moefleet.experts import cpu_gemv, kernels
from moefleet.experts.kernels import fused_experts
from moefleet.models.hf import HFMoEAdapter
from moefleet.models.tiny import tiny_model
from tests.engine_helpers import decode_step_reads

BF16 = torch.bfloat16


@pytest.fixture
def forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOEFLEET_CPU_GEMV", "1")
    monkeypatch.setenv("MOEFLEET_CPU_BF16_UPCAST", "0")  # the AVX2 paths stay out of it
    monkeypatch.setenv("MOEFLEET_CPU_DPBF16", "0")  # and so does the AVX512-BF16 kernel


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_pairs_equal_the_grouped_gemm(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    E, n_in, n_out = 6, 40, 24
    w = torch.randn(E, n_out, n_in, generator=g).to(dtype)
    counts = torch.tensor([2, 0, 1, 3, 0, 1])  # empty segments, and 2 marked rows after
    ends = torch.cumsum(counts, 0)
    a = torch.randn(int(ends[-1]) + 2, n_in, generator=g).to(dtype)
    got = cpu_gemv.pairs(a, w, ends)
    ref = kernels._segments(a.float(), w.float(), ends.tolist())  # one matmul per segment
    assert got.dtype == dtype and got.shape == ref.shape
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2 ** -7,
                                                                       "atol": 1e-2}
    torch.testing.assert_close(got.float(), ref, **tol)
    assert got[int(ends[-1]):].abs().sum() == 0


def test_the_rule(monkeypatch: pytest.MonkeyPatch, forced: None) -> None:
    x = torch.zeros(8, 4, dtype=BF16)

    def w(experts: int, out: int = 4) -> torch.Tensor:
        return torch.empty(experts, out, 4, dtype=BF16)

    assert cpu_gemv.applies(x, w(8)) and cpu_gemv.applies(x, w(64))
    assert not cpu_gemv.applies(x, w(7))  # more pairs than experts
    assert not cpu_gemv.applies(x.float(), w(64).float())
    assert not cpu_gemv.applies(x[:1], w(64))  # one pair: the grouped GEMM
    with cpu_gemv.marked_pairs():  # brownout's calls: the grouped GEMM skips marked pairs
        assert not cpu_gemv.applies(x, w(64))
    assert cpu_gemv.applies(x, w(64))
    # uniting saves reads per expert: not where pairs run one each, at most E / 2 of them
    assert not cpu_gemv.uniting_pays(x, 32, w(64)) and not cpu_gemv.uniting_pays(x, 2, w(64))
    assert cpu_gemv.uniting_pays(x, 33, w(64)) and cpu_gemv.uniting_pays(x, 1, w(64))
    assert cpu_gemv.uniting_pays(x.float(), 8, w(64).float())
    monkeypatch.setenv("MOEFLEET_CPU_GEMV", "")  # measured: only for experts of >= 1 MiB
    monkeypatch.setattr(cpu_gemv._PAYS, "memo", True)
    assert not cpu_gemv.applies(x, w(64))
    assert cpu_gemv.applies(x, w(64, out=cpu_gemv.MIN_WEIGHT_BYTES // 8))
    monkeypatch.setattr(cpu_gemv._PAYS, "memo", False)
    assert not cpu_gemv.applies(x, w(64, out=cpu_gemv.MIN_WEIGHT_BYTES // 8))
    monkeypatch.setenv("MOEFLEET_CPU_GEMV", "0")
    monkeypatch.setattr(cpu_gemv._PAYS, "memo", True)
    assert not cpu_gemv.applies(x, w(64, out=cpu_gemv.MIN_WEIGHT_BYTES // 8))


def test_a_machine_that_cannot_compile_does_not_pay(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> Any:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpu_gemv, "_compiled", broken)
    got = cpu_gemv._measure(reps=1)
    assert got["pays"] is False and "no C++ compiler" in got["error"]


def test_fused_takes_it_for_small_bf16_steps_and_reads_nothing(
        bf16_olmoe: HFMoEAdapter, forced: None, monkeypatch: pytest.MonkeyPatch) -> None:
    layer = bf16_olmoe.moe_layers[0]
    got_w = bf16_olmoe.stacked_expert_weights(layer)
    assert got_w is not None
    gate_up, down, act = got_w
    E = gate_up.shape[0]
    taken: list[int] = []
    real = cpu_gemv.pairs

    def spy(*args: Any) -> torch.Tensor:
        taken.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(cpu_gemv, "pairs", spy)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, bf16_olmoe.hidden_size, generator=g).to(BF16)
    ids, w = bf16_olmoe.route(layer, x)
    K = ids.shape[1]
    assert 3 * K <= E
    keep = ids % 5 != 0
    ids, w = torch.where(keep, ids, E), torch.where(keep, w, 0)
    with HostReads() as reads:
        got = fused_experts(x, ids, w, gate_up, down, act)
    assert reads.count == 0 and taken == [3 * K, 3 * K]  # both projections
    ref = fused_experts(x.float(), ids, w.float(), gate_up.float(), down.float(), act)
    torch.testing.assert_close(got.float(), ref, rtol=0.02, atol=0.02)
    taken.clear()
    many = torch.randn(E // K + 1, bf16_olmoe.hidden_size, generator=g).to(BF16)
    fused_experts(many, *bf16_olmoe.route(layer, many), gate_up, down, act)
    assert taken == []  # more pairs than experts: the grouped GEMM


@pytest.mark.parametrize(("ways", "mode"), [(None, "full"), (4, "full"), (4, "partial")])
def test_decode_steps_through_it_read_the_host_at_most_twice(
        bf16_olmoe: HFMoEAdapter, forced: None, ways: int | None, mode: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[int] = []
    real = cpu_gemv.pairs
    monkeypatch.setattr(cpu_gemv, "pairs", lambda *a: taken.append(1) or real(*a))
    from moefleet.brownout.united import averaged_united
    from moefleet.experts.brownout import BrownoutExperts

    if mode == "partial":  # united experts as group averages: distilling needs a tokenizer
        opened = brownout_engine(bf16_olmoe, ways=None, kernel="fused", wrap=lambda base: (
            BrownoutExperts(base, averaged_united(bf16_olmoe, 4), 0.4, "partial")))
    else:
        opened = brownout_engine(bf16_olmoe, ways=ways, threshold=0.4, mode=mode, kernel="fused")
    taken.clear()  # building it compiled the kernel (test below)
    reads = [c.count for c in decode_step_reads(opened.engine, requests=2, max_tokens=5)]
    assert reads and max(reads) <= 2, reads
    # without brownout the decode steps go through it; full brownout marks pairs:
    # grouped; partial brownout leaves these small steps (4 pairs, 8 experts) alone
    assert bool(taken) is (mode == "partial" or ways is None)
    if ways is not None:
        assert opened.brownout is not None
        assert (opened.brownout.stats.calls_not_united > 0) is (mode == "partial")


def test_partial_brownout_unites_only_where_it_can_save_reads(
        bf16_olmoe: HFMoEAdapter, forced: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose pairs run one product each and number at most half the experts gains
    nothing from united experts (they save reads per expert, not per pair): partial
    brownout leaves it to the original experts, exactly; a larger step is united, and so
    is the small one where the per-pair kernel does not run."""
    from moefleet.brownout.united import averaged_united
    from moefleet.experts.brownout import BrownoutExperts
    from moefleet.experts.kernels import in_process_experts

    inner = in_process_experts(bf16_olmoe, "fused")
    router = BrownoutExperts(inner, averaged_united(bf16_olmoe, 4), 0.0, "partial")
    layer = bf16_olmoe.moe_layers[0]
    E = len(router._group_of[layer])
    g = torch.Generator().manual_seed(3)

    def call(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(rows, bf16_olmoe.hidden_size, generator=g).to(BF16)
        ids, w = bf16_olmoe.route(layer, x)
        return router(layer, x, ids, w), inner(layer, x, ids, w)

    small = E // 2 // 2  # K = 2: E / 2 pairs
    got, ref = call(small)
    assert torch.equal(got, ref) and router.stats.calls_not_united == 1
    assert router.stats.united_pairs == 0
    got, ref = call(small + 1)
    assert router.stats.calls_not_united == 1 and router.stats.united_pairs > 0
    monkeypatch.setenv("MOEFLEET_CPU_GEMV", "0")
    call(small)
    assert router.stats.calls_not_united == 1


def test_an_engine_prepares_it_before_its_first_step(
        bf16_olmoe: HFMoEAdapter, forced: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Building the fused experts of a bf16 CPU model measures and compiles the kernel
    (for every pair count), so no request's first decode step pays for that; float32
    models never touch it."""
    from moefleet.experts.kernels import in_process_experts

    rows: list[int] = []
    real = cpu_gemv.pairs
    monkeypatch.setattr(cpu_gemv, "pairs", lambda *a: rows.append(a[0].shape[0]) or real(*a))
    in_process_experts(bf16_olmoe, "fused")
    assert rows == [2]
    rows.clear()
    monkeypatch.setenv("MOEFLEET_CPU_GEMV", "")  # measured: a tiny model's experts are small
    in_process_experts(bf16_olmoe, "fused")
    assert rows == []
    fp32 = HFMoEAdapter(tiny_model("olmoe", vocab_size=256, seed=2), name="olmoe")
    in_process_experts(fp32, "fused")
    assert rows == []
