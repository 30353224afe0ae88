"""sMoE checkpoint files (format 2): tensors in safetensors, the rest as schema-checked JSON.

One safetensors file (any extension: the first bytes decide). Tensors by dotted name::

    actor.<param>  critic.<param>  actor_t.<param>  critic_t.<param>  [actor_best.<param>]
    opt_a.state.<param id>.<key>   opt_c.state.<param id>.<key>    (Adam's step and moments)
    torch_rng                      the CPU generator's state (uint8)
    replay.<i>.<field>             the newest REPLAY_SAVED transitions (target_N if labelled)

The header's metadata holds one JSON document under ``moefleet.smoe``, a :class:`Meta`:
the scenario (:class:`TrainSetup`), the config space and its fingerprint, the networks'
and DDPG's settings, episodes and their history, the optimisers' param groups and the
names of their state tensors, exploration rate, update count, Python RNG state, the
replay's flags, the kept actor's score and the warm-start record.

Invariants of :func:`read_checkpoint`: nothing is unpickled or evaluated (safetensors
parses a bounded JSON header and raw buffers; pydantic validates the JSON with strict
types and no unknown keys; every dataclass section must name all of its fields); every
floating tensor is finite. :func:`moefleet.autoscale.smoe.restore.restore` adds what
needs the agent: the tensor names are exactly the ones the metadata and the networks
imply, with the agent's shapes and dtypes. Every failure is one :class:`AutoscaleError`
line naming the file and the field.
Format-1 files (torch pickles) are recognised by their first bytes alone and refused
with the converter's command (:mod:`moefleet.autoscale.smoe.convert`).

Libraries: safetensors (the runtime's payloads and weights already use it) and pydantic
(the plans' schema library), rather than a hand-written container or validator.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from moefleet.autoscale.errors import AutoscaleError
from moefleet.autoscale.smoe.agent import DDPGConfig, SmoeAgent
from moefleet.autoscale.smoe.harness import DEFAULT_MODEL
from moefleet.autoscale.smoe.nets import ActorSpec
from moefleet.autoscale.smoe.space import ConfigSpace
from moefleet.errors import MoefleetError, validation_message
from moefleet.io import atomic_path
from moefleet.torch_io import safetensors_ready

FORMAT = 2
REPLAY_SAVED = 1000  # newest transitions kept (the rest would make files hundreds of MB)
KEY = "moefleet.smoe"
NETS = ("actor", "critic", "actor_t", "critic_t")
OPTIMISERS = ("opt_a", "opt_c")
REPLAY_TENSORS = ("x_NF", "valid_NC", "action_N", "reward_G", "x2_NF", "valid2_NC")
RETRAIN = "train a new one with moefleet autoscale train"


@dataclass(frozen=True)
class TrainSetup:
    """Everything a checkpoint must agree with to be reused."""

    model: str = DEFAULT_MODEL
    slo_s: float = 0.3
    interval_s: float = 10.0
    prompt_tokens: int = 64
    mean_rps: float = 3.0
    window_minutes: int = 10
    windows_per_pattern: int = 12
    routing_trace: str = ""  # "" = uniform routing; else a Parquet routing trace
    platform: str = "openfaas-k8s"  # openfaas-k8s-gpu for a space with GPU shares

    @property
    def scenario(self) -> str:
        return "skewed" if self.routing_trace else "uniform"


# ---- the metadata schema ---------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


Json = bool | int | float | str | None
Count = Annotated[int, Field(ge=0)]


class Score(_Strict):
    score: float
    cost_vs_static: float
    worst_p95_over_slo: float


class Kept(Score):
    episode: int


class HistoryRow(_Strict):
    episode: int
    pattern: str
    window: str
    cost_usd: float
    p95_s: float
    reward: float
    demo: bool
    epsilon: float
    updates: int
    imitation_weight: float | None  # None: converted from before the imitation floor
    wall_s: float
    cpu_s: float | None  # None: converted from before CPU accounting
    validation: Score | None


class Segment(_Strict):
    memory_mb: int
    replicas: int
    concurrency: int
    gpu_share: float


class Teacher(_Strict):
    rho: float
    segment: Segment
    max_replicas: int
    expert_gpu: float
    expert_memory_mb: int


class SearchRow(_Strict):
    rule: str
    rho: float
    cost_vs_static: float
    worst_p95_over_slo: float
    meets: bool


class Cloning(_Strict):
    steps: int
    labelled: int
    agreement_before: float | None = None
    agreement_after: float | None = None
    last_loss: float | None = None
    validation: Kept | None = None


class Warm(_Strict):
    """The warm-start record; a key's absence means that step has not run (train.py)."""

    teacher: Teacher | None = None
    search: list[SearchRow] = []
    bc: Cloning | None = None


class Optimiser(_Strict):
    param_groups: list[dict[str, Json | list[Json]]]
    state: dict[str, list[str]]  # param id -> names of its state tensors


class Meta(_Strict):
    format: Literal[2]
    setup: TrainSetup
    dag: str
    space: ConfigSpace
    space_id: str
    spec: ActorSpec
    ddpg: DDPGConfig
    episodes: Count
    history: list[HistoryRow]
    epsilon: Annotated[float, Field(ge=0.0, le=1.0)]
    updates: Count
    rng: tuple[int, tuple[int, ...], float | None]
    opt_a: Optimiser
    opt_c: Optimiser
    replay: list[tuple[bool, bool, bool]]  # (demo, slo_ok, has target_N) per transition
    best: Kept | None
    actor_best: bool
    warm: Warm


# Dataclasses have defaults; a checkpoint must still name every field.
_SECTIONS: dict[str, Any] = {"setup": TrainSetup, "space": ConfigSpace, "spec": ActorSpec,
                             "ddpg": DDPGConfig}


@dataclass
class Checkpoint:
    """A read checkpoint: its validated metadata and its tensors by name."""

    path: Path
    meta: Meta
    tensors: dict[str, torch.Tensor]


# ---- writing ---------------------------------------------------------------------------
def agent_state(agent: SmoeAgent, setup: TrainSetup, episodes: int,
                history: list[dict[str, Any]]) -> dict[str, Any]:
    """What a checkpoint holds, as plain objects (the layout format 1 pickled whole)."""
    return {
        "setup": dataclasses.asdict(setup), "dag": agent.dag.fingerprint(),
        "space": dataclasses.asdict(agent.space), "space_id": agent.space.fingerprint(),
        "spec": dataclasses.asdict(agent.spec), "ddpg": dataclasses.asdict(agent.cfg),
        "episodes": episodes, "history": history,
        **{n: getattr(agent, n).state_dict() for n in (*NETS, *OPTIMISERS)},
        "epsilon": agent.epsilon, "updates": agent.updates,
        "rng": agent.rng.getstate(), "torch_rng": torch.get_rng_state(),
        "replay": [(t.x_NF, t.valid_NC, t.action_N, t.reward_G, t.x2_NF, t.valid2_NC,
                    t.demo, t.slo_ok, t.target_N)
                   for t in list(agent.replay)[-REPLAY_SAVED:]],
        "best": agent.best, "actor_best": agent.actor_best, "warm": agent.warm,
    }


def encode(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], str]:
    """(tensors by name, metadata JSON) of :func:`agent_state`'s dict."""
    tensors: dict[str, torch.Tensor] = {}

    def put(name: str, t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            raise AutoscaleError(f"checkpoint field {name} is a {type(t).__name__}, "
                                 "not a tensor", RETRAIN)
        tensors[name] = t

    nets = [*NETS, *(["actor_best"] if state.get("actor_best") is not None else [])]
    for net in nets:
        for k, v in state[net].items():
            put(f"{net}.{k}", v)
    opts: dict[str, Any] = {}
    for name in OPTIMISERS:
        sd = state[name]
        opts[name] = {"param_groups": [dict(g) for g in sd["param_groups"]],
                      "state": {str(pid): sorted(s) for pid, s in sd["state"].items()}}
        for pid, s in sd["state"].items():
            for key, v in s.items():
                put(f"{name}.state.{pid}.{key}", v)
    put("torch_rng", state["torch_rng"])
    flags = []
    for i, row in enumerate(state["replay"]):
        *parts, demo, slo_ok, target = row
        for field, t in zip(REPLAY_TENSORS, parts, strict=True):
            put(f"replay.{i}.{field}", t)
        if target is not None:
            put(f"replay.{i}.target_N", target)
        flags.append([bool(demo), bool(slo_ok), target is not None])
    doc = {k: state[k] for k in ("setup", "dag", "space", "space_id", "spec", "ddpg",
                                 "episodes", "history", "epsilon", "updates", "rng",
                                 "best", "warm")}
    doc.update(opts, format=FORMAT, replay=flags, actor_best="actor_best" in nets)
    # NaN stays NaN (a measurement can be one); pydantic's JSON parser reads it back.
    # a transition's x2 is the next one's x: one storage, which safetensors refuses
    return safetensors_ready(tensors), json.dumps(doc, sort_keys=True)


def write_state(path: str | Path, state: dict[str, Any]) -> Path:
    """Write ``state`` (see :func:`agent_state`) atomically; its metadata is validated
    first, so what is written can be read back."""
    tensors, text = encode(state)
    parse_meta(text, f"checkpoint {path}")
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={KEY: text})
    return Path(path)


# ---- reading ---------------------------------------------------------------------------
def sniff(head: bytes) -> str:
    """``safetensors``, ``pickle`` (torch.save's zip or raw pickle) or ``unknown``, from
    a file's first bytes; never unpickles."""
    if len(head) >= 9 and head[8:9] == b"{":  # u64 header length, then its JSON
        return "safetensors"
    if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":  # zip / pickle protocol >= 2
        return "pickle"
    return "unknown"


def convert_hint(path: Path) -> str:
    return f"convert it once: moefleet autoscale convert-checkpoint {path} NEW.safetensors"


def read_checkpoint(path: str | Path) -> Checkpoint:
    """The validated metadata and tensors of the checkpoint at ``path`` (module doc)."""
    p = Path(path)
    if not p.is_file():
        raise AutoscaleError(f"no sMoE checkpoint at {p}",
                             "train one: moefleet autoscale train --out CKPT")
    try:
        with open(p, "rb") as fh:
            kind = sniff(fh.read(16))
    except OSError as err:
        raise AutoscaleError(f"cannot read checkpoint {p}: {err.strerror}") from None
    if kind == "pickle":
        raise AutoscaleError(f"{p} is a format-1 sMoE checkpoint (a Python pickle), which "
                             "moefleet no longer loads", convert_hint(p))
    if kind != "safetensors":
        raise AutoscaleError(f"{p} is not a readable sMoE checkpoint (not a safetensors "
                             "file)", RETRAIN)
    try:
        with safe_open(str(p), framework="pt") as f:
            text = (f.metadata() or {}).get(KEY)
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        line = (str(err).splitlines() or [type(err).__name__])[0]
        raise AutoscaleError(f"{p} is not a readable sMoE checkpoint ({line})",
                             RETRAIN) from None
    if text is None:
        raise AutoscaleError(f"{p} is a safetensors file without sMoE metadata ({KEY})",
                             RETRAIN)
    meta = parse_meta(text, f"checkpoint {p}")
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise AutoscaleError(f"checkpoint {p}: tensor '{name}' holds NaN or infinite "
                                 "values", "use an earlier checkpoint or retrain")
    return Checkpoint(p, meta, tensors)


def parse_meta(text: str, where: str) -> Meta:
    """:class:`Meta` from its JSON; every problem is one line naming ``where`` and the field."""
    try:
        doc = json.loads(text)
    except ValueError as err:
        raise AutoscaleError(f"{where}: metadata is not JSON ({err})", RETRAIN) from None
    if not isinstance(doc, dict):
        raise AutoscaleError(f"{where}: metadata is not a JSON object", RETRAIN)
    if doc.get("format") != FORMAT:
        raise AutoscaleError(f"{where} is of format {doc.get('format')!r}; this moefleet "
                             f"reads format {FORMAT}", RETRAIN)
    for key, dc in _SECTIONS.items():
        section = doc.get(key)
        if isinstance(section, dict):
            missing = [f.name for f in dataclasses.fields(dc) if f.name not in section]
            if missing:
                raise AutoscaleError(f"{where}: field '{key}.{missing[0]}' is missing", RETRAIN)
    try:
        return Meta.model_validate_json(text)
    except ValidationError as err:
        raise AutoscaleError(validation_message(err, where), RETRAIN) from None
    except MoefleetError as err:  # a dataclass's own check (e.g. a space out of order)
        raise AutoscaleError(f"{where}: {err.message}", err.hint) from None
