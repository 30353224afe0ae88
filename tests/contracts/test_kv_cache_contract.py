"""The step + KV cache contract, over every decoder family (and tiny-moe-lm when built).

Prefill of part of each sequence, then cached steps of a few tokens (ragged: rows start,
advance and finish at different times) must give the logits of the model's own forward
on the whole sequences, fp32, within 1e-4. Encoders refuse a cache. Both attention paths
(``gather`` and ``paged``, eager FlexAttention here) are held to it, including blocks
reused after ``free`` and a sliding window.
"""

from __future__ import annotations

import pytest
import torch

from moefleet.models import MoEModelAdapter
from moefleet.models.attention import ATTENTION_PATHS, AttentionPath
from moefleet.models.hf import HFMoEAdapter
from moefleet.models.kv import KVCache, KVCacheError, KVCacheFull
from moefleet.models.step import StepInput
from moefleet.models.tiny import tiny_model
from tests.contracts.test_adapter_contract import DECODER_FAMILIES, tiny_bert_moe


@pytest.fixture(params=[*DECODER_FAMILIES, "tiny-moe-lm"], scope="module")
def decoder(request: pytest.FixtureRequest) -> MoEModelAdapter:
    if request.param == "tiny-moe-lm":
        from moefleet.models import zoo

        # checked at run time: the session fixture points the cache elsewhere
        if not zoo.is_built("tiny-moe-lm"):
            pytest.skip("tiny-moe-lm is not built in this cache (moefleet models build "
                        "tiny-moe-lm)")
        return zoo.load("tiny-moe-lm")
    return HFMoEAdapter(tiny_model(request.param, vocab_size=512, seed=3), name=request.param)


@pytest.fixture(params=ATTENTION_PATHS)
def attention(request: pytest.FixtureRequest) -> AttentionPath:
    return request.param


def _seqs(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, min(vocab, 500), (n,), generator=g).tolist() for n in (13, 4, 9)]


def test_prefill_then_cached_steps_equal_full_forward(decoder: MoEModelAdapter,
                                                      attention: AttentionPath) -> None:
    seqs = _seqs(decoder.vocab_size)
    full = [decoder.reference_forward(torch.tensor([s]))[0] for s in seqs]
    cache = KVCache(decoder.kv_layout(), num_blocks=32, block_size=4, attention=attention)
    for i in range(3):
        cache.alloc(i)
    pre = [6, 1, 3]
    out = decoder.forward_step(StepInput.from_lists(
        [0, 1, 2], [s[:p] for s, p in zip(seqs, pre, strict=True)], [0, 0, 0], logits="all"),
        cache)
    worst = max(float((out.all_logits[b] - full[b][: pre[b]]).abs().max())  # type: ignore[operator]
                for b in range(3))
    pos, chunk = list(pre), [3, 1, 2]  # ragged: chunks of several tokens and single tokens
    while any(p < len(s) for p, s in zip(pos, seqs, strict=True)):
        rows = [i for i in range(3) if pos[i] < len(seqs[i])]
        toks = [seqs[i][pos[i]: pos[i] + chunk[i]] for i in rows]
        o = decoder.forward_step(StepInput.from_lists(rows, toks, [pos[i] for i in rows]), cache)
        for r, i in enumerate(rows):
            pos[i] += len(toks[r])
            worst = max(worst, float((o.last_logits_BV[r] - full[i][pos[i] - 1]).abs().max()))
    assert worst <= 1e-4
    assert [cache.length(i) for i in range(3)] == [len(s) for s in seqs]


def test_expert_counts_cover_real_tokens_only(decoder: MoEModelAdapter) -> None:
    seqs = _seqs(decoder.vocab_size)
    step = StepInput.from_lists([0, 1, 2], seqs, [0, 0, 0])
    seen: list[int] = []
    local = decoder.local_expert_fn()

    def spy(layer, x_ND, ids_NK, w_NK):
        seen.append(x_ND.shape[0])
        return local(layer, x_ND, ids_NK, w_NK)

    out = decoder.forward_step(step, None, spy)
    real = sum(len(s) for s in seqs)
    assert seen == [real] * len(decoder.moe_layers)
    assert sorted(out.expert_counts) == decoder.moe_layers
    assert all(int(c.sum()) == real * decoder.top_k for c in out.expert_counts.values())


def test_free_returns_blocks_and_budget_is_never_exceeded(decoder: MoEModelAdapter,
                                                          attention: AttentionPath) -> None:
    layout = decoder.kv_layout()
    cache = KVCache.from_budget(layout, budget_bytes=layout.bytes_per_token * 8, block_size=4,
                                attention=attention)
    assert cache.num_blocks == 2 and cache.bytes_used == 0
    cache.alloc(0)
    decoder.forward_step(StepInput.from_lists([0], [[1, 2, 3, 4, 5]], [0]), cache)
    assert cache.num_free_blocks == 0 and cache.bytes_used <= cache.budget_bytes
    cache.alloc(1)
    with pytest.raises(KVCacheFull):
        decoder.forward_step(StepInput.from_lists([1], [[1]], [0]), cache)
    assert cache.length(1) == 0  # a refused step changes nothing
    cache.free(0)
    assert cache.num_free_blocks == 2 and 0 not in cache
    decoder.forward_step(StepInput.from_lists([1], [[1]], [0]), cache)
    assert cache.length(1) == 1


def _worst(decoder: MoEModelAdapter, cache: KVCache, rows: list[int], toks: list[list[int]],
           starts: list[int], full: dict[int, torch.Tensor]) -> float:
    """Run one step; the largest gap between its logits and the full forward's."""
    out = decoder.forward_step(StepInput.from_lists(rows, toks, starts, logits="all"), cache)
    return max(float((out.all_logits[r] - full[s][st: st + len(t)]).abs().max())  # type: ignore[operator]
               for r, (s, t, st) in enumerate(zip(rows, toks, starts, strict=True)))


def test_blocks_reused_after_free_equal_full_forward(decoder: MoEModelAdapter,
                                                     attention: AttentionPath) -> None:
    """Sequence 0 fills blocks 0-1 and is freed; sequence 1 then takes block 0 as its
    *second* block, where 0's stale tokens sit at positions before 1's queries (a mask
    that trusted positions alone would let them through), and a new sequence reusing id 0
    takes block 1. Every logit still equals the full forward."""
    g = torch.Generator().manual_seed(11)
    vocab = min(decoder.vocab_size, 500)
    a, b, c = (torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 7, 5))
    full = {0: decoder.reference_forward(torch.tensor([a]))[0],
            1: decoder.reference_forward(torch.tensor([b]))[0]}
    cache = KVCache(decoder.kv_layout(), num_blocks=4, block_size=4, attention=attention)
    cache.alloc(0)
    cache.alloc(1)
    worst = _worst(decoder, cache, [0, 1], [a, b[:4]], [0, 0], full)
    assert cache._tables[0] == [0, 1] and cache._tables[1] == [2]
    cache.free(0)
    worst = max(worst, _worst(decoder, cache, [1], [b[4:6]], [4], full))
    assert cache._tables[1] == [2, 0]  # the freed block 0 now holds positions 4-7 of seq 1
    if attention == "paged":  # 0's stale slots 2-3 of block 0 were cleared on reserve
        assert cache.slot_tag[2:4].tolist() == [-1, -1]
    cache.alloc(0)  # the id comes back: a new sequence, a new tag
    full[0] = decoder.reference_forward(torch.tensor([c]))[0]
    worst = max(worst, _worst(decoder, cache, [0, 1], [c[:3], b[6:]], [0, 6], full))
    worst = max(worst, _worst(decoder, cache, [0], [c[3:]], [3], full))
    assert worst <= 1e-4


def test_sliding_window_layers_match_full_forward(attention: AttentionPath) -> None:
    model = tiny_model("mixtral", vocab_size=512, seed=5)
    model.config.sliding_window = 3  # shorter than the sequences: the window matters
    decoder = HFMoEAdapter(model, name="mixtral-sw3")
    seqs = _seqs(decoder.vocab_size)[:2]
    full = {i: decoder.reference_forward(torch.tensor([s]))[0] for i, s in enumerate(seqs)}
    cache = KVCache(decoder.kv_layout(), num_blocks=16, block_size=4, attention=attention)
    cache.alloc(0)
    cache.alloc(1)
    worst = _worst(decoder, cache, [0, 1], [seqs[0][:5], seqs[1][:2]], [0, 0], full)
    worst = max(worst, _worst(decoder, cache, [0, 1], [seqs[0][5:8], seqs[1][2:4]], [5, 2],
                              full))
    worst = max(worst, _worst(decoder, cache, [0], [seqs[0][8:]], [8], full))
    assert worst <= 1e-4


def test_unknown_sequence_is_a_clear_error(decoder: MoEModelAdapter) -> None:
    cache = KVCache(decoder.kv_layout(), num_blocks=4)
    with pytest.raises(KVCacheError, match="sequence 5 has no cache"):
        decoder.forward_step(StepInput.from_lists([5], [[1]], [0]), cache)


def test_encoder_refuses_a_cache() -> None:
    bert = tiny_bert_moe()
    with pytest.raises(KVCacheError, match="encoder"):
        bert.kv_layout()
    layout = HFMoEAdapter(tiny_model("mixtral", vocab_size=512)).kv_layout()
    with pytest.raises(KVCacheError, match="encoder"):
        bert.forward_step(StepInput.from_lists([0], [[1, 2]], [0]), KVCache(layout, 4))
    # without a cache the encoder's step is its ordinary forward
    out = bert.forward_step(StepInput.from_lists([0], [[1, 2, 3]], [0], logits="all"))
    ref = bert.reference_forward(torch.tensor([[1, 2, 3]]))[0]
    assert torch.allclose(out.all_logits[0], ref, atol=1e-5)  # type: ignore[arg-type]
