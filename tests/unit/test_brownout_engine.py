"""Brownout inside the engine: routing through the step loop, SALC moved by the hook."""

from __future__ import annotations

from moefleet.brownout.groups import Grouping, index_groups
from moefleet.brownout.salc import SALC
from moefleet.engine import Engine, InProcessRunner, SamplingParams
from moefleet.experts.brownout import BrownoutExperts
from moefleet.experts.brownout_hook import SALCHook
from moefleet.models.hf import HFMoEAdapter
from moefleet.models.tiny import tiny_model
from tests.engine_helpers import build_engine


def _engine(threshold: float, salc: SALC | None = None):
    adapter = HFMoEAdapter(tiny_model("mixtral", vocab_size=512, seed=5))
    grouping = Grouping(2, "index", {layer: index_groups(adapter.num_experts(layer), 2)
                                     for layer in adapter.moe_layers})
    experts = BrownoutExperts(adapter.local_expert_fn(), grouping, threshold, "full")
    hook = SALCHook(salc, experts) if salc else None
    runner = InProcessRunner(adapter, experts=experts)
    return Engine(runner, hooks=[hook] if hook else None), experts, hook


def test_zero_brownout_in_the_engine_equals_the_plain_engine() -> None:
    engine, experts, _ = _engine(1.0)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    got = engine.generate([[1, 2, 3], [7, 8]], params)
    plain = build_engine(HFMoEAdapter(tiny_model("mixtral", vocab_size=512, seed=5)))
    want = plain.generate([[1, 2, 3], [7, 8]], params)
    assert [o.new_token_ids for o in got] == [o.new_token_ids for o in want]
    assert experts.stats.calls > 0 and experts.stats.dropped_pairs == 0


def test_salc_hook_lowers_the_threshold_when_latency_breaks_the_slo() -> None:
    clock = iter(float(i) for i in range(100_000))  # every reading 1 s later: all slow
    salc = SALC(slo_ttft_s=0.5, slo_tpot_s=0.5, window_s=100.0, interval_s=0.0)
    engine, experts, hook = _engine(1.0, salc)
    engine.clock = lambda: next(clock)
    engine.generate([[1, 2, 3]] * 3, SamplingParams(max_tokens=6, ignore_eos=True))
    assert hook is not None and hook.trace
    kinds = {k for _, k, _ in hook.trace}
    assert kinds == {"prefill", "decode"}
    assert hook.trace[-1][2] < 1.0 and experts.threshold < 1.0
    assert experts.stats.dropped_pairs > 0  # full brownout dropped rare experts' pairs

