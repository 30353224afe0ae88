"""The options every engine-opening command shares (``generate``, ``serve``, ``bench serve``):
a plan, a backend, a store, brownout, fault injection, the device and the kernel, checked
before any model loads and turned into one ``compose.open_engine`` call."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import typer

from moefleet import limits as L
from moefleet.errors import MoefleetError

if TYPE_CHECKING:
    from moefleet.compose import OpenedEngine
    from moefleet.models.base import MoEModelAdapter

PlanOpt = Annotated[str | None, typer.Option(
    help="deployment plan YAML: its experts run in its functions on --backend (a Remoe plan: "
         "this process plays its main function); each request is billed from its "
         "invocations")]
BackendOpt = Annotated[str, typer.Option(help="function backend with --plan: local|ray|aws")]
StoreOpt = Annotated[str | None, typer.Option(
    help="object store with --plan: a directory or s3://bucket/prefix (default: a temporary "
         "directory, removed at exit)")]
WorkersOpt = Annotated[int | None, typer.Option(
    help="local backend: worker processes (default: the machine's cores)")]
BrownoutOpt = Annotated[str | None, typer.Option(
    help="BrownoutServe: ways=8,threshold=0.4 (fixed) or ways=8,slo-ttft=S,slo-tpot=S "
         "(SALC sets the threshold each step)[,mode=partial|full,warning=,increment=,"
         "shrink=,window=,interval=]")]
FaultsOpt = Annotated[str | None, typer.Option(
    help="resilience testing: KIND:RATE[:SEED[:SECONDS]], KIND one of crash, timeout, "
         "throttle, straggler, stall, error; RATE = fraction of expert calls (at the "
         "backend with --plan: crash kills real local workers; else emulated)")]
KernelOpt = Annotated[str, typer.Option(
    help="in-process expert kernel: auto, fused, stacked or loop")]
DtypeOpt = Annotated[str, typer.Option(
    help="weights, activations and KV cache: auto (checkpoint's on a GPU, the faster "
         "measured one on the CPU), bfloat16, float16 or float32")]
KVMemoryOpt = Annotated[str | None, typer.Option(
    help="KV cache size, e.g. 4GiB (default: from GPU memory on a GPU; on the CPU room "
         "for max-num-seqs full sequences, at most 2GiB)")]
GpuUtilOpt = Annotated[float, typer.Option(
    help="GPU: fraction of the device's memory for weights, activations and KV blocks")]
AttentionOpt = Annotated[str, typer.Option(
    help="how attention reads the KV cache: gather (copy each sequence's history), paged "
         "(FlexAttention over the cache blocks, no copy) or auto (paged on CUDA; on the "
         "CPU paged is for correctness tests only)")]


@dataclass
class DeploymentArgs:
    """What the shared options parsed into (see :func:`parse`)."""

    plan: Any = None  # DeploymentPlan
    backend: str = "local"
    store: str | None = None
    workers: int | None = None
    brownout: Any = None  # BrownoutSpec
    faults: Any = None  # FaultPlan
    device: str = "cpu"
    kernel: str = "auto"
    max_num_seqs: int = 64
    dtype: str = "auto"
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    attention: str = "gather"


def parse(*, plan: str | None, backend: str, store: str | None, workers: int | None,
          brownout: str | None, inject_faults: str | None, device: str, kernel: str,
          max_num_seqs: int, dtype: str = "auto", kv_cache_memory: str | None = None,
          gpu_memory_utilization: float = 0.9, attention: str = "gather") -> DeploymentArgs:
    """Check every shared option and read the files they name; no model loads here."""
    from moefleet.engine.build import check_engine_args, resolve_device
    from moefleet.engine.kv_sizing import check_fraction, parse_size
    from moefleet.experts.kernels import KERNELS
    from moefleet.models.attention import ATTENTION_CHOICES
    from moefleet.models.dtypes import DTYPES, check_dtype_name, check_supported

    if plan is None and (store is not None or workers is not None):
        raise MoefleetError("--store and --workers only apply with --plan",
                            "add --plan plan.yaml, or drop them")
    if workers is not None and not 1 <= workers <= L.MAX_WORKERS:
        raise MoefleetError(f"--workers must be in [1, {L.MAX_WORKERS}], got {workers}",
                            "e.g. --workers 2")
    if store is not None and not store.strip():
        raise MoefleetError("--store is empty", "name a directory or s3://bucket/prefix")
    if kernel not in KERNELS:
        raise MoefleetError(f"unknown --kernel {kernel!r}", f"use one of {', '.join(KERNELS)}")
    if attention not in ATTENTION_CHOICES:
        raise MoefleetError(f"unknown --attention {attention!r}",
                            f"use one of {', '.join(ATTENTION_CHOICES)}")
    check_engine_args(device, max_num_seqs)
    check_dtype_name(dtype)
    if dtype != "auto":
        check_supported(DTYPES[dtype], resolve_device(device))
    args = DeploymentArgs(backend=backend, store=store, workers=workers, device=device,
                          kernel=kernel, max_num_seqs=max_num_seqs, dtype=dtype,
                          kv_cache_bytes=None if kv_cache_memory is None
                          else parse_size(kv_cache_memory),
                          gpu_memory_utilization=check_fraction(gpu_memory_utilization),
                          attention=attention)
    if brownout is not None:
        from moefleet.experts.brownout_control import parse_brownout_spec

        args.brownout = parse_brownout_spec(brownout)
    if inject_faults is not None:
        from moefleet.runtime.faults import parse_fault

        args.faults = parse_fault(inject_faults)
    if plan is not None:
        from moefleet.plan import DeploymentPlan
        from moefleet.runtime.base import backend_names

        if backend not in backend_names():
            raise MoefleetError(f"unknown backend {backend!r}",
                                f"available backends: {', '.join(backend_names())}")
        args.plan = DeploymentPlan.load(plan)
        if dtype not in ("auto", "float32"):
            # deploy uploads the checkpoint's float32 weights and the functions compute
            # in float32: the engine's side must hand them float32 activations
            raise MoefleetError(f"--dtype {dtype} does not combine with --plan: a plan's "
                                "functions run float32 weights",
                                "drop --dtype (or use --dtype float32) with --plan")
        if args.plan.main is not None:
            from moefleet.runtime.main_model import main_device

            main_device(args.plan.main.gpu_gb, device)
    return args


def load_model(model: str, args: DeploymentArgs) -> MoEModelAdapter:
    """The model in ``--dtype``, a real shape built directly on ``--device``."""
    from moefleet.models.registry import load_adapter

    # with a plan, "auto" keeps the checkpoint's dtype: the functions compute in it too
    dtype = None if args.plan is not None and args.dtype == "auto" else args.dtype
    return load_adapter(model, dtype=dtype, device=args.device)


class DistillProgress:
    """Distilling united experts (``--brownout``, first time only) takes minutes: a
    progress line with an ETA on stderr, rewritten in place on a terminal; elsewhere
    (a log, a pipe) one plain line per group at most every 5 s, and the last one."""

    def __init__(self, model: str, every_s: float = 5.0) -> None:
        self.model, self.every_s = model, every_s
        self.t0: float | None = None
        self.last = 0.0

    def __call__(self, done: int, total: int, what: str) -> None:
        import sys
        import time

        now = time.monotonic()
        if self.t0 is None:
            self.t0 = self.last = now
            sys.stderr.write(f"note: distilling united experts of {self.model} for "
                             "--brownout (once; cached afterwards)\n")
        elapsed = now - self.t0
        eta = f"{elapsed / done * (total - done):.0f} s" if done else "unknown"
        line = (f"distilling united experts: {done}/{total} groups, {elapsed:.0f} s "
                f"elapsed, ETA {eta} ({what})")
        if sys.stderr.isatty():
            sys.stderr.write("\r" + line + ("\n" if done == total else ""))
        elif done in (0, 1, total) or now - self.last >= self.every_s:
            sys.stderr.write(line + "\n")
            self.last = now
        sys.stderr.flush()


@contextlib.contextmanager
def open_cli_engine(adapter: MoEModelAdapter, args: DeploymentArgs, *, model_ref: str,
                    billing: Any = None, **engine: Any) -> Iterator[OpenedEngine]:
    """``compose.open_engine`` with the parsed options (``engine``: more EngineOptions)."""
    from moefleet.compose import EngineOptions, StackOptions, open_engine

    stack = StackOptions(kernel=args.kernel, brownout=args.brownout,  # type: ignore[arg-type]
                         faults=args.faults, distill_progress=DistillProgress(model_ref))
    sizes: dict[str, Any] = {"kv_budget_bytes": args.kv_cache_bytes,
                             "gpu_memory_utilization": args.gpu_memory_utilization,
                             "attention": args.attention}
    options = EngineOptions(device=args.device, max_num_seqs=args.max_num_seqs,
                            **{**sizes, **engine})
    backend_options = {} if args.workers is None else {"workers": args.workers}
    with open_engine(adapter, plan=args.plan, stack=stack, options=options,
                     backend=args.backend, store=args.store, backend_options=backend_options,
                     billing=billing, model_ref=model_ref) as opened:
        yield opened
