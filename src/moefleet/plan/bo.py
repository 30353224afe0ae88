"""Bayesian optimisation of the Bayesian predictor's table on billed cost (ODS/BO Alg. 2).

Each iteration writes Q key-value pairs into the predictor's count table, predicts the
tokens per expert of the BO batches, plans with ODS, applies the replication rules on
every batch's real routing and bills the result with the analytical model
(:mod:`moefleet.plan.bo_eval`); the mean cost over the batches is the objective an Optuna
sampler minimises (:mod:`moefleet.plan.bo_samplers`). The table is restored after every
trial, so the predictor is unchanged when :meth:`BayesOpt.run` returns;
:meth:`BOResult.applied` writes the best pairs in for as long as a ``with`` block lasts.

Key ranges (our reading of the paper, and where we had to decide):
- L, the limited range: the (layer, token, position, attention id, expert) rows of the BO
  batches whose expert was mispredicted by more than the margin under the *unadjusted*
  predictions. L is fixed after that first evaluation, so a parameter keeps its meaning
  across trials (an Optuna search space is fixed); the paper re-collects it every
  iteration. The first ``mu * Q`` pairs draw keys from L.
- P, the full range: any MoE layer, token id and attention id seen in the table, any
  position up to the largest seen, any expert; index k decodes to a key through a
  generator seeded by k, so it may create keys the profile never saw.
- Values: counts 0..``value_max``; writing 0 removes a key; -1 leaves pair q unwritten.

Iteration 0 evaluates the unadjusted predictions (no pairs: every value -1) and enters the
sampler's history as a completed trial, so the first epsilon-greedy move starts from it
(a few pairs written), not from a random table rewrite. The best cost BO reports is
therefore never worse than the unadjusted plan's. Each iteration's replication rules set
its epsilon decay (:mod:`moefleet.plan.bo_samplers`: a rule firing slows the decay).
Convergence (Alg. 2 line 33): stop when the best cost has improved by less than
``threshold`` (relative) over the last ``patience`` iterations, or after ``max_iters``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from moefleet.errors import DataError
from moefleet.plan.bo_eval import (
    RULES,
    BatchOutcome,
    BOBatch,
    apply_rules,
    batch_cost,
    counts_for_plan,
)
from moefleet.plan.bo_samplers import SAMPLERS, EpsilonGreedySampler, make_sampler
from moefleet.plan.plan import DeploymentPlan
from moefleet.plan.problem import InfeasibleError, PlanningProblem
from moefleet.predict.bayes import BayesPredictor
from moefleet.predict.table import TableKey, unpack_context

KEY_SPACE = 1 << 20  # k indices; L keys are L[k mod |L|], P keys decode from k


@dataclass(frozen=True)
class BOConfig:
    """Alg. 2 constants (names as in the paper where it has them)."""

    pairs: int = 1000  # Q
    mu: float = 0.8  # share of pairs exploring L
    eps0: float = 0.5
    rho: float = 0.1  # base decay
    # rho1 (memory) > rho2 (payload) > rho3 (no replica), all < rho: slower decay
    rho_rules: tuple[float, float, float] = (0.05, 0.03, 0.01)
    slow: float = 2.0  # epsilon factor of the L pairs (> 1: slower decay)
    margin: float = 0.1  # sigma, as a fraction of the real tokens per replica (>= 1 token)
    value_max: int = 32
    threshold: float = 0.002  # relative change of the best cost
    patience: int = 8  # A
    max_iters: int = 40
    slo_penalty: float = 2.0
    candidates: int = 32
    sampler: str = "eps-gp"
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.pairs >= 1, f"pairs must be >= 1, got {self.pairs}"),
            (0 <= self.mu <= 1, f"mu must be in [0, 1], got {self.mu}"),
            (0 < self.eps0 <= 1, f"eps0 must be in (0, 1], got {self.eps0}"),
            (self.margin >= 0, f"margin must be >= 0, got {self.margin}"),
            (self.value_max >= 1, f"value_max must be >= 1, got {self.value_max}"),
            (self.rho >= self.rho_rules[0] >= self.rho_rules[1] >= self.rho_rules[2] >= 0,
             f"need rho >= rho1 >= rho2 >= rho3 >= 0 (a rule slows the decay), got rho "
             f"{self.rho}, rules {self.rho_rules}"),
            (self.patience >= 1, f"patience must be >= 1, got {self.patience}"),
            (self.max_iters >= 1, f"max_iters must be >= 1, got {self.max_iters}"),
            (self.slo_penalty >= 1, f"slo_penalty must be >= 1, got {self.slo_penalty}"),
            (self.sampler in SAMPLERS, f"unknown sampler {self.sampler!r}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise DataError(msg, f"BO options: samplers {', '.join(SAMPLERS)}; see "
                                "moefleet.plan.bo.BOConfig for the ranges")


@dataclass
class Evaluation:
    """One plan from one set of predictions, billed on every BO batch."""

    cost: float  # objective: mean over batches of batch_cost
    plan: DeploymentPlan | None
    outcomes: list[BatchOutcome]
    predicted_LE: np.ndarray
    error: InfeasibleError | None = None  # why there is no plan (plan is None)

    @property
    def feasible_share(self) -> float:
        return float(np.mean([o.feasible for o in self.outcomes])) if self.outcomes else 0.0

    @property
    def billed(self) -> float:
        """Mean billed MoE cost over the batches, without the SLO penalty."""
        return float(np.mean([o.estimate.cost_usd for o in self.outcomes])) \
            if self.outcomes else float("inf")


@dataclass
class BOResult:
    """What a BO run found. ``pairs`` are the best trial's (key, value) writes."""

    predictor: BayesPredictor
    pairs: list[tuple[TableKey, int]]
    baseline: Evaluation
    best: Evaluation
    history: list[dict[str, Any]]
    iterations: int
    converged: bool
    wall_s: float
    sampler: str
    evaluator: str = "analytical"
    limited_range: int = 0

    @contextlib.contextmanager
    def applied(self) -> Iterator[BayesPredictor]:
        """The predictor with the best pairs written in; restored on exit."""
        with write_pairs(self.predictor, self.pairs):
            yield self.predictor

    def summary(self) -> dict[str, Any]:
        return {
            "sampler": self.sampler, "evaluator": self.evaluator,
            "iterations": self.iterations, "converged": self.converged,
            "wall_s": self.wall_s, "pairs": len(self.pairs),
            "limited_range_keys": self.limited_range,
            "baseline_cost_usd": self.baseline.cost, "best_cost_usd": self.best.cost,
            "best_billed_usd": self.best.billed,
            "best_feasible_share": self.best.feasible_share,
            "improvement": 1.0 - self.best.cost / self.baseline.cost
            if self.baseline.cost > 0 else 0.0,
        }


@contextlib.contextmanager
def write_pairs(predictor: BayesPredictor, pairs: list[tuple[TableKey, int]],
                ) -> Iterator[None]:
    """Write ``pairs`` into the predictor's table; put the old values back on exit."""
    table = predictor.table
    if table is None:
        raise DataError("the predictor is not fitted", "fit it on a trace first")
    old: dict[TableKey, float] = {}
    try:
        for key, value in pairs:
            if key not in old:
                old[key] = table.get(key)
            table.set(key, float(value))
        yield
    finally:
        for key, prior in old.items():
            table.set(key, prior)


class BayesOpt:
    """Alg. 2 over one predictor, one planning template and a few real batches.

    ``template`` carries everything but the counts (platform, profile times, SLO, tokens
    per batch); ``planner`` (default ODS) turns predicted counts into a plan.
    """

    def __init__(self, predictor: BayesPredictor, template: PlanningProblem,
                 batches: list[BOBatch], config: BOConfig | None = None,
                 planner: Any = None) -> None:
        if predictor.table is None or predictor.shape is None:
            raise DataError("BO needs a fitted Bayesian predictor", "fit it on a trace first")
        if not batches:
            raise DataError("BO needs at least one batch of real routing",
                            "profile a held-out slice of the dataset")
        if batches[0].real_LE.shape != template.counts_LE.shape:
            raise DataError(
                f"batch counts have shape {batches[0].real_LE.shape}, the planning problem "
                f"{template.counts_LE.shape}", "use traces and a profile of the same model")
        from moefleet.plan.ods import OdsPlanner

        self.predictor, self.template, self.batches = predictor, template, batches
        self.config = config or BOConfig()
        self.planner = planner or OdsPlanner()
        self.shape = predictor.shape
        self._real = [template.with_counts(b.real_LE) for b in batches]
        _, tok, pos, _ = unpack_context(predictor.table.arrays()[0])
        self._tokens = np.unique(tok)
        self._max_pos = int(pos.max(initial=0))
        self._limited: list[TableKey] = []

    # -- one evaluation ---------------------------------------------------------------
    def predict(self) -> np.ndarray:
        """Mean predicted counts_LE over the batches (one deployment serves them all)."""
        preds = [self.predictor.predict_counts(b.requests) for b in self.batches]
        return np.mean(preds, axis=0)

    def evaluate(self, pred_LE: np.ndarray | None = None) -> Evaluation:
        """Plan from ``pred_LE`` (default: the predictor's now) and bill it per batch."""
        pred = self.predict() if pred_LE is None else pred_LE
        try:
            plan = self.planner.plan(self.template.with_counts(counts_for_plan(pred)))
        except InfeasibleError as err:
            return Evaluation(float("inf"), None, [], pred, err)
        outs = [apply_rules(p, plan, pred, self.config.margin) for p in self._real]
        cost = float(np.mean([batch_cost(o, self.config.slo_penalty) for o in outs]))
        return Evaluation(cost, plan, outs, pred)

    # -- key ranges -------------------------------------------------------------------
    def _collect_limited(self, ev: Evaluation) -> None:
        keys: set[TableKey] = set()
        layers = self.shape.moe_layers
        for b, out in zip(self.batches, ev.outcomes, strict=True):
            sel = out.mismatched_LE[b.layer_idx, b.expert]
            for li, t, p, a, e in zip(b.layer_idx[sel].tolist(), b.token[sel].tolist(),
                                      b.position[sel].tolist(), b.attention[sel].tolist(),
                                      b.expert[sel].tolist(), strict=True):
                keys.add(TableKey(layers[li], t, p, a, e))
        self._limited = sorted(keys)

    def decode(self, q: int, k: int) -> TableKey:
        """Pair q's key index k -> a table key (L for the first mu*Q pairs, else P)."""
        if q < round(self.config.mu * self.config.pairs) and self._limited:
            return self._limited[k % len(self._limited)]
        rng = np.random.default_rng([self.config.seed, k])
        li = int(rng.integers(self.shape.num_moe_layers))
        tokens = self._tokens if self._tokens.size else np.zeros(1, np.int64)
        return TableKey(self.shape.moe_layers[li], int(tokens[rng.integers(tokens.size)]),
                        int(rng.integers(self._max_pos + 1)),
                        int(tokens[rng.integers(tokens.size)]),
                        int(rng.integers(self.shape.num_experts[li])))

    def pairs_of(self, params: dict[str, Any]) -> list[tuple[TableKey, int]]:
        """The pairs a trial writes (a value of -1 leaves pair q out)."""
        return [(self.decode(q, int(params[f"k{q}"])), int(params[f"v{q}"]))
                for q in range(self.config.pairs) if int(params[f"v{q}"]) >= 0]

    def _distributions(self) -> dict[str, Any]:
        from optuna.distributions import IntDistribution

        out: dict[str, Any] = {}
        for q in range(self.config.pairs):
            out[f"k{q}"] = IntDistribution(0, KEY_SPACE - 1)
            out[f"v{q}"] = IntDistribution(-1, self.config.value_max)
        return out

    # -- the loop ---------------------------------------------------------------------
    def run(self, progress: Callable[[int, int, float], None] | None = None) -> BOResult:
        """Iterate until convergence; ``progress(iteration, max_iters, best_cost)``."""
        import optuna

        cfg = self.config
        start = time.perf_counter()
        baseline = self.evaluate()
        if baseline.error is not None:
            # Nothing to improve on: the unadjusted predictions cannot meet the SLO.
            raise baseline.error
        self._collect_limited(baseline)
        limited = round(cfg.mu * cfg.pairs) if self._limited else 0
        sampler = make_sampler(cfg.sampler, pairs=cfg.pairs, limited=limited, eps0=cfg.eps0,
                               rho=cfg.rho, slow=cfg.slow, candidates=cfg.candidates,
                               seed=cfg.seed)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(direction="minimize", sampler=sampler)
        dists = self._distributions()
        study.add_trial(optuna.trial.create_trial(  # iteration 0: no pair written
            params={n: (0 if n[0] == "k" else -1) for n in dists}, distributions=dists,
            value=baseline.cost))
        self._slow_decay(sampler, 0, baseline)
        best, best_pairs = baseline, []
        history = [self._row(0, baseline, baseline.cost, time.perf_counter() - start)]
        converged = False
        it = 0
        for it in range(1, cfg.max_iters + 1):
            trial = study.ask()
            params = {}
            for q in range(cfg.pairs):
                params[f"k{q}"] = trial.suggest_int(f"k{q}", 0, KEY_SPACE - 1)
                params[f"v{q}"] = trial.suggest_int(f"v{q}", -1, cfg.value_max)
            pairs = self.pairs_of(params)
            with write_pairs(self.predictor, pairs):
                ev = self.evaluate()
            value = ev.cost if np.isfinite(ev.cost) else 10.0 * max(baseline.cost, 1e-12)
            study.tell(trial, value)
            self._slow_decay(sampler, it, ev)
            if ev.cost < best.cost:
                best, best_pairs = ev, pairs
            history.append(self._row(it, ev, best.cost, time.perf_counter() - start))
            if progress is not None:
                progress(it, cfg.max_iters, best.cost)
            if it > cfg.patience:
                before = history[it - cfg.patience]["best_cost_usd"]
                if before - best.cost <= cfg.threshold * before:
                    converged = True
                    break
        return BOResult(self.predictor, best_pairs, baseline, best, history, it, converged,
                        time.perf_counter() - start, cfg.sampler,
                        limited_range=len(self._limited))

    def _slow_decay(self, sampler: Any, it: int, ev: Evaluation) -> None:
        """Tell an epsilon sampler which replication rules iteration ``it`` fired."""
        if isinstance(sampler, EpsilonGreedySampler):
            for rule, rho_r in zip(RULES, self.config.rho_rules, strict=True):
                if any(o.rules.get(rule, 0) for o in ev.outcomes):
                    sampler.slow_decay(it, rho_r)

    @staticmethod
    def _row(it: int, ev: Evaluation, best: float, wall: float) -> dict[str, Any]:
        rules = {r: sum(o.rules.get(r, 0) for o in ev.outcomes) for r in RULES}
        return {"iteration": it, "cost_usd": ev.cost, "billed_usd": ev.billed,
                "best_cost_usd": best, "feasible_share": ev.feasible_share,
                "rules": rules, "wall_s": wall}
