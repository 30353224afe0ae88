"""One hand-checkable Remoe problem for the planner, audit and simulator tests: round
numbers (1 GB per expert quarter, prices 1 and 3 per GB-s, 0.5 s per invocation), so
every equation can be worked by hand. Tests override only what they exercise."""

from __future__ import annotations

import numpy as np

from moefleet.plan.remoe import RemoeProblem, TimeLaw

GB = 2**30


def remoe_problem(**kw: object) -> RemoeProblem:
    """A 1-layer, 2-expert top-1 problem (activations 0.75 / 0.25) unless overridden."""
    base: dict[str, object] = dict(
        model="t", s_LE=np.array([[0.75, 0.25]]), top_k=1, n_in=4, n_out=2,
        ttft_slo_s=100.0, tpot_slo_s=100.0, main_memory_mb=(1024, 2048),
        remote_memory_mb=(1024, 2048), cpu_price_gb_s=1.0, gpu_price_gb_s=3.0,
        token_bytes=100.0, transfer_bytes_s=1000.0, invoke_overhead_s=0.5,
        law=TimeLaw(0.0, 0.0, 2.0), expert_bytes=0.25 * GB, nonexpert_bytes=0.5 * GB,
        kv_bytes_per_token=0.0, nonexpert_token_s=1.0, nonexpert_cpu_token_s=4.0,
        gpu_expert_token_s=0.1, swap_bytes_s=200.0, cold_main_s=3.0, cold_remote_s=1.0)
    base.update(kw)
    return RemoeProblem(**base)  # type: ignore[arg-type]
