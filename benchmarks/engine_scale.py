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

Every method runs once per round (``--rounds``, same order each round); figures are
medians over rounds (a shared machine's load drifts), ratios compare the medians.
writes benchmarks/results/engine_scale_cpu.json (``_cuda.json`` with ``--device cuda``).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from hf_baseline import hf_generate, run_hf, sync  # benchmarks/ is on sys.path when run as a script

from moefleet.brownout.united import averaged_united
from moefleet.compose import StackOptions, in_process_engine
from moefleet.engine import SamplingParams
from moefleet.engine.engine import merge_into
from moefleet.engine.host_reads import HostReads
from moefleet.engine.request import RequestOutput
from moefleet.experts.brownout import BrownoutExperts
from moefleet.io import write_text_atomic
from moefleet.models.real_shapes import RANDOM_NOTE
from moefleet.models.registry import load_adapter

RESULTS = Path(__file__).parent / "results"
BROWNOUTS = [(2, 0.0), (4, 0.2), (8, 0.4), (8, 0.0)]
GiB = 1 << 30


def workload(vocab: int, n: int, a: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(a.seed)
    plen = torch.randint(a.min_prompt, a.max_prompt + 1, (n,), generator=g).tolist()
    olen = torch.randint(a.min_output, a.max_output + 1, (n,), generator=g).tolist()
    ids = [torch.randint(0, vocab, (p,), generator=g).tolist() for p in plen]
    return ids, olen


def copy_bandwidth(device: torch.device, nbytes: int = 512 << 20) -> float:
    """Bytes moved (read + write) per second by ``copy_`` of a large buffer (median of 5)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


class StepBytes:
    """Weight bytes a decode step of ``B`` rows reads: every non-expert weight but the
    embedding table (only its rows), plus the experts its tokens touch, estimated with
    uniform routing as a share ``1 - (1 - k/E)^B`` of each layer's experts (at large B
    every expert: the issue's "a decode step reads all weights once")."""

    def __init__(self, adapter: Any) -> None:
        shape = adapter.summary()
        emb = adapter.model.get_input_embeddings().weight
        self.fixed = shape.non_expert_param_bytes - emb.numel() * emb.element_size()
        self.experts = shape.expert_param_bytes
        self.k_over_e = adapter.top_k / adapter.num_experts(adapter.moe_layers[0])

    def __call__(self, rows: int) -> float:
        return self.fixed + self.experts * (1 - (1 - self.k_over_e) ** rows)


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_engine(adapter: Any, ids: list[list[int]], lens: list[int], a: argparse.Namespace,
               stack: StackOptions) -> tuple[list[list[int]], dict[str, Any]]:
    opened = in_process_engine(adapter, stack=stack, device=a.device,
                               max_num_seqs=a.max_num_seqs, attention=a.attention,
                               kv_budget_bytes=a.kv_cache_bytes, max_model_len=a.max_model_len)
    eng = opened.engine
    # warm-up (kernel selection, first calls): two short requests, untimed
    eng.generate(ids[:2], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    eng.stats.steps.clear()
    rids = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            for p, n in zip(ids, lens, strict=True)]
    merged = {r: RequestOutput(r, [], "", False) for r in rids}
    decode_rows: list[int] = []
    t0 = time.perf_counter()
    while eng.has_unfinished:
        outs = eng.step()
        st = eng.stats.steps[-1]
        if st.num_tokens == st.num_rows:  # every row advanced by one token: a decode step
            decode_rows.append(st.num_rows)
        for o in outs:
            merge_into(merged[o.request_id], o)
    sync(torch.device(a.device))
    wall = time.perf_counter() - t0
    tokens = sum(lens)
    steps = eng.stats.steps
    info = {"wall_s": wall, "tokens_per_s": tokens / wall, "steps": len(steps),
            "decode_steps": len(decode_rows), "decode_rows": decode_rows,
            "preemptions": eng.scheduler.num_preemptions,
            **host_reads(adapter, ids, a, stack),
            "kv_capacity": opened.runner.kv_capacity.as_dict(),  # type: ignore[attr-defined]
            "peak_rss_gib_so_far": peak_rss_gib(), "notes": opened.notes}
    router = opened.brownout
    if router is not None:
        s = router.stats
        pairs = max(1, s.original_pairs + s.united_pairs + s.dropped_pairs)
        info["brownout"] = {"share_pairs_original": s.original_pairs / pairs,
                            "expert_accesses_per_call": (s.original_accesses
                                                         + s.united_accesses) / max(1, s.calls)}
    return [merged[r].new_token_ids for r in rids], info


def host_reads(adapter: Any, ids: list[list[int]], a: argparse.Namespace,
               stack: StackOptions) -> dict[str, Any]:
    """Host reads per decode step, counted in an untimed pass of its own (the counting
    mode sees every torch call from Python, which would slow the timed run): the first
    ``max_num_seqs`` prompts, 6 tokens each."""
    eng = in_process_engine(adapter, stack=stack, device=a.device, max_num_seqs=a.max_num_seqs,
                            max_model_len=a.max_model_len, attention=a.attention).engine
    for p in ids[: a.max_num_seqs]:
        eng.add_request(p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    counts = []
    while eng.has_unfinished:
        with HostReads() as reads:
            eng.step()
        st = eng.stats.steps[-1]
        if st.num_tokens == st.num_rows:
            counts.append(reads.count)
    return {"host_reads_per_decode_step_max": max(counts, default=None),
            "host_reads_per_decode_step_median": statistics.median(counts) if counts else None}


def load_rss(model: str, dtype: str) -> dict[str, Any]:
    """Peak RSS of building ``model`` in a fresh process, over its weight bytes."""
    # VmHWM, not ru_maxrss: Linux carries this (parent) process's peak into the child.
    code = ("import json, torch\n"
            "from moefleet.models.registry import load_adapter\n"
            "from moefleet.runtime.local_limits import peak_bytes\n"
            f"a = load_adapter({model!r}, dtype={dtype!r})\n"
            "w = sum(p.numel() * p.element_size() for p in a.model.parameters())\n"
            "print(json.dumps({'weight_bytes': w, 'peak_rss_bytes': peak_bytes()}))\n")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=1800)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["ratio"] = res["peak_rss_bytes"] / res["weight_bytes"]
    res["build_s"] = time.perf_counter() - t0
    res["model"] = model
    return res


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


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
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from moefleet.engine.kv_sizing import parse_size

    a.kv_cache_bytes = None if a.kv_cache_memory is None else parse_size(a.kv_cache_memory)
    dev = torch.device(a.device)
    res: dict[str, Any] = {"model": a.model, "dtype": a.dtype, "device": a.device,
                           "note": RANDOM_NOTE, "torch_threads": torch.get_num_threads(),
                           "max_num_seqs": a.max_num_seqs, "attention": a.attention,
                           "runs": {}}
    if dev.type == "cuda":
        res["card"] = torch.cuda.get_device_name(dev)
    if a.load_model:
        from moefleet.models.real_shapes import hf_config, parse_ref

        shape, layers = parse_ref(a.load_model)
        with torch.device("meta"):
            import transformers

            meta = getattr(transformers, shape.arch)(hf_config(shape, layers))
        want = sum(p.numel() for p in meta.parameters()) * 2
        if mem_available() > 1.3 * want:
            res["load"] = load_rss(a.load_model, a.dtype)
            print(f"load {a.load_model}: peak RSS {res['load']['ratio']:.3f}x weights", flush=True)
        else:
            res["load"] = {"model": a.load_model, "skipped": f"needs ~{want / GiB:.1f} GiB, "
                           f"{mem_available() / GiB:.1f} GiB free"}
    adapter = load_adapter(a.model, dtype=a.dtype, device=a.device)
    ids, lens = workload(adapter.vocab_size, a.requests, a)
    tokens = sum(lens)
    bw = copy_bandwidth(dev)
    step_bytes = StepBytes(adapter)
    res.update({"requests": len(ids), "output_tokens": tokens, "copy_bandwidth_gbs": bw / 1e9,
                "weight_bytes_per_step_all_experts": step_bytes.fixed + step_bytes.experts,
                "roofline": "sum over decode steps of the weight bytes a step of its rows "
                            "reads (uniform-routing estimate of experts touched) / copy "
                            "bandwidth, over the run's wall time (prefill included); brownout "
                            "reads fewer weights than that, so it may exceed 1"})
    print(f"{len(ids)} requests, {tokens} output tokens; copy {bw / 1e9:.1f} GB/s, "
          f"{(step_bytes.fixed + step_bytes.experts) / GiB:.2f} GiB of weights per full step",
          flush=True)

    samples: dict[str, list[dict[str, Any]]] = {}

    def record(name: str, info: dict[str, Any], rows: list[int]) -> None:
        info["roofline_fraction"] = sum(step_bytes(b) for b in rows) / bw / info["wall_s"]
        samples.setdefault(name, []).append(info)
        print(f"round {len(samples[name])} {name}: {info['tokens_per_s']:.2f} tok/s, "
              f"roofline {info['roofline_fraction']:.1%}, host reads/decode step "
              f"{info.get('host_reads_per_decode_step_max')}", flush=True)

    configs: list[tuple[str, StackOptions]] = [
        (f"engine_{kernel}", StackOptions(kernel=kernel))  # type: ignore[arg-type]
        for kernel in ("loop", "stacked", "fused")]
    for ways, th in BROWNOUTS:
        united = averaged_united(adapter, ways)

        def wrap(base: Any, united: Any = united, th: float = th) -> BrownoutExperts:
            return BrownoutExperts(base, united, th, "partial")

        configs.append((f"brownout_{ways}_{th:g}", StackOptions(kernel="fused", wrap=wrap)))
    model = adapter.model
    model.config._experts_implementation = "grouped_mm"  # transformers' fastest experts
    model.generation_config.eos_token_id = None
    hf_generate(model, ids[:2], 2, a.device)  # warm-up, untimed
    outputs: dict[str, list[list[int]]] = {}
    seq: list[list[int]] = []
    k = a.sequential
    # rounds, every method once per round in the same order: a shared machine's load
    # drifts, so each figure is the median over rounds and ratios compare medians
    for _ in range(a.rounds):
        for name, stack in configs:
            outputs[name], info = run_engine(adapter, ids, lens, a, stack)
            if name.startswith("brownout"):
                info["united"] = "group averages (speed only, not distilled)"
            record(name, info, info.pop("decode_rows"))
        static, wall, steps = run_hf(model, ids, lens, a.max_num_seqs, a.device)
        record("hf_static", {"wall_s": wall, "tokens_per_s": tokens / wall,
                             "experts_implementation": "grouped_mm"}, steps)
        seq, wall, steps = run_hf(model, ids[:k], lens[:k], 1, a.device)
        record("hf_sequential", {"wall_s": wall, "tokens_per_s": sum(lens[:k]) / wall,
                                 "requests": k}, steps)
    for name, infos in samples.items():
        run = dict(infos[-1])
        for key in ("tokens_per_s", "wall_s", "roofline_fraction"):
            run[key] = statistics.median(i[key] for i in infos)
            run[f"{key}_rounds"] = [i[key] for i in infos]
        if "host_reads_per_decode_step_max" in run:
            run["host_reads_per_decode_step_max"] = max(
                i["host_reads_per_decode_step_max"] for i in infos)
            run["preemptions"] = max(i["preemptions"] for i in infos)
        res["runs"][name] = run
    res["rounds"] = a.rounds
    runs = res["runs"]
    best = max(("engine_loop", "engine_stacked", "engine_fused"),
               key=lambda r: runs[r]["tokens_per_s"])
    res["bars"] = {
        "engine_best": best,
        "engine_vs_hf_static": runs[best]["tokens_per_s"] / runs["hf_static"]["tokens_per_s"],
        "fused_vs_hf_static": runs["engine_fused"]["tokens_per_s"]
        / runs["hf_static"]["tokens_per_s"],
        "brownout_8_0.4_vs_zero": runs["brownout_8_0.4"]["tokens_per_s"]
        / runs["engine_fused"]["tokens_per_s"],
        "brownout_8_0_vs_zero": runs["brownout_8_0"]["tokens_per_s"]
        / runs["engine_fused"]["tokens_per_s"],
        "host_reads_per_decode_step_max": max(
            r["host_reads_per_decode_step_max"] for n, r in runs.items()
            if n.startswith(("engine_fused", "brownout"))),
        "load_rss_over_weights": res.get("load", {}).get("ratio"),
    }
    # bf16: kernels sum in different orders, so near-ties may flip (shares, not checks)
    res["kernels_agree"] = (outputs["engine_loop"] == outputs["engine_stacked"]
                            == outputs["engine_fused"])
    res["engine_equals_hf_sequential"] = sum(
        x == y for x, y in zip(outputs["engine_fused"][:k], seq, strict=True)) / k
    res["engine_equals_hf_static"] = sum(
        x == y for x, y in zip(outputs["engine_fused"], static, strict=True)) / len(ids)
    RESULTS.mkdir(exist_ok=True)
    out = Path(a.out) if a.out else RESULTS / f"engine_scale_{dev.type}.json"
    if "ratio" not in res.get("load", {}) and out.is_file():
        # keep a load measured by an earlier run of this script (said so in the JSON)
        old = json.loads(out.read_text()).get("load", {})
        if "ratio" in old:
            res["load"] = {**old, "from_an_earlier_run": True,
                           "skipped_this_run": res.get("load", {}).get("skipped", "not asked")}
            res["bars"]["load_rss_over_weights"] = old["ratio"]
    write_text_atomic(out, json.dumps(res, indent=2, sort_keys=True) + "\n")
    print(json.dumps(res["bars"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
