"""United experts on every adapter family (tiny random models): distillation lowers the
MSE, brownout runs through forward_layerwise (shared experts untouched), the cache is
keyed and atomic, and mismatched united experts are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moefleet.brownout import distill as distill_mod
from moefleet.brownout.distill import DistillConfig, distill
from moefleet.brownout.groups import BrownoutError
from moefleet.brownout.united import entry_dir, load_entry
from moefleet.experts.brownout import BrownoutExperts
from moefleet.models import zoo
from tests.conftest import FAMILIES

CFG = DistillConfig(calib_tokens=256, seq_len=64, calib_source="wikitext2-raw-test",
                    max_pairs_per_expert=96, sim_tokens=64, max_epochs=6, patience=3,
                    lr=3e-3)


def _name(family: str) -> str:
    return f"tiny-{family.replace('_', '-')}-random"


@pytest.fixture(scope="module")
def adapters():
    return {f: zoo.load(_name(f)) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_distillation_lowers_error_and_brownout_runs_on_every_family(family, adapters) -> None:
    adapter = adapters[family]
    united = distill(adapter, 2, "index", CFG)
    for layer in united.report["layers"]:
        assert layer["rel_err"] <= layer["rel_err_init"]
    assert any(lay["rel_err"] < 0.98 * lay["rel_err_init"] for lay in united.report["layers"])
    gen = torch.Generator().manual_seed(0)
    ids_BT = torch.randint(0, adapter.vocab_size, (2, 24), generator=gen)
    inner = adapter.local_expert_fn()
    ref = adapter.forward_layerwise(ids_BT, expert_fn=inner)
    zero = adapter.forward_layerwise(ids_BT, expert_fn=BrownoutExperts(inner, united, 1.0))
    assert torch.equal(ref, zero)
    fn = BrownoutExperts(inner, united, 0.3)
    partial = adapter.forward_layerwise(ids_BT, expert_fn=fn)
    full = adapter.forward_layerwise(ids_BT, expert_fn=BrownoutExperts(inner, united, 0.3, "full"))
    assert torch.isfinite(partial).all() and not torch.allclose(partial, ref)
    assert fn.stats.united_pairs > 0
    # partial brownout stays closer to the model than dropping the same pairs
    assert (partial - ref).norm() < (full - ref).norm()


def test_similarity_grouping_cache_and_bad_inputs(adapters, monkeypatch) -> None:
    adapter = adapters["qwen2_moe"]
    united = distill(adapter, 4, "similarity", CFG)
    for layer, groups in united.grouping.groups.items():
        assert sorted(e for g in groups for e in g) == list(range(adapter.num_experts(layer)))
        assert all(len(g) == 4 for g in groups)
    # second call: served from the cache, no capture
    monkeypatch.setattr(distill_mod, "capture", lambda *a, **k: pytest.fail("recomputed"))
    again = distill(adapter, 4, "similarity", CFG)
    assert again.report == united.report
    monkeypatch.undo()
    path = entry_dir(adapter, 4, "similarity", distill_mod.dataclasses.asdict(CFG))
    with pytest.raises(BrownoutError, match="ways=4, not ways=8"):
        load_entry(path, adapter, ways=8)
    with pytest.raises(BrownoutError, match="built for model 'tiny-qwen2-moe-random'"):
        load_entry(path, adapters["mixtral"])
    with pytest.raises(BrownoutError, match="ways=9"):
        distill(adapter, 9, "index", CFG)
    with pytest.raises(BrownoutError, match="grouping 'random'"):
        distill(adapter, 2, "random", CFG)


def test_interrupted_distillation_leaves_no_cache_entry(adapters) -> None:
    adapter = adapters["mixtral"]
    cfg = DistillConfig(**{**distill_mod.dataclasses.asdict(CFG), "seed": 5})

    def stop(done: int, total: int, what: str) -> None:
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        distill(adapter, 2, "index", cfg, progress=stop)
    path = entry_dir(adapter, 2, "index", distill_mod.dataclasses.asdict(cfg))
    assert not path.exists()
    assert not [p for p in Path(path.parent).glob(".*")] if path.parent.exists() else True
