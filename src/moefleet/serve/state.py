"""What every handler shares: the worker, the served model's name and the limits."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moefleet.engine import Engine
from moefleet.serve.errors import APIError
from moefleet.serve.metrics import ServeMetrics
from moefleet.serve.worker import EngineWorker

DEFAULT_MAX_WAITING = 256
DEFAULT_MAX_BODY_BYTES = 4 << 20
STALL_POLL_S = 0.25


@dataclass
class ServeState:
    worker: EngineWorker
    metrics: ServeMetrics
    model_name: str
    max_model_len: int
    vocab_size: int
    api_key: str | None = None
    max_waiting: int = DEFAULT_MAX_WAITING
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    default_max_tokens: int | None = None  # None: whatever room the context leaves
    gated: bool = False  # an AdmissionGate bounds the requests in flight (serve/admission)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")

    def check_alive(self) -> None:
        if not self.worker.alive:
            raise APIError(503, self.worker.error or "engine is not running",
                           code="engine_dead")
        self.check_stalled()

    def check_stalled(self) -> None:
        """503 while the running step is past the watchdog's step timeout."""
        took = self.worker.stalled_s
        if took is not None:
            raise APIError(503, f"engine stalled: a model step has run {took:.1f} s (step "
                           f"timeout {self.worker.step_timeout_s:g} s)",
                           code="engine_stalled", headers={"Retry-After": "5"})

    def admit(self) -> None:
        """Without the admission gate (the old behaviour, kept selectable to compare):
        shed load after the body was parsed, 503 + Retry-After 1 once the engine's
        waiting queue is full. With the gate, the gate has already bounded what is in
        flight, so only the engine's health is checked here."""
        self.check_alive()
        if self.gated:
            return
        if self.worker.num_waiting + self.worker.pending >= self.max_waiting:
            self.metrics.rejected.labels(self.model_name).inc()
            raise APIError(503, f"server overloaded: {self.worker.num_waiting} requests "
                           f"waiting (limit {self.max_waiting})", code="overloaded",
                           headers={"Retry-After": "1"})

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """``fn(engine)`` in the engine thread. While it waits, a stalled step turns into
        a 503 and the closure is cancelled (it will not run later behind the client's
        back)."""
        fut = self.worker.call(fn)
        try:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=STALL_POLL_S)
                if done:
                    return fut.result()
                try:
                    self.check_stalled()
                except APIError:
                    fut.cancel()
                    raise
        except RuntimeError as err:
            if not self.worker.alive:
                raise APIError(503, str(err), code="engine_dead") from err
            raise
