"""Run a docs block in a subprocess: bounded in time, its whole process group stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BLOCK_TIMEOUT_S = 300  # one block; the slowest (plan) takes ~10 s on 2 loaded cores


def env() -> dict[str, str]:
    """The environment of a reader who activated the venv: ``moefleet`` on PATH, this
    checkout's sources first, one BLAS thread (the suite shares two cores)."""
    e = dict(os.environ)
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), e.get("PYTHONPATH"))
                                      if p)
    e.setdefault("OMP_NUM_THREADS", "1")
    e["COLUMNS"] = "80"
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(argv: list[str], cwd: Path, timeout_s: float = BLOCK_TIMEOUT_S
        ) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in its own session; whatever it left running (a server started with
    ``&``) is stopped afterwards through that session's process group, by its id."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n[timed out after {timeout_s} s]"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")
