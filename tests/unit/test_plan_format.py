"""DeploymentPlan: YAML round trip, validation messages, model/platform checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from moefleet.plan import DeploymentPlan, PlanError


def _plan() -> DeploymentPlan:
    return DeploymentPlan.uniform("m", "aws-lambda", [0, 2], [4, 4], 3, memory_mb=1024,
                                  method="pipelined", beta=8, replicas=2)


def test_yaml_round_trip(tmp_path: Path) -> None:
    plan = _plan()
    plan.layers[1].experts[3].memory_mb = 2048
    path = plan.save(tmp_path / "p.yaml")
    back = DeploymentPlan.load(path)
    assert back == plan
    assert back.layer(2).experts[3].memory_mb == 2048
    assert back.layer(0).method_code == 1
    assert len(back.function_names()) == 3 + 8


def test_numeric_method_codes_are_accepted() -> None:
    text = _plan().to_yaml().replace("method: pipelined", "method: 3")
    assert DeploymentPlan.from_yaml(text).layer(0).method == "direct"


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (("memory_mb: 1024", "memory_mb: -5", 1), "layers.0.experts.0.memory_mb"),
        (("replicas: 2", "replicas: 0", 1), "replicas"),
        (("method: pipelined", "method: 7", 1), "method"),
        (("policy: uniform", "policy: uniform\nsurprise: 1", 1), "surprise"),
    ],
)
def test_bad_fields_are_named(edit: tuple[str, str, int], needle: str) -> None:
    old, new, count = edit
    text = _plan().to_yaml().replace(old, new, count)
    with pytest.raises(PlanError) as err:
        DeploymentPlan.from_yaml(text, source="bad.yaml")
    assert needle in err.value.message and "bad.yaml" in err.value.message


def test_invalid_yaml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="not valid YAML"):
        DeploymentPlan.from_yaml("a: [1,")
    with pytest.raises(PlanError, match="does not exist"):
        DeploymentPlan.load(tmp_path / "none.yaml")


def test_plan_for_another_model_is_rejected() -> None:
    plan = _plan()
    plan.check_model([0, 2], [4, 4], 3)
    with pytest.raises(PlanError, match="another model"):
        plan.check_model([0, 1, 2], [4, 4, 4], 3)
    with pytest.raises(PlanError, match="another model"):
        plan.check_model([0, 2], [4, 8], 3)
    with pytest.raises(PlanError, match="segment functions"):
        plan.check_model([0, 2], [4, 4], 4)
