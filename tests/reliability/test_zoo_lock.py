"""Safe zoo cache: one build per entry at a time, stale temporaries removed, and two
concurrent real builds of one entry leave exactly one correct entry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from moefleet.models import zoo


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MOEFLEET_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def slow_entry(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A registered entry whose build blocks until released (counts its builds)."""
    state: dict[str, Any] = {"builds": 0, "started": threading.Event(),
                             "release": threading.Event()}

    def build(d: Path, recipe: dict[str, Any], progress: Any) -> dict[str, Any]:
        state["builds"] += 1
        state["started"].set()
        assert state["release"].wait(30)
        if progress is not None:
            progress(1, 2, "training")
        (d / "weights.bin").write_bytes(b"w" * 100)
        return {"fidelity": 1.0}

    entry = zoo.ZooEntry("test-lock-entry", "test", {"v": 1}, build,
                         lambda d, n: None)  # type: ignore[arg-type,return-value]
    zoo._ensure_registered()
    monkeypatch.setitem(zoo._ENTRIES, entry.name, entry)
    state["name"] = entry.name
    return state


def test_second_builder_waits_names_the_holder_and_reuses(cache: Path,
                                                         slow_entry: dict[str, Any]) -> None:
    name = slow_entry["name"]
    waits: list[str] = []
    first = threading.Thread(target=zoo.build, args=(name,))
    first.start()
    assert slow_entry["started"].wait(30)
    second = threading.Thread(target=zoo.build, args=(name,),
                              kwargs={"on_wait": waits.append})
    second.start()
    second.join(0.5)  # blocked on the lock (flock conflicts across open file descriptions)
    assert second.is_alive()
    slow_entry["release"].set()
    first.join(30)
    second.join(30)
    assert slow_entry["builds"] == 1  # the waiter reused the finished build
    assert waits and f"pid {os.getpid()}" in waits[0]
    assert zoo.is_built(name) and zoo.verify(name) == []
    assert [p.name for p in zoo.model_dir(name).parent.iterdir() if p.is_dir()] == [
        zoo.model_dir(name).name]


def test_stale_temporary_dirs_are_removed(cache: Path, slow_entry: dict[str, Any]) -> None:
    name = slow_entry["name"]
    target = zoo.model_dir(name)
    stale = target.parent / f".{target.name}.interrupted"
    stale.mkdir(parents=True)
    (stale / "half.bin").write_bytes(b"x")
    slow_entry["release"].set()
    zoo.build(name)
    assert not stale.exists() and zoo.is_built(name)


def test_models_build_prints_plain_progress_off_terminal(cache: Path,
                                                         slow_entry: dict[str, Any]) -> None:
    from typer.testing import CliRunner

    from moefleet.cli import app

    slow_entry["release"].set()
    res = CliRunner().invoke(app, ["models", "build", slow_entry["name"]])
    assert res.exit_code == 0, res.output
    # No live bar off a terminal: plain lines, one when the task starts and on each change.
    assert f"building {slow_entry['name']}: 0" in res.stderr
    assert f"{slow_entry['name']}: training: 1/2" in res.stderr


@pytest.mark.slow
def test_two_concurrent_real_builds_make_one_entry(cache: Path) -> None:
    """Two processes build tiny-mixtral-random at once into one empty cache."""
    name = "tiny-mixtral-random"
    code = ("import json, sys\nfrom moefleet.models import zoo\n"
            f"p = zoo.build({name!r}, on_wait=lambda m: print('WAIT', m, flush=True))\n"
            "print('DONE', p, flush=True)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "MOEFLEET_CACHE_DIR": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=env) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    paths = {line.split()[1] for o in outs for line in o.splitlines() if line.startswith("DONE")}
    assert paths == {str(zoo.model_dir(name))}
    models = cache / "models"
    assert sorted(p.name for p in models.iterdir() if p.is_dir()) == [zoo.model_dir(name).name]
    assert zoo.verify(name) == []
    report = json.loads((zoo.model_dir(name) / "build.json").read_text())
    assert report["name"] == name and report["manifest"]
    zoo.load(name)  # loads and runs: the single entry is a correct model
