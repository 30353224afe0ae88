"""One billing rule: the simulator and the runtime's biller bill the same invocation alike.

The platform here bills 100 ms units with a 1 s minimum and INIT billed, so the rounding,
the minimum and INIT all show: every simulated call (handler 0.001-0.02 s plus, when cold,
about 1 s of INIT) lands on one of them.
"""

from __future__ import annotations

import pytest

from moefleet.compose.billing import InProcessPricer, InvocationBiller
from moefleet.platform import InvocationRecord, Meter, price_invocation
from moefleet.platform.spec_blocks import Billing
from moefleet.sim import SimConfig, Simulator
from moefleet.workloads import PoissonWorkload
from tests.unit.sim_helpers import plan, profile, spec

RULE = Billing(granularity_ms=100, min_billed_ms=1000, init_billed=True)


class _Replay:
    """An ``Attributed`` source that hands the biller a fixed list of records once."""

    def __init__(self, records: list[InvocationRecord]) -> None:
        self.records = records

    def drain(self) -> list[tuple[InvocationRecord, dict[str, float]]]:
        out, self.records = [(r, {"seq": 1.0}) for r in self.records], []
        return out

    def store_requests(self) -> tuple[int, int]:
        return 0, 0


def test_the_rule_rounds_up_applies_the_minimum_and_init() -> None:
    assert RULE.billed_s(0.05) == 1.0  # under the minimum
    assert RULE.billed_s(1.01) == 1.1  # rounded up to the next 100 ms
    assert RULE.billed_s(0.3) == 1.0 and RULE.billed_s(1.3) == 1.3  # no float artefact
    assert RULE.billed_s(0.5, init_s=0.7) == 1.2  # INIT billed
    no_init = RULE.model_copy(update={"init_billed": False})
    assert no_init.billed_s(0.5, init_s=0.7) == 1.0
    s = spec().model_copy(update={"billing": RULE})
    assert s.invocation_billed_s(1.01, 0.7) == RULE.billed_s(1.01, 0.7)


def test_simulator_and_engine_biller_bill_the_same_invocations_identically() -> None:
    s = spec().model_copy(update={"billing": RULE})
    sim = Simulator(plan(experts=2), profile(), s, top_k=1,
                    config=SimConfig(keep_records=True, output_tokens=2, keep_alive_s=2.0))
    result = sim.run(PoissonWorkload(2.0), 10.0)
    assert sim.meter is not None
    records = sim.meter.records
    assert len(records) == result.invocations > 0
    # both the minimum and INIT decide some bills in this run
    assert any(r.duration_s < 1.0 and not r.cold for r in records)
    assert any(r.cold and r.init_s > 0 for r in records)
    # the runtime's biller (what serve --plan uses) prices the simulator's records
    biller = InvocationBiller([_Replay(records)], s)
    billed = biller.step(set(), 0.0)
    total = sum(billed.values(), start=type(result.cost)())
    assert total.compute == pytest.approx(result.cost.compute, rel=1e-12)
    assert total.request == pytest.approx(result.cost.request, rel=1e-12)
    assert sum(RULE.billed_s(r.duration_s, r.init_s) for r in records) == pytest.approx(
        result.billed_s, rel=1e-12)
    # and one invocation, one price: the meter, the shared function, the in-process pricer
    one = records[0]
    cost, billed_s = price_invocation(s, one.memory_mb, one.duration_s, init_s=one.init_s,
                                      gpu_share=one.gpu_share)
    assert Meter(s).price(one) == (cost, billed_s)
    assert sim.pipe.segments[0].billed_s(one.duration_s, one.init_s) == billed_s
    warm = InProcessPricer(s, one.memory_mb).price(one.duration_s)
    assert warm.billed_s == RULE.billed_s(one.duration_s)
