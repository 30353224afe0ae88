"""Adapter over Hugging Face decoder MoE families (transformers v5 fused experts).

Mixtral, Qwen2-MoE (Qwen1.5-MoE), OLMoE and DeepSeek-V2 share one block shape:

    h -> input_layernorm -> self_attn -> +h = r -> post_attention_layernorm = x
      -> mlp(x) = experts(x, gate(x)) [+ shared(x)] -> +r

so one adapter covers them; the families differ only in what the MLP adds besides the
routed experts (``_shared``) and in which blocks are dense. DeepSeek-V2's shared experts
and Qwen2-MoE's gated shared expert belong to the non-expert segment.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from moefleet.models.attention import with_implementation
from moefleet.models.base import ForwardContext, MoEModelAdapter
from moefleet.models.experts import GatedExpert
from moefleet.models.kv import StepCacheView
from moefleet.models.step import StepInput

# transformers >= 5.24 renames the attention's ``past_key_values`` argument to ``cache``
# and warns on every forward; we pass the name every 5.x accepts, so the notice is noise
# in the CLI's output (revisit when the supported range moves past the rename).
warnings.filterwarnings("ignore", message=r".*`past_key_values` is deprecated",
                        category=FutureWarning)

# architecture class name -> family name
HF_FAMILIES: dict[str, str] = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "OlmoeForCausalLM": "olmoe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
}


class HFSegment(nn.Module):
    """The non-expert part of one decoder block, as a module that owns nothing new."""

    def __init__(self, adapter: HFMoEAdapter, layer: int) -> None:
        super().__init__()
        block = adapter.blocks[layer]
        self.attn_norm = block.input_layernorm
        self.self_attn = block.self_attn
        self.ffn_norm = block.post_attention_layernorm
        mlp = block.mlp
        if hasattr(mlp, "experts"):
            self.gate = mlp.gate
            for name in ("shared_expert", "shared_expert_gate", "shared_experts"):
                if hasattr(mlp, name):
                    self.add_module(name, getattr(mlp, name))
        else:
            self.dense_mlp = mlp
        if layer == 0:
            self.embed = adapter.backbone.embed_tokens
        if layer == adapter.num_layers - 1:
            self.final_norm = adapter.backbone.norm
            self.lm_head = adapter.lm_head


class HFMoEAdapter(MoEModelAdapter):
    causal = True
    supports_paged = True

    def __init__(self, model: nn.Module, tokenizer: Any | None = None, name: str = "") -> None:
        arch = type(model).__name__
        if arch not in HF_FAMILIES:
            raise ValueError(f"HFMoEAdapter does not handle {arch}")
        self.model = model.eval()
        self.family = HF_FAMILIES[arch]
        self.tokenizer = tokenizer
        hf: Any = model  # HF modules are dynamically typed; keep mypy out of their attributes
        self.config: Any = hf.config
        self.name = name or getattr(self.config, "_name_or_path", "") or self.family
        self.backbone: Any = hf.model
        self.lm_head: Any = hf.lm_head
        self.blocks: list[Any] = list(self.backbone.layers[: self.config.num_hidden_layers])
        self._moe = [i for i, b in enumerate(self.blocks) if hasattr(b.mlp, "experts")]
        # DeepSeek-V2's MLA caches a latent that its attention expands per cached slot
        self.latent_cache = self.family == "deepseek_v2"
        # (layer, attention implementation) -> the layer's attention module running it
        self._attn_copies: dict[tuple[int, str], nn.Module] = {}

    # -- structure -------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    @property
    def moe_layers(self) -> list[int]:
        return list(self._moe)

    def _experts(self, layer: int) -> Any:
        if layer not in self._moe:
            raise IndexError(f"layer {layer} is not an MoE layer (MoE layers: {self._moe})")
        return self.blocks[layer].mlp.experts

    def num_experts(self, layer: int) -> int:
        return int(self._experts(layer).num_experts)

    @property
    def top_k(self) -> int:
        return int(self.config.num_experts_per_tok)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def expert(self, layer: int, index: int) -> nn.Module:
        return GatedExpert.from_stacked(self._experts(layer), index, copy=True)

    def expert_view(self, layer: int, index: int) -> nn.Module:
        return GatedExpert.from_stacked(self._experts(layer), index, copy=False)

    def stacked_expert_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, Any] | None:
        experts = self._experts(layer)
        return experts.gate_up_proj.detach(), experts.down_proj.detach(), experts.act_fn

    def segment(self, layer: int) -> nn.Module:
        return HFSegment(self, layer)

    def router_module(self, layer: int) -> nn.Module:
        self._experts(layer)
        return self.blocks[layer].mlp.gate

    def attention_module(self, layer: int) -> nn.Module:
        return self.blocks[layer].self_attn

    # -- layer-by-layer forward ------------------------------------------------------
    def _masks(self, h_BTD: torch.Tensor, mask_BT: torch.Tensor | None, pos_BT: torch.Tensor):
        kw: dict[str, Any] = dict(
            config=self.config,
            inputs_embeds=h_BTD,
            attention_mask=mask_BT,
            past_key_values=None,
            position_ids=pos_BT,
        )
        layer_types = getattr(self.config, "layer_types", None)
        sliding = getattr(self.config, "sliding_window", None)
        if layer_types:
            by_type: dict[str, Any] = {}
            for t in set(layer_types):
                fn = create_sliding_window_causal_mask if t == "sliding_attention" else None
                by_type[t] = (fn or create_causal_mask)(**kw)
            return [by_type[layer_types[i]] for i in range(self.num_layers)]
        fn = create_sliding_window_causal_mask if sliding is not None else create_causal_mask
        return [fn(**kw)] * self.num_layers

    def begin(
        self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ForwardContext]:
        h_BTD = self.backbone.embed_tokens(input_ids_BT)
        pos_BT = torch.arange(input_ids_BT.shape[1], device=h_BTD.device).unsqueeze(0)
        ctx = ForwardContext(input_ids_BT, attention_mask_BT, pos_BT)
        ctx.extras["masks"] = self._masks(h_BTD, attention_mask_BT, pos_BT)
        ctx.extras["rope"] = self.backbone.rotary_emb(h_BTD, pos_BT)
        return h_BTD, ctx

    def begin_step(self, step: StepInput, view: Any) -> tuple[torch.Tensor, ForwardContext]:
        if not isinstance(view, StepCacheView):
            h_BTD, ctx = self.begin(step.input_ids_BT, step.valid_BT.long())
            ctx.extras["cache"] = view  # None, or the layout probe
            return h_BTD, ctx
        h_BTD = self.backbone.embed_tokens(step.input_ids_BT)
        pos_BT = step.position_ids_BT
        ctx = ForwardContext(step.input_ids_BT, step.valid_BT.long(), pos_BT)
        ctx.extras["rope"] = self.backbone.rotary_emb(h_BTD, pos_BT)
        ctx.extras["cache"] = view
        ctx.extras["masks"] = self._cached_masks(view, pos_BT, h_BTD.dtype)
        return h_BTD, ctx

    def _cached_masks(self, view: StepCacheView, pos_BT: torch.Tensor,
                      dtype: torch.dtype) -> list[torch.Tensor] | list[Any]:
        """Per layer: additive masks [B, 1, T, S] (gather view), or a paged step's block
        masks (paged view). Either way query (b, t) sees key j of its own row iff j is a
        real token (cached or new) at or before the query's position (and within the
        sliding window where the layer has one)."""
        window = getattr(self.config, "sliding_window", None)
        layer_types = getattr(self.config, "layer_types", None) or (
            ["sliding_attention" if window is not None else "full_attention"] * self.num_layers)
        if view.paged:
            # imported here: FlexAttention's import adds ~45 MB and 0.7 s to every process
            # that loads a model (every function's runtime footprint), paged or not
            from moefleet.models.paged import step_masks

            windows = {t: int(window) if t == "sliding_attention" and window is not None
                       else None for t in set(layer_types)}
            paged = step_masks(view, pos_BT, windows)
            return [paged[layer_types[i]] for i in range(self.num_layers)]
        dev = pos_BT.device
        j_S = torch.arange(view.key_len, device=dev)
        total_B = torch.tensor([p + n for p, n in zip(view.past_lens, view.new_lens,
                                                      strict=True)], device=dev)
        seen_BTS = ((j_S[None, None] <= pos_BT[:, :, None])
                    & (j_S[None, None] < total_B[:, None, None]))
        neg = torch.finfo(dtype).min

        def additive(ok_BTS: torch.Tensor) -> torch.Tensor:
            zero = torch.zeros((), dtype=dtype, device=dev)
            return torch.where(ok_BTS, zero, torch.full((), neg, dtype=dtype, device=dev))[:, None]

        by_type: dict[str, torch.Tensor] = {}
        for t in set(layer_types):
            ok = seen_BTS
            if t == "sliding_attention" and window is not None:
                ok = ok & (pos_BT[:, :, None] - j_S[None, None] < int(window))
            by_type[t] = additive(ok)
        return [by_type[layer_types[i]] for i in range(self.num_layers)]

    def _attention(self, layer: int, mask: Any) -> Any:
        """The block's attention module; in paged steps its copy that runs
        :func:`moefleet.models.paged.paged_attention_forward`; for an SDPA model its copy
        that runs :func:`moefleet.models.cpu_attention.decode_attention_forward` (the
        product form for one-token queries on the CPU, SDPA itself otherwise)."""
        paged = sys.modules.get("moefleet.models.paged")  # not imported: no paged step ran
        if paged is not None and isinstance(mask, paged.PagedMask):
            impl = paged.PAGED_IMPL
        elif self.config._attn_implementation == "sdpa":
            from moefleet.models import cpu_attention  # registers its implementation

            impl = cpu_attention.CPU_DECODE_IMPL
        else:
            return self.blocks[layer].self_attn
        copy = self._attn_copies.get((layer, impl))
        if copy is None:
            copy = self._attn_copies[layer, impl] = with_implementation(
                self.blocks[layer].self_attn, impl)
        return copy

    def pre_moe(
        self, layer: int, h_BTD: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        block = self.blocks[layer]
        mask = ctx.extras["masks"][layer]
        attn_BTD, _ = self._attention(layer, mask)(
            hidden_states=block.input_layernorm(h_BTD),
            position_embeddings=ctx.extras["rope"],
            attention_mask=mask,
            position_ids=ctx.position_ids_BT,
            past_key_values=ctx.extras.get("cache"),
        )
        residual_BTD = h_BTD + attn_BTD
        return residual_BTD, block.post_attention_layernorm(residual_BTD)

    def _shared(self, layer: int, x_ND: torch.Tensor) -> torch.Tensor | None:
        mlp = self.blocks[layer].mlp
        if hasattr(mlp, "shared_expert"):  # Qwen2-MoE: sigmoid-gated shared expert
            return F.sigmoid(mlp.shared_expert_gate(x_ND)) * mlp.shared_expert(x_ND)
        if hasattr(mlp, "shared_experts"):  # DeepSeek-V2: always-on shared experts
            return mlp.shared_experts(x_ND)
        return None

    def post_moe(
        self,
        layer: int,
        residual_BTD: torch.Tensor,
        x_BTD: torch.Tensor,
        routed_BTD: torch.Tensor | None,
    ) -> torch.Tensor:
        if routed_BTD is None:
            return residual_BTD + self.blocks[layer].mlp(x_BTD)
        shared_ND = self._shared(layer, x_BTD.reshape(-1, x_BTD.shape[-1]))
        if shared_ND is not None:
            routed_BTD = routed_BTD + shared_ND.reshape(routed_BTD.shape)
        return residual_BTD + routed_BTD

    def finish(self, h_BTD: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.lm_head(self.backbone.norm(h_BTD))

    @torch.no_grad()
    def reference_forward(
        self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = self.model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False)
        return out.logits

    @contextlib.contextmanager
    def eager_attention(self) -> Iterator[None]:
        # SDPA never materialises the probability matrix; eager does, and returns it.
        previous = self.config._attn_implementation
        if previous == "eager":
            yield
            return
        hf: Any = self.model
        hf.set_attn_implementation("eager")
        try:
            yield
        finally:
            hf.set_attn_implementation(previous)
