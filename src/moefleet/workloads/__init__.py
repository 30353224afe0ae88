"""Arrival processes: deterministic lists of :class:`Arrival` for the simulator and the
load generator alike.

    PoissonWorkload(rate_rps)                    exponential gaps
    BurstyWorkload(rate_rps, cv)                 gamma renewal, inter-arrival CV = cv
    StepWorkload(base_rps, step_at_s, factor)    Poisson whose rate steps up (or down)
    AzureFunctionsWorkload(function, ...)        Azure Functions 2019 per-minute counts
    AzureLLMWorkload(trace="conv"|"code", ...)   Azure LLM inference 2023 requests + tokens
    load_workload("bursty:rate=5,cv=3")          the same from a spec string or dict

Every ``arrivals(duration_s, seed)`` is sorted, in ``[0, duration_s)``, deterministic
under the seed and prefix-consistent across horizons (see :mod:`.base`).
"""

from moefleet.workloads.azure_functions import (
    AzureFunctionsTrace,
    AzureFunctionsWorkload,
    load_azure_functions,
    spread_per_minute,
)
from moefleet.workloads.azure_llm import AzureLLMTrace, AzureLLMWorkload, load_azure_llm
from moefleet.workloads.base import Arrival, Workload
from moefleet.workloads.bursty import BurstyWorkload
from moefleet.workloads.csvio import read_arrivals_csv, write_arrivals_csv
from moefleet.workloads.poisson import PoissonWorkload
from moefleet.workloads.spec import KINDS, load_workload
from moefleet.workloads.step import StepWorkload
from moefleet.workloads.windows import (
    FunctionWindow,
    Pattern,
    WindowStats,
    classify_windows,
    find_windows,
    pattern_of,
    window_cv,
)

__all__ = [
    "KINDS",
    "Arrival",
    "AzureFunctionsTrace",
    "AzureFunctionsWorkload",
    "AzureLLMTrace",
    "AzureLLMWorkload",
    "BurstyWorkload",
    "FunctionWindow",
    "Pattern",
    "PoissonWorkload",
    "StepWorkload",
    "WindowStats",
    "Workload",
    "classify_windows",
    "find_windows",
    "load_azure_functions",
    "load_azure_llm",
    "load_workload",
    "pattern_of",
    "read_arrivals_csv",
    "spread_per_minute",
    "window_cv",
    "write_arrivals_csv",
]
