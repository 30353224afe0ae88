"""sMoE checkpoints and ``moefleet autoscale train|eval`` (tiny synthetic scenario)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from moefleet.autoscale.errors import AutoscaleError
from moefleet.autoscale.smoe import ConfigSpace
from moefleet.autoscale.smoe.train import (
    TrainSetup,
    load_checkpoint,
    new_agent,
    save_checkpoint,
)
from moefleet.cli import app

runner = CliRunner()
TINY = "synthetic:blocks=2,experts=2,top_k=1,hidden=64,decoder=0"
SPACE = ConfigSpace(memory_mb=(512, 2048), replicas=(1, 2), concurrency=(1, 2))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _ckpt(tmp_path: Path, setup: TrainSetup, space: ConfigSpace = SPACE) -> Path:
    from moefleet.autoscale.smoe import ActorSpec, DDPGConfig

    _, agent = new_agent(setup, space, ActorSpec(hidden=8), DDPGConfig(), seed=0)
    return save_checkpoint(tmp_path / "a.pt", agent, setup, 0, [])


def test_checkpoint_round_trip_and_mismatches(tmp_path: Path) -> None:
    setup = TrainSetup(model=TINY, slo_s=0.2)
    path = _ckpt(tmp_path, setup)
    _, agent, got, episodes, _ = load_checkpoint(path, expect_setup=setup, expect_space=SPACE)
    assert got == setup and episodes == 0 and agent.space == SPACE
    with pytest.raises(AutoscaleError, match="trained for synthetic:blocks=2"):
        load_checkpoint(path, expect_setup=TrainSetup(model=TINY.replace("blocks=2", "blocks=3")))
    with pytest.raises(AutoscaleError, match="another configuration space"):
        load_checkpoint(path, expect_space=SPACE.without_concurrency())
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(AutoscaleError, match="not a readable sMoE checkpoint"):
        load_checkpoint(bad)
    with pytest.raises(AutoscaleError, match="no sMoE checkpoint"):
        load_checkpoint(tmp_path / "missing.pt")


def test_train_resume_and_eval(tmp_path: Path) -> None:
    out = tmp_path / "s.pt"
    base = ["autoscale", "train", "--out", str(out), "--model", TINY, "--slo", "0.2",
            "--interval", "30", "--window-minutes", "10", "--mean-rps", "0.5", "--json",
            "--no-teacher"]
    res = runner.invoke(app, [*base, "--episodes", "1", "--imitation-floor", "0.25"],
                        catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["episodes"] == 1
    res = runner.invoke(app, [*base, "--episodes", "2", "--resume"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["episodes"] == 2
    _, agent, _, _, hist = load_checkpoint(out)
    assert [h["episode"] for h in hist] == [1, 2] and hist[0]["pattern"] == "bursty"
    # the floor is the checkpoint's: the resumed session kept it without the option
    assert agent.cfg.bc_floor == 0.25
    assert all(h["imitation_weight"] >= 0.25 for h in hist)
    res = runner.invoke(app, ["autoscale", "eval", "-c", str(out), "--pattern", "bursty",
                              "--windows", "1", "--baselines", "static,elasticmoe", "--json"],
                        catch_exceptions=False)
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["results"]["bursty"]
    assert set(rows) == {"s", "static", "elasticmoe"}
    assert all(r["cost_usd"] > 0 and r["p95_s"] > 0 for r in rows.values())
    assert rows["s"]["decision_latency_s"] > 0


@pytest.mark.parametrize(("args", "needle"), [
    (["train", "--out", "x.pt", "--interval", "0"], "interval"),
    (["train", "--out", "x.pt", "--variant", "nope"], "unknown sMoE variant"),
    (["train", "--out", "x.pt", "--stay-prior", "-1"], "--stay-prior"),
    (["train", "--out", "x.pt", "--scenario", "zipf"], "unknown scenario 'zipf'"),
    (["train", "--out", "x.pt", "--scenario", "skewed", "--routing-trace", "none.parquet"],
     "no routing trace at none.parquet"),
    (["train", "--out", "x.pt", "--slo", "0"], "--slo must be > 0"),
    (["train", "--out", "x.pt", "--imitation-floor", "-0.5"], "--imitation-floor must be"),
    (["eval", "-c", "missing.pt"], "no sMoE checkpoint"),
])
def test_bad_input_is_one_line_error(args: list[str], needle: str) -> None:
    res = runner.invoke(app, ["autoscale", *args])
    assert res.exit_code != 0
    assert needle in res.output and "Traceback" not in res.output


def test_validation_keeps_the_best_actor(tmp_path: Path) -> None:
    from moefleet.autoscale.smoe import ActorSpec, DDPGConfig
    from moefleet.autoscale.smoe.train import controller_from_checkpoint, train

    setup = TrainSetup(model=TINY, slo_s=0.2, interval_s=60.0, mean_rps=0.3,
                       windows_per_pattern=2)
    out = tmp_path / "v.pt"
    res = train(out, episodes=4, setup=setup, space=SPACE, spec=ActorSpec(hidden=8),
                ddpg=DDPGConfig(warmup=4, batch_size=4), demo_episodes=1, validate_every=1,
                teacher=False)
    hist = res["history"]
    assert [h["demo"] for h in hist] == [True, False, True, False]
    scored = [h for h in hist if h["validation"]]
    assert [h["episode"] for h in scored] == [2, 4]  # learning episodes only
    _, agent, *_ = load_checkpoint(out)
    best = min(scored, key=lambda h: h["validation"]["score"])
    assert agent.best is not None and agent.actor_best is not None
    assert agent.best["episode"] == best["episode"]
    assert agent.best["score"] == best["validation"]["score"]
    _, ctl, _ = controller_from_checkpoint(out)  # acts with the best actor
    for name, value in ctl.agent.actor.state_dict().items():
        assert torch.equal(value, agent.actor_best[name]), name
