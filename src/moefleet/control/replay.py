"""A scaling controller that replays the decisions a run applied (for the simulator)."""

from __future__ import annotations

from collections.abc import Sequence

from moefleet.control.base import APPLY_DELAY_S
from moefleet.control.scaling import (
    Decisions,
    FunctionConfig,
    MetricsSnapshot,
    PolicyState,
    ScalingController,
)


class Replayed(ScalingController):
    """The decisions a run applied, decided again at the same interval: ``applied`` as
    (time applied since the replay's start, function, config); a decision applied at
    ``t`` was taken at the snapshot ``apply_delay_s`` before it. For the simulator, to
    tell the simulator's error from a controller that saw other snapshots and chose
    otherwise. A function the snapshot does not hold gets no decision. State: how many
    snapshots it has seen (an int)."""

    name = "replayed"

    def __init__(self, applied: Sequence[tuple[float, str, FunctionConfig]], interval_s: float,
                 apply_delay_s: float = APPLY_DELAY_S) -> None:
        self.by_interval: dict[int, dict[str, FunctionConfig]] = {}
        for t, name, cfg in applied:
            k = max(1, round((t - apply_delay_s) / interval_s))
            self.by_interval.setdefault(k, {})[name] = cfg
        self.interval_s = interval_s

    def decide(self, snapshot: MetricsSnapshot, state: PolicyState) -> tuple[Decisions,
                                                                             PolicyState]:
        k = (state or 0) + 1  # the k-th snapshot of the replay
        return {name: cfg for name, cfg in self.by_interval.get(k, {}).items()
                if name in snapshot.functions}, k
