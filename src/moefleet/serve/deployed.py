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

A Remoe plan (one with a ``main`` function): this process plays the main function. Its
remote expert groups are deployed (the ``main`` function is not: nothing would call it);
the engine's model is what a main instance loads from the store (the non-expert modules
and the local experts, :class:`~moefleet.remoe.main_model.MainModel`, on CUDA when the
plan's main has a GPU and ``device`` allows, else the CPU: "GPU emulated"), with the
main's KV budget, and each MoE layer runs ``split_experts(local, RemoteExperts, is_local)``
as in the main handler. The biller adds the main function's time (:class:`MainPricing`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from moefleet.compose.build import build_engine
from moefleet.engine import Engine
from moefleet.errors import MoefleetError
from moefleet.experts.remote import RemoteExperts
from moefleet.models.base import MoEModelAdapter
from moefleet.plan import DeploymentPlan
from moefleet.platform import ObjectStore, PlatformSpec, load_platform
from moefleet.runtime.base import FunctionBackend
from moefleet.runtime.deploy import Deployment
from moefleet.runtime.session import Session, deployed_backend, open_deployment
from moefleet.serve.cost import InvocationBiller, MainPricing


class PlanModelError(MoefleetError):
    """The plan was made for a different model than the one being served."""


@dataclass
class DeployedEngine:
    engine: Engine
    biller: InvocationBiller
    experts: RemoteExperts
    deployment: Deployment
    backend: FunctionBackend
    session: Session | None = None  # the executor's session (plans without a main)
    device: str = "cpu"  # where the engine's non-expert modules run

    @property
    def functions(self) -> int:
        """Functions created on the backend (a Remoe plan's main is this process)."""
        main = self.deployment.plan.main is not None
        return sum(1 for f in self.deployment.functions if not main or f.kind != "main")


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
    if plan.main is not None:
        with _main_engine(plan, adapter, spec, store, backend, backend_options, device,
                          max_num_seqs, max_parallel, audit) as d:
            yield d
        return
    with open_deployment(plan, platform=spec, store=store, adapter=adapter, backend=backend,
                         backend_options=backend_options) as session:
        rx = session.remote_experts(max_parallel=max_parallel)
        try:
            engine = build_engine(adapter, device=device, max_num_seqs=max_num_seqs,
                                  experts=rx)
            biller = InvocationBiller(rx, spec, audit=audit)
            biller.attach(engine)
            yield DeployedEngine(engine, biller, rx, session.deployment, session.backend,
                                 session, str(adapter.device))
        finally:
            rx.close()


@contextlib.contextmanager
def _main_engine(plan: DeploymentPlan, adapter: MoEModelAdapter, spec: PlatformSpec,
                 store: ObjectStore, backend: str, backend_options: Mapping[str, Any] | None,
                 device: str, max_num_seqs: int, max_parallel: int, audit: bool,
                 ) -> Iterator[DeployedEngine]:
    """A Remoe plan: this process is the main function (module docstring)."""
    from moefleet.engine.runner import LocalRunner
    from moefleet.remoe.main_model import MainModel, main_device
    from moefleet.remoe.run import gpu_share
    from moefleet.runtime.deploy import MAIN_KV_MB
    from moefleet.runtime.handlers import MB

    assert plan.main is not None
    main_device(plan.main.gpu_gb, device)  # a device this plan cannot use fails first
    with deployed_backend(plan, platform=spec, store=store, adapter=adapter, backend=backend,
                          backend_options=backend_options, with_main=False) as (dep, fb):
        placed = dep.placement.main
        assert placed is not None
        name = dep.function(placed.name)
        share = gpu_share(dep, spec)
        main = MainModel.load(dep, store, name, device=device)
        kv_bytes = MAIN_KV_MB * MB
        main.check_memory(placed.memory_mb, kv_bytes, name)
        rx = RemoteExperts(dep, fb, store, max_parallel=max_parallel)
        pool = ThreadPoolExecutor(1, thread_name_prefix="moefleet-remoe-remote")
        try:
            runner = LocalRunner(main.adapter, experts=main.experts(rx, pool=pool),
                                 kv_budget_bytes=kv_bytes, max_num_seqs=max_num_seqs)
            engine = Engine(runner, tokenizer=adapter.tokenizer, max_num_seqs=max_num_seqs)
            biller = InvocationBiller(rx, spec, audit=audit, main=MainPricing(
                name, placed.memory_mb, share, main.gpu))
            biller.attach(engine)
            yield DeployedEngine(engine, biller, rx, dep, fb, None, str(main.device))
        finally:
            rx.close()
            pool.shutdown(wait=True)
