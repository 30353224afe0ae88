"""benchmarks/engine_scale.py's bookkeeping: a run whose requests failed never reaches a
ratio (its tokens/s counts tokens never made: on an H100, compiled attention's eager
fallback failed two brownout runs, which then 'ran' at 19,600 tok/s), the paged
brownout ratios, and the refusal of an unknown run name."""

from __future__ import annotations

from typing import Any

import pytest

from tests.bench_helpers import load_benchmark


def _module() -> Any:
    return load_benchmark("engine_scale")


def _run(tps: float, **extra: Any) -> dict[str, Any]:
    return {"tokens_per_s": tps, "wall_s": 1.0, "roofline_fraction": tps / 1e4,
            "preemptions": 0, "host_reads_per_decode_step_max": 2, **extra}


def test_failed_runs_stay_out_of_every_ratio() -> None:
    mod = _module()
    samples = {"engine_fused": [_run(900.0)], "engine_fused@paged": [_run(2000.0)],
               "brownout_8_0.4@paged": [_run(19600.0, failed_requests=256)],
               "brownout_8_0@paged": [_run(2600.0)],
               "engine_stacked": [_run(50000.0, failed_requests=3)],
               "hf_static": [{"tokens_per_s": 500.0, "wall_s": 2.0,
                              "roofline_fraction": 0.05}]}
    res: dict[str, Any] = {"runs": {}}
    mod.summarise(res, samples, {}, [], 1)
    bars = res["bars"]
    assert bars["engine_best"] == "engine_fused@paged"  # not the failed stacked run
    assert bars["engine_vs_hf_static"] == pytest.approx(4.0)
    assert bars["brownout_8_0.4_vs_zero_paged"] is None
    assert bars["brownout_8_0_vs_zero_paged"] == pytest.approx(1.3)
    assert bars["fused_vs_hf_static"] == pytest.approx(1.8)
    assert res["runs"]["brownout_8_0.4@paged"]["failed_requests"] == 256  # still reported


def test_an_unknown_run_name_is_refused_with_the_names_it_takes() -> None:
    mod = _module()
    with pytest.raises(SystemExit, match=r"unknown run 'engine_flash'.*brownout_WAYS"):
        mod.engine_configs(object(), ["engine_flash"], "gather")
