"""The fused experts kernel and the step path without host reads (issue #24).

- ``fused`` equals the per-expert loop to 1e-5 in fp32 on every family, marked pairs
  (id >= E) contribute nothing;
- greedy tokens of every kernel equal the loop kernel's (fp32, tiny configs, 4 families);
- a decode step reads values back from the device at most twice (the sampled tokens and
  the step's expert counts), with brownout off, full and partial.
"""

from __future__ import annotations

import pytest
import torch

from moefleet.brownout.groups import index_groups, plan_layer, plan_layer_device
from moefleet.brownout.united import averaged_united
from moefleet.compose import StackOptions, in_process_engine
from moefleet.compose.presets import brownout_engine, build_engine
from moefleet.engine import SamplingParams
from moefleet.experts.brownout import BrownoutExperts
from moefleet.experts.kernels import in_process_experts
from moefleet.models.hf import HFMoEAdapter
from moefleet.models.tiny import tiny_model
from tests.engine_helpers import decode_step_reads

FAMILIES = ["mixtral", "qwen2_moe", "olmoe", "deepseek_v2"]


@pytest.fixture(scope="module", params=FAMILIES)
def adapter(request: pytest.FixtureRequest) -> HFMoEAdapter:
    return HFMoEAdapter(tiny_model(request.param, vocab_size=512, seed=1), name=request.param)


def test_fused_equals_loop_in_fp32(adapter: HFMoEAdapter) -> None:
    layer = adapter.moe_layers[0]
    g = torch.Generator().manual_seed(0)
    x_ND = torch.randn(53, adapter.hidden_size, generator=g)
    ids_NK, w_NK = adapter.route(layer, x_ND)
    loop = in_process_experts(adapter, "loop")(layer, x_ND, ids_NK, w_NK)
    fused = in_process_experts(adapter, "fused")
    assert torch.allclose(fused(layer, x_ND, ids_NK, w_NK), loop, atol=1e-5, rtol=0)
    # marked pairs (id E) are skipped: same as dropping them from the loop's input
    E = adapter.num_experts(layer)
    keep = ids_NK % 3 != 0
    marked = fused(layer, x_ND, torch.where(keep, ids_NK, E), torch.where(keep, w_NK, 0))
    dropped = in_process_experts(adapter, "loop")(layer, x_ND, ids_NK, torch.where(keep, w_NK, 0))
    assert torch.allclose(marked, dropped, atol=1e-5, rtol=0)


def _greedy(adapter: HFMoEAdapter, kernel: str) -> list[list[int]]:
    engine = build_engine(adapter, kernel=kernel, max_num_batched_tokens=24)
    prompts = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0,
                                                   ignore_eos=True))
    return [o.new_token_ids for o in outs]


def test_greedy_tokens_of_every_kernel_equal_the_loops(adapter: HFMoEAdapter) -> None:
    want = _greedy(adapter, "loop")
    for kernel in ("stacked", "fused", "auto"):
        assert _greedy(adapter, kernel) == want, kernel


def test_device_plan_equals_the_reference_plan() -> None:
    g = torch.Generator().manual_seed(3)
    for trial in range(300):
        E, ways = (16, 4) if trial % 2 else (60, 8)
        groups = index_groups(E, ways)
        group_of = [next(i for i, m in enumerate(groups) if e in m) for e in range(E)]
        counts = torch.randint(0, 6, (E,), generator=g) * (torch.rand(E, generator=g) < 0.6)
        threshold = float(torch.rand((), generator=g)) if trial % 3 else 0.4
        mode = "full" if trial % 5 == 0 else "partial"
        dev = plan_layer_device(counts, threshold, torch.tensor(group_of), len(groups), mode)
        assert dev.to_plan(group_of) == plan_layer(counts.tolist(), threshold, group_of, mode)


@pytest.mark.parametrize("brownout", ["off", "full", "partial"])
def test_a_decode_step_reads_the_host_at_most_twice(adapter: HFMoEAdapter,
                                                    brownout: str) -> None:
    if brownout == "partial":  # group averages stand in for distilled united experts
        united = averaged_united(adapter, 4)
        opened = in_process_engine(adapter, stack=StackOptions(
            kernel="fused", wrap=lambda base: BrownoutExperts(base, united, 0.4, "partial")))
    else:
        opened = brownout_engine(adapter, ways=None if brownout == "off" else 4,
                                 threshold=0.4, mode="full", kernel="fused")
    reads = [c.count for c in decode_step_reads(opened.engine, requests=5, max_tokens=6)]
    assert reads and max(reads) <= 2, reads
    if brownout != "off":
        router = opened.brownout
        assert isinstance(router, BrownoutExperts)
        st = router.stats  # read between steps
        assert st.original_pairs > 0
        assert (st.united_pairs > 0) == (brownout == "partial")
        assert (st.dropped_pairs > 0) == (brownout == "full")


def test_parts_share_one_expert_call_and_equal_separate_steps(adapter: HFMoEAdapter) -> None:
    from moefleet.models.kv import KVCache
    from moefleet.models.step import StepInput

    calls: list[int] = []
    inner = in_process_experts(adapter, "fused")

    def counting(layer: int, x_ND: torch.Tensor, ids_NK: torch.Tensor,
                 w_NK: torch.Tensor) -> torch.Tensor:
        calls.append(x_ND.shape[0])
        return inner(layer, x_ND, ids_NK, w_NK)

    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
    outs = []
    for together in (False, True):
        cache = KVCache(adapter.kv_layout(), num_blocks=16, block_size=4)
        for i in range(3):
            cache.alloc(i)
        adapter.forward_step(StepInput.from_lists([0], [prompts[0]], [0]), cache, inner)
        decode = StepInput.from_lists([0], [[3]], [4])
        prefill = StepInput.from_lists([1, 2], prompts[1:], [0, 0])
        calls.clear()
        if together:
            res = adapter.forward_steps([decode, prefill], cache, counting)
        else:
            res = [adapter.forward_step(s, cache, counting) for s in (decode, prefill)]
        outs.append(torch.cat([r.last_logits_BV for r in res]))
        # together: one expert call per MoE layer on all 1 + 2 + 6 real tokens
        assert calls == ([9] * len(adapter.moe_layers) if together
                         else [1] * len(adapter.moe_layers) + [8] * len(adapter.moe_layers))
    assert torch.allclose(outs[0], outs[1], atol=1e-5, rtol=0)
