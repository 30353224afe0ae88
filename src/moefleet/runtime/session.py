"""The deploy -> run -> teardown lifecycle as one library call.

    with open_deployment(plan, adapter=adapter, platform=spec, store=store) as session:
        summary = session.run(batches, reference=adapter)
    summary = run_plan(plan, batches, adapter=adapter, platform=spec, store=store)

``moefleet run``, the demo and the HTTP server share this instead of each wiring
``deploy_plan``, ``install``, the ``Executor`` and the teardown themselves.

Invariants: the plan is turned into functions once (``deploy`` checks it against the
model and the platform, uploads the weights and validates every function spec; the
placement is derived once and kept on the ``Deployment``); whatever happens inside the
``with`` block, the backend is torn down, and when the session deployed a plan itself the
weights it uploaded are removed too. A session opened on an existing ``Deployment``
leaves its weights in the store (they belong to whoever deployed it).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from moefleet.errors import MoefleetError
from moefleet.experts.remote import RemoteExperts
from moefleet.models.base import MoEModelAdapter
from moefleet.plan import DeploymentPlan
from moefleet.platform import ObjectStore, PlatformSpec
from moefleet.runtime.base import FunctionBackend, create_backend, validate_spec
from moefleet.runtime.deploy import Deployment, deploy_plan, install, remove_objects
from moefleet.runtime.executor import BatchResult, Executor
from moefleet.runtime.runner import Batch, run_workload

log = logging.getLogger(__name__)


def deploy(plan: DeploymentPlan, adapter: MoEModelAdapter, platform: PlatformSpec,
           store: ObjectStore, *, backend_name: str = "local") -> Deployment:
    """Check ``plan``, upload ``adapter``'s weights to ``store`` and build the function
    specs, each validated against ``platform`` (vCPUs filled in). Creates no function."""
    dep = deploy_plan(adapter, plan, platform, store, backend_name=backend_name)
    try:
        dep.functions = [validate_spec(platform, spec) for spec in dep.functions]
    except BaseException:
        remove_objects(dep, store)  # a refused deployment leaves no weights behind
        raise
    return dep


@dataclass
class Session:
    """A deployment whose functions exist on ``backend``; runs batches through it."""

    deployment: Deployment
    backend: FunctionBackend
    executor: Executor
    store: ObjectStore | None = None

    def remote_experts(self, *, max_parallel: int = 16) -> RemoteExperts:
        """An ``ExpertFn`` over this deployment's expert functions, for a layer loop that
        runs here (the engine): the caller closes it."""
        return RemoteExperts(self.deployment, self.backend, self.store,
                             max_parallel=max_parallel)

    def run_batch(self, ids_BT: Any, mask_BT: Any, request_ids: list[str]) -> BatchResult:
        return self.executor.run_batch(ids_BT, mask_BT, request_ids)

    def run(self, batches: list[Batch], *, reference: MoEModelAdapter | None = None,
            progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """Run ``batches`` and summarise them (see ``runtime.runner.run_workload``)."""
        return run_workload(self.executor, batches, reference=reference, progress=progress)


@contextlib.contextmanager
def deployed_backend(
    source: DeploymentPlan | Deployment, *, platform: PlatformSpec, store: ObjectStore,
    adapter: MoEModelAdapter | None = None, backend: str = "local",
    backend_options: Mapping[str, Any] | None = None, with_main: bool = True,
) -> Iterator[tuple[Deployment, FunctionBackend]]:
    """Deploy ``source`` (a plan: needs ``adapter``; or an existing deployment, which
    brings its own backend name), create its functions (without the ``main`` function
    when ``with_main`` is false: the caller plays it), yield the deployment and the
    backend, and always tear down (see the module invariants). The one lifecycle that
    :func:`open_deployment`, ``remoe.run`` and ``serve --plan`` share."""
    if isinstance(source, DeploymentPlan):
        if adapter is None:
            raise MoefleetError("deploying a plan needs its model",
                                "pass adapter=load_adapter(plan.model)")
        dep = deploy(source, adapter, platform, store, backend_name=backend)
        owned = True
    else:
        dep, owned = source, False
    options = {"store": dep.store, **(backend_options or {})}
    fb: FunctionBackend | None = None
    try:
        fb = create_backend(dep.backend, platform, **options)
        install(dep, fb, with_main=with_main)
        yield dep, fb
    finally:
        try:
            if fb is not None:
                fb.teardown()
        finally:
            if owned:
                try:
                    remove_objects(dep, store)
                except Exception as err:  # the error that got us here is the one to report
                    log.warning("could not remove the weights under %s: %s", dep.prefix, err)


@contextlib.contextmanager
def open_deployment(
    source: DeploymentPlan | Deployment, *, platform: PlatformSpec, store: ObjectStore,
    adapter: MoEModelAdapter | None = None, backend: str = "local",
    backend_options: Mapping[str, Any] | None = None,
) -> Iterator[Session]:
    """:func:`deployed_backend` with an executor over it: yield a :class:`Session`."""
    with deployed_backend(source, platform=platform, store=store, adapter=adapter,
                          backend=backend, backend_options=backend_options) as (dep, fb), \
            Executor(dep, fb, store, platform) as executor:
        yield Session(dep, fb, executor, store)


def run_plan(
    source: DeploymentPlan | Deployment, batches: list[Batch], *, platform: PlatformSpec,
    store: ObjectStore, adapter: MoEModelAdapter | None = None, backend: str = "local",
    backend_options: Mapping[str, Any] | None = None,
    reference: MoEModelAdapter | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Deploy, run ``batches``, tear down: :func:`open_deployment` + ``Session.run``."""
    with open_deployment(source, platform=platform, store=store, adapter=adapter,
                         backend=backend, backend_options=backend_options) as session:
        return session.run(batches, reference=reference, progress=progress)
