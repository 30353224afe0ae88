"""The CUDA paths of the engine, brownout routing and Remoe's split layer loop.

Skipped where torch sees no CUDA GPU (CI has none); run on a GPU machine with
``python -m pytest tests/gpu``. Each test runs the same work on the CPU and on CUDA and
asks for the same greedy tokens: fp32 on both (TF32 off, torch's default for matmuls),
so only summation order differs, far below these random models' top-2 logit gaps.
"""

from __future__ import annotations

import copy

import pytest
import torch

from moefleet.brownout.groups import Grouping, index_groups
from moefleet.brownout.united import UnitedExperts
from moefleet.engine import Engine, SamplingParams
from moefleet.experts.brownout import BrownoutExperts
from moefleet.experts.kernels import in_process_experts
from moefleet.experts.split import SplitExperts, held_experts
from moefleet.models.hf import HFMoEAdapter
from moefleet.models.tiny import small_mixtral, tiny_model
from moefleet.runtime.main_model import place_non_experts
from tests.engine_helpers import build_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[1, 2, 3, 4], [7, 8], [5, 9, 11, 13, 17, 19]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _tokens(engine: Engine) -> list[list[int]]:
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.error for o in outs] == [None] * len(PROMPTS)
    return [o.new_token_ids for o in outs]


def _adapter() -> HFMoEAdapter:
    return HFMoEAdapter(tiny_model("mixtral", vocab_size=512, seed=5))


@pytest.mark.parametrize("kernel", ["loop", "stacked", "fused"])
def test_engine_on_cuda_gives_the_cpu_tokens(kernel: str) -> None:
    want = _tokens(build_engine(_adapter(), kernel="loop"))
    adapter = _adapter()
    got = _tokens(build_engine(adapter, device="cuda", kernel=kernel))  # type: ignore[arg-type]
    assert adapter.device.type == "cuda"
    assert got == want


def test_sampling_with_a_seed_is_device_independent() -> None:
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=11,
                            ignore_eos=True)
    cpu = build_engine(_adapter()).generate(PROMPTS, params)
    gpu = build_engine(_adapter(), device="cuda").generate(PROMPTS, params)
    assert [o.new_token_ids for o in gpu] == [o.new_token_ids for o in cpu]


def _united(adapter: HFMoEAdapter, ways: int) -> UnitedExperts:
    """United experts that copy each group's first member (no distillation needed: this
    checks where tensors live, not how good the united experts are)."""
    groups = {layer: index_groups(adapter.num_experts(layer), ways)
              for layer in adapter.moe_layers}
    modules = {layer: [copy.deepcopy(adapter.expert(layer, g[0])).eval() for g in gs]
               for layer, gs in groups.items()}
    return UnitedExperts("tiny", "test", Grouping(ways, "index", groups), modules)


@pytest.mark.parametrize(("threshold", "kernel"), [(1.0, "loop"), (0.5, "loop"),
                                                 (0.0, "loop"), (0.5, "stacked")])
def test_partial_brownout_on_cuda_gives_the_cpu_tokens(threshold: float, kernel: str) -> None:
    def run(device: str) -> tuple[list[list[int]], BrownoutExperts]:
        adapter = _adapter()
        adapter.model.to(device)
        experts = BrownoutExperts(in_process_experts(adapter, kernel),  # type: ignore[arg-type]
                                  _united(adapter, 2), threshold, "partial",
                                  united_kernel=kernel)
        return _tokens(build_engine(adapter, device=device, experts=experts)), experts

    want, cpu = run("cpu")
    got, gpu = run("cuda")
    assert got == want
    assert (gpu.stats.united_pairs > 0) == (threshold < 1.0)
    assert gpu.stats.united_pairs == cpu.stats.united_pairs


def test_brownout_engine_moves_the_model_before_building_experts() -> None:
    from moefleet.compose import StackOptions
    from moefleet.compose.root import in_process_engine
    from moefleet.experts.brownout_control import BrownoutSpec

    adapter = _adapter()
    opened = in_process_engine(adapter, device="cuda", stack=StackOptions(
        kernel="stacked", brownout=BrownoutSpec(ways=2, threshold=0.0, mode="full")))
    experts = opened.brownout
    assert adapter.device.type == "cuda" and experts is not None
    outs = opened.engine.generate(PROMPTS, GREEDY)
    assert all(len(o.new_token_ids) == GREEDY.max_tokens for o in outs)
    assert experts.stats.dropped_pairs > 0


def test_remoe_split_layer_loop_on_cuda_with_experts_on_the_cpu() -> None:
    """Remoe's main: non-experts (and the KV cache) on CUDA, routed experts in host
    memory, half of each layer's experts behind a second ExpertFn; tokens as on the CPU."""
    want = _tokens(build_engine(HFMoEAdapter(small_mixtral())))
    adapter = HFMoEAdapter(small_mixtral())
    place_non_experts(adapter, torch.device("cuda"))
    inner = held_experts({layer: {e: adapter.expert_view(layer, e)
                                  for e in range(adapter.num_experts(layer))}
                          for layer in adapter.moe_layers})
    is_local = {layer: torch.arange(adapter.num_experts(layer)) % 2 == 0
                for layer in adapter.moe_layers}
    seen: list[torch.device] = []

    def remote(layer: int, x_ND: torch.Tensor, ids_NK: torch.Tensor,
               w_NK: torch.Tensor) -> torch.Tensor:
        seen.append(x_ND.device)
        return inner(layer, x_ND, ids_NK, w_NK)

    split = SplitExperts(inner, remote, is_local, expert_device="cpu")
    got = _tokens(build_engine(adapter, experts=split))
    assert adapter.device.type == "cuda"
    assert seen and {d.type for d in seen} == {"cpu"}
    assert got == want

