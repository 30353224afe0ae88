"""The end-to-end job behind ``moefleet demo`` (ODS/BO Fig. 14 on one machine).

Stages, each cached or measured as it says:
1. model: the zoo's default (built once, cached);
2. compute profile: measured once per model and machine (cached next to the weights);
3. routing: one profiling pass over ``wikitext2:train`` (the first part fits the
   predictor, the rest becomes the BO batches) and one over ``wikitext2:test`` (the
   workload, never seen by the predictor or the BO); with ``traffic`` set (a domain
   shift), the BO batches and the workload come from one pass over that dataset;
4. predictor: the Bayesian token-feature predictor fitted on the first part;
5. BO + ODS: Alg. 2 on the BO batches, objective billed by the analytical model;
6. plans for the workload: BO-adjusted predictions, unadjusted predictions, the real
   distribution (oracle), LambdaML; each billed as planned on the workload's real routing
   by the analytical model (no rule (i)-(iii) repair: a deployment knows only its
   predictions, so a plan that breaks a constraint on the real counts is reported so),
   and the CPU cluster's cost for the same work;
7. measured run: every serverless plan, exactly as planned, deployed on the local backend
   (memory and vCPU limits on, emulated: runtime/local_limits.py; packets under the aws
   backend's base64 inline budget, the one the planner assumes) and the workload run
   through it as the one batch it was planned as: billed by the meter (expert invocations
   plus the object-store requests the segment functions and the coordinator make, less
   the segments' cold-start parameter GETs, which the model bills with the segments) and
   throughput, outputs checked against the monolithic model; ``run_over_model`` is the
   measured MoE bill over the model's ``cost_usd`` (same scope, plan.transfers). A run
   that fails (out of memory, payload) is reported with its error.

Invariant: the workload's routing is used only by the oracle plan and for billing.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moefleet.errors import MoefleetError
from moefleet.models.shape import ModelShape

THROUGHPUT_LOSS = 0.1876  # the SLO: LambdaML's latency / (1 - the paper's largest loss)


@dataclass(frozen=True)
class DemoConfig:
    model: str = "minilm-moe-e8"
    platform: str = "aws-lambda-2020"
    cluster: str = "cpu-cluster"
    fit_tokens: int = 40_960
    batch_tokens: int = 10_240
    bo_batches: int = 2
    workload_tokens: int = 10_240
    max_length: int = 128
    bo_pairs: int = 1000
    bo_iters: int = 30
    sampler: str = "eps-gp"
    slo_s: float | None = None  # default: LambdaML latency / (1 - THROUGHPUT_LOSS)
    # Serving traffic for the BO batches and the workload: None = wikitext2 (BO batches
    # from the train split after the predictor's part, workload from the test split);
    # another dataset (e.g. "c4") = a domain shift: one pass over it, the first part
    # becomes the BO batches, the rest the workload.
    traffic: str | None = None
    warm_instances: bool = False  # plan for steady-state serving (see PlanningProblem)
    run: bool = True  # deploy and run on the local backend
    workers: int | None = None
    seed: int = 0

    @classmethod
    def quick(cls, **kw: Any) -> DemoConfig:
        base: dict[str, Any] = {"fit_tokens": 8192, "batch_tokens": 2048, "bo_batches": 1,
                "workload_tokens": 2048, "bo_pairs": 200, "bo_iters": 10}
        base.update(kw)
        return cls(**base)


Say = Callable[[str], None]
# progress(stage label, done, total): long stages report through it (the CLI draws bars).
Progress = Callable[[str, int, int], None]


def _quiet(_label: str, _done: int, _total: int) -> None:
    return None


def _profile(adapter: Any, dataset: str, tokens: int, max_length: int, say: Say,
             progress: Progress = _quiet) -> Any:
    from moefleet.data import load_prompts, split_dataset
    from moefleet.traces import profile

    name, split = split_dataset(dataset)
    prompts = load_prompts(name, split=split)
    t0 = time.perf_counter()
    trace = profile(adapter, [p.request_id for p in prompts], [p.text for p in prompts],
                    max_tokens=tokens, max_length=max_length, batch_size=8,
                    attention_ids=True, dataset=dataset,
                    progress=lambda done, total: progress(f"profiling {dataset}", done, total))
    say(f"profiled {trace.num_tokens:,} tokens of {dataset} in {time.perf_counter() - t0:.0f} s")
    return trace


@dataclass
class Prepared:
    """Stages 1-4: everything BO and the comparison need (see the module doc)."""

    adapter: Any
    summary: ModelShape
    profile: Any
    spec: Any
    predictor: Any  # BayesPredictor fitted on the first part of the train trace
    bo_batches: list[Any]  # BOBatch
    workload: Any  # BOBatch of the test workload
    work_trace: Any
    slo_s: float
    work_dataset: str = "wikitext2:test"
    warm_instances: bool = False
    predicted_LE: Any = None  # the unadjusted predictor's counts for the workload
    positions: int = 0  # the workload batch's B x T (padding included): request lengths

    def problem(self, counts: np.ndarray, tokens: int) -> Any:  # -> PlanningProblem
        from moefleet.plan import PlanningProblem

        return PlanningProblem.from_summary(self.summary, self.profile, self.spec, counts,
                                            self.slo_s, tokens=tokens,
                                            warm_instances=self.warm_instances)

    def template(self) -> Any:
        tokens = int(np.mean([b.tokens for b in self.bo_batches]))
        return self.problem(self.bo_batches[0].real_LE, tokens)


def prepare(cfg: DemoConfig, say: Say = print, progress: Progress = _quiet) -> Prepared:
    """Model, compute profile, routing traces, fitted predictor, batches and the SLO."""
    from moefleet.models import load_adapter
    from moefleet.plan import LambdaMLPlanner
    from moefleet.plan.bo_eval import batches_from_trace, counts_for_plan, split_requests
    from moefleet.platform import load_platform
    from moefleet.predict.bayes import BayesPredictor
    from moefleet.profiles.cache import profile_for

    adapter = load_adapter(cfg.model)
    summary = adapter.summary()
    prof = profile_for(cfg.model)
    say(f"model {cfg.model}: {len(summary.moe_layers)} MoE layers x "
        f"{max(summary.num_experts)} experts, top-{summary.top_k}; compute profile ready")
    bo_part = cfg.bo_batches * cfg.batch_tokens
    batch_tokens = cfg.batch_tokens
    if cfg.traffic is None:
        work_dataset = "wikitext2:test"
        train = _profile(adapter, "wikitext2:train", cfg.fit_tokens + bo_part,
                         cfg.max_length, say, progress)
        work = _profile(adapter, work_dataset, cfg.workload_tokens, cfg.max_length, say,
                        progress)
        fit_tokens = cfg.fit_tokens
        if train.num_tokens < cfg.fit_tokens + bo_part:
            # A bare checkout carries only an excerpt of wikitext2: keep the proportions.
            share = train.num_tokens / (cfg.fit_tokens + bo_part)
            fit_tokens, batch_tokens = int(fit_tokens * share), max(1, int(batch_tokens * share))
            say(f"note: wikitext2:train has {train.num_tokens:,} tokens here, not "
                f"{cfg.fit_tokens + bo_part:,} (is ../shared/data beside the checkout?); "
                f"scaled to {fit_tokens:,} for the predictor and BO batches of "
                f"{batch_tokens:,}")
        fit_trace, bo_trace = split_requests(train, fit_tokens)
    else:
        work_dataset = cfg.traffic
        fit_trace = _profile(adapter, "wikitext2:train", cfg.fit_tokens, cfg.max_length, say,
                             progress)
        shifted = _profile(adapter, cfg.traffic, bo_part + cfg.workload_tokens,
                           cfg.max_length, say, progress)
        bo_trace, work = split_requests(shifted, bo_part)
    if work.num_tokens < 0.9 * cfg.workload_tokens:  # whole requests: a little short is normal
        say(f"note: the workload has {work.num_tokens:,} tokens, not {cfg.workload_tokens:,} "
            f"({work_dataset} holds no more here)")
    shape = ModelShape.from_trace(fit_trace)
    predictor = BayesPredictor().fit(fit_trace)
    bo_batches = batches_from_trace(bo_trace, shape, batch_tokens, cfg.bo_batches)
    (workload,) = batches_from_trace(work, shape, work.num_tokens, 1)
    say(f"predictor fitted on {fit_trace.num_tokens:,} tokens; BO batches "
        f"{[b.tokens for b in bo_batches]}; workload {workload.tokens:,} tokens")
    prep = Prepared(adapter, summary, prof, spec=load_platform(cfg.platform),
                    predictor=predictor, bo_batches=bo_batches, workload=workload,
                    work_trace=work, slo_s=cfg.slo_s or 1e6, work_dataset=work_dataset,
                    warm_instances=cfg.warm_instances,
                    predicted_LE=predictor.predict_counts(workload.requests),
                    positions=padded_positions(work))
    if cfg.slo_s is None:
        probe = prep.problem(counts_for_plan(prep.predicted_LE), workload.tokens)
        latency = LambdaMLPlanner().plan(probe).predicted["latency_s"]
        prep.slo_s = latency / (1 - THROUGHPUT_LOSS)
    say(f"SLO {prep.slo_s:.3f} s end to end ({cfg.platform})")
    return prep


def run_demo(cfg: DemoConfig, out_dir: Path, say: Say = print,
             progress: Progress = _quiet) -> dict[str, Any]:
    """Run every stage; returns the report dict (also written by the caller)."""
    from moefleet.plan import LambdaMLPlanner, OdsPlanner, cpu_cluster_cost, evaluate
    from moefleet.plan.bo import BayesOpt, BOConfig
    from moefleet.plan.bo_eval import counts_for_plan
    from moefleet.platform import load_platform
    from moefleet.traces import write_trace

    t_start = time.perf_counter()
    prep = prepare(cfg, say, progress)
    write_trace(prep.work_trace, out_dir / "workload_trace.parquet")
    workload, slo = prep.workload, prep.slo_s
    bo_cfg = BOConfig(pairs=cfg.bo_pairs, max_iters=cfg.bo_iters, sampler=cfg.sampler,
                      seed=cfg.seed)
    bo = BayesOpt(prep.predictor, prep.template(), prep.bo_batches, bo_cfg).run(
        progress=lambda it, total, _best: progress("BO iterations", it, total))
    say(f"BO ({bo.sampler}, evaluator {bo.evaluator}): {bo.iterations} iterations in "
        f"{bo.wall_s:.1f} s, objective {bo.baseline.cost:.4g} -> {bo.best.cost:.4g} USD")

    # The batch's padded shape is known before it runs (request lengths), its routing is not.
    real = dataclasses.replace(prep.problem(workload.real_LE, workload.tokens),
                               positions=max(prep.positions, workload.tokens))
    ods = OdsPlanner()
    pred_work = prep.predicted_LE
    with bo.applied() as adjusted:
        pred_bo = adjusted.predict_counts(workload.requests)
    plans: dict[str, Any] = {}
    for name, pred in (("bo", pred_bo), ("unadjusted", pred_work)):
        plans[name] = (ods.plan(real.with_counts(counts_for_plan(pred))), pred)
    plans["oracle"] = (ods.plan(real), workload.real_LE.astype(float))
    plans["lambdaml"] = (LambdaMLPlanner().plan(real), workload.real_LE.astype(float))
    rows: dict[str, dict[str, Any]] = {}
    for name, (plan, _pred) in plans.items():
        est = evaluate(real, plan)  # as planned, on the real counts: no repair
        rows[name] = {"kind": "serverless", "cost_usd": est.cost_usd,
                      "model_parts_usd": {k: v for k, v in est.as_predicted().items()
                                          if k not in ("cost_usd", "latency_s")},
                      "latency_s": est.latency_s, "slo_met": est.latency_s <= slo + 1e-9,
                      "feasible": est.feasible, "violations": est.violations[:3],
                      "throughput_tokens_per_s": workload.tokens / est.latency_s,
                      "min_memory_mb": min(ec.memory_mb for lp in plan.layers
                                           for ec in lp.experts)}
        plan.save(out_dir / f"plan_{name}.yaml")
    cluster = cpu_cluster_cost(real, prep.profile, load_platform(cfg.cluster))
    rows["cpu_cluster"] = {"kind": "cluster", "cost_usd": cluster.cost_usd,
                           "moe_prorated_usd": cluster.moe_prorated_usd,
                           "latency_s": cluster.wall_s, "slo_met": cluster.wall_s <= slo,
                           "throughput_tokens_per_s": workload.tokens / cluster.wall_s}
    if cfg.run:
        for name in ("bo", "oracle", "unadjusted", "lambdaml"):
            say(f"deploying the {name} plan on the local backend and running the workload")
            label = f"running the {name} plan"

            def on_batch(done: int, total: int, label: str = label) -> None:
                progress(label, done, total)

            m = measure(out_dir / f"plan_{name}.yaml", prep.adapter, prep.spec,
                        prep.work_trace, prep.work_dataset, cfg, on_batch)
            if "moe_cost_usd" in m:
                m["run_over_model"] = m["moe_cost_usd"] / rows[name]["cost_usd"]
            rows[name]["measured"] = m
    return {
        "model": cfg.model, "platform": cfg.platform, "cluster": cfg.cluster,
        "slo_s": slo, "workload": {"dataset": prep.work_dataset, "tokens": workload.tokens},
        "bo": bo.summary(), "bo_history": bo.history, "plans": rows,
        "memory": {"runtime_bytes": prep.profile.runtime_bytes,
                   "intermediate_bytes_per_token": {
                       str(k): v for k, v in prep.profile.intermediate_bytes_per_token.items()}},
        "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
        "wall_s": time.perf_counter() - t_start,
    }


def measure(plan_path: Path, adapter: Any, spec: Any, work: Any, dataset: str,
            cfg: DemoConfig, progress: Callable[[int, int], None] | None = None,
            ) -> dict[str, Any]:
    """Deploy a plan as saved on the local backend (limits on), run the workload as the
    one batch it was planned for, bill it (module doc, stage 7)."""
    import tempfile

    from moefleet.compose import open_engine
    from moefleet.compose.run import run_billed
    from moefleet.compose.score import SCORE, max_abs_diff, score_options
    from moefleet.plan import DeploymentPlan
    from moefleet.plan.costmodel import PARAM_GETS
    from moefleet.platform import Meter, open_store
    from moefleet.traces.profile import tokenize_prompts

    plan = DeploymentPlan.load(plan_path)
    rids, texts = _workload_texts(work, dataset)
    kept = tokenize_prompts(adapter, texts, max_tokens=work.num_tokens,
                            max_length=cfg.max_length)
    prompts = [(rids[i], ids) for i, ids in kept]
    options: dict[str, Any] = {"limits": True, "wire": "base64"}
    if cfg.workers is not None:
        options["workers"] = cfg.workers
    # one step: every request of the workload in the one batch it was planned for
    with tempfile.TemporaryDirectory(prefix="moefleet-demo-store-") as tmp, \
            open_engine(adapter, plan=plan, platform=spec, store=open_store(tmp),
                        backend="local", backend_options=options,
                        options=score_options(len(prompts), cfg.max_length)) as opened:
        backend: Any = opened.backend  # LocalBackend: stats() has the limit counters
        t0 = time.perf_counter()
        run = run_billed(opened, [ids for _, ids in prompts], SCORE,
                         request_ids=[rid for rid, _ in prompts])
        wall = time.perf_counter() - t0
        failed = [o for o in run.outputs if o.finish_reason == "error"]
        if failed:
            stats = backend.stats()
            return {"error": failed[0].error, "limits": stats.get("limits"),
                    "out_of_memory": stats.get("out_of_memory")}
        records = backend.records()
        client_puts, client_gets = opened.client_store_requests()
        oversize = opened.remote.oversize_splits if opened.remote is not None else 0
        latency_s = opened.engine.stats.steps[-1].forward_s
        stats = backend.stats()
    if progress:
        progress(1, 1)
    meter = Meter(spec)
    expert = expert_store = segment_store = segment_total = segment_param = 0.0
    for rec in records:
        parts = meter.add(rec)
        if rec.kind == "expert":
            expert += parts.total
            expert_store += parts.storage
        else:
            # a cold segment's parameter GETs are the segment's cost (costmodel.segment_cost)
            param = spec.storage_request_cost(0, PARAM_GETS) if rec.cold else 0.0
            segment_param += param
            segment_store += parts.storage - param
            segment_total += parts.total
    client = meter.add_storage(client_puts, client_gets, function="<engine>").total
    tokens = sum(len(ids) for _, ids in prompts)
    return {"moe_cost_usd": expert + segment_store + client,
            "expert_cost_usd": expert, "expert_store_usd": expert_store,
            "segment_store_usd": segment_store, "segment_param_usd": segment_param,
            "client_store_usd": client, "total_cost_usd": expert + segment_total + client,
            "latency_s": latency_s, "wall_s": wall,
            "throughput_tokens_per_s": tokens / latency_s, "tokens": tokens,
            "positions": len(prompts) * max(len(ids) for _, ids in prompts),
            "cold_starts": sum(r.cold for r in records),
            "invocations": len(records),
            "max_abs_diff": max_abs_diff(adapter, prompts, run.outputs),
            # extra invocations for direct shares the plan undercounted (eq. 12f broken)
            "oversize_splits": oversize,
            "cpu_stretch_s": stats["cpu_stretch_s"], "limits": stats["limits"]}


def padded_positions(trace: Any) -> int:
    """B x T of ``trace``'s requests sent as one batch padded to the longest (the trace
    has one row per token and MoE layer)."""
    per_request = np.unique(np.asarray(trace.table.column("request_id").to_pylist()),
                            return_counts=True)[1]
    layers = max(1, len(set(trace.table.column("layer").to_pylist())))
    return int(len(per_request) * (int(per_request.max(initial=0)) // layers))


def _workload_texts(work: Any, dataset: str) -> tuple[list[str], list[str]]:
    from moefleet.data import load_prompts, split_dataset

    name, split = split_dataset(dataset)
    wanted = list(dict.fromkeys(work.table.column("request_id").to_pylist()))
    prompts = {p.request_id: p.text for p in load_prompts(name, split=split)}
    missing = [r for r in wanted if r not in prompts]
    if missing:
        raise MoefleetError(f"workload requests {missing[:3]} are not in {dataset}",
                            "re-run the demo (the dataset changed under it)")
    return wanted, [prompts[r] for r in wanted]
