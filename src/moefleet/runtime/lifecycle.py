"""The deploy -> use -> teardown lifecycle of a plan's functions, as one context manager.

    with deployed_backend(plan, platform=spec, store=store, adapter=adapter) as (dep, fb):
        ...  # invoke dep's functions on fb

The composition root (``moefleet.compose.open_engine``) and Remoe's main-function client
(``remoe.run``) share it. Invariants: the plan is turned into functions once (``deploy``
checks it against the model and the platform, uploads the weights and validates every
function spec; the placement is derived once and kept on the ``Deployment``); whatever
happens inside the ``with`` block, the backend is torn down, and when this call deployed a
plan itself the weights it uploaded are removed too. A deployment passed in leaves its
weights in the store (they belong to whoever deployed it).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

from moefleet.errors import MoefleetError
from moefleet.models.base import MoEModelAdapter
from moefleet.plan import DeploymentPlan
from moefleet.platform import ObjectStore, PlatformSpec
from moefleet.runtime.base import FunctionBackend, create_backend, validate_spec
from moefleet.runtime.deploy import Deployment, deploy_plan, install, remove_objects

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


@contextlib.contextmanager
def deployed_backend(
    source: DeploymentPlan | Deployment, *, platform: PlatformSpec, store: ObjectStore,
    adapter: MoEModelAdapter | None = None, backend: str | FunctionBackend = "local",
    backend_options: Mapping[str, Any] | None = None,
    kinds: Collection[str] | None = None,
    wrap: Callable[[FunctionBackend], FunctionBackend] | None = None,
) -> Iterator[tuple[Deployment, FunctionBackend]]:
    """Deploy ``source`` (a plan: needs ``adapter``; or an existing deployment, which
    brings its own backend name), create its functions of the ``kinds`` asked for (None:
    all; the caller plays the others, e.g. ``serve`` plays the main function), yield the
    deployment and the backend (``wrap``-ped, e.g. by fault injection), and always tear
    down (see the module invariants). ``backend`` may be a backend that already runs (a
    test's, a benchmark's): the functions are created on it (those it has already, as
    specified, are kept warm), and it is left running."""
    given = backend if isinstance(backend, FunctionBackend) else None
    name = given.name if given is not None else str(backend)
    if isinstance(source, DeploymentPlan):
        if adapter is None:
            raise MoefleetError("deploying a plan needs its model",
                                "pass adapter=load_adapter(plan.model)")
        dep = deploy(source, adapter, platform, store, backend_name=name)
        owned = True
    else:
        dep, owned = source, False
    options = {"store": dep.store, **(backend_options or {})}
    fb: FunctionBackend | None = None
    try:
        fb = given if given is not None else create_backend(dep.backend, platform, **options)
        if wrap is not None:
            fb = wrap(fb)
        # a running backend keeps the functions it already has as specified (warm)
        install(dep, fb, kinds=kinds, keep_existing=given is not None)
        yield dep, fb
    finally:
        try:
            if fb is not None and given is None:
                fb.teardown()
        finally:
            if owned:
                try:
                    remove_objects(dep, store)
                except Exception as err:  # the error that got us here is the one to report
                    log.warning("could not remove the weights under %s: %s", dep.prefix, err)
