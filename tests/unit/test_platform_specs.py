"""PlatformSpec and the catalog: shipped entries, memory/vCPU rules, rounding, bad input."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from moefleet.errors import MoefleetError, UnknownNameError
from moefleet.platform import (
    InvalidMemoryError,
    PlatformConfigError,
    PlatformError,
    catalog_dir,
    list_platforms,
    load_platform,
    parse_platform,
)

EXPECTED = {
    "aws-lambda",
    "aws-lambda-2020",
    "gcp-cloud-run-functions",
    "azure-functions-flex",
    "alibaba-fc",
    "alibaba-fc-gpu",
    "gcp-cloud-run-l4",
    "openfaas-k8s",
    "openfaas-k8s-gpu",
    "cpu-cluster",
    "gpu-server",
}


def test_catalog_lists_every_shipped_platform_and_each_loads() -> None:
    assert set(list_platforms()) == EXPECTED
    for name in list_platforms():
        spec = load_platform(name)
        assert spec.name == name
        if spec.kind == "faas":
            assert spec.memory_options_mb()  # non-empty, and every block present
            assert spec.storage is not None and spec.network is not None
        else:
            assert spec.hourly is not None and spec.memory is None


def test_every_shipped_number_has_a_source_or_assumption_comment() -> None:
    # Policy: every "key: <number>" line of a catalog file says where the number comes from.
    for path in sorted(catalog_dir().glob("*.yaml")):
        for i, line in enumerate(path.read_text().splitlines(), start=1):
            m = re.match(r"^\s*[a-z_]+:\s*[0-9]", line)
            if m:
                assert "#" in line, f"{path.name}:{i} has a number without a source comment"


def test_paper_setting_memory_options_and_baseline() -> None:
    spec = load_platform("aws-lambda-2020")
    opts = spec.memory_options_mb()
    # READING-NOTES: "[128, 768, 960, ..., 3072] MB (14 values)": 128, then 768 + 192 k.
    assert opts == [128] + [768 + 192 * k for k in range(13)]
    assert len(opts) == 14 and opts[-1] == 3072
    assert spec.baseline_memory() == 3008
    assert 3008 not in opts and spec.is_valid_memory(3008)
    assert spec.billing is not None and spec.billing.granularity_ms == 100


def test_lambda_memory_range_and_linear_vcpus() -> None:
    spec = load_platform("aws-lambda")
    assert spec.memory_options_mb()[:2] == [128, 129]
    assert len(spec.memory_options_mb()) == 10240 - 128 + 1
    assert spec.vcpus(1769) == pytest.approx(1.0)
    assert spec.vcpus(3538) == pytest.approx(2.0)
    assert spec.vcpus(10240) == pytest.approx(10240 / 1769)  # 5.79: under the 6 vCPU cap


def test_table_vcpu_rule_and_fixed_options() -> None:
    spec = load_platform("gcp-cloud-run-functions")
    assert spec.vcpus(1024) == pytest.approx(0.583)
    assert spec.vcpus(4096) == pytest.approx(2.0)
    with pytest.raises(InvalidMemoryError):
        spec.vcpus(3000)


def test_invalid_memory_names_value_and_nearest_options() -> None:
    spec = load_platform("aws-lambda-2020")
    with pytest.raises(InvalidMemoryError) as exc:
        spec.check_memory(1000)
    assert "1000" in exc.value.message
    assert "[960, 1152]" in exc.value.hint
    lam = load_platform("aws-lambda")
    assert lam.nearest_memory_options(64) == [128]
    assert lam.nearest_memory_options(20000) == [10240]
    assert lam.nearest_memory_options(1500.5) == [1500, 1501]
    with pytest.raises(InvalidMemoryError, match="whole number"):
        lam.check_memory(1024.5)  # type: ignore[arg-type]


def test_round_up_memory() -> None:
    spec = load_platform("aws-lambda-2020")
    assert spec.round_up_memory(1000) == 1152
    assert spec.round_up_memory(1152) == 1152
    assert spec.round_up_memory(1) == 128
    with pytest.raises(InvalidMemoryError, match="at most 3072"):
        spec.round_up_memory(5000)


def test_user_chosen_vcpus_only_where_the_platform_allows() -> None:
    fc = load_platform("alibaba-fc")
    assert fc.check_vcpus(2048, 1.0) == 1.0  # 2048 MB per vCPU: inside 1024..4096
    with pytest.raises(PlatformError, match="does not allow 4 vCPUs"):
        fc.check_vcpus(2048, 4.0)  # 512 MB per vCPU: below the 1:1 ratio
    lam = load_platform("aws-lambda")
    assert lam.check_vcpus(1769, None) == pytest.approx(1.0)
    with pytest.raises(PlatformError, match="ties vCPUs to memory"):
        lam.check_vcpus(1769, 2.0)


def test_gpu_share_rules() -> None:
    gpu = load_platform("alibaba-fc-gpu")
    assert gpu.check_gpu_share(0.5) == 0.5  # 12 of 24 GB
    with pytest.raises(PlatformError, match="not a multiple"):
        gpu.check_gpu_share(0.3)  # 7.2 GB: not whole 1 GB slices
    with pytest.raises(PlatformError, match="no GPU functions"):
        load_platform("aws-lambda").check_gpu_share(0.5)
    with pytest.raises(PlatformError):
        gpu.check_gpu_share(1.5)


def test_billed_duration_rounding_granularity_and_minimum() -> None:
    lam = load_platform("aws-lambda")  # 1 ms granularity, 1 ms minimum
    old = load_platform("aws-lambda-2020")  # 100 ms granularity, 100 ms minimum
    flex = load_platform("azure-functions-flex")  # 100 ms granularity, 1000 ms minimum
    assert lam.billed_duration_s(0.0015) == pytest.approx(0.002)
    assert lam.billed_duration_s(0.0) == pytest.approx(0.001)
    assert old.billed_duration_s(0.3) == pytest.approx(0.3)  # no float artefact → not 0.4
    assert old.billed_duration_s(0.30000001) == pytest.approx(0.4)
    assert old.billed_duration_s(0.01) == pytest.approx(0.1)
    assert flex.billed_duration_s(0.25) == pytest.approx(1.0)
    assert flex.billed_duration_s(1.05) == pytest.approx(1.1)


@pytest.mark.parametrize("bad", [-0.001, float("nan"), float("inf")])
def test_negative_or_non_finite_durations_are_errors(bad: float) -> None:
    spec = load_platform("aws-lambda")
    with pytest.raises(PlatformError):
        spec.billed_duration_s(bad)
    with pytest.raises(PlatformError):
        spec.invocation_cost(1024, 1.0, init_s=bad)


def test_invocation_cost_hand_computed() -> None:
    lam = load_platform("aws-lambda")
    # 2048 MB = 2 GB; 0.5 s + 0.3 s INIT (billed on today's Lambda) = 0.8 s
    # compute = 2 * 0.8 * 0.0000166667 = 0.00002666672; request = 0.0000002
    assert lam.invocation_cost(2048, 0.5, init_s=0.3) == pytest.approx(0.00002666672 + 2e-7)
    old = load_platform("aws-lambda-2020")
    # INIT not billed in 2020: billed 0.5 s; 1920 MB = 1.875 GB
    # compute = 1.875 * 0.5 * 0.0000166667 = 0.00001562503
    assert old.invocation_cost(1920, 0.5, init_s=0.3) == pytest.approx(0.00001562503 + 2e-7)


def test_cluster_specs_bill_by_the_hour_not_per_invocation() -> None:
    cluster = load_platform("cpu-cluster")
    assert cluster.hourly is not None and cluster.hourly.price_per_hour == 7.41888
    assert cluster.hourly.cores == 128 and cluster.hourly.memory_gib == 512
    assert cluster.hourly_billed_s(1.0) == 3600.0
    assert cluster.hourly_billed_s(3600.0) == 3600.0
    assert cluster.hourly_billed_s(3600.5) == 7200.0
    with pytest.raises(PlatformError, match="bill_cluster"):
        cluster.invocation_cost(1024, 1.0)


def test_unknown_platform_lists_known_names_and_suggests() -> None:
    with pytest.raises(UnknownNameError) as exc:
        load_platform("aws-lamda")
    assert "aws-lamda" in exc.value.message
    assert "did you mean 'aws-lambda'" in exc.value.hint
    assert "gcp-cloud-run-functions" in exc.value.hint


def _write_variant(tmp_path: Path, edit: object) -> Path:
    data = yaml.safe_load((catalog_dir() / "aws-lambda.yaml").read_text())
    edit(data)  # type: ignore[operator]
    path = tmp_path / "variant.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("edit", "field", "words"),
    [
        (lambda d: d["billing"].pop("granularity_ms"), "billing.granularity_ms", "missing"),
        (lambda d: d["prices"].update(per_gb_hour=1.0), "prices.per_gb_hour", "unknown field"),
        (lambda d: d["storage"].update(price_per_put=-1.0), "storage.price_per_put", "-1.0"),
        (lambda d: d["vcpu"].update(bogus=1), "vcpu.bogus", "unknown field"),
        (lambda d: d["limits"].update(max_replicas="many"), "limits.max_replicas", "'many'"),
        (lambda d: d.pop("storage"), "storage", "needs the field"),
        (lambda d: d.update(baseline_memory_mb=99999), "baseline_memory_mb", "outside"),
    ],
)
def test_bad_yaml_errors_name_file_and_field(
    tmp_path: Path, edit: object, field: str, words: str
) -> None:
    path = _write_variant(tmp_path, edit)
    with pytest.raises(PlatformConfigError) as exc:
        load_platform(path)
    assert str(path) in exc.value.message
    assert field in exc.value.message
    assert words in exc.value.message
    assert isinstance(exc.value, MoefleetError)


def test_user_yaml_by_path_loads(tmp_path: Path) -> None:
    path = _write_variant(tmp_path, lambda d: d.update(name="my-lambda"))
    assert load_platform(str(path)).name == "my-lambda"


def test_unreadable_or_non_mapping_yaml(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(PlatformConfigError, match="cannot read YAML"):
        load_platform(bad)
    with pytest.raises(PlatformConfigError, match="expected a mapping"):
        parse_platform([1, 2], source="inline")
    with pytest.raises(PlatformConfigError, match="not found"):
        load_platform(tmp_path / "missing.yaml")


def test_self_hosted_prices_must_add_up_to_the_node_price(tmp_path: Path) -> None:
    data = yaml.safe_load((catalog_dir() / "openfaas-k8s.yaml").read_text())
    spec = parse_platform(data)
    assert spec.node is not None and spec.prices is not None
    # Whole node for an hour: 3600 * (8 * per_vcpu_s + 32 * per_gb_s) == $0.46368
    full = 3600 * (8 * spec.prices.per_vcpu_s + 32 * spec.prices.per_gb_s)
    assert full == pytest.approx(0.46368, rel=1e-3)
    data["prices"]["per_vcpu_s"] = 0.0001
    with pytest.raises(PlatformConfigError, match="whole node per hour"):
        parse_platform(data, source="openfaas-variant")


def test_specs_are_frozen() -> None:
    spec = load_platform("aws-lambda")
    with pytest.raises(ValidationError, match="frozen"):
        spec.name = "other"
