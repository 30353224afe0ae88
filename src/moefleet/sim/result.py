"""What a simulation run reports: cost, latency, throughput, SLO, cold starts, timeline.
The serving figures are repeated under the server's metric names (``named_metrics``), so a
simulated run and a served one (``bench serve``, ``/metrics``) share their keys.

Costs come from the platform's prices applied per invocation exactly as ``Meter``
does (with ``keep_records`` the records themselves are in ``bill``, a real ``Meter``
bill, and the totals agree). Latency percentiles are streamed (within 0.2%); means,
minima and maxima are exact. Units: seconds, USD, requests, tokens.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moefleet.io import write_json_atomic
from moefleet.metric_names import named_figures
from moefleet.platform.billing import Bill, CostParts

if TYPE_CHECKING:
    from moefleet.sim.simulator import Simulator

CLIENT = "<executor>"  # the coordinator's own store requests, as the runtime bills them


@dataclass
class SimResult:
    model: str
    platform: str
    policy: str
    seed: int
    duration_s: float
    makespan_s: float
    requests: dict[str, int]
    throughput_rps: float
    tokens_per_s: float
    latency: dict[str, Any]
    ttft: dict[str, Any]
    tpot: dict[str, Any]
    slo_violation_rate: float
    cost: CostParts
    cost_by_kind: dict[str, CostParts]
    cost_by_layer: dict[int, CostParts]
    cost_by_expert: dict[str, CostParts]
    cost_by_function: dict[str, CostParts]
    invocations: int
    cold_starts: int
    billed_s: float
    gb_s: float
    handler_s: float
    handler_s_by_kind: dict[str, float]
    peak_instances: int
    expert_tokens: list[list[int]]
    expert_busy_s: list[list[float]]
    reconfigurations: int
    events: int
    wall_s: float
    timeline: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)
    # the figures above again, under the server's metric names (moefleet.metric_names)
    named_metrics: dict[str, Any] = field(default_factory=dict)
    bill: Bill | None = None
    request_log: list[dict[str, Any]] = field(default_factory=list)  # with keep_requests

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s if self.wall_s > 0 else math.inf

    @property
    def cost_usd(self) -> float:
        return self.cost.total

    @property
    def cost_per_request(self) -> float:
        done = self.requests["completed"]
        return self.cost.total / done if done else 0.0

    def to_dict(self, timeline: bool = True) -> dict[str, Any]:
        def parts(d: dict[Any, CostParts]) -> dict[str, dict[str, float]]:
            return {str(k): v.to_dict() for k, v in sorted(d.items())}

        out: dict[str, Any] = {
            "model": self.model, "platform": self.platform, "policy": self.policy,
            "seed": self.seed, "duration_s": self.duration_s, "makespan_s": self.makespan_s,
            "requests": self.requests, "throughput_rps": self.throughput_rps,
            "tokens_per_s": self.tokens_per_s, "latency_s": self.latency,
            "ttft_s": self.ttft, "tpot_s": self.tpot,
            "slo_violation_rate": self.slo_violation_rate,
            "cost": {**self.cost.to_dict(), "per_request": self.cost_per_request,
                     "by_kind": parts(self.cost_by_kind), "by_layer": parts(self.cost_by_layer),
                     "by_expert": parts(self.cost_by_expert)},
            "invocations": self.invocations, "cold_starts": self.cold_starts,
            "billed_s": self.billed_s, "gb_s": self.gb_s, "handler_s": self.handler_s,
            "handler_s_by_kind": self.handler_s_by_kind,
            "peak_instances": self.peak_instances,
            "expert_tokens": self.expert_tokens, "expert_busy_s": self.expert_busy_s,
            "reconfigurations": self.reconfigurations,
            "performance": {"events": self.events, "wall_s": self.wall_s,
                            "events_per_s": self.events_per_s},
            "config": self.config,
            "named_metrics": self.named_metrics,
        }
        if timeline:
            out["timeline"] = self.timeline
        if self.request_log:
            out["request_log"] = self.request_log
        return out

    def save(self, path: str | Path) -> Path:
        write_json_atomic(path, self.to_dict())
        return Path(path)


def build_result(sim: Simulator, *, duration_s: float, events: int, wall_s: float) -> SimResult:
    """Collect the finished run's streams into a :class:`SimResult`."""
    pipe, st, spec = sim.pipe, sim.stats, sim.spec
    total = CostParts()
    by_kind: dict[str, CostParts] = defaultdict(CostParts)
    by_layer: dict[int, CostParts] = defaultdict(CostParts)
    by_expert: dict[str, CostParts] = {}
    by_function: dict[str, CostParts] = {}
    invocations = cold = peak = 0
    billed = gb_s = handler = 0.0
    handler_by_kind: dict[str, float] = defaultdict(float)
    for p in pipe.all_pools():
        c = CostParts(p.cost_compute, p.cost_request, p.cost_storage)
        total += c
        by_kind[p.kind] += c
        by_layer[p.layer] += c
        by_function[p.name] = c
        if p.expert is not None:
            by_expert[f"{p.layer}:{p.expert}"] = c
        invocations += p.invocations
        cold += p.cold_starts
        peak += p.peak_live
        billed += p.billed_s_total
        gb_s += p.gb_s_total
        handler += p.work_s
        handler_by_kind[p.kind] += p.work_s
    if pipe.client_puts or pipe.client_gets:
        client = CostParts(storage=spec.storage_request_cost(pipe.client_puts, pipe.client_gets))
        total += client
        by_function[CLIENT] = client
    bill = None
    if sim.meter is not None:
        if pipe.client_puts or pipe.client_gets:
            sim.meter.add_storage(pipe.client_puts, pipe.client_gets, CLIENT)
        bill = sim.meter.bill()
    makespan = max(sim.last_completion_s, 0.0)
    span = makespan if makespan > 0 else max(duration_s, 1e-12)
    cfg = sim.config
    return SimResult(
        model=sim.shape.name, platform=spec.name,
        policy=sim.controller.name if sim.controller is not None else "static",
        seed=sim.seed, duration_s=duration_s, makespan_s=makespan,
        requests={"arrived": st.arrived, "completed": st.completed,
                  "slo_violations": st.slo_violations, "prompt_tokens": st.prompt_tokens,
                  "output_tokens": st.output_tokens},
        throughput_rps=st.completed / span,
        tokens_per_s=(st.prompt_tokens + st.output_tokens) / span,
        latency=st.latency.summary(), ttft=st.ttft.summary(), tpot=st.tpot.summary(),
        slo_violation_rate=st.slo_violations / st.completed if st.completed else 0.0,
        cost=total, cost_by_kind=dict(by_kind), cost_by_layer=dict(by_layer),
        cost_by_expert=by_expert, cost_by_function=by_function,
        invocations=invocations, cold_starts=cold, billed_s=billed, gb_s=gb_s, handler_s=handler,
        handler_s_by_kind=dict(handler_by_kind),
        peak_instances=peak,
        expert_tokens=[[p.total_tokens for p in layer] for layer in pipe.experts],
        expert_busy_s=[[p.total_busy_s for p in layer] for layer in pipe.experts],
        reconfigurations=sim.reconfigurations, events=events, wall_s=wall_s,
        timeline=sim.timeline,
        config={"scaling": cfg.scaling, "keep_alive_s": cfg.keep_alive_s,
                "concurrency": cfg.concurrency, "decode": cfg.decode,
                "max_decode_batch": cfg.max_decode_batch, "interval_s": cfg.interval_s,
                "apply_delay_s": cfg.apply_delay_s, "prewarm": cfg.prewarm,
                "reload_params": cfg.reload_params, "slo_s": cfg.slo_s,
                "ttft_slo_s": cfg.ttft_slo_s, "tpot_slo_s": cfg.tpot_slo_s,
                "router": sim.router.describe(), "decoder": sim.shape.decoder},
        bill=bill,
        request_log=sim.request_log,
        named_metrics=named_figures(
            ttft=st.ttft.summary(), tpot=st.tpot.summary(), e2e=st.latency.summary(),
            queue=st.queue.summary(), prompt_tokens=st.prompt_tokens,
            generation_tokens=st.output_tokens, completed=st.completed,
            slo_violations=dict(st.slo_by_phase),
            cost={"compute": total.compute, "requests": total.request,
                  "storage": total.storage}),
    )
