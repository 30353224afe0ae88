"""The composition root: ``open_engine`` turns a model, a plan (or none), an expert stack, a
backend and a store into a running engine and its biller. Nothing else constructs an
:class:`~moefleet.engine.Engine` (:func:`assemble` is the one place).

    with open_engine(adapter, plan=plan, stack=StackOptions(brownout=spec),
                     backend="local", store=store) as opened:
        outs = opened.engine.generate(prompts, params)

Which runner and which expert stack, by plan (``docs/architecture.md``):

- no plan: the in-process runner, the in-process kernel;
- an ODS/BO plan (expert functions): the in-process runner with remote dispatch (only the
  expert functions are created), or with ``runner="segments"`` the segment runner (its
  segment functions too; prefill only);
- a Remoe plan (a main function): this process plays the main function — what a main
  instance loads from the store (non-experts, KV cache, local experts), Remoe's split of
  local and remote experts; its expert groups are functions.

Brownout wraps whatever the base is (united experts run here); SALC is a step hook that
sets the threshold per step. Faults go where a real failure would be: at the backend when
the plan has functions (a real worker kill on the local backend), else at the expert seam
(emulated). Invariants: on exit the stack's threads stop, the backend is torn down and the
weights this call uploaded are removed, whatever raised.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from moefleet.compose.billing import Biller, InProcessBiller, InProcessPricer, InvocationBiller
from moefleet.compose.options import Billing, EngineOptions, StackOptions
from moefleet.compose.parts import (
    DeployedParts,
    brownout_piece,
    check_plan_model,
    deployed_parts,
    move_model,
    runner_sizes,
    salc_hooks,
)
from moefleet.engine.engine import Engine, StepHook
from moefleet.engine.runner import InProcessRunner, ModelRunner
from moefleet.errors import MoefleetError
from moefleet.experts.brownout import BrownoutExperts
from moefleet.experts.faults import FaultyExperts
from moefleet.experts.kernels import in_process_experts
from moefleet.experts.nest import compose
from moefleet.experts.remote import RemoteExperts
from moefleet.experts.stack import ExpertStack, find
from moefleet.models.base import MoEModelAdapter
from moefleet.plan import DeploymentPlan
from moefleet.platform import ObjectStore, PlatformSpec, load_platform, open_store
from moefleet.runtime.base import FunctionBackend
from moefleet.runtime.deploy import Deployment
from moefleet.runtime.faults import FaultyBackend


@dataclass
class OpenedEngine:
    """What :func:`open_engine` yields. ``stack`` is the expert stack the runner calls;
    ``notes`` the labels every output that depends on them must carry ("emulated")."""

    engine: Engine
    biller: Biller
    stack: ExpertStack
    runner: ModelRunner
    deployment: Deployment | None = None
    backend: FunctionBackend | None = None
    device: str = "cpu"
    notes: list[str] = field(default_factory=list)
    spawn: Callable[[], OpenedEngine] | None = None
    """Another engine over the same deployed functions (its own runner, expert stack and
    biller; closed with this one), for requests that must run independently at once."""

    @property
    def brownout(self) -> BrownoutExperts | None:
        return find(self.stack, BrownoutExperts)

    @property
    def remote(self) -> RemoteExperts | None:
        return find(self.stack, RemoteExperts)

    @property
    def retries(self) -> int:
        """Expert calls repeated after a transient failure, so far."""
        from moefleet.experts.retry import RetryingExperts

        r = find(self.stack, RetryingExperts)
        return r.retries if r is not None else 0

    def client_store_requests(self) -> tuple[int, int]:
        """(PUT+LIST, GET) requests this process made itself (billed as storage)."""
        if not isinstance(self.biller, InvocationBiller):
            return 0, 0
        pairs = [src.store_requests() for src in self.biller.sources]
        return sum(p for p, _ in pairs), sum(g for _, g in pairs)

    @property
    def salc(self) -> Any:
        """The SALC step hook (its ``trace`` of thresholds), or None."""
        from moefleet.experts.brownout_hook import SALCHook

        return next((h for h in self.engine.hooks if isinstance(h, SALCHook)), None)

    @property
    def faults_injected(self) -> int:
        f = find(self.stack, FaultyExperts)
        injected = f.injected if f is not None else 0
        if isinstance(self.backend, FaultyBackend):
            injected += self.backend.injected
        return injected


def assemble(runner: ModelRunner, *, tokenizer: Any, options: EngineOptions,
             hooks: list[StepHook]) -> Engine:
    """The one ``Engine(...)`` of the code base."""
    return Engine(runner, tokenizer=tokenizer, max_num_seqs=options.max_num_seqs,
                  max_num_batched_tokens=options.max_num_batched_tokens, clock=options.clock,
                  eos_token_id=options.eos_token_id, hooks=[*options.hooks, *hooks])


@contextlib.contextmanager
def open_engine(adapter: MoEModelAdapter, *,
                plan: DeploymentPlan | Deployment | None = None,
                stack: StackOptions | None = None, options: EngineOptions | None = None,
                backend: str | FunctionBackend = "local",
                store: ObjectStore | str | None = None,
                platform: PlatformSpec | None = None,
                backend_options: Mapping[str, Any] | None = None,
                billing: Billing | None = None, model_ref: str | None = None,
                audit: bool = False) -> Iterator[OpenedEngine]:
    """See the module docstring. ``backend``: a backend name, or a backend that already runs
    (left running on exit). ``store``: an object store or its URL/directory (None with a
    plan: a temporary directory, removed on exit). ``model_ref``: the name the user gave
    for the model (a plan must be for it). ``audit``: the biller keeps every priced record
    per request (tests re-price them). ``plan`` may be a deployment already made (``moefleet
    deploy``): its functions are created on its own backend and its weights stay."""
    stack = stack or StackOptions()
    options = options or EngineOptions()
    if plan is None:
        if options.runner == "segments" or options.play_segments:
            raise MoefleetError("the segment runner and play_segments need a plan with "
                                "segment functions", "pass --plan, or use the in-process "
                                "runner without play_segments")
        yield _in_process(adapter, stack, options, billing or Billing())
        return
    if stack.local is not None:
        raise MoefleetError("a plan places the experts itself: local experts cannot be given "
                            "with one", "drop StackOptions(local=...)")
    the_plan = plan.plan if isinstance(plan, Deployment) else plan
    check_plan_model(the_plan, adapter, model_ref or adapter.name)
    spec = platform or load_platform(the_plan.platform)
    with contextlib.ExitStack() as exits:
        if store is None:
            tmp = exits.enter_context(tempfile.TemporaryDirectory(prefix="moefleet-store-"))
            store = open_store(tmp)
        elif isinstance(store, str):
            store = open_store(store)
        parts = exits.enter_context(deployed_parts(
            adapter, plan, spec, store, stack, options, backend=backend,
            backend_options=backend_options, audit=audit))
        yield _opened(parts, adapter, stack, options)


def _opened(parts: DeployedParts, adapter: MoEModelAdapter, stack: StackOptions,
            options: EngineOptions) -> OpenedEngine:
    engine = assemble(parts.runner, tokenizer=adapter.tokenizer, options=options,
                      hooks=salc_hooks(parts.stack, stack))
    parts.biller.attach(engine)
    spawn = parts.spawn

    def sibling() -> OpenedEngine:
        assert spawn is not None  # deployed parts can always make more
        return _opened(spawn(), adapter, stack, options)

    return OpenedEngine(engine, parts.biller, parts.stack, parts.runner, parts.deployment,
                        parts.backend, parts.device, [*adapter.notes, *parts.notes],
                        spawn=sibling if spawn is not None else None)


def _in_process(adapter: MoEModelAdapter, stack: StackOptions, options: EngineOptions,
                billing: Billing) -> OpenedEngine:
    """No plan: every expert in this process (nothing to tear down)."""
    device = move_model(adapter, options.device)
    notes: list[str] = list(adapter.notes)
    pieces = compose(stack.local or in_process_experts(adapter, stack.kernel),
                     brownout=brownout_piece(adapter, stack, device, notes),
                     faults=stack.faults, retry=stack.retry, wrap=stack.wrap)
    if stack.faults is not None and stack.faults.kind != "none":
        notes.append(f"faults: {stack.faults.kind} at {stack.faults.rate:.0%} of expert calls "
                     "(emulated)")
    runner = InProcessRunner(adapter, experts=pieces, kv_budget_bytes=options.kv_budget_bytes,
                             block_size=options.block_size, max_num_seqs=options.max_num_seqs,
                             max_model_len=options.max_model_len,
                             **runner_sizes(options))
    engine = assemble(runner, tokenizer=adapter.tokenizer, options=options,
                      hooks=salc_hooks(pieces, stack))
    biller = InProcessBiller(InProcessPricer(load_platform(billing.platform), billing.memory_mb))
    return OpenedEngine(engine, biller, pieces, runner, device=str(device), notes=notes)



def in_process_engine(adapter: MoEModelAdapter, *, stack: StackOptions | None = None,
                      billing: Billing | None = None, **options: Any) -> OpenedEngine:
    """:func:`open_engine` without a plan, when nothing needs tearing down (every expert in
    this process): ``options`` are :class:`EngineOptions` fields."""
    return _in_process(adapter, stack or StackOptions(), EngineOptions(**options),
                       billing or Billing())
