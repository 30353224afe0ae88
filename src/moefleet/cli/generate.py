"""``moefleet generate``: run prompts through the engine; stream or summarise."""

from __future__ import annotations

import sys
import time
from typing import Annotated

import typer

from moefleet.cli.common import emit_json, err_console, out_console, progress, user_errors
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
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N")] = "cpu",
    kernel: Annotated[str, typer.Option(help="expert kernel: auto, stacked or loop")] = "auto",
    max_num_seqs: Annotated[int, typer.Option(help="sequences per step")] = 64,
    json_out: Annotated[bool, typer.Option("--json", help="print JSON on stdout")] = False,
) -> None:
    """Generate text with continuous batching; --json adds TTFT/TPOT/throughput.

    Example: moefleet generate -m tiny-moe-lm --prompt "The castle was" --stream
    """
    with user_errors():
        from moefleet.compose.build import build_engine
        from moefleet.engine import SamplingParams, merge_into
        from moefleet.engine.build import check_engine_args, summarize
        from moefleet.engine.request import RequestOutput

        if (prompt is None) == (dataset is None):
            raise MoefleetError("give exactly one of --prompt and --dataset",
                                "e.g. --prompt 'Once upon a time' or --dataset sharegpt")
        if not 1 <= num_prompts <= MAX_PROMPTS:
            raise MoefleetError(f"--num-prompts must be in [1, {MAX_PROMPTS}], got "
                                f"{num_prompts}", "generate in several runs")
        check_engine_args(device, max_num_seqs)  # before the model loads
        if kernel not in ("auto", "stacked", "loop"):
            raise MoefleetError(f"unknown --kernel {kernel!r}", "use auto, stacked or loop")
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, seed=seed, ignore_eos=ignore_eos)
        texts = _prompts(prompt, dataset, num_prompts)
        from moefleet.models.registry import load_adapter

        adapter = load_adapter(model)
        engine = build_engine(adapter, device=device, kernel=kernel,  # type: ignore[arg-type]
                              max_num_seqs=max_num_seqs)
        ids = [engine.add_request(t, params) for t in texts]
        merged = {r: RequestOutput(r, [], "", False) for r in ids}
        console = out_console(json_out)
        live_stream = stream and len(ids) == 1 and not json_out
        t0 = time.perf_counter()
        with progress() as bar:
            task = bar.add_task("generating", total=len(ids)) if not live_stream else None
            while engine.has_unfinished:
                for o in engine.step():
                    merge_into(merged[o.request_id], o)
                    if live_stream:
                        sys.stdout.write(o.new_text)
                        sys.stdout.flush()
                    if o.finished and task is not None:
                        bar.advance(task)
        wall = time.perf_counter() - t0
        outs = [merged[r] for r in ids]
        summary = summarize(outs, wall)
        if json_out:
            emit_json({"model": adapter.name, "device": device, "kernel": kernel,
                       "outputs": [{"prompt": t, "text": o.new_text, "token_ids":
                                    o.new_token_ids, "finish_reason": o.finish_reason}
                                   for t, o in zip(texts, outs, strict=True)],
                       "metrics": summary.to_dict()})
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


def _prompts(prompt: str | None, dataset: str | None, n: int) -> list[str]:
    if prompt is not None:
        if not prompt.strip():
            raise MoefleetError("--prompt is empty", "give some text to continue")
        return [prompt]
    from moefleet.data.registry import load_prompts

    return [p.text for p in load_prompts(dataset or "", limit=n)]
