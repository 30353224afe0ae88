"""Serving a deployment (``moefleet serve --plan``): the engine's experts run in the plan's
functions on a backend, and every request is billed from its invocation records.

    with deployed_engine(plan, adapter, backend="local", store=store) as d:
        app = create_app(d.engine, model_name=..., biller=d.biller)
        ...  # serve until stopped

Invariants: the plan is checked against the served model before anything is uploaded (a
plan for another model is refused with :class:`PlanModelError`); the functions exist only
inside the ``with`` block; on the way out the ExpertFn's threads stop, the backend is torn
down and the weights this call uploaded are removed (``runtime.session.open_deployment``),
whatever raised. The engine's layer loop runs here; only routed expert tokens travel.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from moefleet.engine import Engine
from moefleet.engine.build import build_engine
from moefleet.errors import MoefleetError
from moefleet.models.base import MoEModelAdapter
from moefleet.plan import DeploymentPlan
from moefleet.platform import ObjectStore, PlatformSpec, load_platform
from moefleet.runtime.remote_experts import RemoteExperts
from moefleet.runtime.session import Session, open_deployment
from moefleet.serve.cost import InvocationBiller


class PlanModelError(MoefleetError):
    """The plan was made for a different model than the one being served."""


@dataclass
class DeployedEngine:
    engine: Engine
    biller: InvocationBiller
    experts: RemoteExperts
    session: Session


def _same_model(a: str, b: str) -> bool:
    if a == b:
        return True
    pa, pb = os.path.expanduser(a), os.path.expanduser(b)
    return os.path.isdir(pa) and os.path.isdir(pb) and os.path.samefile(pa, pb)


def check_plan_model(plan: DeploymentPlan, adapter: MoEModelAdapter, model_ref: str) -> None:
    """Refuse a plan for another model: it names ``plan.model``, which must be what the
    server loads (``model_ref`` as given, or the adapter's own name)."""
    if _same_model(plan.model, model_ref) or plan.model == adapter.name:
        return
    raise PlanModelError(
        f"the plan is for model {plan.model!r}, but the server loads {model_ref!r}",
        f"serve --model {plan.model}, or make a plan for {model_ref} "
        f"(moefleet plan --model {model_ref} ...)")


@contextlib.contextmanager
def deployed_engine(plan: DeploymentPlan, adapter: MoEModelAdapter, *, store: ObjectStore,
                    backend: str = "local", model_ref: str | None = None,
                    platform: PlatformSpec | None = None,
                    backend_options: Mapping[str, Any] | None = None, device: str = "cpu",
                    max_num_seqs: int = 64, max_parallel: int = 16, audit: bool = False,
                    ) -> Iterator[DeployedEngine]:
    """Deploy ``plan`` on ``backend``, yield an engine whose experts are its functions and
    the biller that prices its requests; tear everything down on exit (module docstring).
    """
    check_plan_model(plan, adapter, model_ref or adapter.name)
    spec = platform or load_platform(plan.platform)
    if not spec.is_faas:
        raise MoefleetError(f"platform {spec.name!r} in the plan is a {spec.kind}, not a "
                            "function platform", "plan for a FaaS platform, e.g. aws-lambda")
    with open_deployment(plan, platform=spec, store=store, adapter=adapter, backend=backend,
                         backend_options=backend_options) as session:
        rx = session.remote_experts(max_parallel=max_parallel)
        try:
            engine = build_engine(adapter, device=device, max_num_seqs=max_num_seqs,
                                  experts=rx)
            biller = InvocationBiller(rx, spec, audit=audit)
            biller.attach(engine)
            yield DeployedEngine(engine, biller, rx, session)
        finally:
            rx.close()
