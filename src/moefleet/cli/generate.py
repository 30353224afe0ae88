"""``moefleet generate``: run prompts through the engine; stream or summarise."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from moefleet.cli.common import emit_json, err_console, out_console, progress, user_errors
from moefleet.cli.deployment import (
    AttentionOpt,
    BackendOpt,
    BrownoutOpt,
    DtypeOpt,
    FaultsOpt,
    GpuUtilOpt,
    KernelOpt,
    KVMemoryOpt,
    PlanOpt,
    StoreOpt,
    WorkersOpt,
    load_model,
    open_cli_engine,
    parse,
)
from moefleet.errors import MoefleetError

MAX_PROMPTS = 10_000


def generate_cmd(
    model: Annotated[str, typer.Option("--model", "-m", help="zoo name, directory or hub id")],
    prompt: Annotated[str | None, typer.Option(help="one prompt (text)")] = None,
    dataset: Annotated[str | None, typer.Option(help="prompts from a dataset or file")] = None,
    num_prompts: Annotated[int, typer.Option(help=f"prompts from --dataset (<= {MAX_PROMPTS})")
                           ] = 8,
    max_tokens: Annotated[int, typer.Option(help="tokens to generate per prompt")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: Annotated[float, typer.Option(help="nucleus sampling mass, (0, 1]")] = 1.0,
    top_k: Annotated[int, typer.Option(help="0 = all tokens")] = 0,
    seed: Annotated[int | None, typer.Option(help="per-request seed for sampling")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="generate max-tokens whatever")] = False,
    stream: Annotated[bool, typer.Option(help="print text as it is generated")] = False,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N")] = "cpu",
    kernel: KernelOpt = "auto",
    dtype: DtypeOpt = "auto",
    kv_cache_memory: KVMemoryOpt = None,
    gpu_memory_utilization: GpuUtilOpt = 0.9,
    attention: AttentionOpt = "gather",
    max_num_seqs: Annotated[int, typer.Option(help="sequences per step")] = 64,
    plan: PlanOpt = None,
    backend: BackendOpt = "local",
    store: StoreOpt = None,
    workers: WorkersOpt = None,
    brownout: BrownoutOpt = None,
    inject_faults: FaultsOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="print JSON on stdout")] = False,
) -> None:
    """Generate text with continuous batching; --json adds TTFT/TPOT/throughput and the bill.

    Any deployment: --plan (ODS/BO or Remoe), --brownout, --inject-faults, on any --backend.

    Example: moefleet generate -m tiny-moe-lm --prompt "The castle was" --stream
    """
    with user_errors():
        from moefleet.engine import SamplingParams
        from moefleet.engine.build import summarize

        if (prompt is None) == (dataset is None):
            raise MoefleetError("give exactly one of --prompt and --dataset",
                                "e.g. --prompt 'Once upon a time' or --dataset sharegpt")
        if not 1 <= num_prompts <= MAX_PROMPTS:
            raise MoefleetError(f"--num-prompts must be in [1, {MAX_PROMPTS}], got "
                                f"{num_prompts}", "generate in several runs")
        if max_tokens < 1:  # the engine takes 0 (prompt scoring); generate needs a token
            raise MoefleetError(f"--max-tokens must be >= 1, got {max_tokens}",
                                "ask for at least one token, e.g. --max-tokens 32")
        args = parse(plan=plan, backend=backend, store=store, workers=workers,
                     brownout=brownout, inject_faults=inject_faults, device=device,
                     kernel=kernel, max_num_seqs=max_num_seqs, dtype=dtype,
                     kv_cache_memory=kv_cache_memory,
                     gpu_memory_utilization=gpu_memory_utilization,
                     attention=attention)  # before the model loads
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, seed=seed, ignore_eos=ignore_eos)
        texts = _prompts(prompt, dataset, num_prompts)
        from moefleet.compose.run import run_billed
        adapter = load_model(model, args)
        console = out_console(json_out)
        live_stream = stream and len(texts) == 1 and not json_out
        with open_cli_engine(adapter, args, model_ref=model) as opened:
            for note in opened.notes:
                err_console.print(f"note: {note}", highlight=False)
            kv = getattr(opened.runner, "kv_capacity", None)
            if kv is not None:
                err_console.print(kv.describe(), highlight=False)
            run = run_billed(opened, texts, params, stream=sys.stdout if live_stream else None,
                             progress=progress)
        outs, wall = run.outputs, run.wall_s
        summary = summarize(outs, wall)
        if json_out:
            emit_json({"model": adapter.name, "device": opened.device, "kernel": kernel,
                       "plan": plan, "notes": opened.notes,
                       "outputs": [{"prompt": t, "text": o.new_text, "token_ids":
                                    o.new_token_ids, "finish_reason": o.finish_reason,
                                    "cost_usd": c.total}
                                   for t, o, c in zip(texts, outs, run.costs, strict=True)],
                       "metrics": summary.to_dict(), "cost_usd": run.total_usd})
            return
        if live_stream:
            sys.stdout.write("\n")
        else:
            for t, o in zip(texts, outs, strict=True):
                console.print(f"[bold]{t[:60]!r}[/] -> {o.new_text!r}", highlight=False)
        err_console.print(
            f"{summary.requests} requests, {summary.output_tokens} tokens in {wall:.2f} s "
            f"({summary.output_tokens_per_s:.1f} tok/s); TTFT p50 "
            f"{summary.ttft_p50_s * 1e3:.1f} ms, TPOT p50 {summary.tpot_p50_s * 1e3:.1f} ms",
            highlight=False)
        err_console.print(f"billed ${run.total_usd:.3g} ({run.basis})", highlight=False)


def _prompts(prompt: str | None, dataset: str | None, n: int) -> list[str]:
    if prompt is not None:
        if not prompt.strip():
            raise MoefleetError("--prompt is empty", "give some text to continue")
        return [prompt]
    from moefleet.data.registry import load_prompts

    return [p.text for p in load_prompts(dataset or "", limit=n)]
