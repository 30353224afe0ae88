"""``moefleet export``: OpenFaaS, Knative and Ray Serve manifests round-trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moefleet.cli import app
from moefleet.control import FunctionConfig
from moefleet.plan import DeploymentPlan
from moefleet.plan.export import FORMATS, ExportError, export, k8s_name, parse_export
from moefleet.platform import load_platform

SPEC = load_platform("openfaas-k8s")
PLAN = DeploymentPlan.uniform("synthetic:blocks=2,experts=2", "openfaas-k8s", [0, 1], [2, 2],
                              2, 1024, replicas=2, segment_memory_mb=2048)


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_with_decisions(fmt: str) -> None:
    dec = {"exp-0-1": FunctionConfig(4096, 3, 4)}
    got = parse_export(export(PLAN, fmt, SPEC, image="img:1", decisions=dec), fmt)
    assert set(got) == set(PLAN.function_names())
    assert got["exp-0-1"] == FunctionConfig(4096, 3, 4)
    assert got["exp-1-0"] == FunctionConfig(1024, 2, 1)
    assert got["seg-0"] == FunctionConfig(2048, 1, 1)


def test_ray_config_passes_rays_schema() -> None:
    pytest.importorskip("ray.serve.schema")
    import yaml
    from ray.serve.schema import ServeDeploySchema

    doc = yaml.safe_load(export(PLAN, "ray-serve", SPEC, image="img"))
    schema = ServeDeploySchema.model_validate(doc)
    dep = {d.name: d for d in schema.applications[0].deployments}
    assert dep["exp-0-0"].num_replicas == 2
    assert dep["seg-1"].ray_actor_options.num_cpus == pytest.approx(0.5)


def test_limits_clamped_and_bad_input(caplog: pytest.LogCaptureFixture) -> None:
    assert SPEC.limits is not None
    big = FunctionConfig(10**6, 10**4, 10**3)
    with caplog.at_level("WARNING"):
        got = parse_export(export(PLAN, "openfaas", SPEC, image="i",
                                  decisions={"seg-0": big}), "openfaas")
    assert got["seg-0"].replicas == SPEC.limits.max_replicas
    assert got["seg-0"].concurrency == SPEC.limits.max_concurrency_per_instance
    assert "clamped" in caplog.text
    with pytest.raises(ExportError, match="does not have"):
        export(PLAN, "knative", SPEC, image="i", decisions={"exp-9-9": big})
    with pytest.raises(ExportError, match="unknown export format"):
        export(PLAN, "helm", SPEC, image="i")
    assert k8s_name("exp-0-1_2") == "exp-0-1-g-2"
    with pytest.raises(ExportError, match="not a knative object"):
        parse_export(export(PLAN, "openfaas", SPEC, image="i"), "knative")


def test_cli(tmp_path: Path) -> None:
    plan = PLAN.save(tmp_path / "plan.yaml")
    dec = tmp_path / "d.json"
    dec.write_text(json.dumps({"exp-1-1": {"memory_mb": 512, "replicas": 4}}))
    out = tmp_path / "k.yaml"
    res = CliRunner().invoke(app, ["export", str(plan), "--format", "knative", "-o", str(out),
                                   "--decisions", str(dec)])
    assert res.exit_code == 0, res.output
    assert parse_export(out.read_text(), "knative")["exp-1-1"] == FunctionConfig(512, 4, 1)
    res = CliRunner().invoke(app, ["export", str(plan), "--format", "swarm"])
    assert res.exit_code != 0 and "unknown export format" in res.output
