"""``MoEModelAdapter`` over :class:`BertMoEModel` (architecture ``MoefleetBertMoE``).

Shape legend: B batch, T sequence, N tokens (B*T), D hidden, E experts, K top-k,
H heads, V vocabulary.

Block l cut into the adapter's pieces (every block is an MoE block):

    pre_moe : h -> attn(h) = a          returns (residual=a, x=a): BERT is post-LN, so
                                        the FFN input is also the residual
    experts : routed = sum_k expert_k(x)   (unweighted: router weights are all 1)
    post_moe: LN(a + routed + shared(x))

``finish`` returns the last hidden state h_BTD (an encoder has no head). These are the
very methods the model's own forward uses, so ``forward_layerwise`` equals
``reference_forward`` up to the order of floating-point additions in the expert sum.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moefleet.models.base import ForwardContext, MoEModelAdapter
from moefleet.models.moefy.model import BertExpert, BertMoEModel, MoEFFN

FAMILY = "bert_moe"


class BertMoESegment(nn.Module):
    """The non-expert part of one block; shares every parameter with the model."""

    def __init__(self, model: BertMoEModel, layer: int) -> None:
        super().__init__()
        block = model.blocks[layer]
        self.attn = block.attn
        self.router = block.moe.router
        self.shared = block.moe.shared
        self.ffn_norm = block.moe.norm
        if layer == 0:
            self.embeddings = model.embeddings


class BertMoEAdapter(MoEModelAdapter):
    """Adapter for the converted MiniLM (or any BertMoEModel)."""

    causal = False
    model: BertMoEModel

    def __init__(self, model: BertMoEModel, tokenizer: Any | None = None, name: str = "") -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.family = FAMILY
        self.name = name or FAMILY

    # -- structure -------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def moe_layers(self) -> list[int]:
        return list(range(self.num_layers))

    def _moe(self, layer: int) -> MoEFFN:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range (model has {self.num_layers} layers)")
        return self.model.blocks[layer].moe

    def num_experts(self, layer: int) -> int:
        return self._moe(layer).num_experts

    @property
    def top_k(self) -> int:
        return int(self.model.config.top_k)

    def set_top_k(self, top_k: int) -> None:
        """Route each token to ``top_k`` experts from now on (weights unchanged)."""
        self.model.set_top_k(top_k)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def _expert(self, layer: int, index: int, copy: bool) -> BertExpert:
        moe = self._moe(layer)
        if not 0 <= index < moe.num_experts:
            raise IndexError(f"expert {index} out of range (layer has {moe.num_experts})")
        parts = [
            p[index].detach()
            for p in (moe.w1_EFD, moe.b1_EF, moe.alpha_EF, moe.w2_EDF, moe.b2_ED)
        ]
        if copy:
            parts = [t.clone() for t in parts]
        return BertExpert(*parts)

    def expert(self, layer: int, index: int) -> nn.Module:
        return self._expert(layer, index, copy=True)

    def expert_view(self, layer: int, index: int) -> nn.Module:
        return self._expert(layer, index, copy=False)

    def segment(self, layer: int) -> nn.Module:
        self._moe(layer)
        return BertMoESegment(self.model, layer)

    def router_module(self, layer: int) -> nn.Module:
        return self._moe(layer).router

    def attention_module(self, layer: int) -> nn.Module:
        self._moe(layer)
        return self.model.blocks[layer].attn

    # -- layer-by-layer forward ------------------------------------------------------
    def begin(
        self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ForwardContext]:
        h_BTD = self.model.embeddings(input_ids_BT)
        pos_BT = torch.arange(input_ids_BT.shape[1], device=h_BTD.device).unsqueeze(0)
        ctx = ForwardContext(input_ids_BT, attention_mask_BT, pos_BT)
        ctx.extras["mask_bias"] = self.model.mask_bias(attention_mask_BT, h_BTD.dtype)
        return h_BTD, ctx

    def pre_moe(
        self, layer: int, h_BTD: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        a_BTD, _ = self.model.blocks[layer].attn(h_BTD, ctx.extras["mask_bias"])
        return a_BTD, a_BTD

    def post_moe(
        self,
        layer: int,
        residual_BTD: torch.Tensor,
        x_BTD: torch.Tensor,
        routed_BTD: torch.Tensor | None,
    ) -> torch.Tensor:
        moe = self._moe(layer)
        if routed_BTD is None:
            # Not reached by forward_layerwise (all blocks are MoE); route locally.
            x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
            _, w_NK, ids_NK = moe.router(x_ND)
            routed_BTD = moe.experts(x_ND, ids_NK, w_NK).view_as(x_BTD)
        return moe.finish(residual_BTD, x_BTD, routed_BTD)

    def finish(self, h_BTD: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return h_BTD

    @torch.no_grad()
    def reference_forward(
        self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None = None
    ) -> torch.Tensor:
        out: torch.Tensor = self.model(input_ids_BT, attention_mask_BT)
        return out

    @contextlib.contextmanager
    def eager_attention(self) -> Iterator[None]:
        # SDPA never materialises probabilities; the explicit path does and returns them.
        attns = [block.attn for block in self.model.blocks]
        previous = [a.return_probs for a in attns]
        for a in attns:
            a.return_probs = True
        try:
            yield
        finally:
            for a, p in zip(attns, previous, strict=True):
                a.return_probs = p


def load_bert_moe(path: str | Path, name: str = "", top_k: int | None = None) -> BertMoEAdapter:
    """Load a saved BertMoE directory (config.json, model.safetensors, tokenizer files).

    ``top_k`` overrides the k stored in config.json (1 <= k <= E).
    """
    model = BertMoEModel.from_pretrained(path, top_k=top_k)
    return BertMoEAdapter(model, _tokenizer(Path(path)), name=name or Path(path).name)


def _tokenizer(path: Path) -> Any | None:
    if not (path / "tokenizer.json").is_file() and not (path / "vocab.txt").is_file():
        return None  # a checkpoint without tokenizer files still runs on token ids
    # Not AutoTokenizer: it would read config.json, whose model_type transformers does not
    # know, and warn. A converted BERT always carries BERT's WordPiece tokenizer.
    from transformers import BertTokenizer

    return BertTokenizer.from_pretrained(str(path))
