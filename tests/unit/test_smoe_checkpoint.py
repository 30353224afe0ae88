"""sMoE checkpoint format 2 (safetensors + schema-checked JSON): round trip, resume,
one-line errors for every kind of damage, and the format-1 converter."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from moefleet.autoscale.errors import AutoscaleError
from moefleet.autoscale.smoe import ActorSpec, ConfigSpace, DDPGConfig
from moefleet.autoscale.smoe.checkpoint import KEY, agent_state
from moefleet.autoscale.smoe.train import TrainSetup, load_checkpoint, save_checkpoint, train
from moefleet.cli import app

TINY = "synthetic:blocks=2,experts=2,top_k=1,hidden=64,decoder=0"
SPACE = ConfigSpace(memory_mb=(512, 2048), replicas=(1, 2), concurrency=(1, 2))
SETUP = TrainSetup(model=TINY, slo_s=0.2, interval_s=60.0, mean_rps=0.3, windows_per_pattern=2)
KW: dict[str, Any] = dict(setup=SETUP, space=SPACE, spec=ActorSpec(hidden=8), demo_episodes=1,
                          validate_every=1)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two episodes with the teacher: replay, optimiser moments, kept actor, warm record."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("ck") / "smoe.safetensors"
    train(out, episodes=2, ddpg=DDPGConfig(warmup=4, batch_size=4, bc_pretrain_steps=5,
                                           bc_floor=0.5), teacher=True, **KW)
    return out


def read(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()[KEY]), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def rewrite(src: Path, dst: Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    save_file(tensors, str(dst), metadata={KEY: json.dumps(meta)})
    return dst


def test_load_then_save_is_identical(trained: Path, tmp_path: Path) -> None:
    _, agent, setup, episodes, history = load_checkpoint(trained, expect_setup=SETUP,
                                                         expect_space=SPACE)
    assert set(agent.warm) == {"teacher", "search", "bc"} and agent.best is not None
    assert agent.actor_best is not None and agent.opt_a.state_dict()["state"]
    assert len(agent.replay) > 0 and any(t.target_N is not None for t in agent.replay)
    assert agent.opt_a.param_groups[0]["betas"] == (0.9, 0.999)  # a tuple again
    again = save_checkpoint(tmp_path / "again.safetensors", agent, setup, episodes, history)
    (m1, t1), (m2, t2) = read(trained), read(again)
    assert m1 == m2 and t1.keys() == t2.keys()
    assert all(torch.equal(t1[k], t2[k]) for k in t1)


def test_resume_continues_identically(tmp_path: Path) -> None:
    """Two episodes, then a resumed third, end in the same state as three in one go."""
    kw = {**KW, "ddpg": DDPGConfig(warmup=4, batch_size=4), "teacher": False}
    train(tmp_path / "a.st", episodes=3, **kw)
    train(tmp_path / "b.st", episodes=2, **kw)
    train(tmp_path / "b.st", episodes=3, resume=True, **kw)
    (ma, ta), (mb, tb) = read(tmp_path / "a.st"), read(tmp_path / "b.st")
    assert ta.keys() == tb.keys()
    assert [k for k in ta if not torch.equal(ta[k], tb[k])] == []
    for m in (ma, mb):
        for row in m["history"]:
            row.pop("wall_s"), row.pop("cpu_s")
    assert ma == mb


def _nan(t: dict[str, torch.Tensor]) -> None:
    name = next(k for k in t if k.startswith("actor.") and t[k].numel() > 1)
    t[name] = t[name].clone()
    t[name].view(-1)[0] = float("nan")


def _reshape(t: dict[str, torch.Tensor]) -> None:
    name = next(k for k in t if k.startswith("critic.") and t[k].dim() == 2)
    t[name] = torch.zeros(3, 3)


DAMAGE: dict[str, tuple[Callable[[dict[str, Any], dict[str, torch.Tensor]], Any], str]] = {
    "missing-setup-field": (lambda m, t: m["setup"].pop("slo_s"), "field 'setup.slo_s' is missing"),
    "unknown-key": (lambda m, t: m.update(bogus=1), "field 'bogus'"),
    "wrong-type": (lambda m, t: m.update(episodes="2"), "field 'episodes'"),
    "nested-wrong-type": (lambda m, t: m["history"][0].update(demo="yes"),
                          "field 'history.0.demo'"),
    "missing-history-key": (lambda m, t: m["history"][0].pop("pattern"),
                            "field 'history.0.pattern'"),
    "bad-space": (lambda m, t: m["space"].update(replicas=[2, 1]), "strictly increasing"),
    "space-id": (lambda m, t: m.update(space_id="other"), "field 'space_id'"),
    "format": (lambda m, t: m.update(format=1), "of format 1"),
    "param-group": (lambda m, t: m["opt_a"]["param_groups"][0].update(lr="fast"),
                    "field 'opt_a.param_groups.0.lr'"),
    "param-group-nan": (lambda m, t: m["opt_c"]["param_groups"][0].update(eps=float("nan")),
                        "field 'opt_c.param_groups.0.eps'"),
    "rng": (lambda m, t: m.update(rng=[3, [1, 2, 3], None]), "field 'rng'"),
    "nan-weight": (lambda m, t: _nan(t), "holds NaN or infinite values"),
    "missing-tensor": (lambda m, t: t.pop(next(k for k in t if k.startswith("critic."))),
                       "is missing"),
    "extra-tensor": (lambda m, t: t.update(evil=torch.zeros(1)), "unexpected tensor 'evil'"),
    "wrong-shape": (lambda m, t: _reshape(t), "expected torch.float32"),
    "replay-flags": (lambda m, t: m["replay"][0].__setitem__(2, not m["replay"][0][2]),
                     "tensor 'replay.0.target_N'"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damage_is_one_line_naming_file_and_field(case: str, trained: Path,
                                                  tmp_path: Path) -> None:
    meta, tensors = read(trained)
    damage, needle = DAMAGE[case]
    damage(meta, tensors)
    bad = rewrite(trained, tmp_path / "bad.safetensors", meta, tensors)
    with pytest.raises(AutoscaleError) as got:
        load_checkpoint(bad)
    msg = str(got.value)
    assert "\n" not in msg and str(bad) in msg and needle in msg, msg


def _format1(trained: Path, dst: Path, drop: tuple[str, ...] = ()) -> Path:
    """A format-1 file as ``moefleet autoscale train`` wrote it before format 2: the
    same state pickled whole by torch.save (minus fields older versions lacked)."""
    _, agent, setup, episodes, history = load_checkpoint(trained)
    state = {**agent_state(agent, setup, episodes, history), "format": 1}
    for key in drop:
        section, field = key.split(".")
        if section == "history":
            state[section] = [{k: v for k, v in r.items() if k != field} for r in history]
        else:
            state[section] = {k: v for k, v in state[section].items() if k != field}
    torch.save(state, dst)
    return dst


def test_format1_checkpoints_are_refused_with_the_converter_and_convert(
        trained: Path, tmp_path: Path) -> None:
    old = _format1(trained, tmp_path / "old.pt", drop=("ddpg.bc_floor", "history.cpu_s"))
    with pytest.raises(AutoscaleError, match="convert-checkpoint"):
        load_checkpoint(old)
    new = tmp_path / "new.safetensors"
    res = CliRunner().invoke(app, ["autoscale", "convert-checkpoint", str(old), str(new)])
    assert res.exit_code == 0, res.output
    _, agent, _, _, history = load_checkpoint(new)
    assert agent.cfg.bc_floor == 0.0 and history[0]["cpu_s"] is None  # format 1's defaults
    (_, t_new), (_, t_ref) = read(new), read(trained)
    assert t_new.keys() == t_ref.keys() and all(torch.equal(t_new[k], t_ref[k]) for k in t_new)
    res = CliRunner().invoke(app, ["autoscale", "convert-checkpoint", str(new),
                                   str(tmp_path / "x.safetensors")])
    assert res.exit_code != 0 and "already a format-2 checkpoint" in res.stderr
    again = tmp_path / "again.safetensors"
    res = CliRunner().invoke(app, ["autoscale", "convert-checkpoint", str(old), str(again),
                                   "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == {"input": str(old), "output": str(again), "format": 2}
