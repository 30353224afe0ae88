"""Every knob of a MiniLM -> MoE conversion, in one frozen dataclass (the zoo recipe)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from moefleet.errors import MoefleetError
from moefleet.models.moefy.model import check_split


@dataclass(frozen=True)
class ConvertOptions:
    """Every knob of a conversion. With the same options, data and torch thread count
    the result is bitwise reproducible on one machine (seeded generators, stable sorts).
    Defaults are the quick structural setting; the zoo recipe (entries.py) is the tuned one.
    """

    num_experts: int = 8  # E; must divide the FFN width (1536 for MiniLM)
    top_k: int = 2  # k stored in config.json; any 1..E can be chosen at load time
    calib_lines: int = 256  # wikitext2 train lines drawn (seeded) for calibration
    max_length: int = 128  # tokens per line (truncation)
    batch_size: int = 32  # lines per calibration batch
    fit_tokens: int = 16384  # tokens for the GELU fit, clustering stats, gate training
    cluster_tokens: int = 4096  # tokens in each neuron's co-activation profile
    kmeans_iters: int = 30
    gate_steps: int = 200  # full-batch Adam steps on the fit tokens
    gate_lr: float = 1e-2
    gate_temperature: float = 0.5  # softness of the gate's importance targets
    refit: bool = False  # least-squares refit of the output side (see finetune.py)
    refit_ridge: float = 1e-3
    refit_tokens: int = 16384
    distill_steps: int = 0  # layer-wise distillation steps per layer (0 = exact split)
    distill_lr: float = 1e-4
    distill_batch: int = 2048  # tokens per distillation step
    e2e_steps: int = 0  # end-to-end fine-tune steps after all layers (0 = off)
    e2e_lr: float = 5e-4
    e2e_batch: int = 8  # sequences per end-to-end step
    e2e_cosine_weight: float = 0.0  # weight of (1 - cos) of pooled embeddings in its loss
    seed: int = 0

    def validate(self, intermediate_size: int) -> None:
        """Raise MoefleetError naming the first bad option."""
        check_split(intermediate_size, self.num_experts, self.top_k)
        positive = ("calib_lines", "max_length", "batch_size", "fit_tokens", "cluster_tokens",
                    "kmeans_iters", "distill_batch", "e2e_batch", "refit_tokens")
        for f in fields(self):
            value = getattr(self, f.name)
            low = 1 if f.name in positive else 0
            if isinstance(value, int | float) and not isinstance(value, bool) and value < low:
                raise MoefleetError(
                    f"conversion option {f.name}={value} is out of range",
                    f"use a value >= {low}",
                )
