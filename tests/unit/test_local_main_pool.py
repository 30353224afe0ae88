"""The local backend runs main functions on their own workers: with a single worker for
everything else, a main fanning out to an expert function cannot starve it."""

from __future__ import annotations

from pathlib import Path

import pytest

from moefleet.platform import load_platform
from moefleet.runtime import FunctionSpec, HandlerRef
from moefleet.runtime.local import LocalBackend
from moefleet.runtime.payload import pack, unpack

pytestmark = pytest.mark.timeout(120)
DEBUG = HandlerRef("moefleet.runtime.handlers:debug_handler")


def test_main_on_its_own_pool_never_starves_its_experts(tmp_path: Path) -> None:
    with LocalBackend(load_platform("aws-lambda"), store=str(tmp_path), workers=1,
                      main_workers=1, admission_timeout_s=20.0) as b:
        b.deploy(FunctionSpec("exp", "expert", DEBUG, memory_mb=256, layer=0, experts=(0,)))
        b.deploy(FunctionSpec("main", "main", DEBUG, memory_mb=256))
        out = b.invoke("main", pack(meta={"op": "nested", "target": "exp", "calls": 3}))
        meta = unpack(out.payload).meta
        assert meta["functions"] == ["exp"] * 3
        # the main ran in a different process from the one expert worker
        assert meta["pid"] not in meta["pids"]
        workers = b.stats()["workers"]
        assert len(workers) == 2
        assert [r.function for r in b.records()].count("exp") == 3
