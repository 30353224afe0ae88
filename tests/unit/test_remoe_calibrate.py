"""``moefleet.calibration.remoe`` by hand: per-part times from fabricated steps and records,
slot counts from reply sizes, and the calibrated problem the planner and simulator get."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moefleet.calibration.remoe import (
    RemoeCalibration,
    StepTiming,
    calibrate,
    calibrate_in_process,
    calibrate_runtime,
    calibrated_problem,
    cpu_calibrated,
    held_factors,
    metered_prices,
    record_slots,
)
from moefleet.errors import MoefleetError
from moefleet.plan.remoe.shapes import Timing, model_dims, problem_for
from moefleet.platform import InvocationRecord, load_platform
from moefleet.runtime.local import LocalBackend
from moefleet.runtime.payload import pack

L, K, D = 2, 2, 16


def test_in_process_times_by_hand() -> None:
    steps = [StepTiming(True, 10, 0.100, 0.030),  # 0.07 s non-expert over 2 layers x 10
             StepTiming(True, 30, 0.200, 0.050),
             StepTiming(False, 1, 0.010, 0.004), StepTiming(False, 1, 0.012, 0.004),
             StepTiming(False, 1, 0.050, 0.004)]  # a slow outlier: medians ignore it
    cal = calibrate_in_process(steps, L, K)
    assert cal.nonexpert_decode_s == pytest.approx(0.008 / L)  # median of 6, 8, 46 ms
    assert cal.expert_token_s == pytest.approx(0.004 / (L * K))
    # prefill: totals over totals (0.22 s non-expert over 2 x 40 tokens; 0.08 s of
    # experts over 2 x 2 x 40 slots = 0.5 ms a slot, half a decode slot's)
    assert cal.nonexpert_prefill_token_s == pytest.approx(0.22 / (L * 40))
    assert cal.prefill_factor == pytest.approx(0.5)
    with pytest.raises(MoefleetError, match="prefill and decode"):
        calibrate_in_process(steps[2:], L, K)


def _record(slots: int, seconds: float) -> InvocationRecord:
    n = len(pack({"y": torch.zeros(slots, D)}))
    return InvocationRecord(function="g", kind="expert", memory_mb=1024, start_s=0.0,
                            end_s=seconds, layer=0, bytes_out=n)


def test_record_slots_reads_the_reply_size() -> None:
    for n in (0, 1, 2, 7, 300):
        assert record_slots(_record(n, 0.0), D) == n
    with pytest.raises(MoefleetError, match="no packet"):
        record_slots(InvocationRecord(function="g", kind="expert", memory_mb=1024,
                                      start_s=0.0, end_s=1.0, bytes_out=5), D)


def test_remote_call_times_by_hand() -> None:
    base = RemoeCalibration(nonexpert_decode_s=0.002, nonexpert_prefill_token_s=1e-4,
                            expert_token_s=0.001, prefill_factor=0.5)
    h0, w = 0.003, 0.0002
    dec = [_record(K, h0 + K * (0.001 + w)) for _ in range(3)]
    pre = [_record(40, h0 + 40 * (0.0005 + w))]
    tpot = L * (0.002 + 0.004 + K * (0.001 + w))  # round trip 4 ms per layer
    run = {"results": [SimpleNamespace(tpot_s=tpot)], "remote_records": dec + pre,
           "cold": {"main_init_s": 0.5, "remote_init_s": 0.2}}
    cal = calibrate(base, run, num_layers=L, top_k=K, hidden=D)
    assert cal.slot_wire_s == pytest.approx(w)
    assert cal.handler_fixed_s == pytest.approx(h0)
    assert cal.call_overhead_s == pytest.approx(0.004)
    assert cal.main_init_s == 0.5 and cal.remote_init_s == 0.2
    with pytest.raises(MoefleetError, match="no decode call"):
        calibrate(base, {**run, "remote_records": pre}, num_layers=L, top_k=K, hidden=D)


def test_calibrated_problem_and_metered_prices() -> None:
    spec = load_platform("alibaba-fc-gpu")
    dims = model_dims("gpt2-moe")
    s = np.full((dims.moe_layers, dims.experts), 1 / dims.experts)
    p = problem_for(dims, Timing(1e9, 1e9), spec, s, n_in=8, n_out=4, ttft_slo_s=30,
                    tpot_slo_s=1)
    cal = RemoeCalibration(0.002, 1e-4, 0.001, 0.5, call_overhead_s=0.004,
                           slot_wire_s=0.0002)
    q = metered_prices(calibrated_problem(p, cal), spec)
    assert q.expert_s(1.0) == q.expert_s(4.0) == pytest.approx(0.001)  # one thread
    assert q.invoke_overhead_s == 0.004 and q.nonexpert_token_s == 0.002
    assert 2 * q.token_bytes / q.transfer_bytes_s == pytest.approx(0.0002)
    # the meter: 1024 MB get 0.5 vCPU on alibaba-fc-gpu (2048 MB per vCPU)
    assert q.cpu_price_gb_s == pytest.approx(spec.prices.per_gb_s
                                             + 0.5 * spec.prices.per_vcpu_s)
    # the planner takes the platform's vCPU rule too (it assumed 1 GB = 1 vCPU before)
    assert p.cpu_price_gb_s == pytest.approx(q.cpu_price_gb_s)
    assert p.law.gb_per_vcpu == pytest.approx(2.0)


def test_cpu_calibrated_takes_the_engines_cpu_times_and_keeps_the_platform() -> None:
    """compare --measure's calibration: the engine's measured CPU times replace the
    FLOP-scaled ones; the vCPU rule, the platform's invoke and wire times and the GPU
    roofline stay (the local runtime's are added, not substituted)."""
    from moefleet.plan.remoe import plan_policy
    from moefleet.plan.remoe.model import main_times

    spec = load_platform("aws-lambda")
    dims = model_dims("gpt2-moe")
    s = np.full((dims.moe_layers, dims.experts), 1 / dims.experts)
    p = problem_for(dims, Timing(1e9, 4e9), spec, s, n_in=8, n_out=4, ttft_slo_s=30,
                    tpot_slo_s=1, gpu=False)
    cal = RemoeCalibration(0.002, 3e-4, 0.001, 0.25, call_overhead_s=0.004,
                           slot_wire_s=0.0002)
    q = cpu_calibrated(p, cal)
    g = p.law.gb_per_vcpu
    assert q.law.gb_per_vcpu == g and q.law.one_vcpu_s == pytest.approx(0.001)
    assert q.law(4 * g) / q.law(g) == pytest.approx(p.law(4 * g) / p.law(g))  # its shape
    assert q.law(g / 2) == pytest.approx(0.002)  # half a vCPU: twice as long
    assert q.invoke_overhead_s == pytest.approx(p.invoke_overhead_s + 0.004)
    wire = 2 * q.token_bytes / q.transfer_bytes_s
    assert wire == pytest.approx(2 * p.token_bytes / p.transfer_bytes_s + 0.0002)
    assert (q.nonexpert_token_s, q.gpu_expert_token_s) == (p.nonexpert_token_s,
                                                           p.gpu_expert_token_s)
    assert q.prefill_factor == 0.25 and q.nonexpert_cpu_token_s == 0.002
    lay = plan_policy(q, "cpu", check_slo=False).layout
    m = main_times(q, lay)
    speed = q.expert_s(q.gb(lay.main_mb)) / q.law.one_vcpu_s
    assert m.f_dec == pytest.approx(0.002 * speed)
    assert m.f_pre == pytest.approx(8 * 3e-4 * speed)  # the measured prompt time
    # uncalibrated, a prompt token is a decode token x prefill_factor (the default -1)
    m0 = main_times(p, lay)
    assert m0.f_pre == pytest.approx(8 * m0.f_dec * p.prefill_factor)
    with pytest.raises(MoefleetError, match="nonexpert_cpu_prefill_token_s"):
        dataclasses.replace(p, nonexpert_cpu_prefill_token_s=-0.5)


def test_calibrate_runtime_needs_a_round() -> None:
    shape = SimpleNamespace(moe_layers=[0], top_k=2)
    adapter = SimpleNamespace(summary=lambda: shape)
    with pytest.raises(MoefleetError, match="rounds must be >= 1"):
        calibrate_runtime(adapter, [[1, 2]], platform=None, store=None, max_tokens=2,
                          rounds=0)
    with pytest.raises(MoefleetError, match="held shares must be in"):
        calibrate_runtime(adapter, [[1, 2]], platform=None, store=None, max_tokens=2,
                          held_shares=(0.5, 1.0))


def _step(prefill: bool, cpu: float) -> StepTiming:
    return StepTiming(prefill, 8 if prefill else 1, cpu, 0.0, cpu)


def test_held_factors_by_hand() -> None:
    """Decode: the held steps' median CPU over the unheld one's; prefill: totals over
    totals; never below 1 (a held step cheaper than an unheld one is noise)."""
    base = [_step(True, 0.010), _step(True, 0.030),
            _step(False, 0.004), _step(False, 0.005), _step(False, 0.040)]
    held = [_step(True, 0.012), _step(True, 0.036),
            _step(False, 0.006), _step(False, 0.0075), _step(False, 0.0075)]
    dec, pre = held_factors(base, held)
    assert dec == pytest.approx(1.5) and pre == pytest.approx(1.2)
    assert held_factors(held, base) == (1.0, 1.0)
    with pytest.raises(MoefleetError, match="prefill and decode"):
        held_factors(base, held[2:])


def test_the_main_pays_the_held_factors_below_one_vcpu() -> None:
    """cpu_calibrated hands the measured factors to the problem; a CPU main's non-experts
    and local experts cost them at its share (interpolated, the lowest share's below
    it, 1 from one vCPU); a bad point is refused."""
    from moefleet.plan.remoe import plan_policy
    from moefleet.plan.remoe.model import main_times

    spec = load_platform("aws-lambda")
    dims = model_dims("gpt2-moe")
    s = np.full((dims.moe_layers, dims.experts), 1 / dims.experts)
    p = problem_for(dims, Timing(1e9, 4e9), spec, s, n_in=8, n_out=4, ttft_slo_s=30,
                    tpot_slo_s=1, gpu=False)
    held = ((0.25, 1.5, 1.2), (0.5, 1.25, 1.1))
    cal = RemoeCalibration(0.002, 3e-4, 0.001, 0.25, held=held)
    q = cpu_calibrated(p, cal)
    assert q.main_held == held
    assert q.held_factors(0.1) == (1.5, 1.2)  # below the lowest share: its factors
    assert q.held_factors(0.375) == pytest.approx((1.375, 1.15))
    assert q.held_factors(0.75) == pytest.approx((1.125, 1.05))  # towards 1 at one vCPU
    assert q.held_factors(1.0) == q.held_factors(2.0) == (1.0, 1.0)
    assert cpu_calibrated(p, dataclasses.replace(cal, held=())).held_factors(0.1) == (1, 1)
    lay = plan_policy(q, "cpu", check_slo=False).layout
    share = q.gb(lay.main_mb) / q.law.gb_per_vcpu
    assert share < 1
    hd, hp = q.held_factors(share)
    m, m1 = main_times(q, lay), main_times(dataclasses.replace(q, main_held=()), lay)
    assert m.f_dec == pytest.approx(m1.f_dec * hd)
    assert m.t_loc == pytest.approx(m1.t_loc * hd)
    assert m.f_pre == pytest.approx(m1.f_pre * hp)
    assert m.t_loc_pre == pytest.approx(m1.t_loc_pre * hp)
    for bad in (((0.5, 1.2, 1.1), (0.25, 1.5, 1.2)), ((1.0, 1.2, 1.1),),
                ((0.5, 0.9, 1.0),), ((0.5, 1.2),)):
        with pytest.raises(MoefleetError, match="main_held"):
            dataclasses.replace(q, main_held=bad)


def test_local_backend_refuses_a_zero_thread_cap() -> None:
    with pytest.raises(ValueError, match="max_threads"):
        LocalBackend("aws-lambda", max_threads=0)


def test_record_passes_holds_each_step_to_the_share() -> None:
    """Held to a quarter of a core, every step lasts at least its CPU time x 4 (the
    shortfall slept after it), and the greedy tokens are the unheld run's."""
    import time

    from moefleet.calibration.remoe import record_passes
    from moefleet.models.hf import HFMoEAdapter
    from moefleet.models.tiny import tiny_model

    a = HFMoEAdapter(tiny_model("mixtral"))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    _, free, tokens = record_passes(a, prompts, 3)
    t0 = time.perf_counter()
    _, held, held_tokens = record_passes(a, prompts, 3, hold_vcpus=0.25)
    wall = time.perf_counter() - t0
    assert held_tokens == tokens and len(held) == len(free)
    assert all(s.cpu_s > 0 for s in held)
    assert wall >= 0.95 * sum(s.cpu_s for s in held) / 0.25
