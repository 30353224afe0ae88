"""BertMoE: a post-LayerNorm BERT encoder whose FFNs are split into routed experts.

Shape legend (suffixes on tensor names):
    B batch, T sequence length, N tokens flattened (B*T), D hidden size, H heads,
    Dh head size, E experts in a layer, F neurons per expert, K experts per token.
    (Local variables spell F as ``Fe`` where ``F`` is torch.nn.functional.)

One block, as a one-line pipeline:

    h -> attn(h) -> LN(h + .) = a -> router(a) -> sum_k expert_k(a) + shared(a) -> LN(a + .)

Expert e computes, with z = w1_EFD[e] @ x + b1_EF[e],

    expert_e(x) = w2_EDF[e] @ (gelu(z) - alpha_EF[e] * z) + b2_ED[e]

i.e. its neurons' GELU minus a per-neuron linear fit of that GELU. ``shared`` (a D x D
linear map in the non-expert segment) holds the sum of all those linear fits plus the
dense FFN's output bias. Invariant: with every expert selected (``top_k == E``) and the
exact split (no refit/distillation) the block equals the dense BERT block it came from; with
fewer, a skipped expert contributes its best linear approximation instead of nothing
(alpha = 0 would be the plain "replace by its mean" rule). Selected experts are summed
unweighted (MoEfication), so the router's combination weights are all 1; its gate
probabilities are softmax(logits_NE).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from moefleet.errors import DataError, MoefleetError
from moefleet.io import atomic_path, write_json_atomic

ARCHITECTURE = "MoefleetBertMoE"
MODEL_TYPE = "moefleet_bert_moe"
WEIGHTS_FILE = "model.safetensors"


@dataclass
class BertMoEConfig:
    """Everything that determines the module's shapes, plus provenance (``source``)."""

    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    num_experts: int = 8
    top_k: int = 2
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    source: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_split(self.intermediate_size, self.num_experts, self.top_k)
        if self.hidden_size % self.num_attention_heads:
            raise MoefleetError(
                f"hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}",
                "use a head count that divides the hidden size",
            )

    @property
    def expert_size(self) -> int:
        return self.intermediate_size // self.num_experts

    def to_json(self) -> dict[str, Any]:
        return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, **asdict(self)}

    @classmethod
    def from_json(cls, blob: dict[str, Any]) -> BertMoEConfig:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in blob.items() if k in known})


def check_split(intermediate_size: int, num_experts: int, top_k: int) -> None:
    """Raise MoefleetError unless E divides the FFN width and 1 <= k <= E."""
    if num_experts < 1 or intermediate_size % num_experts:
        raise MoefleetError(
            f"{num_experts} experts do not split an FFN of {intermediate_size} neurons evenly",
            f"pick a divisor of {intermediate_size}, e.g. 4, 8, 16",
        )
    if not 1 <= top_k <= num_experts:
        raise MoefleetError(
            f"top_k={top_k} is not between 1 and the number of experts ({num_experts})",
            "use top_k 1 or 2",
        )


class BertEmbeddings(nn.Module):
    """word + position + token type (always 0) embeddings, then LayerNorm."""

    def __init__(self, cfg: BertMoEConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.position = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        pos_T = torch.arange(input_ids_BT.shape[1], device=input_ids_BT.device)
        h_BTD = self.word(input_ids_BT) + self.position(pos_T)[None] + self.token_type.weight[0]
        return self.norm(h_BTD)


class BertAttention(nn.Module):
    """Self-attention plus its output projection and post-LayerNorm: h -> LN(h + attn(h)).

    forward returns ``(out_BTD, probs_BHTT | None)``; probabilities are computed
    explicitly (and returned) only while ``return_probs`` is set, which is what the
    adapter's ``eager_attention()`` toggles. Otherwise SDPA runs and returns None.
    """

    def __init__(self, cfg: BertMoEConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.wo = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.return_probs = False

    def forward(
        self, h_BTD: torch.Tensor, mask_bias_B11T: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T, D = h_BTD.shape
        qkv = self.wqkv(h_BTD).view(B, T, 3, self.num_heads, D // self.num_heads)
        q_BHTDh, k_BHTDh, v_BHTDh = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        probs_BHTT: torch.Tensor | None = None
        if self.return_probs:
            scores_BHTT = q_BHTDh @ k_BHTDh.transpose(-1, -2) * q_BHTDh.shape[-1] ** -0.5
            if mask_bias_B11T is not None:
                scores_BHTT = scores_BHTT + mask_bias_B11T
            probs_BHTT = scores_BHTT.softmax(dim=-1)
            ctx_BHTDh = probs_BHTT @ v_BHTDh
        else:
            ctx_BHTDh = F.scaled_dot_product_attention(
                q_BHTDh, k_BHTDh, v_BHTDh, attn_mask=mask_bias_B11T
            )
        ctx_BTD = ctx_BHTDh.transpose(1, 2).reshape(B, T, D)
        return self.norm(h_BTD + self.wo(ctx_BTD)), probs_BHTT


class MoERouter(nn.Module):
    """Linear gate; forward(x_ND) -> (logits_NE, weights_NK, ids_NK).

    ids are the top-k logits (ties broken by torch.topk); weights are all ones because
    the selected experts are summed unweighted. ``top_k`` is a plain attribute so k can
    change at load time without touching weights.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts)
        self.top_k = top_k

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits_NE = self.gate(x_ND)
        ids_NK = logits_NE.topk(self.top_k, dim=-1).indices
        weights_NK = torch.ones(ids_NK.shape, dtype=x_ND.dtype, device=x_ND.device)
        return logits_NE, weights_NK, ids_NK


def expert_forward(
    x_ND: torch.Tensor,
    w1_FD: torch.Tensor,
    b1_F: torch.Tensor,
    alpha_F: torch.Tensor,
    w2_DF: torch.Tensor,
    b2_D: torch.Tensor,
) -> torch.Tensor:
    """w2 @ (gelu(z) - alpha * z) + b2 with z = w1 @ x + b1 (see module docstring)."""
    z_NF = F.linear(x_ND, w1_FD, b1_F)
    return F.linear(F.gelu(z_NF) - alpha_F * z_NF, w2_DF, b2_D)


class BertExpert(nn.Module):
    """One expert as a standalone module (own parameters): x_ND -> y_ND."""

    def __init__(
        self,
        w1_FD: torch.Tensor,
        b1_F: torch.Tensor,
        alpha_F: torch.Tensor,
        w2_DF: torch.Tensor,
        b2_D: torch.Tensor,
    ) -> None:
        super().__init__()
        self.w1 = nn.Parameter(w1_FD, requires_grad=False)
        self.b1 = nn.Parameter(b1_F, requires_grad=False)
        self.alpha = nn.Parameter(alpha_F, requires_grad=False)
        self.w2 = nn.Parameter(w2_DF, requires_grad=False)
        self.b2 = nn.Parameter(b2_D, requires_grad=False)

    @property
    def intermediate_size(self) -> int:
        return int(self.w1.shape[0])

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        return expert_forward(x_ND, self.w1, self.b1, self.alpha, self.w2, self.b2)


class MoEFFN(nn.Module):
    """Router + stacked experts (gpt-fast layout) + the non-expert shared map and LayerNorm."""

    def __init__(self, cfg: BertMoEConfig) -> None:
        super().__init__()
        E, Fe, D = cfg.num_experts, cfg.expert_size, cfg.hidden_size
        self.router = MoERouter(D, E, cfg.top_k)
        self.w1_EFD = nn.Parameter(torch.zeros(E, Fe, D))
        self.b1_EF = nn.Parameter(torch.zeros(E, Fe))
        self.alpha_EF = nn.Parameter(torch.zeros(E, Fe))
        self.w2_EDF = nn.Parameter(torch.zeros(E, D, Fe))
        self.b2_ED = nn.Parameter(torch.zeros(E, D))
        self.shared = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D, eps=cfg.layer_norm_eps)

    @property
    def num_experts(self) -> int:
        return int(self.w1_EFD.shape[0])

    def expert_out(self, e: int, x_ND: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on every row of x_ND (same arithmetic as :class:`BertExpert`)."""
        return expert_forward(
            x_ND, self.w1_EFD[e], self.b1_EF[e], self.alpha_EF[e], self.w2_EDF[e], self.b2_ED[e]
        )

    def experts(self, x_ND: torch.Tensor, ids_NK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
        """sum_k w_NK * expert[ids_NK](x_N); each expert runs once on its own tokens."""
        y_ND = torch.zeros_like(x_ND)
        for e in range(self.num_experts):
            tok, slot = torch.nonzero(ids_NK == e, as_tuple=True)
            if tok.numel():
                y_ND.index_add_(0, tok, self.expert_out(e, x_ND[tok]) * w_NK[tok, slot, None])
        return y_ND

    def finish(
        self, residual_BTD: torch.Tensor, x_BTD: torch.Tensor, routed_BTD: torch.Tensor
    ) -> torch.Tensor:
        """The non-expert tail of the block: LN(residual + routed + shared(x))."""
        return self.norm(residual_BTD + routed_BTD + self.shared(x_BTD))

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        # In BERT the FFN input is also the residual (post-LN), hence x_BTD twice.
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        _, w_NK, ids_NK = self.router(x_ND)
        return self.finish(x_BTD, x_BTD, self.experts(x_ND, ids_NK, w_NK).view_as(x_BTD))


class BertMoEBlock(nn.Module):
    def __init__(self, cfg: BertMoEConfig) -> None:
        super().__init__()
        self.attn = BertAttention(cfg)
        self.moe = MoEFFN(cfg)

    def forward(self, h_BTD: torch.Tensor, mask_bias_B11T: torch.Tensor | None) -> torch.Tensor:
        a_BTD, _ = self.attn(h_BTD, mask_bias_B11T)
        return self.moe(a_BTD)


class BertMoEModel(nn.Module):
    """The encoder; ``forward(ids, mask)`` returns the last hidden state h_BTD."""

    def __init__(self, cfg: BertMoEConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList(BertMoEBlock(cfg) for _ in range(cfg.num_hidden_layers))

    @property
    def blocks(self) -> list[BertMoEBlock]:
        """The blocks, typed (``layers`` is the ModuleList that owns them)."""
        return [cast(BertMoEBlock, b) for b in self.layers]

    def set_top_k(self, top_k: int) -> None:
        """Change how many experts each token uses (no weight changes)."""
        check_split(self.config.intermediate_size, self.config.num_experts, top_k)
        self.config.top_k = top_k
        for block in self.blocks:
            block.moe.router.top_k = top_k

    def mask_bias(
        self, attention_mask_BT: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """Additive key mask: 0 where attended, dtype-min where padded (prob exactly 0)."""
        if attention_mask_BT is None:
            return None
        keep_B11T = attention_mask_BT[:, None, None, :].to(torch.bool)
        zero = torch.zeros((), dtype=dtype, device=attention_mask_BT.device)
        return torch.where(keep_B11T, zero, torch.finfo(dtype).min)

    def forward(
        self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None = None
    ) -> torch.Tensor:
        h_BTD = self.embeddings(input_ids_BT)
        bias_B11T = self.mask_bias(attention_mask_BT, h_BTD.dtype)
        for block in self.blocks:
            h_BTD = block(h_BTD, bias_B11T)
        return h_BTD

    # -- persistence -----------------------------------------------------------------
    def save_pretrained(self, out: str | Path) -> None:
        """Write config.json + model.safetensors into ``out`` (each file atomically)."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        with atomic_path(out / WEIGHTS_FILE) as tmp:
            save_file(tensors, str(tmp), metadata={"format": "pt"})
        write_json_atomic(out / "config.json", self.config.to_json())

    @classmethod
    def from_pretrained(cls, path: str | Path, top_k: int | None = None) -> BertMoEModel:
        """Load a directory written by :meth:`save_pretrained`; ``top_k`` overrides k."""
        path = Path(path)
        try:
            blob = json.loads((path / "config.json").read_text())
            state = load_file(str(path / WEIGHTS_FILE))
        except (OSError, ValueError, SafetensorError) as err:
            raise DataError(
                f"could not read the BertMoE checkpoint at {path}: {str(err).splitlines()[0]}",
                "rebuild it (moefleet models build NAME --force)",
            ) from err
        model = cls(BertMoEConfig.from_json(blob))
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise DataError(
                f"weights in {path} do not match its config.json: {str(err).splitlines()[0]}",
                "rebuild it (moefleet models build NAME --force)",
            ) from err
        if top_k is not None:
            model.set_top_k(top_k)
        return model.eval()
