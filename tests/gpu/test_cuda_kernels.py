"""Issue #24's CUDA paths: the fused kernel's grouped GEMM, paged attention compiled,
the KV cache sized from GPU memory, and the host reads of a decode step on a GPU.

Skipped where torch sees no CUDA GPU (CI has none); run on a GPU machine with
``python -m pytest tests/gpu``. fp32 comparisons run with TF32 off (torch's default for
matmuls), so only summation order differs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moefleet.brownout.united import averaged_united
from moefleet.compose import StackOptions, in_process_engine
from moefleet.engine import SamplingParams
from moefleet.engine.request import EngineError
from moefleet.experts.brownout import BrownoutExperts
from moefleet.experts.kernels import in_process_experts
from moefleet.models.hf import HFMoEAdapter
from moefleet.models.tiny import tiny_model
from tests.engine_helpers import decode_step_reads

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FAMILIES = ["mixtral", "qwen2_moe", "olmoe", "deepseek_v2"]
PROMPTS = [[5, 9, 2, 7, 1, 3], [8, 4], [6, 6, 1, 2, 9, 9, 9, 4, 2]]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _adapter(family: str, device: str, dtype: torch.dtype = torch.float32) -> HFMoEAdapter:
    adapter = HFMoEAdapter(tiny_model(family, vocab_size=512, seed=1), name=family)
    adapter.model.to(device=device, dtype=dtype)
    return adapter


class _CountGrouped:
    """Counts calls of ``torch._grouped_mm`` (the fused kernel's GEMM on this device)."""

    def __init__(self) -> None:
        self.calls = 0
        self.real = torch._grouped_mm

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        return self.real(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_on_cuda_runs_grouped_gemms_and_equals_the_loop(
        family: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    adapter = _adapter(family, "cuda", dtype)
    layer = adapter.moe_layers[0]
    x_ND = torch.randn(53, adapter.hidden_size, device="cuda", dtype=dtype,
                       generator=torch.Generator("cuda").manual_seed(0))
    ids_NK, w_NK = adapter.route(layer, x_ND)
    loop = in_process_experts(adapter, "loop")(layer, x_ND, ids_NK, w_NK)
    counter = _CountGrouped()
    monkeypatch.setattr(torch, "_grouped_mm", counter)
    fused = in_process_experts(adapter, "fused")(layer, x_ND, ids_NK, w_NK)
    assert counter.calls == 2  # one grouped GEMM per projection, no per-expert fallback
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(fused.float(), loop.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_paged_attention_on_cuda_gives_the_cpu_gather_tokens(family: str) -> None:
    tokens = {}
    for device, attention in (("cpu", "gather"), ("cuda", "paged")):
        opened = in_process_engine(_adapter(family, device), device=device,
                                   attention=attention, stack=StackOptions(kernel="fused"),
                                   kv_budget_bytes=64 << 20, eos_token_id=-1)
        assert opened.runner.attention == attention  # type: ignore[attr-defined]
        tokens[device] = [o.new_token_ids for o in opened.engine.generate(PROMPTS, GREEDY)]
    assert tokens["cuda"] == tokens["cpu"]


def test_the_kv_cache_is_sized_from_gpu_memory_and_refuses_no_room() -> None:
    opened = in_process_engine(_adapter("mixtral", "cuda"), device="cuda",
                               gpu_memory_utilization=0.5)
    cap = opened.runner.kv_capacity  # type: ignore[attr-defined]
    total = torch.cuda.mem_get_info()[1]
    assert "GPU memory" in cap.source
    assert 0.3 * total < cap.bytes <= 0.5 * total
    del opened
    torch.cuda.empty_cache()
    with pytest.raises(EngineError, match="no GPU memory is left"):
        in_process_engine(_adapter("mixtral", "cuda"), device="cuda",
                          gpu_memory_utilization=1e-6)


@pytest.mark.parametrize("brownout", [False, True])
@pytest.mark.parametrize("attention", ["gather", "paged"])
def test_a_cuda_decode_step_reads_the_host_at_most_twice(attention: str,
                                                         brownout: bool) -> None:
    adapter = _adapter("mixtral", "cuda", torch.bfloat16)
    stack = StackOptions(kernel="fused")
    if brownout:
        united = averaged_united(adapter, 2)
        stack = StackOptions(kernel="fused", wrap=lambda base: BrownoutExperts(
            base, united, 0.4, "partial"))
    engine = in_process_engine(adapter, device="cuda", stack=stack, attention=attention,
                               kv_budget_bytes=64 << 20).engine
    counters = decode_step_reads(engine, requests=4, max_tokens=5)
    reads = [c.count for c in counters]
    assert reads and max(reads) <= 2, (reads, [(c.by_name, c.where) for c in counters])
