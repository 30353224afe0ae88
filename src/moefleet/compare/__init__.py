"""``moefleet compare``: every serving policy of the project on one scenario, one table.

A scenario fixes the model shape, the platform, the arrivals (with their prompt and
output lengths), the expert routing and the prices; each policy is evaluated on exactly
that scenario by the project's existing simulators (:mod:`moefleet.sim` for function
pipelines, :mod:`moefleet.sim.remoe` for Remoe layouts, the engine's own scheduler in
simulated time for monolithic engines) and reported as one :class:`~moefleet.compare.rows.Row`.
"""

from moefleet.compare.rows import Row
from moefleet.compare.run import CompareResult, run_compare
from moefleet.compare.scenario import Scenario, build_scenario

__all__ = ["CompareResult", "Row", "Scenario", "build_scenario", "run_compare"]

