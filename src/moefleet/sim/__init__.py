"""Discrete-event simulation (SimPy) of serverless MoE serving.

    Simulator(plan, profile, "aws-lambda", router=..., config=SimConfig(...),
              controller=make_policy("hpa"), seed=0).run(workload, duration_s) -> SimResult

Functions have instances with a per-instance concurrency limit, a FIFO queue, cold and
warm starts, keep-alive and scale to zero; a request runs a prefill pass and G decode
steps, each pass a DAG segment -> experts (split over replicas) -> barrier -> next
segment, with direct or object-storage transfers per the plan; costs use the platform's
per-invocation prices (the billing ``Meter``'s rules). See ``timing`` for the formulas.
Needs the ``sim`` extra (SimPy).
"""

try:
    import simpy  # noqa: F401  (fail early, naming the extra)
except ImportError as _err:  # pragma: no cover - depends on the environment
    from moefleet.errors import MissingExtraError

    raise MissingExtraError("simpy", "sim") from _err

from moefleet.models.shape import ModelShape
from moefleet.sim.config import Calibration, SimConfig, SimError, apply_calibration
from moefleet.sim.metrics import StreamStats
from moefleet.sim.result import SimResult
from moefleet.sim.routing import DistributionRouter, Router, TraceRowRouter, router_from_trace
from moefleet.sim.simulator import Simulator
from moefleet.sim.synthetic import synthetic_profile

__all__ = [
    "Calibration",
    "DistributionRouter",
    "ModelShape",
    "Router",
    "SimConfig",
    "SimError",
    "SimResult",
    "Simulator",
    "StreamStats",
    "TraceRowRouter",
    "apply_calibration",
    "router_from_trace",
    "synthetic_profile",
]
