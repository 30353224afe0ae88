"""``moefleet platforms list|show`` through typer's CliRunner, against the sub-app itself."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from moefleet.cli.platforms import app
from moefleet.platform import catalog_dir, list_platforms

runner = CliRunner()


def _unwrapped(text: str) -> str:
    """Rich wraps stderr at the terminal width: undo line breaks before matching."""
    return " ".join(text.split())


def _unfolded(text: str) -> str:
    """Long tokens (paths) are folded mid-word: join lines to match them."""
    return text.replace("\n", "")


def test_list_json_is_machine_readable_on_stdout_only() -> None:
    result = runner.invoke(app, ["list", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["platforms"]
    assert [r["name"] for r in rows] == list_platforms()
    lam = next(r for r in rows if r["name"] == "aws-lambda")
    assert lam["memory_min_mb"] == 128 and lam["memory_max_mb"] == 10240
    assert lam["price_per_gb_s"] == 0.0000166667
    assert lam["sync_payload_bytes"] == 6 * 1024 * 1024
    cluster = next(r for r in rows if r["name"] == "cpu-cluster")
    assert cluster["price_per_hour"] == 7.41888 and cluster["price_per_gb_s"] is None


def test_list_table_names_every_platform() -> None:
    result = runner.invoke(app, ["list"])
    assert result.exit_code == 0
    for name in list_platforms():
        assert name in result.stdout
    assert "$7.41888/h" in result.stdout


def test_show_json_has_all_fields() -> None:
    result = runner.invoke(app, ["show", "aws-lambda-2020", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["baseline_memory_mb"] == 3008
    assert data["memory"]["options_mb"][:3] == [128, 768, 960]
    assert data["billing"] == {"granularity_ms": 100, "min_billed_ms": 100, "init_billed": False}
    assert data["derived"]["memory_options_count"] == 14
    assert data["storage"]["price_per_put"] == 0.000005


def test_show_table_and_path_argument(tmp_path: Path) -> None:
    data = yaml.safe_load((catalog_dir() / "gpu-server.yaml").read_text())
    data["name"] = "my-server"
    path = tmp_path / "my-server.yaml"
    path.write_text(yaml.safe_dump(data))
    result = runner.invoke(app, ["show", str(path)])
    assert result.exit_code == 0, result.output
    assert "my-server" in result.stdout and "hourly.price_per_hour" in result.stdout


def test_show_unknown_platform_is_a_clean_error() -> None:
    result = runner.invoke(app, ["show", "aws-lamda", "--json"])
    assert result.exit_code == 2
    assert result.stdout == ""  # nothing but JSON ever goes to stdout with --json
    assert "unknown platform 'aws-lamda'" in _unwrapped(result.stderr)
    assert "aws-lambda" in result.stderr and "Traceback" not in result.output


def test_show_invalid_file_names_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    data = yaml.safe_load((catalog_dir() / "aws-lambda.yaml").read_text())
    data["billing"]["granularity_ms"] = -5
    path.write_text(yaml.safe_dump(data))
    result = runner.invoke(app, ["show", str(path)])
    assert result.exit_code == 2
    err = _unfolded(result.stderr)
    assert "billing.granularity_ms" in err and "bad.yaml" in err
