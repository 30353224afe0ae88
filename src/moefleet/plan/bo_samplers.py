"""Optuna samplers for the BO loop (ODS/BO Alg. 2 and the comparisons of its Fig. 13).

The BO variables are Q key-value pairs; trial parameters ``k0..k{Q-1}`` (key indices)
and ``v0..v{Q-1}`` (values). A *pair* is the unit of exploration: dimension q of the
epsilon vector decides whether pair q keeps the best trial's (key, value) or draws a new
one.

- :class:`EpsilonGreedySampler` (``multi=True``, the paper's method): every pair has its
  own epsilon. Each trial draws ``candidates`` vectors by per-pair epsilon-greedy moves
  away from the best trial so far; a Gaussian process fitted to the history (kernel:
  exp(-hamming / lengthscale) over pairs, a valid kernel on categorical vectors) scores
  them and the lowest lower-confidence bound wins. So the GP is the surrogate and the
  epsilon-greedy draw is the acquisition's proposal distribution.
- ``multi=False`` (single-epsilon): one epsilon for the whole vector: with probability
  epsilon an entirely new vector, else the best one with a single pair redrawn (re-running
  the best vector unchanged would only repeat a deterministic evaluation).
- ``random`` and ``tpe`` come from Optuna itself (:func:`make_sampler`).

Decay (Alg. 2 line 3 and lines 13-21, our reading): eps_tau = eps0 / (1 + sum_{t<tau}
rho_t), where rho_t = rho for an iteration in which no replication rule fired and the
rule's own smaller rate (rho1 for memory, rho2 for payload, rho3 for no replica;
rho3 < rho2 < rho1 < rho) when one did (:meth:`slow_decay`; the smallest when several
did): a rule firing *slows* the decay, as the paper has it. With no rule ever firing,
eps_tau = eps0 / (1 + rho * tau). The first ``limited`` pairs (those exploring the limited
range L) decay more slowly still (their epsilon is multiplied by ``slow``, capped at 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, IntDistribution
from optuna.samplers import BaseSampler
from optuna.study import Study
from optuna.trial import FrozenTrial, TrialState

SAMPLERS = ("eps-gp", "eps", "single-eps", "random", "tpe")


class EpsilonGreedySampler(BaseSampler):
    """Multi- or single-dimensional decaying epsilon-greedy search (module doc)."""

    def __init__(self, pairs: int, *, limited: int = 0, eps0: float = 0.5, rho: float = 0.1,
                 slow: float = 2.0, multi: bool = True, gp: bool = True, candidates: int = 32,
                 kappa: float = 1.0, lengthscale: float = 0.3, seed: int = 0) -> None:
        if pairs < 1 or not 0 <= limited <= pairs:
            raise ValueError(f"need pairs >= 1 and 0 <= limited <= pairs, got {pairs}, {limited}")
        if not 0 < eps0 <= 1 or rho < 0 or slow < 1 or candidates < 1:
            raise ValueError("need 0 < eps0 <= 1, rho >= 0, slow >= 1, candidates >= 1")
        self.pairs, self.limited = pairs, limited
        self.eps0, self.rho, self.slow = eps0, rho, slow
        self.multi, self.gp, self.candidates = multi, gp, candidates
        self.kappa, self.lengthscale = kappa, lengthscale
        self._rates: dict[int, float] = {}  # iteration -> its decay rate, where below rho
        self._rng = np.random.default_rng(seed)
        self._random = optuna.samplers.RandomSampler(seed=seed)

    # -- epsilon ---------------------------------------------------------------------
    def slow_decay(self, iteration: int, rho_rule: float) -> None:
        """Iteration ``iteration`` fired a rule whose rate is ``rho_rule`` (< rho): that
        iteration decays epsilon by 1 + rho_rule instead of 1 + rho (module doc)."""
        if not 0 <= rho_rule <= self.rho:
            raise ValueError(f"a rule's decay rate must be in [0, rho={self.rho}], got {rho_rule}")
        self._rates[iteration] = min(rho_rule, self._rates.get(iteration, self.rho))

    def epsilon(self, tau: int) -> np.ndarray:
        """eps_Q for the trial drawn after ``tau`` completed iterations (iteration 0, the
        unadjusted predictor, included)."""
        spent = sum(self._rates.get(t, self.rho) for t in range(tau))
        base = self.eps0 / (1.0 + spent)
        eps = np.full(self.pairs, base)
        eps[: self.limited] = np.minimum(1.0, base * self.slow)
        return eps

    # -- optuna sampler API -----------------------------------------------------------
    def infer_relative_search_space(self, study: Study, trial: FrozenTrial,
                                    ) -> dict[str, BaseDistribution]:
        done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        return dict(done[0].distributions) if done else {}

    def sample_relative(self, study: Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if not search_space or not done:
            return {}
        best = study.best_trial.params
        tau = len(done)
        if self.multi:
            cands = [self._multi_move(best, search_space, tau) for _ in range(self.candidates)]
        else:
            cands = [self._single_move(best, search_space, tau) for _ in range(self.candidates)]
        if self.gp and len(done) >= 2 and len(cands) > 1:
            return cands[self._gp_pick(done, cands)]
        return cands[0]

    def sample_independent(self, study: Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        return self._random.sample_independent(study, trial, param_name, param_distribution)

    # -- moves -----------------------------------------------------------------------
    def _draw(self, name: str, dist: BaseDistribution) -> int:
        assert isinstance(dist, IntDistribution)
        return int(self._rng.integers(dist.low, dist.high + 1))

    def _redraw_pair(self, params: dict[str, Any], q: int,
                     space: dict[str, BaseDistribution]) -> None:
        for name in (f"k{q}", f"v{q}"):
            if name in space:
                params[name] = self._draw(name, space[name])

    def _multi_move(self, best: dict[str, Any], space: dict[str, BaseDistribution],
                    tau: int) -> dict[str, Any]:
        params = dict(best)
        explore = self._rng.random(self.pairs) < self.epsilon(tau)
        for q in np.flatnonzero(explore):
            self._redraw_pair(params, int(q), space)
        return params

    def _single_move(self, best: dict[str, Any], space: dict[str, BaseDistribution],
                     tau: int) -> dict[str, Any]:
        if self._rng.random() < float(self.epsilon(tau).mean()):
            return {name: self._draw(name, dist) for name, dist in space.items()}
        params = dict(best)
        self._redraw_pair(params, int(self._rng.integers(self.pairs)), space)
        return params

    # -- surrogate -------------------------------------------------------------------
    def _pairs_matrix(self, rows: Sequence[dict[str, Any]]) -> np.ndarray:
        return np.array([[(p.get(f"k{q}", -1), p.get(f"v{q}", -1)) for q in range(self.pairs)]
                         for p in rows]).reshape(len(rows), self.pairs, 2)

    def _kernel(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        # Hamming distance over pairs (a pair differs if its key or value differs).
        diff = (a[:, None] != b[None, :]).any(axis=-1).mean(axis=-1)
        return np.asarray(np.exp(-diff / self.lengthscale))

    def _gp_pick(self, done: list[FrozenTrial], cands: list[dict[str, Any]]) -> int:
        X = self._pairs_matrix([t.params for t in done])
        y = np.array([float(t.value) for t in done])  # type: ignore[arg-type]
        y = (y - y.mean()) / (y.std() or 1.0)
        K = self._kernel(X, X) + 1e-3 * np.eye(len(done))
        C = self._pairs_matrix(cands)
        Ks = self._kernel(C, X)
        try:
            Lc = np.linalg.cholesky(K)
        except np.linalg.LinAlgError:
            return 0
        alpha = np.linalg.solve(Lc.T, np.linalg.solve(Lc, y))
        mean = Ks @ alpha
        v = np.linalg.solve(Lc, Ks.T)
        var = np.clip(1.0 - (v * v).sum(axis=0), 1e-12, None)
        return int(np.argmin(mean - self.kappa * np.sqrt(var)))


def make_sampler(name: str, *, pairs: int, limited: int, eps0: float, rho: float,
                 slow: float, candidates: int, seed: int) -> BaseSampler:
    """A sampler by name: ``eps-gp`` (the paper's), ``eps`` (multi-epsilon, no GP),
    ``single-eps``, ``random``, ``tpe``."""
    def eps(multi: bool, gp: bool) -> EpsilonGreedySampler:
        return EpsilonGreedySampler(pairs, limited=limited, eps0=eps0, rho=rho, slow=slow,
                                    multi=multi, gp=gp, candidates=candidates, seed=seed)

    if name == "eps-gp":
        return eps(True, True)
    if name == "eps":
        return eps(True, False)
    if name == "single-eps":
        return eps(False, False)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=5)
    raise ValueError(f"unknown sampler {name!r}; choose one of {', '.join(SAMPLERS)}")
