"""bf16 matmuls through float32 blocks on CPUs without bf16 units (issue #24's CPU bar).

The results, not the speed (benchmarks/engine_scale.py measures that): the blocked path
equals the float32 product rounded to bf16 and PyTorch's own bf16 matmul to bf16
rounding; linears swap and swap back without copying a weight; the fused experts kernel
takes the segment path only at 8 pairs per expert and then reads the segment ends once,
and its dense path (few experts, many rows each) only where its rule says, reading nothing;
the measurement is cached per machine; the switch is honoured both ways.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moefleet.engine.host_reads import HostReads
from moefleet.experts import kernels
from moefleet.experts.kernels import CPU_SEGMENT_PAIRS, CPU_SEGMENT_TOKENS, fused_experts
from moefleet.models import cpu_bf16
from moefleet.models.dtypes import cached_cpu_measure
from moefleet.models.hf import HFMoEAdapter

BF16 = torch.bfloat16


@pytest.fixture
def forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOEFLEET_CPU_BF16_UPCAST", "1")
    monkeypatch.setenv("MOEFLEET_CPU_DPBF16", "0")  # the AVX512-BF16 kernel stays out


def _close_to_reference(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                        bias: torch.Tensor | None = None) -> None:
    ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    assert got.dtype == BF16 and got.shape == ref.shape
    # one bf16 rounding of the float32 sum (the sums' order may differ)
    torch.testing.assert_close(got.float(), ref, rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(got, F.linear(x, w, bias), rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize(("rows", "n_out", "n_in"), [(3, 40, 24), (17, 1000, 64),
                                                      (5, 33, 9000)])
def test_blocked_matmul_equals_the_float32_product_rounded(rows: int, n_out: int,
                                                           n_in: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, n_in, generator=g).to(BF16)
    w = (torch.randn(n_out, n_in, generator=g) / n_in ** 0.5).to(BF16)
    bias = torch.randn(n_out, generator=g).to(BF16)
    _close_to_reference(cpu_bf16.upcast_matmul(x, w), x, w)
    _close_to_reference(cpu_bf16.upcast_matmul(x, w, bias), x, w, bias)


def test_linear_takes_the_blocked_path_only_where_it_applies(
        forced: None, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(2, 3, 16).to(BF16)
    assert cpu_bf16.applies(x, 6) and not cpu_bf16.applies(x, cpu_bf16.MIN_ROWS - 1)
    assert not cpu_bf16.applies(x.float(), 6)
    w = torch.randn(8, 16).to(BF16)
    calls: list[int] = []
    real = cpu_bf16.upcast_matmul
    monkeypatch.setattr(cpu_bf16, "upcast_matmul",
                        lambda a, b, c=None: calls.append(a.shape[0]) or real(a, b, c))
    y = cpu_bf16.linear(x, w)  # 6 rows, kept in x's leading shape
    assert y.shape == (2, 3, 8) and calls == [6]
    _close_to_reference(y.reshape(6, 8), x.reshape(6, 16), w)
    cpu_bf16.linear(x[:, :1], w)  # 2 rows: plain F.linear
    cpu_bf16.linear(x.float(), w.float())
    assert calls == [6]
    monkeypatch.setenv("MOEFLEET_CPU_BF16_UPCAST", "0")
    assert not cpu_bf16.applies(x, 6)


def test_linears_swap_without_copies_and_swap_back(forced: None) -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8, bias=False)).to(BF16)
    model.requires_grad_(False)  # a loaded model's weights (with grad: F.linear, autograd)
    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    x = torch.randn(5, 16).to(BF16)
    before = model(x)
    assert cpu_bf16.use_upcast_linears(model) == 2
    assert all(type(m) is cpu_bf16.UpcastLinear for m in (model[0], model[2]))
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    torch.testing.assert_close(model(x), before, rtol=2 ** -6, atol=2e-2)
    with pytest.raises(RuntimeError), cpu_bf16.plain_linears(model):
        assert type(model[0]) is nn.Linear
        raise RuntimeError("a baseline failing must still restore the swap")
    assert type(model[2]) is cpu_bf16.UpcastLinear


def test_no_swap_where_it_does_not_pay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOEFLEET_CPU_BF16_UPCAST", "0")
    model = nn.Sequential(nn.Linear(4, 4)).to(BF16)
    assert cpu_bf16.use_upcast_linears(model) == 0 and type(model[0]) is nn.Linear


def _stacked(adapter: HFMoEAdapter, layer: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
    got = adapter.stacked_expert_weights(layer)
    assert got is not None
    return got


def test_fused_segment_path_equals_the_grouped_path_and_reads_once(
        bf16_olmoe: HFMoEAdapter, forced: None) -> None:
    layer = bf16_olmoe.moe_layers[0]
    gate_up, down, act = _stacked(bf16_olmoe, layer)
    E = gate_up.shape[0]
    g = torch.Generator().manual_seed(0)
    K = bf16_olmoe.route(layer, torch.zeros(1, bf16_olmoe.hidden_size, dtype=BF16))[0].shape[1]
    # a prefill-sized step at >= 8 pairs per expert: segments, one read; a step of 63
    # rows at >= 8 pairs per expert, and one at 1 pair: the grouped GEMM, no read
    for tokens, reads_wanted in ((max(CPU_SEGMENT_TOKENS, CPU_SEGMENT_PAIRS * E // K), 1),
                                 (CPU_SEGMENT_TOKENS - 1, 0), (-(-E // K), 0)):
        x = torch.randn(tokens, bf16_olmoe.hidden_size, generator=g).to(BF16)
        ids, w = bf16_olmoe.route(layer, x)
        keep = ids % 5 != 0  # marked pairs (id E) must still contribute nothing
        ids, w = torch.where(keep, ids, E), torch.where(keep, w, 0)
        with HostReads() as reads:
            got = fused_experts(x, ids, w, gate_up, down, act)
        assert reads.count == reads_wanted
        # the float32 product of the same bf16 weights (the grouped path in float32)
        ref = fused_experts(x.float(), ids, w.float(), gate_up.float(), down.float(), act)
        torch.testing.assert_close(got.float(), ref, rtol=0.02, atol=0.02)
        assert got[(~keep).all(dim=1)].abs().sum() == 0


@pytest.mark.parametrize(("tokens", "pairs", "experts", "dense"), [
    (8, 64, 8, True),     # brownout's 8 united experts in a decode step of 8 rows
    (32, 256, 8, True),
    (4, 32, 8, False),    # 4 slots per expert: the blocked path costs 3 rows
    (16, 32, 8, False),   # Mixtral-like top-2 over 8 at 16 rows: 4 per expert
    (8, 64, 64, False),   # a decode step over 64 experts
    (63, 504, 64, False),
])
def test_dense_rule(tokens: int, pairs: int, experts: int, dense: bool) -> None:
    assert kernels._dense_pays(tokens, pairs, experts) is dense


def test_dense_path_equals_the_float32_product_and_reads_nothing(
        forced: None, monkeypatch: pytest.MonkeyPatch) -> None:
    E, D, F_, N, K = 8, 64, 32, 8, 8
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(E, 2 * F_, D, generator=g) / 8).to(BF16)
    down = (torch.randn(E, D, F_, generator=g) / 8).to(BF16)
    x = torch.randn(N, D, generator=g).to(BF16)
    ids = torch.randint(0, E, (N, K), generator=g)
    w = torch.rand(N, K, generator=g)
    # brownout's marking: a token's later pair in a group it already has goes to id E;
    # the last row is marked whole and holds an inf, which must not leak into its output
    later = torch.stack([(ids[:, :k] == ids[:, k:k + 1]).any(1) for k in range(K)], 1)
    later[-1] = True
    ids, w = torch.where(later, E, ids), torch.where(later, 0, w).to(BF16)
    x[-1, 0] = float("inf")
    taken: list[int] = []
    real = kernels._dense

    def spy(*args: Any) -> torch.Tensor:
        taken.append(1)
        return real(*args)

    monkeypatch.setattr(kernels, "_dense", spy)
    with HostReads() as reads:
        got = fused_experts(x, ids, w, gate_up, down, F.silu)
    assert taken and reads.count == 0
    # the grouped path in float32 (float32 never takes the dense path)
    ref = fused_experts(x[:-1].float(), ids[:-1], w[:-1].float(), gate_up.float(),
                        down.float(), F.silu)
    assert len(taken) == 1 and got.dtype == BF16
    torch.testing.assert_close(got[:-1].float(), ref, rtol=0.02, atol=0.02)
    assert got[-1].abs().sum() == 0


def test_cached_measure_is_reused_and_remeasured_on_a_new_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOEFLEET_CACHE_DIR", str(tmp_path))
    runs: list[int] = []

    def measure() -> dict[str, object]:
        runs.append(1)
        return {"pays": True}

    assert cached_cpu_measure("probe.json", measure)["pays"] is True
    assert cached_cpu_measure("probe.json", measure)["pays"] is True and len(runs) == 1
    path = tmp_path / "probe.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "key": "another machine"}))
    cached_cpu_measure("probe.json", measure)
    path.write_text("{not json")
    cached_cpu_measure("probe.json", measure)
    assert len(runs) == 3


def test_blocked_matmul_in_and_out_of_inference_mode(
        forced: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The float32 scratch is per mode: one made under inference mode (profile-compute
    measures there) may not be written by a later no-grad step (it failed the engine)."""
    monkeypatch.setattr(cpu_bf16, "_local", threading.local())  # no scratch yet
    x, w = torch.randn(4, 32).to(BF16), torch.randn(16, 32).to(BF16)
    with torch.inference_mode():
        a = cpu_bf16.linear(x, w)
    with torch.no_grad():
        b = cpu_bf16.linear(x, w)
    with torch.inference_mode():
        c = cpu_bf16.linear(x, w)
    assert torch.equal(a, b) and torch.equal(b, c)
