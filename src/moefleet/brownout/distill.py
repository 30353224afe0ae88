"""Distilling united experts from real routed activations.

Shape legend: N calibration tokens, K experts per token, D hidden size, E experts,
P (token, expert) pairs of one group, S tokens used for similarity.

1. **Capture**: run the model on calibration text through ``forward_layerwise`` with a
   recording ExpertFn (a hook at the expert seam): every MoE layer's expert inputs
   ``x_ND`` and routing ``ids_NK`` as the model really produces them.
2. **Group** each layer's experts in groups of ``ways``: by index (the paper), or by
   similarity: every expert is run on the same S calibration tokens, its outputs
   (flattened, unit-normalised) are its feature, and balanced k-means cuts the features
   into equal groups (cosine distance on unit vectors; a greedy most-similar-first fill
   when E is not a multiple of ``ways``).
3. **Train** one united expert per group: start from the members' parameter average,
   minimise the MSE to each member's output on the tokens routed to that member. Each
   member's pairs are capped at ``max_pairs_per_expert`` and re-weighted by
   count / kept, so the loss weights members by how often they are chosen. Adam, early
   stopping on a held-out tenth of the pairs (best state kept).

Report per layer: relative error (MSE / mean squared target) of the average-init and of
the distilled experts on held-out pairs, averaged over groups weighted by pairs.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moefleet.brownout.groups import BrownoutError, Grouping, check_ways, index_groups
from moefleet.brownout.united import (
    UnitedExperts,
    check_grouping_kind,
    entry_dir,
    find_cached,
    model_key,
    save_atomic,
)
from moefleet.errors import DataError
from moefleet.models.base import MoEModelAdapter

ProgressFn = Callable[[int, int, str], None]


@dataclass(frozen=True)
class DistillConfig:
    """Defaults measured on tiny-moe-lm-e32 (README, BrownoutServe): 1,024 calibration
    tokens / 256 pairs per expert left 8-way united experts at wikitext2 perplexity 412
    at threshold 0.4 (zero brownout 153); 32,768 / 4,096 brought it to 183."""

    calib_tokens: int = 32768
    seq_len: int = 128
    calib_source: str = "c4"
    max_pairs_per_expert: int = 4096
    sim_tokens: int = 256
    lr: float = 2e-3
    batch: int = 128
    max_epochs: int = 40
    patience: int = 4
    seed: int = 0


def calibration_ids(adapter: MoEModelAdapter, cfg: DistillConfig) -> torch.Tensor:
    """ids_WT: the first ``calib_tokens`` tokens of ``calib_source`` in windows."""
    from moefleet.models.tinylm.corpus import read_source

    tok = adapter.tokenizer
    if tok is None:
        raise DataError(f"model {adapter.name!r} has no tokenizer", "use a model with one")
    ids: list[int] = []
    for doc in read_source(cfg.calib_source, max_chars=cfg.calib_tokens * 12):
        ids.extend(tok(doc, add_special_tokens=False)["input_ids"])
        if len(ids) >= cfg.calib_tokens:
            break
    n = min(len(ids), cfg.calib_tokens) // cfg.seq_len * cfg.seq_len
    if n == 0:
        raise DataError(f"calibration source {cfg.calib_source!r} gave {len(ids)} tokens",
                        f"need at least seq_len={cfg.seq_len}")
    return torch.tensor(ids[:n], dtype=torch.long).view(-1, cfg.seq_len) % adapter.vocab_size


@torch.no_grad()
def capture(adapter: MoEModelAdapter, ids_WT: torch.Tensor, batch: int = 8
            ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """layer -> (x_ND, ids_NK) of every calibration token, recorded at the expert seam."""
    inner = adapter.local_expert_fn()
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def record(layer: int, x_ND: torch.Tensor, ids_NK: torch.Tensor, w_NK: torch.Tensor):
        seen.setdefault(layer, []).append((x_ND.detach().clone(), ids_NK.clone()))
        return inner(layer, x_ND, ids_NK, w_NK)

    for s in range(0, ids_WT.shape[0], batch):
        adapter.forward_layerwise(ids_WT[s : s + batch], expert_fn=record)
    return {layer: (torch.cat([x for x, _ in v]), torch.cat([i for _, i in v]))
            for layer, v in seen.items()}


@torch.no_grad()
def similarity_groups(experts: list[nn.Module], x_SD: torch.Tensor, ways: int, seed: int
                      ) -> tuple[tuple[int, ...], ...]:
    """Groups of ``ways`` experts whose outputs on ``x_SD`` point the same way."""
    from moefleet.models.moefy.cluster import balanced_kmeans

    feats_EM = torch.stack([e(x_SD).reshape(-1).float() for e in experts])
    feats_EM = feats_EM / feats_EM.norm(dim=1, keepdim=True).clamp_min(1e-12)
    n = len(experts)
    if n % ways == 0:
        labels = balanced_kmeans(feats_EM, n // ways, seed=seed).tolist()
        groups = [tuple(e for e in range(n) if labels[e] == g) for g in range(n // ways)]
        return tuple(sorted(groups))
    sim_EE = feats_EM @ feats_EM.T
    left, out = list(range(n)), []
    while left:
        seed_e = left.pop(0)
        left.sort(key=lambda e: (-float(sim_EE[seed_e, e]), e))
        out.append(tuple(sorted([seed_e, *left[: ways - 1]])))
        left = sorted(left[ways - 1 :])
    return tuple(out)


def _average(members: list[nn.Module]) -> nn.Module:
    united = copy.deepcopy(members[0])
    with torch.no_grad():
        for name, p in united.named_parameters():
            p.copy_(torch.stack([dict(m.named_parameters())[name] for m in members]).mean(0))
    return united


def _weighted_mse(y_PD: torch.Tensor, t_PD: torch.Tensor, w_P: torch.Tensor) -> torch.Tensor:
    return (((y_PD - t_PD) ** 2).mean(-1) * w_P).sum() / w_P.sum()


def distill_group(members: list[nn.Module], x_ND: torch.Tensor, ids_NK: torch.Tensor,
                  expert_ids: tuple[int, ...], cfg: DistillConfig, gen: torch.Generator
                  ) -> tuple[nn.Module, dict[str, Any]]:
    """One united expert for ``expert_ids`` (module doc, step 3) and its numbers."""
    xs, ts, ws = [], [], []
    with torch.no_grad():
        for e, member in zip(expert_ids, members, strict=True):
            tok = torch.nonzero((ids_NK == e).any(1)).flatten()
            count = tok.numel()
            if count == 0:
                continue
            if count > cfg.max_pairs_per_expert:
                tok = tok[torch.randperm(count, generator=gen)[: cfg.max_pairs_per_expert]]
            xs.append(x_ND[tok])
            ts.append(member(x_ND[tok]))
            ws.append(torch.full((tok.numel(),), count / tok.numel()))
    united = _average(members)
    if not xs:  # a group nobody routes to: the average is all we can do
        return united.eval(), {"pairs": 0, "rel_err_init": None, "rel_err": None, "epochs": 0}
    x_PD, t_PD, w_P = torch.cat(xs), torch.cat(ts), torch.cat(ws)
    perm = torch.randperm(x_PD.shape[0], generator=gen)
    n_val = max(1, x_PD.shape[0] // 10)
    val, tr = perm[:n_val], perm[n_val:] if x_PD.shape[0] > 1 else perm
    scale = float(((t_PD[val] ** 2).mean(-1) * w_P[val]).sum() / w_P[val].sum()) or 1.0

    def val_err() -> float:
        with torch.no_grad():
            return float(_weighted_mse(united(x_PD[val]), t_PD[val], w_P[val])) / scale

    params = list(united.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=cfg.lr)
    init_err = best = val_err()
    best_state = copy.deepcopy(united.state_dict())
    stale, epochs = 0, 0
    for epoch in range(cfg.max_epochs):
        epochs = epoch + 1
        order = tr[torch.randperm(tr.numel(), generator=gen)]
        for s in range(0, order.numel(), cfg.batch):
            b = order[s : s + cfg.batch]
            loss = _weighted_mse(united(x_PD[b]), t_PD[b], w_P[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        err = val_err()
        if err < best - 1e-6:
            best, stale, best_state = err, 0, copy.deepcopy(united.state_dict())
        else:
            stale += 1
            if stale >= cfg.patience:
                break
    united.load_state_dict(best_state)
    for p in params:
        p.requires_grad_(False)
    return united.eval(), {"pairs": int(x_PD.shape[0]), "rel_err_init": init_err,
                           "rel_err": best, "epochs": epochs}


def distill(adapter: MoEModelAdapter, ways: int, kind: str, cfg: DistillConfig | None = None,
            progress: ProgressFn | None = None, force: bool = False) -> UnitedExperts:
    """United experts of ``adapter`` for ``ways`` and grouping ``kind``, cached."""
    cfg = cfg or DistillConfig()
    check_grouping_kind(kind)
    for layer in adapter.moe_layers:
        check_ways(ways, adapter.num_experts(layer))
    config = dataclasses.asdict(cfg)
    if not force:
        cached = find_cached(adapter, ways, kind, config)
        if cached is not None:
            return cached
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    total = sum(-(-adapter.num_experts(layer) // ways) for layer in adapter.moe_layers)
    if progress is not None:  # the capture below is the first long silent step
        progress(0, total, f"running {cfg.calib_tokens} calibration tokens")
    captured = capture(adapter, calibration_ids(adapter, cfg))
    groups: dict[int, tuple[tuple[int, ...], ...]] = {}
    modules: dict[int, list[nn.Module]] = {}
    layers_report = []
    done = 0
    for layer in adapter.moe_layers:
        x_ND, ids_NK = captured[layer]
        experts = [adapter.expert(layer, i) for i in range(adapter.num_experts(layer))]
        if kind == "index":
            groups[layer] = index_groups(len(experts), ways)
        else:
            pick = torch.randperm(x_ND.shape[0], generator=gen)[: cfg.sim_tokens]
            groups[layer] = similarity_groups(experts, x_ND[pick], ways, cfg.seed)
        modules[layer], stats = [], []
        for members in groups[layer]:
            united, st = distill_group([experts[e] for e in members], x_ND, ids_NK, members,
                                       cfg, gen)
            if st["rel_err"] is not None and not math.isfinite(st["rel_err"]):
                # NaN weights or activations: caching this would serve NaN forever.
                raise BrownoutError(
                    f"distilling layer {layer}'s experts {list(members)} gave a relative "
                    f"error of {st['rel_err']}; nothing was cached",
                    "the model's weights or activations hold NaN or infinity: rebuild it")
            modules[layer].append(united)
            stats.append(st)
            done += 1
            if progress is not None:
                progress(done, total, f"layer {layer}: rel. error {st['rel_err'] or 0:.3f}")
        layers_report.append(_layer_summary(layer, groups[layer], stats))
    report = {"model": adapter.name, "ways": ways, "grouping": kind, "config": config,
              "calibration_tokens": int(next(iter(captured.values()))[0].shape[0]),
              "layers": layers_report}
    united_experts = UnitedExperts(adapter.name, model_key(adapter),
                                   Grouping(ways, kind, groups), modules, report)
    save_atomic(entry_dir(adapter, ways, kind, config), united_experts)
    return united_experts


def _layer_summary(layer: int, groups: tuple[tuple[int, ...], ...],
                   stats: list[dict[str, Any]]) -> dict[str, Any]:
    used = [s for s in stats if s["pairs"]]
    pairs = sum(s["pairs"] for s in used) or 1

    def avg(key: str) -> float | None:
        return sum(s[key] * s["pairs"] for s in used) / pairs if used else None

    return {"layer": layer, "groups": [list(g) for g in groups],
            "rel_err_init": avg("rel_err_init"), "rel_err": avg("rel_err"),
            "epochs": [s["epochs"] for s in stats], "pairs": [s["pairs"] for s in stats]}
