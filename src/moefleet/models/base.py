"""The one interface moefleet uses to see an MoE model: ``MoEModelAdapter``.

Shape legend (suffixes on tensor names):
    B batch, T sequence length, N tokens flattened (B*T), D hidden size,
    F expert intermediate size, E experts in a layer, K experts per token (top-k),
    H attention heads, V vocabulary.

A model is a stack of ``num_layers`` blocks. Each block l is cut into
    segment(l)  : everything that is not a routed expert: attention, norms, the router
                  (gate), dense MLPs and shared experts; block 0 also carries the
                  embedding and the last block the final norm and the head;
    experts     : ``num_experts(l)`` standalone FFN modules, only on MoE layers.

The layer-by-layer forward runs exactly these pieces in order:

    embed -> for l: [pre_moe(l) -> route -> experts via expert_fn -> post_moe(l)] -> head

so a runtime can execute ``expert_fn`` somewhere else (another process, a serverless
function) and still get the model's own output. Invariant checked by the tests:
``forward_layerwise(ids)`` equals the model's own forward to 1e-5 in fp32.

Routers follow one convention so the recorder and the executor need no per-family code:
the module returned by ``router_module(l)`` maps x_ND to ``(logits_NE, weights_NK, ids_NK)``.
Attention modules return ``(out, probs_BHTT | None)``; probabilities are materialised only
inside ``adapter.eager_attention()``.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from moefleet.models.kv import KVCache, KVCacheError, KVLayout, LayoutProbe, StepCacheView
from moefleet.models.shape import ModelShape
from moefleet.models.step import StepInput, StepOutput, run_layers, run_layers_parts

# expert_fn(layer, x_ND, ids_NK, weights_NK) -> y_ND: the weighted sum of the chosen
# experts' outputs for every token (no residual, no shared expert).
ExpertFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class ForwardContext:
    """Per-batch state every segment needs: masks and position encodings."""

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor | None
    position_ids_BT: torch.Tensor
    extras: dict[str, Any] = field(default_factory=dict)


def param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


class MoEModelAdapter(ABC):
    """A Hugging Face (or moefleet-built) MoE model seen as segments + experts.

    Subclasses wrap one model instance; ``model`` stays the original ``nn.Module`` so
    its own forward remains the reference. Adapters never modify weights.
    """

    name: str
    family: str
    model: nn.Module
    tokenizer: Any | None
    causal: bool
    # labels every output built on this model must carry ("random weights: ...")
    notes: tuple[str, ...] = ()
    # True where the cache holds a latent the attention expands per cached slot (MLA):
    # ``attention="auto"`` keeps the gather path for such models (models.paged)
    latent_cache: bool = False
    # False for adapters whose steps cannot run attention="paged" (only the HF decoder
    # adapter builds paged block masks)
    supports_paged: bool = False

    # -- structure -------------------------------------------------------------------
    @property
    @abstractmethod
    def num_layers(self) -> int: ...

    @property
    @abstractmethod
    def moe_layers(self) -> list[int]:
        """Indices (0-based, over all blocks) of blocks with routed experts."""

    @abstractmethod
    def num_experts(self, layer: int) -> int: ...

    @property
    @abstractmethod
    def top_k(self) -> int: ...

    @property
    @abstractmethod
    def hidden_size(self) -> int: ...

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def expert(self, layer: int, index: int) -> nn.Module:
        """A standalone copy of expert ``index`` of ``layer``: own weights, x_ND -> y_ND."""

    @abstractmethod
    def segment(self, layer: int) -> nn.Module:
        """The non-expert part of block ``layer`` as a module (shares weights with model)."""

    @abstractmethod
    def router_module(self, layer: int) -> nn.Module:
        """The gate of an MoE layer; forward(x_ND) -> (logits_NE, weights_NK, ids_NK)."""

    @abstractmethod
    def attention_module(self, layer: int) -> nn.Module:
        """The attention block of ``layer``; returns ``(out, probs_BHTT | None)``."""

    # -- layer-by-layer forward ------------------------------------------------------
    @abstractmethod
    def begin(
        self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ForwardContext]:
        """Embed the inputs; returns h_BTD and the context the segments need."""

    @abstractmethod
    def pre_moe(
        self, layer: int, h_BTD: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention part of block ``layer``: returns (residual_BTD, x_BTD) where x is
        the normalised input of the FFN part (what the router and experts see)."""

    @abstractmethod
    def post_moe(
        self,
        layer: int,
        residual_BTD: torch.Tensor,
        x_BTD: torch.Tensor,
        routed_BTD: torch.Tensor | None,
    ) -> torch.Tensor:
        """FFN part minus the routed experts: adds shared/dense outputs and residual.
        ``routed_BTD`` is the experts' combined output (None on dense layers)."""

    @abstractmethod
    def finish(self, h_BTD: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Final norm and head: logits_BTV for LMs, last hidden state for encoders."""

    @abstractmethod
    def reference_forward(
        self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The wrapped model's own forward, returning what ``finish`` returns."""

    # -- shared behaviour ------------------------------------------------------------
    def route(self, layer: int, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids and gate weights for each token of an MoE layer."""
        _, weights_NK, ids_NK = self.router_module(layer)(x_ND)
        return ids_NK, weights_NK

    def stacked_expert_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, Any] | None:
        """A gated-FFN layer's weights stacked over experts: ``(gate_up_E2FD, down_EDF,
        act)``, views of the model's own tensors; None where the family has no such
        layout (then only the per-expert loop runs it)."""
        return None

    def expert_modules(self, layer: int) -> list[nn.Module]:
        return [self.expert(layer, i) for i in range(self.num_experts(layer))]

    def local_expert_fn(self) -> ExpertFn:
        """The default expert computation: every expert in this process.

        Groups tokens by expert so each expert runs once per layer on all its tokens
        (batched), then scatters the weighted outputs back.
        """
        cache: dict[int, list[nn.Module]] = {}

        def run(layer: int, x_ND: torch.Tensor, ids_NK: torch.Tensor, w_NK: torch.Tensor):
            if layer not in cache:
                cache[layer] = [self.expert_view(layer, i) for i in range(self.num_experts(layer))]
            return combine_experts(cache[layer], x_ND, ids_NK, w_NK)

        return run

    def expert_view(self, layer: int, index: int) -> nn.Module:
        """Like :meth:`expert` but may share storage with the model (no copy)."""
        return self.expert(layer, index)

    @torch.no_grad()
    def forward_layerwise(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor | None = None,
        expert_fn: ExpertFn | None = None,
    ) -> torch.Tensor:
        """A prefill without cache: what ``finish`` returns at every position.

        Padded positions (mask 0) never reach ``expert_fn``; their outputs are whatever
        the non-expert modules make of them (callers ignore them).
        """
        B, T = input_ids_BT.shape
        valid_BT = (torch.ones(B, T, dtype=torch.bool, device=input_ids_BT.device)
                    if attention_mask_BT is None else attention_mask_BT.bool())
        pos_BT = torch.arange(T, device=input_ids_BT.device).expand(B, T)
        step = StepInput(list(range(B)), input_ids_BT, pos_BT, valid_BT, logits="all")
        h_BTD, ctx = self.begin(input_ids_BT, attention_mask_BT)
        return self._layers(step, h_BTD, ctx, expert_fn, {})

    @torch.no_grad()
    def forward_step(self, step: StepInput, cache: KVCache | None = None,
                     experts: ExpertFn | None = None) -> StepOutput:
        """The layer loop: run ``step`` against ``cache`` (None: a prefill that keeps no
        state), routed experts through ``experts`` (default: in process).

        Invariant (contract-tested for every decoder family): a prefill step followed by
        cached decode steps gives the logits of the model's own forward on the whole
        sequences. Only real tokens reach ``experts``.
        """
        return self.forward_steps([step], cache, experts)[0]

    @torch.no_grad()
    def forward_steps(self, steps: list[StepInput], cache: KVCache | None = None,
                      experts: ExpertFn | None = None) -> list[StepOutput]:
        """Several steps of distinct sequences (decode rows and prefill chunks, each padded
        only to its own length) in one layer loop: attention runs per step, each MoE layer
        calls ``experts`` once on all of their real tokens (step by step, row-major), so
        the experts' weights are read once. Every output carries the same ``expert_counts``
        (all steps together). Same results as one :meth:`forward_step` per step."""
        views: list[StepCacheView | None] = []
        for step in steps:
            view = None
            if cache is not None:
                if not self.causal:
                    raise KVCacheError(
                        f"{self.name} ({self.family}) is an encoder: it attends both ways, "
                        "so nothing can be cached between steps", "run it with cache=None")
                if cache.paged and not self.supports_paged:
                    raise KVCacheError(f"{self.name} ({self.family}) has no paged attention",
                                       "use attention='gather'")
                view = cache.view(step.seq_ids, step.lengths)
                view.set_valid(step.valid_BT, step.valid_index())
            views.append(view)
        parts = [(step, *self.begin_step(step, view))
                 for step, view in zip(steps, views, strict=True)]
        counts: dict[int, torch.Tensor] = {}
        outs = run_layers_parts(self, parts, experts or self.local_expert_fn(), counts)
        for view in views:
            if view is not None:
                view.commit()
        return [_step_output(step, out, counts) for step, out in zip(steps, outs, strict=True)]

    def begin_step(self, step: StepInput, view: StepCacheView | None
                   ) -> tuple[torch.Tensor, ForwardContext]:
        """Embed a step. Adapters with a cache override this; the default is the cacheless
        prefill (the step's valid mask is the attention mask)."""
        return self.begin(step.input_ids_BT, step.valid_BT.long())

    def moe(self, layer: int, x_BTD: torch.Tensor, step: StepInput, experts: ExpertFn,
            counts: dict[int, torch.Tensor]) -> torch.Tensor:
        """The routed-expert part of MoE block ``layer``: route the step's real tokens, call
        ``experts`` on them and return their combined output ``[B, T, D]`` (0 at padding).
        Records the per-expert token counts of the layer in ``counts[layer]`` (a device
        tensor). No host read: the step's valid rows come from its host lengths."""
        return self.moe_parts(layer, [x_BTD], [step], experts, counts)[0]

    def moe_parts(self, layer: int, xs_BTD: list[torch.Tensor], steps: list[StepInput],
                  experts: ExpertFn, counts: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`moe` for several steps with one ``experts`` call on all their real tokens
        (routing is per token, so it is the same as one call per step)."""
        xv, index = [], []
        for x_BTD, step in zip(xs_BTD, steps, strict=True):
            x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
            valid_N = None if step.all_valid else step.valid_index()
            index.append(valid_N)
            xv.append(x_ND if valid_N is None else x_ND[valid_N])  # padding never reaches experts
        xcat_ND = xv[0] if len(xv) == 1 else torch.cat(xv)
        ids_NK, w_NK = self.route(layer, xcat_ND)
        # kept on the device; the runner reads every layer's counts once per step
        counts[layer] = count_experts(ids_NK, self.num_experts(layer))
        ycat_ND = experts(layer, xcat_ND, ids_NK, w_NK)
        sizes = [step.num_tokens for step in steps]  # host-known: no read
        out = []
        for x_BTD, yv_ND, valid_N in zip(xs_BTD, ycat_ND.split(sizes), index, strict=True):
            if valid_N is None:
                out.append(yv_ND.reshape(x_BTD.shape))
                continue
            y_ND = x_BTD.new_zeros(x_BTD.shape[0] * x_BTD.shape[1], x_BTD.shape[-1])
            y_ND[valid_N] = yv_ND.to(y_ND.dtype)
            out.append(y_ND.reshape(x_BTD.shape))
        return out

    def _layers(self, step: StepInput, h_BTD: torch.Tensor, ctx: ForwardContext,
                expert_fn: ExpertFn | None, counts: dict[int, torch.Tensor]) -> torch.Tensor:
        return run_layers(self, step, h_BTD, ctx, expert_fn or self.local_expert_fn(), counts)

    def kv_layout(self) -> KVLayout:
        """What one token caches per layer, learnt from a one-token probe forward."""
        if not self.causal:
            raise KVCacheError(f"{self.name} ({self.family}) is an encoder and keeps no "
                               "KV cache", "generate with a decoder model")
        probe = LayoutProbe()
        step = StepInput.from_lists([0], [[0]], [0], device=self.device)
        h_BTD, ctx = self.begin_step(step, probe)  # type: ignore[arg-type]
        # The cache's shape is attention's alone: zero expert outputs keep the probe off
        # the experts, wherever they live (Remoe's main keeps them off the GPU, or remote).
        self._layers(step, h_BTD, ctx, _no_experts, {})
        return probe.layout(self.num_layers)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @contextlib.contextmanager
    def eager_attention(self) -> Iterator[None]:
        """Within this block, attention modules return their probabilities."""
        yield

    def summary(self) -> ModelShape:
        """This model's :class:`ModelShape`, sizes included."""
        expert_bytes = sum(
            param_bytes(self.expert_view(layer, i))
            for layer in self.moe_layers
            for i in range(self.num_experts(layer))
        )
        total = param_bytes(self.model)
        return ModelShape(
            name=self.name,
            family=self.family,
            num_layers=self.num_layers,
            moe_layers=list(self.moe_layers),
            num_experts=[self.num_experts(layer) for layer in self.moe_layers],
            top_k=self.top_k,
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            expert_param_bytes=expert_bytes,
            non_expert_param_bytes=total - expert_bytes,
            total_param_bytes=total,
            causal=self.causal,
        )


def _step_output(step: StepInput, out: torch.Tensor,
                 counts: dict[int, torch.Tensor]) -> StepOutput:
    lengths = step.lengths
    if step.logits == "all":
        rows = step.all_rows
        all_logits = [out[b, :n] if rows is None or b in rows else None
                      for b, n in enumerate(lengths)]
        last = torch.stack([out[b, n - 1] for b, n in enumerate(lengths)])
    else:
        all_logits = [None] * len(lengths)
        last = out[:, 0]
    return StepOutput(last, all_logits, counts)


def count_experts(ids_NK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Pairs per expert, ``[num_experts]`` (ids >= num_experts, marked pairs, are not
    counted). A scatter, not ``bincount``: bincount's output size depends on the largest
    id, which a GPU would have to send back to the host first."""
    flat = ids_NK.reshape(-1)
    out = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    out.scatter_add_(0, flat.clamp(max=num_experts), torch.ones_like(flat))
    return out[:num_experts]


def combine_experts(
    experts: list[nn.Module], x_ND: torch.Tensor, ids_NK: torch.Tensor, w_NK: torch.Tensor
) -> torch.Tensor:
    """y_N = sum_k w_NK * experts[ids_NK](x_N), each expert run once on its tokens."""
    y_ND = torch.zeros_like(x_ND)
    flat_ids = ids_NK.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=len(experts)).tolist()
    token_of = order // ids_NK.shape[1]
    weight_of = w_NK.reshape(-1)[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = token_of[start : start + n]
        out = experts[e](x_ND[tok]) * weight_of[start : start + n, None].to(x_ND.dtype)
        y_ND.index_add_(0, tok, out.to(y_ND.dtype))
        start += n
    return y_ND


def _no_experts(layer: int, x_ND: torch.Tensor, ids_NK: torch.Tensor,
                w_NK: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x_ND)
