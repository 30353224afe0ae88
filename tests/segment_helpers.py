"""Prefill batches through a deployed plan's segment functions, for tests: the composition
root's segment runner (``compose.open_engine(..., runner="segments")``), one engine step
per batch (``compose.batches``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from moefleet.compose import open_engine
from moefleet.compose.batches import Batches
from moefleet.compose.score import score_options


@contextlib.contextmanager
def segment_batches(adapter: Any, plan: Any, platform: Any, backend: Any, store: Any, *,
                    batch_size: int = 8, max_length: int = 64, **kw: Any) -> Iterator[Batches]:
    """Deploy ``plan`` (or use a deployment) on ``backend`` (a running backend) and yield
    :class:`Batches` over it; the functions' weights are removed on exit."""
    the_plan = getattr(plan, "plan", plan)  # a Deployment carries its plan
    kw.setdefault("model_ref", the_plan.model)  # test plans name their model freely
    with open_engine(adapter, plan=plan, backend=backend, store=store, platform=platform,
                     options=score_options(batch_size, max_length), **kw) as opened:
        yield Batches(opened)


def one_request_batches(adapter: Any, request_ids: list[str], texts: list[str], *,
                        max_tokens: int, max_length: int
                        ) -> list[tuple[torch.Tensor, torch.Tensor, list[str]]]:
    """One single-row batch per prompt (tokenised as the profiler does): (ids, mask, rid)."""
    from moefleet.traces.profile import tokenize_prompts

    out = []
    for i, ids in tokenize_prompts(adapter, texts, max_tokens=max_tokens,
                                   max_length=max_length):
        t = torch.tensor([ids])
        out.append((t, torch.ones_like(t), [request_ids[i]]))
    return out
