"""Real MoE sizes: the engine against HF ``generate`` on a real-shape model, one run.

Model: a real-shape entry (``moefleet.models.real_shapes``: published config, seeded random
weights: speed, memory and cost only), by default the 2-layer slice of OLMoE-1B-7B in
bfloat16. Workload: the same token ids for every method (seeded: prompts of
``--min-prompt``..``--max-prompt`` tokens, outputs of ``--min-output``..``--max-output``
tokens, greedy, end-of-sequence ignored). Side by side, on one device:

- the engine with each expert kernel (loop, stacked, fused) and the fused kernel under
  brownout (ways, threshold) = (2, 0), (4, 0.2), (8, 0.4), (8, 0.0), partial mode with
  united experts that are group averages (not distilled: speed only);
- HF ``generate`` in static batches of ``--max-num-seqs`` with transformers' fastest
  experts implementation (``grouped_mm``), and one request at a time (first
  ``--sequential`` requests; a rate, so the subset compares).

Per run: tokens/s; fraction of the memory roofline (a decode step reads every weight
once: roofline time = steps x weight bytes / measured copy bandwidth, over the run's
wall time, so prefill time counts against it); KV capacity; preemptions; host reads per
decode step (``engine.host_reads.HostReads`` around every step of an untimed pass: the
counting slows every torch call); peak RSS so far. And,
in a subprocess, the peak RSS of loading the full model shape (``--load-model``) over its
weight bytes (skipped, and said so, when the machine's free memory cannot hold it).

    python benchmarks/engine_scale.py            # CPU, ~6 min on 2 cores
    python benchmarks/engine_scale.py --device cuda --model olmoe-1b-7b --load-model '' \
        --requests 256 --max-num-seqs 256 --min-prompt 64 --max-prompt 512 \
        --min-output 64 --max-output 256 --max-model-len 1024 --rounds 1 \
        --runs engine_fused,brownout_8_0.4,brownout_8_0,hf_static,hf_sequential,\
engine_fused@paged,engine_stacked,brownout_2_0,brownout_4_0.2      # the GPU bars

``--runs`` picks the methods and their order (``NAME@paged`` / ``NAME@gather`` sets an
engine run's attention); the JSON is rewritten after every run, so a run cut short keeps
what it measured (``complete: false``).

Every method runs once per round (``--rounds``, same order each round); figures are
medians over rounds (a shared machine's load drifts), ratios compare the medians.
writes benchmarks/results/engine_scale_cpu.json (``_cuda.json`` with ``--device cuda``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from hf_baseline import hf_generate, run_hf, sync  # benchmarks/ is on sys.path when run as a script
from scale_helpers import (
    GiB,
    StepBytes,
    compiled_graphs,
    copy_bandwidth,
    gpu_peak_gib,
    load_check,
    peak_rss_gib,
    release,
)
from scale_runs import hf_static, host_reads, profile_decode
from torch._dynamo import reset as dynamo_reset

from moefleet.brownout.united import averaged_united
from moefleet.compose import StackOptions, in_process_engine
from moefleet.engine import SamplingParams
from moefleet.engine.engine import merge_into
from moefleet.engine.request import RequestOutput
from moefleet.experts.brownout import BrownoutExperts
from moefleet.io import write_text_atomic
from moefleet.models.cpu_bf16 import plain_linears
from moefleet.models.real_shapes import RANDOM_NOTE
from moefleet.models.registry import load_adapter

RESULTS = Path(__file__).parent / "results"
BROWNOUTS = [(2, 0.0), (4, 0.2), (8, 0.4), (8, 0.0)]
KERNELS = ("loop", "stacked", "fused")
DEFAULT_RUNS = ",".join([f"engine_{k}" for k in KERNELS]
                        + [f"brownout_{w}_{t:g}" for w, t in BROWNOUTS]
                        + ["hf_static", "hf_sequential"])


def workload(vocab: int, n: int, a: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(a.seed)
    plen = torch.randint(a.min_prompt, a.max_prompt + 1, (n,), generator=g).tolist()
    olen = torch.randint(a.min_output, a.max_output + 1, (n,), generator=g).tolist()
    ids = [torch.randint(0, vocab, (p,), generator=g).tolist() for p in plen]
    return ids, olen


def run_engine(adapter: Any, ids: list[list[int]], lens: list[int], a: argparse.Namespace,
               stack: StackOptions, attention: str) -> tuple[list[list[int]], dict[str, Any]]:
    dev = torch.device(a.device)
    opened = in_process_engine(adapter, stack=stack, device=a.device,
                               max_num_seqs=a.max_num_seqs, attention=attention,
                               kv_budget_bytes=a.kv_cache_bytes, max_model_len=a.max_model_len)
    eng = opened.engine
    # warm-up (kernel selection, compilation, first calls), untimed: 1, 2, 3 and 7 rows,
    # so that compiled attention has seen one row and several, prefill and decode
    for n in (1, 2, 3, 7):
        eng.generate(ids[:n], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    eng.stats.steps.clear()
    graphs = compiled_graphs()
    rids = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            for p, n in zip(ids, lens, strict=True)]
    merged = {r: RequestOutput(r, [], "", False) for r in rids}
    decode_rows: list[int] = []
    kv_tokens = 0  # cached tokens the decode steps' attention read
    t0 = time.perf_counter()
    while eng.has_unfinished:
        context = sum(s.num_tokens for s in eng.scheduler.running)
        outs = eng.step()
        st = eng.stats.steps[-1]
        if st.num_tokens == st.num_rows:  # every row advanced by one token: a decode step
            decode_rows.append(st.num_rows)
            kv_tokens += context
        for o in outs:
            merge_into(merged[o.request_id], o)
    sync(dev)
    wall = time.perf_counter() - t0
    tokens = sum(lens)
    info = {"wall_s": wall, "tokens_per_s": tokens / wall, "steps": len(eng.stats.steps),
            "decode_steps": len(decode_rows), "decode_rows": decode_rows,
            "kv_bytes_read": kv_tokens * adapter.kv_layout().bytes_per_token,
            "attention": opened.runner.attention,  # type: ignore[attr-defined]
            "preemptions": eng.scheduler.num_preemptions,
            "compiles_while_timed": compiled_graphs() - graphs,
            "kv_capacity": opened.runner.kv_capacity.as_dict(),  # type: ignore[attr-defined]
            "peak_rss_gib_so_far": peak_rss_gib(), "gpu_peak_gib": gpu_peak_gib(dev),
            "notes": opened.notes}
    router = opened.brownout
    if router is not None:
        s = router.stats
        pairs = max(1, s.original_pairs + s.united_pairs + s.dropped_pairs)
        info["brownout"] = {"share_pairs_original": s.original_pairs / pairs,
                            "expert_accesses_per_call": (s.original_accesses
                                                         + s.united_accesses) / max(1, s.calls),
                            # calls left to the original experts: uniting saves nothing there
                            "share_calls_not_united": s.calls_not_united / max(1, s.calls)}
    tokens_out = [merged[r].new_token_ids for r in rids]
    failed = [merged[r].error for r in rids if merged[r].error]
    if failed:  # its tokens/s would count tokens never made: kept out of every ratio
        info["failed_requests"] = len(failed)
        info["first_error"] = str(failed[0])[:500]
    del opened, eng
    release(dev)  # the timed engine's cache goes before the counting engine sizes its own
    info.update(host_reads(adapter, ids, a, stack, attention))
    # The counting mode makes dynamo compile paged attention's shapes again (4 more, up
    # to its limit of 8, after which flex runs eagerly over the whole pool): drop them.
    dynamo_reset()
    release(dev)
    if a.profile:
        a.profile = False  # the first engine run only
        try:
            info["profile"] = profile_decode(adapter, ids, a, stack, attention)
        except Exception as err:  # a failed profile is reported, not fatal
            info["profile"] = {"error": f"{type(err).__name__}: {err}"[:500]}
        release(dev)
    return tokens_out, info


def engine_configs(adapter: Any, names: list[str], default_attention: str
                   ) -> dict[str, tuple[StackOptions, str]]:
    """``engine_KERNEL`` / ``brownout_WAYS_THRESHOLD`` names, optionally ``@ATTENTION``,
    to (stack, attention). United experts (group averages) are built with each engine."""
    out: dict[str, tuple[StackOptions, str]] = {}
    for name in names:
        base, _, att = name.partition("@")
        att = att or default_attention
        if base.startswith("engine_") and base[7:] in KERNELS:
            out[name] = (StackOptions(kernel=base[7:]), att)  # type: ignore[arg-type]
            continue
        parts = base.split("_")
        if len(parts) != 3 or parts[0] != "brownout":
            raise SystemExit(f"unknown run {name!r}: engine_{{{','.join(KERNELS)}}}, "
                             "brownout_WAYS_THRESHOLD, hf_static or hf_sequential")
        ways, th = int(parts[1]), float(parts[2])

        def wrap(base: Any, ways: int = ways, th: float = th) -> BrownoutExperts:
            # built with the engine and freed with it: a GPU holds one set at a time
            return BrownoutExperts(base, averaged_united(adapter, ways), th, "partial")

        out[name] = (StackOptions(kernel="fused", wrap=wrap), att)
    return out


def summarise(res: dict[str, Any], samples: dict[str, list[dict[str, Any]]],
              outputs: dict[str, list[list[int]]], seq: list[list[int]], k: int) -> None:
    """Medians over rounds into ``res['runs']``; the bars from the runs there are."""
    for name, infos in samples.items():
        run = dict(infos[-1])
        for key in ("tokens_per_s", "wall_s", "roofline_fraction", "roofline_fraction_with_kv"):
            if key not in run:
                continue
            run[key] = statistics.median(i[key] for i in infos)
            run[f"{key}_rounds"] = [i[key] for i in infos]
        reads = [i["host_reads_per_decode_step_max"] for i in infos
                 if i.get("host_reads_per_decode_step_max") is not None]
        if reads:
            run["host_reads_per_decode_step_max"] = max(reads)
        if "preemptions" in run:
            run["preemptions"] = max(i["preemptions"] for i in infos)
        res["runs"][name] = run
    runs = res["runs"]

    def tps(name: str) -> float | None:
        if name not in runs or runs[name].get("failed_requests"):
            return None
        return runs[name]["tokens_per_s"]

    def ratio(x: str, y: str) -> float | None:
        tx, ty = tps(x), tps(y)
        return None if tx is None or ty is None else tx / ty

    engines = [n for n in runs if n.startswith("engine_") and tps(n) is not None]
    best = max(engines, key=lambda n: runs[n]["tokens_per_s"]) if engines else None
    zero = "engine_fused" if "engine_fused" in runs else None
    reads = [r["host_reads_per_decode_step_max"] for n, r in runs.items()
             if n.startswith(("engine_fused", "brownout"))
             and r.get("host_reads_per_decode_step_max") is not None]
    res["bars"] = {
        "engine_best": best,
        "engine_best_roofline_fraction": runs[best]["roofline_fraction"] if best else None,
        "engine_vs_hf_static": ratio(best, "hf_static") if best else None,
        "fused_vs_hf_static": ratio("engine_fused", "hf_static"),
        "brownout_8_0.4_vs_zero": ratio("brownout_8_0.4", zero) if zero else None,
        "brownout_8_0_vs_zero": ratio("brownout_8_0", zero) if zero else None,
        "brownout_8_0.4_vs_zero_paged": ratio("brownout_8_0.4@paged", "engine_fused@paged"),
        "brownout_8_0_vs_zero_paged": ratio("brownout_8_0@paged", "engine_fused@paged"),
        "host_reads_per_decode_step_max": max(reads, default=None),
        "preemptions_max": max((r["preemptions"] for r in runs.values()
                                if "preemptions" in r), default=None),
        "load_rss_over_weights": res.get("load", {}).get("ratio"),
    }
    kernels = [outputs[n] for n in ("engine_loop", "engine_stacked", "engine_fused")
               if n in outputs]
    # bf16: kernels sum in different orders, so near-ties may flip (shares, not checks)
    res["kernels_agree"] = all(o == kernels[0] for o in kernels) if len(kernels) > 1 else None
    if "engine_fused" in outputs and seq:
        res["engine_equals_hf_sequential"] = sum(
            x == y for x, y in zip(outputs["engine_fused"][:k], seq, strict=True)) / k
    if "engine_fused" in outputs and "hf_static" in outputs:
        got, want = outputs["engine_fused"], outputs["hf_static"]
        res["engine_equals_hf_static"] = sum(
            x == y for x, y in zip(got, want, strict=True)) / len(got)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="olmoe-1b-7b:layers=2")
    ap.add_argument("--load-model", default="olmoe-1b-7b", help="'' skips the load check")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sequential", type=int, default=1)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=64)
    ap.add_argument("--min-output", type=int, default=4)
    ap.add_argument("--max-output", type=int, default=24)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--kv-cache-memory", default=None, help="e.g. 1GiB (default: sized)")
    ap.add_argument("--attention", default="gather", choices=["gather", "paged", "auto"],
                    help="how attention reads the KV cache (paged: FlexAttention, no gather)")
    ap.add_argument("--runs", default=DEFAULT_RUNS,
                    help="comma list, in order: engine_{loop,stacked,fused}, "
                         "brownout_WAYS_THRESHOLD, hf_static, hf_sequential; NAME@paged "
                         "or NAME@gather sets an engine run's attention")
    ap.add_argument("--hf-batch", type=int, default=0,
                    help="HF static batch size (0: max_num_seqs; halved on GPU OOM)")
    ap.add_argument("--profile", action="store_true",
                    help="profile decode steps of the first engine run (torch.profiler)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from moefleet.engine.kv_sizing import parse_size

    a.kv_cache_bytes = None if a.kv_cache_memory is None else parse_size(a.kv_cache_memory)
    names = [n.strip() for n in a.runs.split(",") if n.strip()]
    dev = torch.device(a.device)
    out = Path(a.out) if a.out else RESULTS / f"engine_scale_{dev.type}.json"
    res: dict[str, Any] = {"model": a.model, "dtype": a.dtype, "device": a.device,
                           "note": RANDOM_NOTE, "torch_threads": torch.get_num_threads(),
                           "torch": torch.__version__, "max_num_seqs": a.max_num_seqs,
                           "attention": a.attention, "runs_asked": names, "runs": {},
                           "complete": False}
    if dev.type == "cuda":
        res["card"] = torch.cuda.get_device_name(dev)
    else:  # results differ by CPU class: AVX2 runs bf16 through float32 blocks
        from moefleet.models.dtypes import fastest_cpu_dtype

        res["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        res["cpu_bf16_speedup_over_fp32"] = round(fastest_cpu_dtype()[1], 3)
    if a.load_model:
        res["load"] = load_check(a.load_model, a.dtype)
        if "ratio" in res["load"]:
            print(f"load {a.load_model}: peak RSS {res['load']['ratio']:.3f}x weights",
                  flush=True)
    old = json.loads(out.read_text()).get("load", {}) if out.is_file() else {}
    if "ratio" not in res.get("load", {}) and "ratio" in old:
        # keep a load measured by an earlier run of this script (said so in the JSON)
        res["load"] = {**old, "from_an_earlier_run": True,
                       "skipped_this_run": res.get("load", {}).get("skipped", "not asked")}
    adapter = load_adapter(a.model, dtype=a.dtype, device=a.device)
    res["model_notes"] = list(adapter.notes)  # e.g. bf16 linears through float32 blocks
    ids, lens = workload(adapter.vocab_size, a.requests, a)
    tokens = sum(lens)
    bw = copy_bandwidth(dev)
    step_bytes = StepBytes(adapter)
    res.update({"requests": len(ids), "output_tokens": tokens, "copy_bandwidth_gbs": bw / 1e9,
                "prompt_tokens": sum(len(p) for p in ids),
                "weight_bytes_per_step_all_experts": step_bytes.fixed + step_bytes.experts,
                "roofline_with_kv": "the same, the decode steps' reads of their rows' cached "
                                    "K/V added to the weight bytes (engine runs only)",
                "roofline": "sum over decode steps of the weight bytes a step of its rows "
                            "reads (uniform-routing estimate of experts touched) / copy "
                            "bandwidth (read + write bytes of a device copy), over the run's "
                            "wall time (prefill included); brownout reads fewer weights than "
                            "that, so it may exceed 1"})
    print(f"{len(ids)} requests, {tokens} output tokens; copy {bw / 1e9:.1f} GB/s, "
          f"{(step_bytes.fixed + step_bytes.experts) / GiB:.2f} GiB of weights per full step",
          flush=True)
    configs = engine_configs(adapter, [n for n in names if not n.startswith("hf_")],
                             a.attention)
    samples: dict[str, list[dict[str, Any]]] = {}
    outputs: dict[str, list[list[int]]] = {}
    seq: list[list[int]] = []
    k = a.sequential

    def record(name: str, info: dict[str, Any], rows: list[int]) -> None:
        weights = sum(step_bytes(b) for b in rows)
        info["roofline_fraction"] = weights / bw / info["wall_s"]
        if "kv_bytes_read" in info:  # the decode steps' KV reads too: a step's real floor
            info["roofline_fraction_with_kv"] = (weights + info["kv_bytes_read"]) / bw \
                / info["wall_s"]
        samples.setdefault(name, []).append(info)
        if info.get("failed_requests"):
            print(f"{name}: {info['failed_requests']} requests FAILED: {info['first_error']}",
                  flush=True)
        print(f"round {len(samples[name])} {name}: {info['tokens_per_s']:.2f} tok/s, "
              f"roofline {info['roofline_fraction']:.1%}, host reads/decode step "
              f"{info.get('host_reads_per_decode_step_max')}, preemptions "
              f"{info.get('preemptions')}", flush=True)
        summarise(res, samples, outputs, seq, k)
        write_text_atomic(out, json.dumps(res, indent=2, sort_keys=True) + "\n")

    model = adapter.model
    if any(n.startswith("hf_") for n in names):
        model.config._experts_implementation = "grouped_mm"  # transformers' fastest experts
        model.generation_config.eos_token_id = None
        with plain_linears(model):
            hf_generate(model, ids[:2], 2, a.device)  # warm-up, untimed
    RESULTS.mkdir(exist_ok=True)
    # rounds, every method once per round in the same order: a shared machine's load
    # drifts, so each figure is the median over rounds and ratios compare medians
    for _ in range(a.rounds):
        for name in names:
            if name == "hf_static":
                with plain_linears(model):  # transformers' own modules, as users run them
                    hf = hf_static(model, ids, lens, a)
                if hf is None:
                    res.setdefault("errors", {})[name] = "out of memory down to batch 16"
                    continue
                outputs[name], wall, steps, batch = hf
                record(name, {"wall_s": wall, "tokens_per_s": tokens / wall, "batch": batch,
                              "gpu_peak_gib": gpu_peak_gib(dev),
                              "experts_implementation": "grouped_mm"}, steps)
            elif name == "hf_sequential":
                with plain_linears(model):
                    seq, wall, steps = run_hf(model, ids[:k], lens[:k], 1, a.device)
                record(name, {"wall_s": wall, "tokens_per_s": sum(lens[:k]) / wall,
                              "requests": k}, steps)
            else:
                stack, attention = configs[name]
                try:
                    outputs[name], info = run_engine(adapter, ids, lens, a, stack, attention)
                except Exception as err:  # one method failing must not lose the others
                    res.setdefault("errors", {})[name] = f"{type(err).__name__}: {err}"[:2000]
                    print(f"{name} FAILED: {res['errors'][name]}", flush=True)
                    release(dev)
                    continue
                if name.startswith("brownout"):
                    info["united"] = "group averages (speed only, not distilled)"
                record(name, info, info.pop("decode_rows"))
            release(dev)
    res["rounds"] = a.rounds
    res["complete"] = True
    write_text_atomic(out, json.dumps(res, indent=2, sort_keys=True) + "\n")
    print(json.dumps(res["bars"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
