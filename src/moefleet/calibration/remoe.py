"""Measure what a Remoe deployment's parts cost on this runtime, and hand the numbers to
the planner and the simulator (:class:`RemoeCalibration`, :func:`calibrated_problem`).

Two measurements, neither of them the run they are later compared with:

1. :func:`record_passes` runs the model in this process, one request at a time, with the
   main function's own expert code (``held_experts``, one expert after another): per
   engine step (a :class:`~moefleet.sim.remoe.Pass`) the routed slots per layer and
   expert, the step's wall time and the part spent in experts. The non-expert time per
   layer (attention, norms, gate, plus the step's share of embedding, LM head, sampling
   and scheduling) is the rest; a local expert's time is per routed slot.
2. :func:`measure_plan` deploys a plan on a backend, warms every function, sends each
   request in its own main invocation and returns the main function's TTFT/TPOT per
   request and every invocation record (nested remote calls included). Run on an
   all-remote plan, :func:`calibrate` reads a nested call's overhead from it: a decode
   step of such a plan is, per layer, non-experts + one call (round trip + K slots).

Every time is a median (a shared machine's slow outliers are other processes' slices).
The model is linear per slot; a nested call's round trip and its handler's fixed time
are constants. The main function of a GPU plan runs on this CPU ("GPU emulated"), so the
calibrated problem gives its "GPU" non-expert and expert times the CPU's measured ones.
Units: seconds.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from moefleet.errors import MoefleetError
from moefleet.sim.remoe import Pass

FOLDED = 1e15  # a rate whose time is already inside a measured constant (bytes/s)


@dataclass
class StepTiming:
    """One in-process engine step: tokens, wall seconds, seconds inside experts, and the
    stepping thread's CPU seconds (a held step's wall time includes its hold; its CPU
    does not)."""

    prefill: bool
    tokens: int
    wall_s: float
    expert_s: float
    cpu_s: float = 0.0


@dataclass(frozen=True)
class RemoeCalibration:
    """Per-part times of this runtime (see the module docstring)."""

    nonexpert_decode_s: float  # one layer, one decode token
    nonexpert_prefill_token_s: float  # one layer, one prompt token
    expert_token_s: float  # one routed slot of a local expert, decode
    prefill_factor: float  # a prompt slot's expert time / a decode slot's (<= 1)
    call_overhead_s: float = 0.0  # a nested call as the main waits on it, beyond its compute
    handler_fixed_s: float = 0.0  # of which the remote handler is billed for
    slot_wire_s: float = 0.0  # per slot sent to a remote function, beyond its compute
    main_init_s: float = 0.0
    remote_init_s: float = 0.0
    # (vCPU share, decode factor, prefill factor): a step's CPU time held to that share
    # over the unheld one's (:func:`held_factors`; RemoeProblem.main_held)
    held: tuple[tuple[float, float, float], ...] = ()
    source: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def record_passes(adapter: Any, prompts: list[list[int]], max_tokens: int, *,
                  hold_vcpus: float | None = None
                  ) -> tuple[list[list[Pass]], list[StepTiming], list[list[int]]]:
    """Each prompt alone through the engine (greedy, ``max_tokens`` tokens, no EOS), every
    expert run by the main function's per-expert loop. Returns per request its passes,
    every step's timing, and the greedy tokens. The first prompt runs once untimed
    before (a process's first steps pay one-off allocations: measured 2x slower).
    ``hold_vcpus`` (< 1) holds every step to that share of a core as a measured run's
    main is held (:class:`~moefleet.compose.held_share.ShareHeldRunner`: the shortfall
    slept after the step), so the next step starts after the same pause."""
    from moefleet.compose import StackOptions
    from moefleet.compose.root import in_process_engine
    from moefleet.engine.request import SamplingParams
    from moefleet.experts.split import held_experts
    from moefleet.runtime.local_limits import hold_to_share

    layers = list(adapter.moe_layers)
    E = adapter.num_experts(layers[0])
    held = held_experts({layer: {e: adapter.expert(layer, e) for e in range(E)}
                         for layer in layers})
    counts_LE = np.zeros((len(layers), E), np.int64)
    clock: dict[str, float] = {"expert": 0.0, "tokens": 0}

    def timed(layer: int, x_ND: torch.Tensor, ids_NK: torch.Tensor,
              w_NK: torch.Tensor) -> torch.Tensor:
        li = layers.index(layer)
        ids = ids_NK.reshape(-1).numpy()
        counts_LE[li] += np.bincount(ids[ids >= 0], minlength=E)
        clock["tokens"] = int(x_ND.shape[0])
        t0 = time.perf_counter()
        y = held(layer, x_ND, ids_NK, w_NK)
        clock["expert"] += time.perf_counter() - t0
        return y

    stack = StackOptions(local=timed, retry=None)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    passes: list[list[Pass]] = []
    steps: list[StepTiming] = []
    tokens: list[list[int]] = []
    with torch.no_grad():
        warm = in_process_engine(adapter, stack=stack, max_num_seqs=1).engine
        warm.generate([list(prompts[0])], params)
        for prompt in prompts:
            engine = in_process_engine(adapter, stack=stack, max_num_seqs=1).engine
            engine.add_request(list(prompt), params)
            mine: list[Pass] = []
            out: list[int] = []
            while engine.has_unfinished:
                counts_LE[:] = 0
                clock["expert"] = 0.0
                prefill = not out
                cpu0, t0 = time.thread_time(), time.perf_counter()
                for o in engine.step():
                    out.extend(o.new_token_ids)
                wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
                mine.append(Pass(prefill, int(clock["tokens"]), counts_LE.copy()))
                steps.append(StepTiming(prefill, int(clock["tokens"]), wall, clock["expert"],
                                        cpu))
                if hold_vcpus is not None:
                    hold_to_share(cpu, wall, hold_vcpus)
            passes.append(mine)
            tokens.append(out)
    return passes, steps, tokens


def calibrate_in_process(steps: list[StepTiming], num_layers: int, top_k: int
                         ) -> RemoeCalibration:
    """Non-expert and local-expert times from :func:`record_passes`' steps (medians)."""
    dec = [s for s in steps if not s.prefill]
    pre = [s for s in steps if s.prefill]
    if not dec or not pre:
        raise MoefleetError("calibration needs prefill and decode steps",
                            "record at least 2 output tokens per request")
    L = num_layers
    f_dec = statistics.median((s.wall_s - s.expert_s) / L for s in dec)
    t_loc = statistics.median(s.expert_s / (L * top_k * s.tokens) for s in dec)
    # Prefill: totals over totals. A prompt step's time is mostly per step and per expert
    # called, not per token, so a per-token median would weigh short prompts up.
    slots = sum(L * top_k * s.tokens for s in pre)
    f_pre = sum(s.wall_s - s.expert_s for s in pre) / sum(L * s.tokens for s in pre)
    t_pre = sum(s.expert_s for s in pre) / slots
    return RemoeCalibration(
        nonexpert_decode_s=max(f_dec, 0.0), nonexpert_prefill_token_s=max(f_pre, 0.0),
        expert_token_s=t_loc, prefill_factor=min(1.0, t_pre / t_loc),
        source={"in_process_steps": {"prefill": len(pre), "decode": len(dec)}})


def held_factors(base: list[StepTiming], held: list[StepTiming]) -> tuple[float, float]:
    """(decode, prefill) CPU factors of ``held`` steps (:func:`record_passes` with
    ``hold_vcpus``) over ``base`` (the same prompts unheld): decode by per-step medians,
    prefill by totals (a few steps of unequal lengths). At least 1 each: a held step is
    not cheaper than an unheld one, so a ratio below 1 is noise."""
    def cpu(steps: list[StepTiming], prefill: bool) -> list[float]:
        return [s.cpu_s for s in steps if s.prefill == prefill]

    if not cpu(base, False) or not cpu(held, False) or not cpu(base, True) \
            or not cpu(held, True):
        raise MoefleetError("held factors need prefill and decode steps on both sides",
                            "record at least 2 output tokens per request")
    dec = statistics.median(cpu(held, False)) / max(statistics.median(cpu(base, False)),
                                                    1e-12)
    pre = sum(cpu(held, True)) / max(sum(cpu(base, True)), 1e-12)
    return max(dec, 1.0), max(pre, 1.0)


def measure_plan(plan: Any, adapter: Any, prompts: list[list[int]], *, platform: Any,
                 store: Any, max_tokens: int, workers: int = 2) -> dict[str, Any]:
    """Deploy ``plan`` on the local backend, warm every function (phase 1 of
    :func:`moefleet.remoe.run.run_remoe`), then each request in its own main invocation.
    Returns per-request ``results`` (``RequestResult``), the generation phase's
    ``main_records`` and ``remote_records``, the warm phase's ``cold`` summary and the
    ``gpu_share`` the main function is priced with (GPU emulated)."""
    from moefleet.remoe.run import generate, start_all
    from moefleet.runtime.lifecycle import deployed_backend
    from moefleet.runtime.main_model import gpu_share

    with deployed_backend(plan, platform=platform, store=store, adapter=adapter,
                          backend="local",
                          backend_options={"workers": workers, "main_workers": 1}) as (dep, fb):
        share = gpu_share(dep, platform)
        cold = start_all(dep, fb)
        mid = len(fb.records())
        batches = generate(dep, fb, prompts, max_tokens=max_tokens, batch_size=1)
        records = fb.records()[mid:]
    return {"results": [r for res, _ in batches for r in res.requests()],
            "remote_invocations": [res.remote_invocations for res, _ in batches],
            "main_records": [r for r in records if r.kind == "main"],
            "remote_records": [r for r in records if r.kind != "main"],
            "cold": cold, "gpu_share": share, "run_id": uuid.uuid4().hex[:6]}


def record_slots(record: Any, hidden: int) -> int:
    """Token-slots a direct expert call answered: its reply is one packed fp32 tensor of
    (slots, ``hidden``), so the slot count is the one whose packet has the reply's size."""
    from moefleet.runtime.payload import pack

    guess = int(record.bytes_out // (4 * hidden))
    for n in range(guess, max(-1, guess - 4), -1):
        if len(pack({"y": torch.zeros(n, hidden)})) == record.bytes_out:
            return n
    raise MoefleetError(f"{record.function}: a {record.bytes_out}-byte reply is no packet of "
                        f"{hidden}-wide rows", "count slots of direct expert calls only")


def calibrate(cal: RemoeCalibration, all_remote: dict[str, Any], *, num_layers: int,
              top_k: int, hidden: int) -> RemoeCalibration:
    """Add the remote calls' times to ``cal`` from :func:`measure_plan` of a plan whose
    every expert is remote, one replica per layer. Its handler records give, with t and
    the prefill factor pf from ``cal``, a decode call of K slots d_dec = h0 + K·(t + w)
    and a prefill call of n slots d_pre = h0 + n·(pf·t + w): the handler's fixed time h0
    and its per-slot cost w beyond the expert (unpacking and packing the rows; the
    simulator's "wire"). Its TPOT gives the call's round trip as the main waits on it:
    per layer TPOT / L = f + t_rem + K·(t + w)."""
    t, pf = cal.expert_token_s, cal.prefill_factor
    tpot = statistics.median(r.tpot_s for r in all_remote["results"])
    calls = [(record_slots(r, hidden), r.duration_s) for r in all_remote["remote_records"]]
    dec = [d for n, d in calls if n == top_k]
    pre = [(n, d) for n, d in calls if n > 4 * top_k]
    if not dec or not pre:
        raise MoefleetError("the all-remote run made no decode call of K slots or no "
                            "prefill call", "calibrate on a plan with every expert remote, "
                            "one replica, prompts of more than 4 tokens")
    d_dec = statistics.median(dec)
    n_pre = statistics.median(n for n, _ in pre)
    d_pre = statistics.median(d for _, d in pre)
    wire = max((d_pre - d_dec - n_pre * pf * t + top_k * t) / (n_pre - top_k), 0.0)
    fixed = max(d_dec - top_k * (t + wire), 0.0)
    call = tpot / num_layers - cal.nonexpert_decode_s - top_k * (t + wire)
    return dataclasses.replace(
        cal, call_overhead_s=max(call, 0.0), handler_fixed_s=fixed, slot_wire_s=wire,
        main_init_s=float(all_remote["cold"]["main_init_s"]),
        remote_init_s=float(all_remote["cold"]["remote_init_s"]),
        source={**cal.source, "all_remote_tpot_s": tpot, "decode_calls": len(dec),
                "decode_call_median_s": d_dec, "prefill_calls": len(pre),
                "prefill_call_median_s": d_pre, "prefill_call_median_slots": n_pre})


def calibrate_runtime(adapter: Any, prompts: list[list[int]], *, platform: Any, store: Any,
                      max_tokens: int, workers: int = 2, main_memory_mb: int = 2048,
                      remote_memory_mb: int = 1024, gpu_gb: float = 1.0,
                      rounds: int = 1, held_shares: tuple[float, ...] = ()
                      ) -> RemoeCalibration:
    """Both measurements on ``prompts`` (keep them apart from any run this calibration is
    compared with): :func:`record_passes` in process, then :func:`measure_plan` of a plan
    with every expert remote, one replica per layer (its main holding ``gpu_gb`` of GPU:
    0 for a CPU main), and :func:`calibrate`. ``rounds`` > 1 records the in-process steps
    that many times and keeps the fastest round's times (on a shared machine a slower
    round is other processes' time slices: measured 1.5x on one of five runs here).
    ``held_shares`` (each in (0, 1)) records the prompts ``rounds`` more times per share,
    every step held to it, for :attr:`RemoeCalibration.held` against the kept round (each
    factor the lowest of its rounds: one disturbed round measured 2.0x where the others
    gave 1.1-1.3x). The in-process
    engine runs on one torch thread (one vCPU, as the functions that take these times)."""
    from moefleet.profiles.timing import torch_threads
    from moefleet.remoe.plans import manual_plan

    shape = adapter.summary()
    layers = list(shape.moe_layers)
    L, K = len(layers), int(shape.top_k)
    if rounds < 1:
        raise MoefleetError(f"rounds must be >= 1, got {rounds}", "e.g. rounds=3")
    if any(not 0 < v < 1 for v in held_shares):
        raise MoefleetError(f"held shares must be in (0, 1) vCPU, got {held_shares}",
                            "e.g. (0.125, 0.25, 0.5)")
    # One torch thread: one vCPU of the models that take these times (the local backend's
    # functions at one vCPU or less run on one; a held main too).
    with torch_threads(1):
        recorded = [record_passes(adapter, prompts, max_tokens)[1] for _ in range(rounds)]
        cal, base = min(((calibrate_in_process(st, L, K), st) for st in recorded),
                        key=lambda cs: cs[0].nonexpert_decode_s + K * cs[0].expert_token_s)
        held: list[tuple[float, float, float]] = []
        for v in sorted(held_shares):  # per share, each factor's least disturbed round
            got = [held_factors(base, record_passes(adapter, prompts, max_tokens,
                                                    hold_vcpus=v)[1]) for _ in range(rounds)]
            held.append((v, min(f[0] for f in got), min(f[1] for f in got)))
    cal = dataclasses.replace(cal, held=tuple(held), source={**cal.source, "rounds": rounds})
    every = {layer: range(int(shape.num_experts[li])) for li, layer in enumerate(layers)}
    plan = manual_plan(shape, platform.name, every, main_memory_mb=main_memory_mb,
                       remote_memory_mb=remote_memory_mb, replicas=1, gpu_gb=gpu_gb,
                       policy="remoe-calibration")
    run = measure_plan(plan, adapter, prompts, platform=platform, store=store,
                       max_tokens=max_tokens, workers=workers)
    return calibrate(cal, run, num_layers=L, top_k=K, hidden=int(shape.hidden_size))


def calibrated_problem(p: Any, cal: RemoeCalibration) -> Any:
    """``p`` with this runtime's measured times: one thread per function whatever its
    memory (the local backend's workers), so T(y) is flat at the measured slot time; the
    "GPU" non-experts and experts of the emulated main function run at CPU speed; wires
    is the measured per-slot cost w of a remote call (2·D bytes per w); GPU<->CPU copies
    are inside the measured constants (no separate time)."""
    from moefleet.plan.remoe.problem import TimeLaw

    return dataclasses.replace(
        p, law=TimeLaw(0.0, 0.0, cal.expert_token_s),
        nonexpert_token_s=cal.nonexpert_decode_s,
        nonexpert_prefill_token_s=cal.nonexpert_prefill_token_s,
        nonexpert_cpu_token_s=cal.nonexpert_decode_s,
        gpu_expert_token_s=cal.expert_token_s, prefill_factor=cal.prefill_factor,
        invoke_overhead_s=cal.call_overhead_s,
        transfer_bytes_s=(2.0 * p.token_bytes / cal.slot_wire_s if cal.slot_wire_s > 0
                          else FOLDED), swap_bytes_s=FOLDED,
        notes=(*p.notes, "calibrated on the local runtime"))


def metered_prices(p: Any, platform: Any) -> Any:
    """``p`` with the CPU price per GB-second the platform's meter charges a function at
    its default vCPUs (what a deployed spec gets), in place of the planner's 1 GB = 1 vCPU
    (on ``alibaba-fc-gpu``: 2048 MB per vCPU, so 1.3e-5 instead of 2.3e-5 USD per GB-s)."""
    per_gb_s = float(platform.compute_cost(1024, 1.0))
    return dataclasses.replace(p, cpu_price_gb_s=per_gb_s,
                               cpu_mem_price_gb_s=min(p.cpu_mem_price_gb_s, per_gb_s))


def cpu_calibrated(p: Any, cal: RemoeCalibration) -> Any:
    """``p`` with this runtime's measured *CPU* times, its platform model otherwise kept
    (unlike :func:`calibrated_problem`, which models the local backend itself): one thread
    of the engine's step is one vCPU, so the non-experts per layer and decode token
    (scheduling, sampling, embedding and head included, as the engine runs them), per
    prompt token, and a local expert's slot time at one vCPU become the measured ones;
    T(y) keeps its shape and the platform's vCPU rule, scaled to the measured slot. A
    remote call costs the platform's invoke round trip *plus* the measured local one, and
    each slot the platform's wire time plus the measured per-slot (un)packing; the main's
    CPU work below one vCPU costs the measured held factors (``main_held``). The GPU
    times stay the roofline's (nothing here measures a GPU)."""
    from moefleet.plan.remoe.problem import TimeLaw

    law = p.law
    r = cal.expert_token_s / law.one_vcpu_s
    wire = 2.0 * p.token_bytes / p.transfer_bytes_s + cal.slot_wire_s
    return dataclasses.replace(
        p, law=TimeLaw(law.theta1 * r, law.theta2, law.theta3 * r, law.gb_per_vcpu),
        nonexpert_cpu_token_s=cal.nonexpert_decode_s,
        nonexpert_cpu_prefill_token_s=cal.nonexpert_prefill_token_s,
        prefill_factor=min(1.0, max(cal.prefill_factor, 1e-6)),
        invoke_overhead_s=p.invoke_overhead_s + cal.call_overhead_s,
        transfer_bytes_s=2.0 * p.token_bytes / wire if wire > 0 else p.transfer_bytes_s,
        main_held=cal.held,
        notes=(*p.notes, "CPU times calibrated on this machine's engine"))
