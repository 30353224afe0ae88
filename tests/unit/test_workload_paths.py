"""Results record trace files portably: relative to the data directory, not this machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from moefleet.workloads._data import portable


def test_a_file_in_the_data_directory_is_named_from_it(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOEFLEET_DATA_DIR", str(tmp_path / "data"))
    f = tmp_path / "data" / "azure_llm_inference_2023" / "trace.csv"
    f.parent.mkdir(parents=True)
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    assert portable(f) == "data:azure_llm_inference_2023/trace.csv"


def test_a_file_elsewhere_is_kept_as_the_user_gave_it(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "data").mkdir()
    monkeypatch.setenv("MOEFLEET_DATA_DIR", str(tmp_path / "data"))
    f = tmp_path / "mine" / "trace.csv"
    f.parent.mkdir()
    f.write_text("x\n")
    assert portable(f) == str(f)
