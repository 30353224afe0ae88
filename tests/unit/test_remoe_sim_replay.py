"""The Remoe simulator's runtime mode: the runtime's dispatch of remote slots over
replicas (``split``), replayed engine passes, and billing only the handler's part."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moefleet.plan.remoe import Layout, RemoeProblem, evaluate
from moefleet.runtime.scatter import assign
from moefleet.sim.config import SimError
from moefleet.sim.remoe import Pass, RemoeSimulator, split_chunks
from tests.unit.remoe_helpers import remoe_problem


def _problem(s_LE: np.ndarray, top_k: int = 1, **kw: object) -> RemoeProblem:
    return remoe_problem(**{"s_LE": s_LE, "top_k": top_k, "n_out": 3, "ttft_slo_s": 1e3,
                            "tpot_slo_s": 1e3, "prefill_factor": 0.5, "cold_main_s": 0.0,
                            "cold_remote_s": 0.0, **kw})


@pytest.mark.parametrize("seed", range(6))
def test_split_chunks_are_the_runtime_scatter_shares(seed: int) -> None:
    rng = np.random.default_rng(seed)
    E, K, N = 6, 2, int(rng.integers(1, 40))
    remote_E = rng.random(E) < 0.6
    remote_E[0] = True
    z = int(rng.integers(1, 4))
    ids_NK = torch.as_tensor(rng.integers(0, E, size=(N, K)))
    masked_NK = torch.where(torch.as_tensor(remote_E)[ids_NK], ids_NK, -1)
    per_replica = [0] * z
    for share in assign(0, masked_NK, [z] * E):
        per_replica[share.replica] += share.size
    counts_E = np.bincount(ids_NK.reshape(-1).numpy(), minlength=E)
    assert split_chunks(counts_E, remote_E, z) == per_replica


def test_replayed_passes_reproduce_the_equations_and_split_sends_one_call() -> None:
    # top-1 onto expert 0 of layer 0 (remote) and expert 1 of layer 1 (local): with these
    # counts replayed the simulator equals eqs. 1-10, as with routing that has no chance.
    s = np.array([[1.0, 0.0], [0.0, 1.0]])
    p = _problem(s)
    x = np.array([[True, False], [False, False]])
    lay = Layout("remoe", 1024, x, (2048, 0), (((0,),), ()))
    est = evaluate(p, lay)

    def counts(n: int) -> np.ndarray:
        return np.array([[n, 0], [0, n]])

    passes = [Pass(True, 4, counts(4))] + [Pass(False, 1, counts(1)) for _ in range(3)]
    got = RemoeSimulator(p, lay).run([0.0], passes=[passes])
    assert got.prefill_s[0] == pytest.approx(est.pt_s)
    assert got.tpot_s[0] == pytest.approx(est.tpot_s)
    assert got.main_cost == pytest.approx(est.c_loc)
    assert got.cost_usd == pytest.approx(est.cost)
    assert got.calls_by_layer == {0: 4} and got.slots_by_layer == {0: 7}
    # split over 2 replicas: the prefill's 4 slots go 2 + 2 (two calls), a decode slot to
    # replica 0 only
    lay2 = Layout("remoe", 1024, x, (2048, 0), (((0,), ()), ()))
    split = RemoeSimulator(p, lay2, dispatch="split").run([0.0], passes=[passes])
    assert split.calls_by_layer == {0: 2 + 3} and split.slots_by_layer == {0: 7}


def test_billed_overhead_bills_the_handler_only() -> None:
    s = np.array([[1.0, 0.0]])
    p = _problem(s)
    lay = Layout("remoe", 1024, np.array([[True, False]]), (1024,), (((0,),),))
    passes = [[Pass(True, 2, np.array([[2, 0]])), Pass(False, 1, np.array([[1, 0]]))]]
    paper = RemoeSimulator(p, lay).run([0.0], passes=passes)
    runtime = RemoeSimulator(p, lay, billed_overhead_s=0.1).run([0.0], passes=passes)
    wire = 2 * 100.0 / 1000.0
    # the same latency; the handler billed (slots x (T + wire) + 0.1), not t_rem = 0.5
    assert runtime.ttft_s == paper.ttft_s and runtime.tpot_s == paper.tpot_s
    assert runtime.remote_prefill_cost == pytest.approx(2 * (2.0 * 0.5 + wire) + 0.1)
    assert runtime.remote_decode_cost == pytest.approx(1 * (2.0 + wire) + 0.1)
    assert paper.remote_decode_cost == pytest.approx(2.0 + wire + 0.5)


def test_bad_replay_inputs_are_refused() -> None:
    s = np.array([[1.0, 0.0]])
    p = _problem(s)
    lay = Layout("remoe", 1024, np.array([[True, False]]), (1024,), (((0,),),))
    ok = Pass(True, 2, np.array([[2, 0]]))
    with pytest.raises(SimError, match="pass lists"):
        RemoeSimulator(p, lay).run([0.0, 1.0], passes=[[ok]])
    with pytest.raises(SimError, match="prefill pass"):
        RemoeSimulator(p, lay).run([0.0], passes=[[Pass(False, 1, np.array([[1, 0]])), ok]])
    with pytest.raises(SimError, match="shape"):
        RemoeSimulator(p, lay).run([0.0], passes=[[Pass(True, 2, np.array([2, 0]))]])
    with pytest.raises(SimError, match="dispatch"):
        RemoeSimulator(p, lay, dispatch="round-robin")  # type: ignore[arg-type]
    with pytest.raises(SimError, match="billed_overhead_s"):
        RemoeSimulator(p, lay, billed_overhead_s=-1.0)
