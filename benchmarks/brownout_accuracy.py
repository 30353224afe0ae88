"""BrownoutServe's accuracy trade-off (its Table I / Fig. 10) on our fine-grained model.

    python benchmarks/brownout_accuracy.py [--model tiny-moe-lm-e32] [--piqa-items 1838]
        [--ppl-tokens 16384] [--ways 2,4,8] [--groupings index,similarity]

For ways in {2, 4, 8} (partial brownout with united experts of both groupings) and
"full" (full brownout: pairs outside S1 dropped), and threshold 1.0, 0.9, ..., 0.0:

- PIQA accuracy: log-likelihood of " " + solution given the goal, summed over the
  solution's tokens (lm-eval's ``acc``), over the first ``--piqa-items`` validation items;
- WikiText-2 perplexity: the first ``--ppl-tokens`` tokens of wikitext2-tokens-valid
  (held out from training) in windows of 128, every token but a window's first scored;
- next-token top-1 agreement with zero brownout on those WikiText-2 positions.

The model runs through ``forward_layerwise`` with ``BrownoutExperts`` around the local
experts; brownout decides per MoE layer per call, a call being one batch of
``--batch`` sequences; padding never reaches the experts (forward_layerwise routes
only valid rows, as the engine does). Threshold 1.0 is zero brownout for every ways (computed once).

Writes benchmarks/results/brownout_accuracy.json (+ .png, + .md table): every figure,
the accuracy loss vs zero brownout, and the bars (similarity vs index at 8 ways; loss at
the paper's configurations (2, 0), (4, 0.2), (8, 0.4)).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from moefleet.brownout.distill import DistillConfig, distill
from moefleet.brownout.groups import Grouping, index_groups
from moefleet.brownout.united import find_cached
from moefleet.experts.brownout import BrownoutExperts
from moefleet.io import write_json_atomic, write_text_atomic
from moefleet.models import zoo
from moefleet.models.base import MoEModelAdapter

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "brownout_accuracy.json"
THRESHOLDS = [round(1.0 - 0.1 * i, 1) for i in range(11)]
PAPER_CONFIGS = [("2", 0.0), ("4", 0.2), ("8", 0.4)]


def piqa_items(n: int) -> list[tuple[str, str, str, int]]:
    from moefleet.paths import shared_data_dirs

    for d in shared_data_dirs():
        f = d / "piqa" / "valid.jsonl"
        if f.is_file():
            rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            labels = (d / "piqa" / "valid-labels.lst").read_text().split()
            items = [(r["goal"], r["sol1"], r["sol2"], int(lab))
                     for r, lab in zip(rows, labels, strict=True)]
            return items[:n]
    raise SystemExit("PIQA validation data not found (set $MOEFLEET_DATA_DIR)")


def piqa_requests(tok: Any, items: list[tuple[str, str, str, int]]) -> list[tuple[list[int], int]]:
    """(ids, number of continuation tokens) for both solutions of every item."""
    out = []
    for goal, s1, s2, _ in items:
        ctx = tok(goal, add_special_tokens=False)["input_ids"]
        for sol in (s1, s2):
            cont = tok(" " + sol, add_special_tokens=False)["input_ids"]
            out.append(([tok.eos_token_id, *ctx, *cont][-256:], len(cont)))
    return out


@torch.no_grad()
def loglik(adapter: MoEModelAdapter, fn_for: Any, reqs: list[tuple[list[int], int]],
           batch: int) -> list[float]:
    """Sum of log-probabilities of each request's continuation tokens."""
    out: list[float] = []
    for s in range(0, len(reqs), batch):
        chunk = reqs[s : s + batch]
        t = max(len(ids) for ids, _ in chunk)
        ids_BT = torch.zeros(len(chunk), t, dtype=torch.long)
        mask_BT = torch.zeros(len(chunk), t, dtype=torch.long)
        for b, (ids, _) in enumerate(chunk):
            ids_BT[b, : len(ids)] = torch.tensor(ids)
            mask_BT[b, : len(ids)] = 1
        # forward_layerwise routes only the valid rows: padding never reaches experts
        logits = adapter.forward_layerwise(ids_BT, mask_BT, fn_for())
        logp_BTV = logits.float().log_softmax(-1)
        for b, (ids, n_cont) in enumerate(chunk):
            pos = torch.arange(len(ids) - n_cont, len(ids))
            out.append(float(logp_BTV[b, pos - 1, torch.tensor(ids)[pos]].sum()))
    return out


@torch.no_grad()
def wikitext(adapter: MoEModelAdapter, fn_for: Any, ids_WT: torch.Tensor, batch: int
             ) -> tuple[float, torch.Tensor]:
    """(perplexity, argmax predictions of every scored position)."""
    nll, n, preds = 0.0, 0, []
    for s in range(0, ids_WT.shape[0], batch):
        chunk = ids_WT[s : s + batch]
        logits = adapter.forward_layerwise(chunk, expert_fn=fn_for()).float()[:, :-1]
        nll += float(torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum"))
        n += chunk[:, 1:].numel()
        preds.append(logits.argmax(-1).reshape(-1))
    return math.exp(nll / n), torch.cat(preds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-moe-lm-e32")
    ap.add_argument("--piqa-items", type=int, default=1838)
    ap.add_argument("--ppl-tokens", type=int, default=16384)
    ap.add_argument("--ways", default="2,4,8")
    ap.add_argument("--groupings", default="index,similarity")
    ap.add_argument("--thresholds", default=",".join(str(t) for t in THRESHOLDS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--cached-only", action="store_true",
                    help="skip (ways, grouping) whose united experts are not cached yet")
    ap.add_argument("--resume", action="store_true",
                    help="keep the configurations already in --out (same data sizes)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    adapter = zoo.load(args.model)
    tok = adapter.tokenizer
    items = piqa_items(args.piqa_items)
    reqs = piqa_requests(tok, items)
    from moefleet.models.tinylm.corpus import encode_docs, read_source

    stream = encode_docs(tok, read_source("wikitext2-tokens-valid"), False)
    n = min(args.ppl_tokens, stream.numel()) // 128 * 128
    ids_WT = stream[:n].view(-1, 128)
    inner = adapter.local_expert_fn()
    thresholds = [float(t) for t in args.thresholds.split(",")]

    def evaluate(fn_for: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        ll = loglik(adapter, fn_for, reqs, args.batch)
        correct = [int((ll[2 * i + 1] > ll[2 * i]) == bool(label))
                   for i, (*_, label) in enumerate(items)]
        ppl, preds = wikitext(adapter, fn_for, ids_WT, args.batch)
        return {"piqa_acc": sum(correct) / len(correct), "wikitext2_ppl": ppl,
                "preds": preds, "seconds": round(time.perf_counter() - t0, 2)}

    base = evaluate(lambda: inner)
    rows: list[dict[str, Any]] = []

    def record(ways: str, grouping: str, threshold: float, res: dict[str, Any],
               stats: Any) -> None:
        agree = float((res["preds"] == base["preds"]).float().mean())
        row = {"ways": ways, "grouping": grouping, "threshold": threshold,
               "piqa_acc": res["piqa_acc"], "wikitext2_ppl": res["wikitext2_ppl"],
               "top1_agreement": agree,
               "piqa_acc_loss_pct": 100 * (base["piqa_acc"] - res["piqa_acc"]) / base["piqa_acc"],
               "seconds": res["seconds"]}
        if stats is not None:
            pairs = stats.original_pairs + stats.united_pairs + stats.dropped_pairs
            row["share_pairs_original"] = stats.original_pairs / max(pairs, 1)
            row["expert_accesses_per_call"] = (stats.original_accesses
                                              + stats.united_accesses) / max(stats.calls, 1)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items()}), flush=True)

    groupings = args.groupings.split(",")
    distill_s: dict[str, float] = {}
    if args.resume and args.out.is_file():
        old = json.loads(args.out.read_text())
        if old["setup"]["piqa_items"] != len(items) or old["setup"]["wikitext2_tokens"] != int(
                ids_WT.numel()):
            raise SystemExit(f"{args.out} was measured on other data sizes; drop --resume")
        rows.extend(r for r in old["rows"] if r["ways"] != "zero")
        distill_s.update(old["setup"].get("united_seconds (distill, or load if cached)", {}))
    record("zero", "-", 1.0, base, None)

    def done(ways: str, grouping: str, th: float) -> bool:
        return any(r["ways"] == ways and r["grouping"] == grouping
                   and abs(r["threshold"] - th) < 1e-9 for r in rows)

    def save() -> None:
        setup = {"piqa_items": len(items), "wikitext2_tokens": int(ids_WT.numel()),
                 "batch_sequences_per_call": args.batch, "torch_threads": 1,
                 "distill_config": dataclasses.asdict(DistillConfig()),
                 "united_seconds (distill, or load if cached)": distill_s,
                 "machine": platform.machine(), "cpus": os.cpu_count(),
                 "seconds_this_run": round(time.perf_counter() - t_start, 1)}
        write_all(args, sorted(rows, key=_order), base, setup, groupings)

    # full brownout drops pairs outside S1 and never uses groups: any grouping will do
    by_index = Grouping(2, "index", {layer: index_groups(adapter.num_experts(layer), 2)
                                     for layer in adapter.moe_layers})
    for th in thresholds:
        if th >= 1.0 or done("full", "-", th):
            continue
        shared = BrownoutExperts(inner, by_index, th, "full")
        res = evaluate(lambda s=shared: s)
        record("full", "-", th, res, shared.stats)
        save()
    for ways in [int(w) for w in args.ways.split(",")]:
        for grouping in groupings:
            cfg = DistillConfig()
            if args.cached_only and find_cached(adapter, ways, grouping,
                                                dataclasses.asdict(cfg)) is None:
                print(f"skipping {ways}-way {grouping}: not distilled yet", flush=True)
                continue
            t0 = time.perf_counter()
            united = distill(adapter, ways, grouping, cfg)
            distill_s[f"{grouping}-{ways}"] = round(time.perf_counter() - t0, 1)
            for th in thresholds:
                if th >= 1.0 or done(str(ways), grouping, th):
                    continue
                # one wrapper for the whole evaluation: its stats cover every call
                shared = BrownoutExperts(inner, united, th, "partial")
                res = evaluate(lambda s=shared: s)
                record(str(ways), grouping, th, res, shared.stats)
                save()
    save()


def write_all(args: argparse.Namespace, rows: list[dict[str, Any]], base: dict[str, Any],
              setup: dict[str, Any], groupings: list[str]) -> None:
    # every grouping measured so far, this run's or a resumed run's
    groupings = [g for g in ("index", "similarity") if any(r["grouping"] == g for r in rows)]
    summary = summarise(rows, base)
    out = {
        "model": args.model,
        "emulated": False,
        "setup": setup,
        "zero_brownout": {k: base[k] for k in ("piqa_acc", "wikitext2_ppl")},
        "rows": rows,
        "summary": summary,
    }
    write_json_atomic(args.out, out)
    write_text_atomic(args.out.with_suffix(".md"), table_md(rows, groupings))
    plot(rows, groupings, args.out.with_suffix(".png"))


def _order(r: dict[str, Any]) -> tuple:
    rank = {"zero": 0, "2": 1, "4": 2, "8": 3, "full": 4}
    return (rank.get(r["ways"], 5), r["grouping"], -r["threshold"])


def summarise(rows: list[dict[str, Any]], base: dict[str, Any]) -> dict[str, Any]:
    def pick(ways: str, grouping: str, th: float) -> dict[str, Any] | None:
        for r in rows:
            if r["ways"] == ways and r["grouping"] in (grouping, "-") and abs(
                    r["threshold"] - th) < 1e-9:
                return r
        return None

    out: dict[str, Any] = {"paper_configs": {}}
    for grouping in ("index", "similarity"):
        for ways, th in PAPER_CONFIGS:
            r = pick(ways, grouping, th)
            if r:
                out["paper_configs"][f"{grouping} ({ways}, {th})"] = {
                    k: r[k] for k in ("piqa_acc", "piqa_acc_loss_pct", "wikitext2_ppl",
                                      "top1_agreement")}
    eights = {g: [r for r in rows if r["ways"] == "8" and r["grouping"] == g]
              for g in ("index", "similarity")}
    if eights["index"] and eights["similarity"]:
        mean = {g: {k: sum(r[k] for r in v) / len(v)
                    for k in ("piqa_acc", "wikitext2_ppl", "top1_agreement")}
                for g, v in eights.items()}
        out["ways8_mean_over_thresholds"] = mean
        out["similarity_no_worse_than_index_at_8"] = {
            "top1_agreement": mean["similarity"]["top1_agreement"]
            >= mean["index"]["top1_agreement"],
            "wikitext2_ppl": mean["similarity"]["wikitext2_ppl"]
            <= mean["index"]["wikitext2_ppl"],
            "piqa_acc": mean["similarity"]["piqa_acc"] >= mean["index"]["piqa_acc"]}
    out["zero_brownout"] = {k: base[k] for k in ("piqa_acc", "wikitext2_ppl")}
    return out


def table_md(rows: list[dict[str, Any]], groupings: list[str]) -> str:
    """PIQA accuracy loss (% of zero brownout) / perplexity, ways x threshold."""
    ths = sorted({r["threshold"] for r in rows}, reverse=True)
    lines = ["| ways (grouping) | " + " | ".join(f"{t:.1f}" for t in ths) + " |",
             "|---" * (len(ths) + 1) + "|"]
    keys = [(w, g) for g in groupings for w in ("2", "4", "8")] + [("full", "-")]
    zero = next(r for r in rows if r["ways"] == "zero")
    for w, g in keys:
        cells = []
        for t in ths:
            r = zero if t >= 1.0 else next((r for r in rows if r["ways"] == w and r["grouping"]
                                            == g and abs(r["threshold"] - t) < 1e-9), None)
            cells.append("-" if r is None else
                         f"{r['piqa_acc_loss_pct']:+.1f}% / {r['wikitext2_ppl']:.0f}")
        label = f"{w}-way ({g})" if w != "full" else "full brownout"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], groupings: list[str], path: Path) -> None:
    from moefleet.report.figures import pyplot, save_png

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    zero = next(r for r in rows if r["ways"] == "zero")
    for w, g, style in [(w, g, "-" if g == "index" else "--") for g in groupings
                        for w in ("2", "4", "8")] + [("full", "-", ":")]:
        pts = sorted([r for r in rows if r["ways"] == w and r["grouping"] == g]
                     + [zero], key=lambda r: r["threshold"])
        label = f"{w}-way {g}" if w != "full" else "full brownout"
        for ax, key in zip(axes, ("piqa_acc", "wikitext2_ppl", "top1_agreement"), strict=True):
            ax.plot([r["threshold"] for r in pts], [r[key] for r in pts], style, marker="o",
                    ms=3, label=label)
    for ax, title in zip(axes, ("PIQA accuracy", "WikiText-2 perplexity (log)",
                                "top-1 agreement with zero brownout"), strict=True):
        ax.set_xlabel("brownout threshold")
        ax.set_title(title)
        ax.invert_xaxis()
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7)
    save_png(fig, path)


if __name__ == "__main__":
    main()
