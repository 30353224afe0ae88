"""Scheduler tests: no model, fabricated sampled tokens, a fake clock."""

from __future__ import annotations

import pytest

from moefleet.engine import EngineError, SamplingParams, Scheduler, SchedulerConfig
from moefleet.engine.scheduler import SchedulerOutput, Sequence
from moefleet.engine.stops import token_stop


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0)


def _advance(s: Scheduler, out: SchedulerOutput, sampled: dict[int, int]) -> list[Sequence]:
    """Update the scheduler and end what the engine's stop rule ends, as the engine does;
    returns the sequences that finished this step."""
    s.update(out, sampled)
    done = []
    for row in out.rows:
        seq = s.seqs.get(row.seq_id)
        if seq is None or not row.sample:
            continue
        reason = token_stop(seq.params, seq.output_ids[-1], len(seq.output_ids), None)
        if reason is not None:
            s.finish(seq.seq_id, reason)
            done.append(seq)
    return done


def _run(s: Scheduler, max_steps: int = 500) -> list[list[tuple[int, int, bool]]]:
    """Drive to completion; sampled token = 7 always. Returns each step's rows."""
    log = []
    for _ in range(max_steps):
        if not s.has_unfinished:
            return log
        out = s.schedule()
        assert out.num_tokens <= s.config.max_num_batched_tokens
        assert len(s.running) <= s.config.max_num_seqs
        assert s.free_blocks >= 0
        log.append([(r.seq_id, len(r.token_ids), r.sample) for r in out.rows])
        _advance(s, out, {r.seq_id: 7 for r in out.rows if r.sample})
    raise AssertionError("did not finish")


def test_fcfs_decode_one_token_each_and_prefill_first() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    for i in range(3):
        s.add(f"r{i}", [1] * (5 + i), _params(3), arrival=float(i))
    log = _run(s)
    assert log[0] == [(0, 5, True), (1, 6, True), (2, 7, True)]  # whole prompts, FCFS
    assert log[1] == [(0, 1, True), (1, 1, True), (2, 1, True)]  # then one token each
    assert len(log) == 3


def test_max_num_seqs_admits_later_requests_as_slots_free() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64))
    for i in range(3):
        s.add(f"r{i}", [1, 2], _params(2), arrival=0.0)
    log = _run(s)
    assert [r[0] for r in log[0]] == [0, 1]
    assert all(2 not in [r[0] for r in step] for step in log[:2])
    assert any(2 in [r[0] for r in step] for step in log[2:])


def test_chunked_prefill_respects_the_token_budget() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8))
    s.add("long", [1] * 20, _params(2), arrival=0.0)
    s.add("short", [1] * 3, _params(2), arrival=1.0)
    log = _run(s)
    assert log[0] == [(0, 8, False)]
    assert log[1] == [(0, 8, False)]
    assert log[2] == [(0, 4, True), (1, 3, True)]  # the rest, and the next request fits


def test_cache_exhaustion_preempts_the_newest_and_everything_completes() -> None:
    # 6 blocks of 4 tokens = 24 tokens; three requests of 4 prompt + 8 output tokens
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                  num_cache_blocks=6, block_size=4, max_model_len=64))
    seqs = [s.add(f"r{i}", [1, 2, 3, 4], _params(8), arrival=float(i)) for i in range(3)]
    preempted_steps = []
    for _ in range(200):
        if not s.has_unfinished:
            break
        out = s.schedule()
        if out.preempted:
            preempted_steps.append(list(out.preempted))
        assert s.free_blocks >= 0
        _advance(s, out, {r.seq_id: 7 for r in out.rows if r.sample})
    assert not s.has_unfinished
    assert preempted_steps and preempted_steps[0] == [2]  # the last admitted goes first
    assert s.num_preemptions >= 1
    assert all(len(q.output_ids) == 8 and q.finish_reason == "length" for q in seqs)
    assert s.free_blocks == 6


def test_recompute_after_preemption_covers_prompt_and_outputs() -> None:
    s = Scheduler(SchedulerConfig(num_cache_blocks=3, block_size=2, max_model_len=16,
                                  max_num_batched_tokens=32))
    a = s.add("a", [1, 2], _params(3), 0.0)
    b = s.add("b", [3, 4], _params(3), 0.0)
    out = s.schedule()
    _advance(s, out, {0: 9, 1: 9})
    out = s.schedule()  # both need a 2nd block, only one is free: b is preempted
    assert out.preempted == [b.seq_id] and [r.seq_id for r in out.rows] == [a.seq_id]
    _advance(s, out, {0: 9})
    recomputed = None
    for _ in range(10):
        out = s.schedule()
        rows = {r.seq_id: r for r in out.rows}
        if b.seq_id in rows:
            recomputed = rows[b.seq_id]
            break
        _advance(s, out, {r.seq_id: 9 for r in out.rows if r.sample})
    assert recomputed is not None
    assert recomputed.token_ids == [3, 4, 9] and recomputed.start == 0 and recomputed.sample


def test_finish_frees_blocks_at_once_and_is_idempotent() -> None:
    s = Scheduler(SchedulerConfig(num_cache_blocks=10, block_size=4))
    seq = s.add("a", [1] * 9, _params(4), 0.0)
    s.schedule()
    assert s.free_blocks == 7
    assert s.finish(seq.seq_id, "abort") is seq
    assert s.free_blocks == 10 and seq.finish_reason == "abort"
    assert s.finish(seq.seq_id, "abort") is None
    # an aborted waiting request leaves the queue
    w = s.add("w", [1], _params(1), 0.0)
    s.finish(w.seq_id, "abort")
    assert not s.waiting and not s.has_unfinished


def test_stop_token_ids_end_a_sequence() -> None:
    s = Scheduler(SchedulerConfig())
    s.add("a", [1], SamplingParams(max_tokens=10, stop_token_ids=(5,)), 0.0)
    out = s.schedule()
    assert _advance(s, out, {0: 4}) == []
    out = s.schedule()
    assert [q.request_id for q in _advance(s, out, {0: 5})] == ["a"]
    assert s.seqs.get(0) is None and not s.has_unfinished


@pytest.mark.parametrize(("prompt", "max_tokens", "match"), [
    ([], 1, "empty"),
    ([1] * 60, 10, "exceeds the model's context of 64"),
    ([1] * 20, 10, "can never fit the KV cache"),
])
def test_requests_that_cannot_run_are_refused(prompt: list[int], max_tokens: int,
                                              match: str) -> None:
    s = Scheduler(SchedulerConfig(num_cache_blocks=4, block_size=4, max_model_len=64))
    with pytest.raises(EngineError, match=match):
        s.add("x", prompt, _params(max_tokens), 0.0)
    assert not s.has_unfinished


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": -1}, {"temperature": -0.1}, {"temperature": float("nan")},
    {"top_p": 0.0}, {"top_p": 1.5}, {"stop": ("",)}, {"top_k": -1}, {"seed": -3},
])
def test_bad_sampling_params_name_the_value(kwargs: dict) -> None:
    name = next(iter(kwargs))
    with pytest.raises(EngineError, match=name):
        SamplingParams(**kwargs)


def test_rows_say_whether_they_compute_prompt_tokens() -> None:
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=4))
    s.add("a", [1] * 6, _params(3), 0.0)
    first = s.schedule()
    assert first.has_prefill and first.rows[0].prefill and not first.rows[0].sample
    s.update(first, {})
    second = s.schedule()  # the prompt's last 2 tokens: still prefill, and sampled
    assert second.rows[0].prefill and second.rows[0].sample
    s.update(second, {0: 7})
    third = s.schedule()
    assert not third.has_prefill and len(third.rows[0].token_ids) == 1
