"""Metric names, defined once, shared by the server's Prometheus metrics
(``serve/metrics.py`` re-exports them), the load generator's report and the simulator's
result, so one dashboard query or one JSON key compares a live run with a simulated one.

A leaf module: no imports beyond the standard library (the simulator and the load
generator use it without prometheus-client). The ``moefleet:`` prefix follows vLLM's
``vllm:``. In JSON results, a latency name maps to a summary (count, mean, percentiles,
seconds), a ``*_total`` counter name to a number, and :data:`BILLED_COST` to USD by
:data:`COST_PARTS` (the ``part`` label's values) plus ``total``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PREFIX = "moefleet:"
TTFT = PREFIX + "time_to_first_token_seconds"
ITL = PREFIX + "inter_token_latency_seconds"
TPOT = PREFIX + "time_per_output_token_seconds"
E2E = PREFIX + "e2e_request_latency_seconds"
QUEUE = PREFIX + "request_queue_time_seconds"
RUNNING = PREFIX + "num_requests_running"
WAITING = PREFIX + "num_requests_waiting"
PROMPT_TOKENS = PREFIX + "prompt_tokens_total"
GENERATION_TOKENS = PREFIX + "generation_tokens_total"
MODEL_TOKENS = PREFIX + "model_tokens_total"  # tokens through the model, recomputes included
PREEMPTIONS = PREFIX + "num_preemptions_total"
KV_CACHE_USAGE = PREFIX + "kv_cache_usage_perc"
EXPERT_TOKENS = PREFIX + "expert_tokens_total"
BILLED_COST = PREFIX + "billed_cost_usd_total"
SLO_VIOLATIONS = PREFIX + "slo_violations_total"
REQUEST_SUCCESS = PREFIX + "request_success_total"
REQUESTS_ABORTED = PREFIX + "num_requests_aborted_total"
REQUESTS_REJECTED = PREFIX + "num_requests_rejected_total"
REQUESTS_FAILED = PREFIX + "num_requests_failed_total"  # a model step failed for good
EXPERT_RETRIES = PREFIX + "expert_call_retries_total"
CONTROLLER_SETTING = PREFIX + "controller_setting"

COST_PARTS = ("compute", "requests", "storage")
SLO_PHASES = ("ttft", "tpot")

# What a run's result reports under these names (serve's bench, the simulator).
RESULT_NAMES = (TTFT, TPOT, E2E, QUEUE, PROMPT_TOKENS, GENERATION_TOKENS, REQUEST_SUCCESS,
                SLO_VIOLATIONS, BILLED_COST)


def named_figures(*, ttft: Mapping[str, Any], tpot: Mapping[str, Any],
                  e2e: Mapping[str, Any], queue: Mapping[str, Any] | None,
                  prompt_tokens: int, generation_tokens: int, completed: int,
                  slo_violations: Mapping[str, int], cost: Mapping[str, float] | None
                  ) -> dict[str, Any]:
    """A run's figures keyed by :data:`RESULT_NAMES` (every key present; a figure the run
    cannot measure is None). ``cost`` needs the :data:`COST_PARTS` keys."""
    billed = None
    if cost is not None:
        billed = {p: float(cost[p]) for p in COST_PARTS}
        billed["total"] = sum(billed.values())
    return {TTFT: dict(ttft), TPOT: dict(tpot), E2E: dict(e2e),
            QUEUE: None if queue is None else dict(queue),
            PROMPT_TOKENS: int(prompt_tokens), GENERATION_TOKENS: int(generation_tokens),
            REQUEST_SUCCESS: int(completed), SLO_VIOLATIONS: dict(slo_violations),
            BILLED_COST: billed}
