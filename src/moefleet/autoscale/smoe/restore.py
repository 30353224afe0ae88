"""Loading a read checkpoint (:mod:`moefleet.autoscale.smoe.checkpoint`) into an agent.

Invariant: before anything is loaded, the checkpoint's tensor names are exactly the ones
its metadata and the agent's networks imply (networks, kept actor, optimiser states,
generator state, replay), each with the agent's shape and dtype, and the optimisers'
param groups have the agent's keys, parameter ids and value kinds. So a crafted or
mismatched file is one error line naming the file and the field, never a torch error
later in training.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from moefleet.autoscale.errors import AutoscaleError
from moefleet.autoscale.smoe.agent import SmoeAgent, Transition
from moefleet.autoscale.smoe.checkpoint import (
    NETS,
    OPTIMISERS,
    REPLAY_TENSORS,
    RETRAIN,
    Checkpoint,
    Optimiser,
)
from moefleet.autoscale.smoe.graph import num_features

Template = tuple[tuple[int, ...], torch.dtype]


def restore(ck: Checkpoint, agent: SmoeAgent) -> None:
    """Load ``ck`` into a fresh ``agent`` built for its setup, space, spec and DDPG
    settings (module doc for what is checked first)."""
    m, t, where = ck.meta, ck.tensors, f"checkpoint {ck.path}"
    check_tensors(ck, agent)
    for n in NETS:
        net = getattr(agent, n)
        net.load_state_dict({k: t[f"{n}.{k}"] for k in net.state_dict()})
    agent.actor_best = ({k: t[f"actor_best.{k}"] for k in agent.actor.state_dict()}
                        if m.actor_best else None)
    for name in OPTIMISERS:
        _load_optimiser(getattr(m, name), getattr(agent, name), t, name, where)
    agent.epsilon, agent.updates = m.epsilon, m.updates
    try:
        agent.rng.setstate(m.rng)
        torch.set_rng_state(t["torch_rng"])
    except (ValueError, TypeError, OverflowError, RuntimeError) as err:
        raise AutoscaleError(f"{where}: field 'rng' is not a generator state ({err})",
                             RETRAIN) from None
    for i, (demo, slo_ok, labelled) in enumerate(m.replay):
        parts = {f: t[f"replay.{i}.{f}"] for f in REPLAY_TENSORS}
        target = t[f"replay.{i}.target_N"] if labelled else None
        agent.remember(Transition(**parts, demo=demo, slo_ok=slo_ok, target_N=target))
    agent.best = m.best.model_dump() if m.best is not None else None
    agent.warm = m.warm.model_dump(exclude_unset=True)


def replay_templates(agent: SmoeAgent) -> dict[str, Template]:
    """Shape and dtype of each replay tensor for ``agent``'s pipeline and space."""
    n, c = agent.dag.num_nodes, agent.space.size
    f, g = num_features(agent.space.has_gpu), len(agent.dag.groups)
    return {"x_NF": ((n, f), torch.float32), "valid_NC": ((n, c), torch.bool),
            "action_N": ((n,), torch.int64), "reward_G": ((g,), torch.float32),
            "x2_NF": ((n, f), torch.float32), "valid2_NC": ((n, c), torch.bool),
            "target_N": ((n,), torch.int64)}


def check_tensors(ck: Checkpoint, agent: SmoeAgent) -> None:
    """Every tensor the metadata and ``agent`` imply is there with the right shape and
    dtype, and no other (an optimiser state is a scalar or its parameter's shape)."""
    m, where = ck.meta, f"checkpoint {ck.path}"
    want: dict[str, Template | None] = {}  # None: checked by _load_optimiser's rule
    nets = {n: getattr(agent, n).state_dict() for n in NETS}
    if m.actor_best:
        nets["actor_best"] = nets["actor"]
    for n, sd in nets.items():
        want.update({f"{n}.{k}": (tuple(v.shape), v.dtype) for k, v in sd.items()})
    for name in OPTIMISERS:
        for pid, keys in getattr(m, name).state.items():
            want.update({f"{name}.state.{pid}.{k}": None for k in keys})
    rng = torch.get_rng_state()
    want["torch_rng"] = (tuple(rng.shape), rng.dtype)
    shapes = replay_templates(agent)
    for i, (_, _, labelled) in enumerate(m.replay):
        for f in (*REPLAY_TENSORS, *(["target_N"] if labelled else [])):
            want[f"replay.{i}.{f}"] = shapes[f]
    have = ck.tensors
    missing, extra = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
    if missing:
        raise AutoscaleError(f"{where}: tensor '{missing[0]}' is missing"
                             + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""),
                             "was it written for another network or space? retrain")
    if extra:
        raise AutoscaleError(f"{where}: unexpected tensor '{extra[0]}'"
                             + (f" (+{len(extra) - 1} more)" if len(extra) > 1 else ""),
                             RETRAIN)
    for name, tmpl in want.items():
        t = have[name]
        if tmpl is not None and (tuple(t.shape) != tmpl[0] or t.dtype != tmpl[1]):
            raise AutoscaleError(f"{where}: tensor '{name}' is {t.dtype} {tuple(t.shape)}, "
                                 f"expected {tmpl[1]} {tmpl[0]}", RETRAIN)


def _same_kind(value: Any, fresh: Any) -> bool:
    """A saved param-group value may replace the fresh one: same JSON kind, finite."""
    if fresh is None or isinstance(fresh, bool):
        return type(value) is type(fresh)
    if isinstance(fresh, int | float):
        return (isinstance(value, int | float) and not isinstance(value, bool)
                and math.isfinite(value))
    if isinstance(fresh, list | tuple):
        return (isinstance(value, list) and len(value) == len(fresh)
                and all(_same_kind(v, f) for v, f in zip(value, fresh, strict=True)))
    return False


def _load_optimiser(meta: Optimiser, opt: torch.optim.Optimizer,
                    tensors: dict[str, torch.Tensor], name: str, where: str) -> None:
    fresh = opt.state_dict()["param_groups"]
    if len(meta.param_groups) != len(fresh):
        raise AutoscaleError(f"{where}: field '{name}.param_groups' has "
                             f"{len(meta.param_groups)} groups, expected {len(fresh)}", RETRAIN)
    groups = []
    for gi, (saved, f) in enumerate(zip(meta.param_groups, fresh, strict=True)):
        field = f"{name}.param_groups.{gi}"
        if saved.keys() != f.keys():
            odd = sorted(saved.keys() ^ f.keys())[0]
            raise AutoscaleError(f"{where}: field '{field}.{odd}' is "
                                 f"{'unexpected' if odd in saved else 'missing'}", RETRAIN)
        if saved["params"] != f["params"]:
            raise AutoscaleError(f"{where}: field '{field}.params' names other parameters "
                                 "than the network has", RETRAIN)
        for k, v in saved.items():
            if not _same_kind(v, f[k]):
                raise AutoscaleError(f"{where}: field '{field}.{k}' is {v!r}, not like "
                                     f"{f[k]!r}", RETRAIN)
        groups.append({k: tuple(v) if isinstance(f[k], tuple) and isinstance(v, list) else v
                       for k, v in saved.items()})
    params = [p for g in opt.param_groups for p in g["params"]]
    state: dict[int, dict[str, torch.Tensor]] = {}
    for pid, keys in meta.state.items():
        if not (pid.isascii() and pid.isdigit()) or int(pid) >= len(params):
            raise AutoscaleError(f"{where}: field '{name}.state' names parameter {pid!r}; "
                                 f"the network has {len(params)}", RETRAIN)
        p = params[int(pid)]
        state[int(pid)] = {}
        for k in keys:
            t = tensors[f"{name}.state.{pid}.{k}"]
            if (t.dim() and tuple(t.shape) != tuple(p.shape)) or not t.is_floating_point():
                raise AutoscaleError(f"{where}: tensor '{name}.state.{pid}.{k}' is "
                                     f"{t.dtype} {tuple(t.shape)}, expected a float scalar "
                                     f"or {tuple(p.shape)}", RETRAIN)
            state[int(pid)][k] = t
    opt.load_state_dict({"state": state, "param_groups": groups})
