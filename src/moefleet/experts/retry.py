"""Retries at the expert seam: :class:`RetryingExperts` repeats an expert call that failed
with a transient error (a crashed, timed-out or throttled expert function, a dropped
connection) under a :class:`~moefleet.runtime.retry.RetryPolicy`, with backoff and the
platform's retry-after. An expert call is a pure function of its inputs, so a retry returns
the same output and the step goes on, only later. The outermost layer of every stack
(:func:`moefleet.experts.compose`).
"""

from __future__ import annotations

import torch

from moefleet.experts.stack import ExpertStack, as_stack
from moefleet.models.base import ExpertFn
from moefleet.runtime.retry import RetryPolicy, retry_call


class RetryingExperts(ExpertStack):
    """An ExpertFn that retries ``inner``'s transient failures under ``policy``;
    ``retries`` counts the calls repeated (thread-safe enough: one engine thread)."""

    def __init__(self, inner: ExpertStack | ExpertFn, policy: RetryPolicy) -> None:
        self.inner, self.policy = as_stack(inner), policy
        self.inners = (self.inner,)
        self.retries = 0

    def __call__(self, layer: int, x_ND: torch.Tensor, ids_NK: torch.Tensor,
                 w_NK: torch.Tensor) -> torch.Tensor:
        return retry_call(self.policy, lambda: self.inner(layer, x_ND, ids_NK, w_NK),
                          on_failure=self._failed)

    def _failed(self, err: BaseException, attempt: int) -> None:
        if attempt < self.policy.attempts - 1:
            self.retries += 1
