"""``moefleet plan --policy remoe|cpu|gpu|mix|fetch`` in-process: the plan's placement
(main + one group per layer), planning time reported, and the bad-input errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from moefleet.cli import app
from moefleet.plan import DeploymentPlan

runner = CliRunner()


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    rng = np.random.default_rng(0)
    s = rng.dirichlet(np.full(64, 0.3), size=26)
    np.save(tmp_path / "s.npy", s)
    (tmp_path / "other.json").write_text(json.dumps({"model": "gpt2-moe", "s_LE": s.tolist()}))
    (tmp_path / "timing.json").write_text(json.dumps({"cpu_flops_1": 1.6e9,
                                                      "cpu_flops_batch": 1.8e10}))
    return {"s": tmp_path / "s.npy", "other": tmp_path / "other.json",
            "timing": tmp_path / "timing.json", "out": tmp_path / "plan.yaml"}


def _args(f: dict[str, Path], *extra: str, policy: str = "remoe",
          activation: str = "s", ttft: str = "60", tpot: str = "2") -> list[str]:
    return ["plan", "--policy", policy, "--platform", "alibaba-fc-gpu", "--ttft", ttft,
            "--tpot", tpot, "--activation", str(f[activation]), "--timing",
            str(f["timing"]), "-o", str(f["out"]), *extra]


def test_remoe_plan_has_main_and_groups(files: dict[str, Path]) -> None:
    res = runner.invoke(app, _args(files, "--json"))
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["predicted"]["solve_s"] > 0 and "GPU emulated" in info["meta"]["gpu"]
    assert info["meta"]["memory"]["theorem2_convex"] is True
    plan = DeploymentPlan.load(files["out"])
    pl = plan.placement()
    assert pl.main is not None and pl.main.memory_mb == plan.main.memory_mb  # type: ignore[union-attr]
    assert len(plan.groups) == 26 and not pl.segments
    for g in plan.groups:
        fns = pl.expert_functions(g.layer)
        assert len(fns) == 1 and fns[0].replicas == g.replicas
        assert sorted(fns[0].experts + tuple(plan.main_expert_ids(g.layer))) == list(range(64))
    assert DeploymentPlan.from_yaml(plan.to_yaml()) == plan
    shown = runner.invoke(app, ["plan", "show", str(files["out"])])
    assert shown.exit_code == 0 and "main" in shown.stdout


@pytest.mark.parametrize("policy", ["cpu", "mix", "fetch"])
def test_baseline_policies_write_plans(files: dict[str, Path], policy: str) -> None:
    res = runner.invoke(app, _args(files, "--json", policy=policy, ttft="1000", tpot="100"))
    assert res.exit_code == 0, res.output
    plan = DeploymentPlan.load(files["out"])
    assert plan.policy == f"remoe-{policy}" and not plan.groups
    assert plan.main is not None and (plan.main.gpu_gb > 0) == (policy != "cpu")


def test_gpu_baseline_that_needs_more_than_one_card_is_refused(files: dict[str, Path]
                                                                 ) -> None:
    # DeepSeek-V2-Lite's 26 x 64 bf16 experts + non-experts need 28 GB; an A10 has 24 GB.
    res = runner.invoke(app, _args(files, policy="gpu", ttft="1000", tpot="100"))
    assert res.exit_code != 0
    assert "needs 28 GB of GPU memory, one GPU of the platform has 24 GB" in res.output


def test_bad_inputs_have_clear_errors(files: dict[str, Path]) -> None:
    res = runner.invoke(app, _args(files, ttft="0.5", tpot="0.001"))
    assert res.exit_code != 0
    assert "infeasible: the fastest layout gives TTFT" in res.output
    res = runner.invoke(app, _args(files, activation="other"))
    assert res.exit_code != 0 and "predicted for 'gpt2-moe'" in res.output
    res = runner.invoke(app, _args(files, "--model", "gpt2-moe"))
    assert res.exit_code != 0 and "12 MoE layers x 8 experts" in res.output
    res = runner.invoke(app, _args(files, "--remote-memory", "1000"))
    assert res.exit_code != 0 and "not offered by 'alibaba-fc-gpu'" in res.output
    args = _args(files)
    args[args.index("alibaba-fc-gpu")] = "aws-lambda"
    res = runner.invoke(app, args)
    assert res.exit_code != 0 and "has no GPU functions" in res.output


def test_plan_file_groups_are_validated(files: dict[str, Path]) -> None:
    from moefleet.plan.plan import PlanError

    assert runner.invoke(app, _args(files)).exit_code == 0
    text = files["out"].read_text()
    plan = DeploymentPlan.from_yaml(text)
    bad = plan.model_dump(mode="json")
    bad["groups"][0]["experts"] = [64]
    import yaml

    with pytest.raises(PlanError, match="replica_experts"):  # LPT sets no longer cover it
        DeploymentPlan.from_yaml(yaml.safe_dump(bad))
    bad["groups"][0]["replica_experts"] = None
    with pytest.raises(PlanError, match="below 64"):
        DeploymentPlan.from_yaml(yaml.safe_dump(bad))
    bad = plan.model_dump(mode="json")
    bad["main"] = None
    with pytest.raises(PlanError, match="need a main function"):
        DeploymentPlan.from_yaml(yaml.safe_dump(bad))
