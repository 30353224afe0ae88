"""Input and output failures the corpus cannot show through argv alone: a full disk while
writing (stdout and files), training that finishes no episode, seeds and worker counts
past what the machine can take, and the distillation progress line."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moefleet.errors import LimitError, OutputPathError


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("args", [["platforms", "list"], ["platforms", "list", "--json"]])
def test_stdout_on_a_full_disk_is_one_error_line(args: list[str]) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "moefleet", *args], stdout=full,
                              stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[0] == "error: cannot write the output: No space left on device"


def test_a_file_write_on_a_full_disk_is_refused_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moefleet.io import write_text_atomic

    def full(self: Path, *a: object, **k: object) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OutputPathError, match="No space left on device"):
        write_text_atomic(tmp_path / "out.json", "{}")
    assert list(tmp_path.iterdir()) == []


def test_training_that_finishes_no_episode_fails_and_saves_nothing(tmp_path: Path) -> None:
    from moefleet.autoscale.errors import AutoscaleError
    from moefleet.autoscale.smoe import ConfigSpace
    from moefleet.autoscale.smoe.train import TrainSetup, train

    out = tmp_path / "s.pt"
    setup = TrainSetup(model="synthetic:blocks=2,experts=2,top_k=1,hidden=64,decoder=0",
                       slo_s=0.2)
    with pytest.raises(AutoscaleError, match="nothing was saved"):
        train(out, episodes=1, setup=setup, teacher=False, time_budget_s=1e-9,
              space=ConfigSpace(memory_mb=(512, 1024), replicas=(1, 2), concurrency=(1, 2)))
    assert not out.exists()


def test_seeds_past_64_bits_are_refused() -> None:
    from moefleet.engine import SamplingParams
    from moefleet.engine.request import EngineError

    SamplingParams(seed=2**63 - 1)
    for bad in (2**63, 2**64, -1, True):
        with pytest.raises(EngineError, match="seed"):
            SamplingParams(seed=bad)


def test_local_workers_past_the_memory_are_refused() -> None:
    from moefleet.runtime.local_pool import checked_workers

    assert checked_workers(1) == 1
    with pytest.raises(LimitError, match="local workers"):
        checked_workers(10**6)


def test_distillation_progress_is_plain_lines_off_a_terminal(
        capsys: pytest.CaptureFixture[str]) -> None:
    from moefleet.cli.deployment import DistillProgress

    show = DistillProgress("tiny", every_s=3600)
    for done in range(0, 13):
        show(done, 12, f"layer {done // 4}")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("note: distilling united experts of tiny")
    assert "0/12 groups" in lines[1] and "ETA unknown" in lines[1]
    assert "1/12 groups" in lines[2] and "ETA" in lines[2]
    assert "12/12 groups" in lines[-1] and len(lines) == 4  # throttled in between
    assert all("\r" not in ln for ln in lines)
