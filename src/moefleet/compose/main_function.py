"""Engines inside a Remoe main function (``remoe.handler``): the composition root's entry
for a process that *is* a main-function instance.

One instance keeps its model, local experts and KV cache (the runner) across invocations;
each invocation gets a fresh engine whose remote experts are that call's (its nested
invoker bills them to the call). The stack is the root's order: retry ∘ split(local held
experts, the call's remote experts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from moefleet.compose.options import EngineOptions, StackOptions
from moefleet.compose.root import assemble
from moefleet.engine.engine import Engine
from moefleet.engine.runner import InProcessRunner
from moefleet.experts.nest import compose
from moefleet.experts.split import held_experts
from moefleet.experts.stack import ExpertStack
from moefleet.runtime.errors import FunctionError
from moefleet.runtime.main_model import MainModel


class _CallRemote(ExpertStack):
    """The remote experts of the invocation in progress (none between invocations)."""

    def __init__(self, function: str) -> None:
        self.function = function
        self.current: ExpertStack | None = None

    def set_owners(self, owners_N: Sequence[str] | None) -> None:
        if self.current is not None:
            self.current.set_owners(owners_N)

    def __call__(self, layer: int, x_ND: torch.Tensor, ids_NK: torch.Tensor,
                 w_NK: torch.Tensor) -> torch.Tensor:
        if self.current is None:
            raise FunctionError(f"{self.function}: layer {layer} routed tokens to remote "
                                "experts outside an invocation", "this is a bug")
        return self.current(layer, x_ND, ids_NK, w_NK)


class MainFunctionEngines:
    """See the module docstring."""

    def __init__(self, main: MainModel, function: str, *, kv_bytes: int,
                 max_num_seqs: int = 64, stack: StackOptions | None = None) -> None:
        stack = stack or StackOptions()
        self._remote = _CallRemote(function)
        self.stack = compose(held_experts(main.local), remote=self._remote,
                             is_local=main.is_local, retry=stack.retry)
        self.runner = InProcessRunner(main.adapter, experts=self.stack,
                                      kv_budget_bytes=kv_bytes, max_num_seqs=max_num_seqs)

    @contextlib.contextmanager
    def engine(self, remote: ExpertStack | None, max_num_seqs: int) -> Iterator[Engine]:
        """An engine for one invocation, whose remote experts are ``remote``."""
        self._remote.current = remote
        try:
            yield assemble(self.runner, tokenizer=None,
                           options=EngineOptions(max_num_seqs=max_num_seqs), hooks=[])
        finally:
            self._remote.current = None

    def close(self) -> None:
        self.stack.close()
