"""The paged attention path (``models.paged``): no gather, same tokens, a checked option.

Exactness over every decoder family lives in the KV contract suite
(``tests/contracts/test_kv_cache_contract.py``, parametrized over both paths); here: that
paged ``update`` hands back the pools themselves, that an engine generates the same greedy
tokens on both paths, and how the option is chosen and refused.
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from moefleet.cli import app
from moefleet.compose import EngineOptions, StackOptions
from moefleet.compose.root import in_process_engine
from moefleet.engine import SamplingParams
from moefleet.errors import MoefleetError
from moefleet.models.attention import resolve_attention
from moefleet.models.hf import HFMoEAdapter
from moefleet.models.kv import KVCache, KVCacheError, KVLayout
from moefleet.models.step import StepInput
from moefleet.models.tiny import tiny_model
from tests.engine_helpers import decode_step_reads


def _step_view(cache: KVCache, new: list[int]):
    """A view of one step of fresh sequences 0..len(new)-1, its valid mask set."""
    ids = list(range(len(new)))
    for s in ids:
        cache.alloc(s)
    view = cache.view(ids, new)
    step = StepInput.from_lists(ids, [[1] * n for n in new], [0] * len(new))
    view.set_valid(step.valid_BT, step.valid_index())
    return view, step


def test_paged_update_returns_the_pools_not_a_copy() -> None:
    layout = KVLayout((((2, 8), (2, 6)),), torch.float32)  # one layer, Dv != Dk
    cache = KVCache(layout, num_blocks=5, block_size=4, attention="paged")
    view, step = _step_view(cache, [3, 6])
    B, T = step.input_ids_BT.shape
    k_BHTC, v_BHTC = torch.randn(B, 2, T, 8), torch.randn(B, 2, T, 6)
    k, v = view.update(k_BHTC, v_BHTC, 0)
    pool_k, pool_v = cache._pools[0]
    assert k.shape == (1, 2, 5 * 4, 8) and v.shape == (1, 2, 5 * 4, 6)
    assert k.untyped_storage().data_ptr() == pool_k.untyped_storage().data_ptr()
    assert v.untyped_storage().data_ptr() == pool_v.untyped_storage().data_ptr()
    # the tokens landed in their blocks: row 1's 5th token is block table[1][1], offset 0
    blk = cache._tables[1][1]
    assert torch.equal(k[0, :, blk * 4], k_BHTC[1, :, 4])
    # and the slots know whose they are: row 0 wrote 3 slots, row 1 six, nothing else
    assert int((cache.slot_tag >= 0).sum()) == 9
    gather = KVCache(layout, num_blocks=5, block_size=4)  # the default path copies
    gv, _ = _step_view(gather, [3, 6])
    gk, _ = gv.update(k_BHTC, v_BHTC, 0)
    assert gk.untyped_storage().data_ptr() != gather._pools[0][0].untyped_storage().data_ptr()


def test_a_real_forward_attends_over_the_pools() -> None:
    """During a model's paged step every layer's attention receives pool views."""
    adapter = HFMoEAdapter(tiny_model("mixtral", vocab_size=512, seed=3))
    cache = KVCache(adapter.kv_layout(), num_blocks=6, block_size=4, attention="paged")
    cache.alloc(0)
    seen: list[bool] = []
    original = type(cache.view([0], [0])).update

    def spy(self, a, b, layer_idx, *args, **kw):
        out = original(self, a, b, layer_idx, *args, **kw)
        pool = cache._pools[layer_idx][0]
        seen.append(out[0].untyped_storage().data_ptr() == pool.untyped_storage().data_ptr())
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("moefleet.models.kv.StepCacheView.update", spy)
        adapter.forward_step(StepInput.from_lists([0], [[1, 2, 3, 4, 5]], [0]), cache)
    assert seen == [True] * adapter.num_layers


def test_engine_greedy_tokens_are_the_same_on_both_paths() -> None:
    prompts = [[5, 9, 2, 7, 1, 3], [8, 4], [6, 6, 1, 2, 9, 9, 9, 4, 2]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = {}
    for attention in ("gather", "paged"):
        adapter = HFMoEAdapter(tiny_model("qwen2_moe", vocab_size=128, seed=4))
        # a small cache: the paged path scans all of it on the CPU; blocks get reused
        opened = in_process_engine(adapter, attention=attention, block_size=4,
                                   kv_budget_bytes=adapter.kv_layout().bytes_per_token * 48,
                                   eos_token_id=-1)
        assert opened.runner.cache.attention == attention  # type: ignore[attr-defined]
        outs = opened.engine.generate(prompts, params)
        tokens[attention] = [o.new_token_ids for o in outs]
    assert tokens["paged"] == tokens["gather"]
    assert all(len(t) == 6 for t in tokens["paged"])


def test_a_paged_decode_step_reads_the_host_no_more_than_gather() -> None:
    """The block masks are built from host-known sizes: a decode step still makes only
    the runner's two reads (the step's statistics, the sampled tokens), also after other
    models (other softmax scales) ran paged in this process: the scale is folded into
    the query, so dynamo never makes it a value it reads back."""
    adapter = HFMoEAdapter(tiny_model("mixtral", vocab_size=128, seed=1))
    opened = in_process_engine(adapter, stack=StackOptions(kernel="fused"), attention="paged",
                               block_size=4,
                               kv_budget_bytes=adapter.kv_layout().bytes_per_token * 64)
    counters = decode_step_reads(opened.engine, requests=4, max_tokens=4)
    reads = [c.count for c in counters]
    assert reads and max(reads) <= 2, (reads, [(c.by_name, c.where) for c in counters])


def test_auto_is_paged_on_cuda_only_and_never_for_latent_caches() -> None:
    assert resolve_attention("auto", "cpu") == "gather"
    assert resolve_attention("auto", "cuda") == "paged"
    assert resolve_attention("auto", "cuda", latent_cache=True) == "gather"
    assert resolve_attention("paged", "cpu") == "paged"
    assert HFMoEAdapter(tiny_model("deepseek_v2", vocab_size=128)).latent_cache


def test_unknown_attention_is_refused_everywhere() -> None:
    with pytest.raises(MoefleetError, match=r"unknown attention 'flash'.*gather, paged, auto"):
        EngineOptions(attention="flash")
    with pytest.raises(KVCacheError, match="unknown attention path"):
        KVCache(KVLayout((((1, 2), (1, 2)),), torch.float32), 2, attention="auto")  # type: ignore[arg-type]
    r = CliRunner().invoke(app, ["generate", "-m", "tiny-mixtral-random", "--prompt", "x",
                                 "--attention", "flash"])
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert "unknown --attention 'flash'" in r.stderr and "gather, paged, auto" in r.stderr


def test_the_paged_path_is_not_imported_until_a_paged_step_runs() -> None:
    """FlexAttention's import adds ~45 MB to every process that loads a model, and so to
    every function's runtime footprint (it raised plan memory floors once)."""
    import subprocess
    import sys

    code = ("import sys, moefleet.models.hf, moefleet.compose; "
            "print('moefleet.models.paged' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_compiled_paged_attention_sees_a_bounded_set_of_shapes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo compiles the CUDA kernel again for every new shape it is handed, and after
    8 it falls back to eager, which scans the whole pool (on an H100 that failed whole
    engine runs). Compiled here with dynamo's eager backend (the same guards, no
    kernel): sequences that grow over many blocks, batches of 1 to 16 rows, prefill and
    decode together make at most 4 graphs (one row or several, times one query token or
    several). Measured the same way: a step under a ``TorchFunctionMode`` (the benchmark's
    host-read counter) compiles each of them again, 8 in all, the limit."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention

    import moefleet.models.paged as paged

    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, backend="eager")
    monkeypatch.setattr(paged, "_flex_for", lambda device: compiled)
    adapter = HFMoEAdapter(tiny_model("olmoe", vocab_size=128, seed=1))
    engine = in_process_engine(adapter, stack=StackOptions(kernel="fused"), attention="paged",
                               block_size=4, max_num_seqs=16, max_num_batched_tokens=64,
                               kv_budget_bytes=adapter.kv_layout().bytes_per_token * 1024,
                               max_model_len=96).engine
    before = counters["stats"]["unique_graphs"]
    for i in range(24):  # prompts of 3-31 tokens, 2-10 new: table widths 1 to 11 blocks
        engine.add_request([1 + i % 50] * (3 + i % 29),
                           SamplingParams(max_tokens=2 + i % 9, temperature=0,
                                          ignore_eos=True))
    errors = []
    while engine.has_unfinished:
        errors += [o.error for o in engine.step() if o.error]
    assert not errors
    assert counters["stats"]["unique_graphs"] - before <= 4
