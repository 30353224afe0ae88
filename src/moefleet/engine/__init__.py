"""Request-level generation shared by every system: scheduler -> runner -> sampler.

    Engine.step() = Scheduler.schedule() -> ModelRunner.execute() -> Sampler + update
"""

from moefleet.engine.engine import Engine, EngineStats, StepHook, StepStats, merge_into
from moefleet.engine.request import (
    EngineError,
    RequestOutput,
    RequestTimes,
    SamplingParams,
    TokenLogprob,
)
from moefleet.engine.runner import InProcessRunner, ModelRunner, RunnerOutput
from moefleet.engine.scheduler import (
    ScheduledSeq,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

__all__ = [
    "Engine", "EngineError", "EngineStats", "InProcessRunner", "ModelRunner", "RequestOutput",
    "RequestTimes", "RunnerOutput", "SamplingParams", "ScheduledSeq", "Scheduler",
    "SchedulerConfig", "SchedulerOutput", "StepHook", "StepStats", "TokenLogprob", "merge_into",
]
