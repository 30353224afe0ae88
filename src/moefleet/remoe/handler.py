"""Remoe's main function: the generation engine inside one function invocation.

Cold start (``main_handler``): read the deployment (``config["deployment"]``, a key in the
object store), load what the main function holds (:class:`~.main_model.MainModel`: every
block's non-expert weights and the local experts, every expert no expert group holds),
and allocate the KV cache; the weights plus the cache must fit ``memory_mb``. Device
(``config["device"]``, default ``auto``): the non-experts and the cache on CUDA when the
plan gives the main function a GPU and the instance has one; otherwise the CPU, and whoever
bills it applies the plan's GPU price to the measured time ("GPU emulated").

Per invocation (a :class:`~moefleet.remoe.messages.Generate`): a fresh engine (scheduler,
greedy sampler) over the instance's runner and cache runs the batch's prefill and decode
to completion (``compose.main_function``). Experts: Remoe's split of the held experts and the
call's ``RemoteExperts``, so each layer's
local experts run here while its remote experts run in the layer's group function
(invoked through ``ctx.functions``: metered by the backend like any call). Replies with a
:class:`~moefleet.remoe.messages.Result`.
"""

from __future__ import annotations

from typing import Any

import torch

from moefleet.compose.main_function import MainFunctionEngines
from moefleet.engine.engine import Engine, merge_into
from moefleet.engine.request import RequestOutput, SamplingParams
from moefleet.profiles.gpu import GPU_EMULATED_HOST_MB
from moefleet.remoe.messages import Generate, Result
from moefleet.runtime.errors import FunctionError
from moefleet.runtime.handlers import MB, CallContext, Handler, InitContext
from moefleet.runtime.main_model import GPU_EMULATED, MainModel
from moefleet.runtime.messages import Warm, decode, encode
from moefleet.runtime.payload import pack, unpack

DEFAULT_KV_MB = 64


class MainFunctionHandler:
    """One main-function instance (see the module docstring)."""

    def __init__(self, config: dict[str, Any], init: InitContext) -> None:
        if init.store is None:
            raise FunctionError(f"{init.function}: needs an object store",
                                "configure the backend store")
        self.function = init.function
        self.main = MainModel.from_store(str(config["deployment"]), init.store,
                                         self.function, device=str(config.get("device",
                                                                              "auto")))
        self.dep, self.is_local = self.main.dep, self.main.is_local
        # GPU emulated on this CPU: the memory limit is charged what CUDA adds to the same
        # main's host memory all the same (runtime/host.py, Instance.emulated_bytes).
        self.emulated_host_bytes = (int(GPU_EMULATED_HOST_MB * MB)
                                    if self.main.gpu == GPU_EMULATED else 0)
        kv_bytes = int(config.get("kv_mb", DEFAULT_KV_MB)) * MB
        self.main.check_memory(init.memory_mb, kv_bytes, self.function)
        self.weight_bytes = self.main.weight_bytes
        self.engines = MainFunctionEngines(self.main, self.function, kv_bytes=kv_bytes,
                                           max_num_seqs=int(config.get("max_num_seqs", 64)))

    def __call__(self, payload: bytes, ctx: CallContext) -> bytes:
        msg = decode(unpack(payload).meta, Generate, Warm)
        if isinstance(msg, Warm):  # the cold start (weights, KV cache) is all it asks for
            return pack(meta=encode(msg))
        remote = None
        if self.main.has_remote:
            if ctx.functions is None:
                raise FunctionError(f"{self.function}: this backend offers no nested calls, "
                                    "so remote experts cannot run", "use the local or aws "
                                    "backend")
            from moefleet.experts.remote import RemoteExperts

            remote = RemoteExperts(self.dep, ctx.functions, ctx.store)
        try:
            with torch.no_grad(), self.engines.engine(remote, msg.max_num_seqs) as engine:
                result = self._generate(engine, msg)
        finally:
            if remote is not None:
                remote.close()
        if remote is not None:
            stats = remote.stats.values()
            result = Result(**{**result.__dict__,
                               "remote_invocations": sum(s.invocations for s in stats),
                               "remote_s": sum(s.seconds for s in stats)})
        return pack(meta=encode(result))

    def _generate(self, engine: Engine, msg: Generate) -> Result:
        params = SamplingParams(max_tokens=msg.max_tokens, temperature=0.0,
                                ignore_eos=msg.ignore_eos)
        merged: dict[str, RequestOutput] = {}
        for rid, prompt in zip(msg.request_ids, msg.prompts, strict=True):
            engine.add_request(list(prompt), params, request_id=rid)
            merged[rid] = RequestOutput(rid, [], "", False)
        steps = 0
        while engine.has_unfinished:
            steps += 1
            for out in engine.step():
                merge_into(merged[out.request_id], out)
        outs = [merged[r] for r in msg.request_ids]
        times = [o.times for o in outs]
        if any(t is None for t in times):
            raise FunctionError(f"{self.function}: a request finished without timings",
                                "this is a bug in the engine")
        return Result(
            request_ids=msg.request_ids,
            tokens=tuple(tuple(o.new_token_ids) for o in outs),
            ttft_s=tuple(float(t.ttft_s or 0.0) for t in times if t is not None),
            tpot_s=tuple(float(t.tpot_s or 0.0) for t in times if t is not None),
            e2e_s=tuple(float(t.e2e_s or 0.0) for t in times if t is not None),
            remote_invocations=0, remote_s=0.0, steps=steps, device=str(self.main.device))


def main_handler(config: dict[str, Any], init: InitContext) -> Handler:
    """Factory; config: ``deployment`` (key of the deployment JSON in the store),
    ``kv_mb`` (KV cache budget, MB), ``max_num_seqs``, ``device`` (auto|cpu|cuda)."""
    return MainFunctionHandler(config, init)
