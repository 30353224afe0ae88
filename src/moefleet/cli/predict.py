"""``moefleet predict``: fit and evaluate expert-popularity predictors.

A data source (``--train``/``--test``) is either an existing trace ``.parquet`` (from
``moefleet profile``) or a dataset ``name[:split]`` / prompt file, which is profiled on
``--model`` first. The model is loaded only when something needs it: profiling, or the
token embeddings of the SPS family (``--embed adapter|minilm``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from moefleet import limits as L
from moefleet.cli.common import check_outputs, emit_json, out_console, progress, user_errors
from moefleet.errors import MoefleetError
from moefleet.io import check_output_dir

app = typer.Typer(help="Expert-popularity predictors: fit one, or evaluate several.",
                  no_args_is_help=True)

DEFAULT_MODEL = "minilm-moe-e8"

ModelOpt = Annotated[str | None, typer.Option(
    "--model", "-m", help=f"Zoo name, dir or hub id (default: the trace's, else {DEFAULT_MODEL})."
)]
TrainOpt = Annotated[str, typer.Option(
    "--train", help="Trace .parquet, or dataset name[:split] / prompt file to profile."
)]
MaxTokensOpt = Annotated[int, typer.Option(
        max=L.MAX_TOKENS, help="Tokens to profile from --train.")]
MaxLengthOpt = Annotated[int, typer.Option(
        min=1, max=L.MAX_PROMPT_TOKENS, help="Truncate each prompt to this when profiling.")]
EmbedOpt = Annotated[str, typer.Option(
    help="Token embeddings for sps/bf/vared: adapter (model input embeddings), minilm, random."
)]
SeedOpt = Annotated[int, typer.Option(min=0, max=L.MAX_SEED, help="Seed (SPS clustering).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]


def _check_tokens(max_tokens: int) -> None:
    # Checked even when --train is a trace (where it is unused): 0 is never meant.
    if max_tokens <= 0:
        raise MoefleetError(f"--max-tokens must be positive, got {max_tokens}",
                            "pass e.g. --max-tokens 65536")


class _Sources:
    """Loads traces and (once, lazily) the model they need."""

    def __init__(self, model: str | None, max_length: int, json_mode: bool,
                 save_dir: Path | None = None) -> None:
        self.model = model
        self.max_length = max_length
        self.json_mode = json_mode
        self.save_dir = save_dir
        self._adapter: Any = None

    def adapter(self, fallback: str | None = None) -> Any:
        if self._adapter is None:
            from moefleet.cli.models import load_with_progress

            self._adapter = load_with_progress(self.model or fallback or DEFAULT_MODEL,
                                               self.json_mode)
        return self._adapter

    def trace(self, ref: str, max_tokens: int) -> Any:  # -> Trace
        from moefleet.traces import read_trace

        path = Path(ref)
        if path.suffix == ".parquet":
            trace = read_trace(path)
            traced = str(trace.meta.get("model") or "") or None
            if self.model is not None and traced is not None and self.model != traced:
                raise MoefleetError(
                    f"--model {self.model} but the trace {path} was recorded on '{traced}'",
                    "drop --model (a trace names its model) or record a trace of that model")
            if self.model is None:
                self.model = traced
            return trace
        return self._profile(ref, max_tokens)

    def _profile(self, ref: str, max_tokens: int) -> Any:
        from moefleet.data import load_prompts, split_dataset
        from moefleet.traces import profile, write_trace

        if max_tokens <= 0:
            raise MoefleetError(f"token limit must be positive, got {max_tokens}",
                                "pass e.g. --max-tokens 65536")
        name, split = split_dataset(ref)
        prompts = load_prompts(name, split=split)
        adapter = self.adapter()
        with progress() as bar:
            task = bar.add_task(f"profiling {adapter.name} on {ref}", total=max_tokens)

            def on_progress(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            trace = profile(adapter, [p.request_id for p in prompts], [p.text for p in prompts],
                            max_tokens=max_tokens, max_length=self.max_length, dataset=ref,
                            progress=on_progress)
        if self.save_dir is not None:
            safe = ref.replace("/", "_").replace(":", "-")
            write_trace(trace, self.save_dir / f"{adapter.name}-{safe}-{max_tokens}.parquet")
        return trace

    def embedding(self, kind: str, seed: int, train_trace: Any) -> Any:
        from moefleet.errors import UnknownNameError
        from moefleet.predict import make_embedding

        if kind not in ("adapter", "minilm", "random"):
            raise UnknownNameError(f"unknown embedding source {kind!r}",
                                   "use --embed adapter, minilm or random")
        if kind == "random":
            return make_embedding("random", seed=seed)
        return make_embedding(kind, self.adapter(str(train_trace.meta.get("model") or "")))


def _context(names: list[str], embed: str, seed: int, sources: _Sources,
             train_trace: Any) -> Any:
    from moefleet.predict import PredictorContext
    from moefleet.predict.harness import EMBEDDING_PREDICTORS

    emb = None
    if EMBEDDING_PREDICTORS.intersection(names):
        emb = sources.embedding(embed, seed, train_trace)
    return PredictorContext(embed=emb, seed=seed)


def _label(ref: str, trace: Any, taken: dict[str, Any]) -> str:
    """A short name for a test source: a trace file's dataset (else its stem)."""
    label = ref
    if ref.endswith(".parquet"):
        label = str(trace.meta.get("dataset") or "") or Path(ref).stem
    base, n = label, 2
    while label in taken:  # the same dataset twice (e.g. two trace files of it)
        label, n = f"{base}#{n}", n + 1
    return label


def _ticker(bar: Any, task: Any, label: str) -> Callable[[str], None]:
    def tick(name: str) -> None:
        bar.update(task, advance=1, description=f"{label}: {name}")

    return tick


def _split_list(values: list[str]) -> list[str]:
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


@app.command("eval")
def eval_cmd(
    train: TrainOpt,
    test: Annotated[list[str], typer.Option(
        "--test", help="Test source(s), like --train; repeat or comma-separate.")],
    model: ModelOpt = None,
    predictors: Annotated[str, typer.Option(
        help="Comma-separated: bayes, bayes-pos, bayes-flat, bayes-pos-flat, bayes-auto, "
        "bayes-map, bayes-pos-map, lina, dop, ef, sps, bf, vared."
    )] = "bayes,bayes-pos,bayes-pos-flat,lina,dop,ef,sps,bf",
    max_tokens: MaxTokensOpt = 65536,
    test_tokens: Annotated[int, typer.Option(
        min=1, max=L.MAX_TOKENS, help="Tokens to profile per --test.")] = 10240,
    batch_tokens: Annotated[int, typer.Option(
        min=1, max=L.MAX_BATCH_TOKENS, help="Tokens per scored batch.")] = 10240,
    max_length: MaxLengthOpt = 256,
    embed: EmbedOpt = "adapter",
    seed: SeedOpt = 0,
    as_json: JsonOpt = False,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write results JSON.")] = None,
    png: Annotated[Path | None, typer.Option(help="Write a bar chart PNG.")] = None,
    save_traces: Annotated[Path | None, typer.Option(
        help="Also write profiled traces (Parquet) into this folder for reuse.")] = None,
) -> None:
    """Fit predictors on --train and score them on each --test.

    Example: moefleet predict eval --model minilm-moe-e8 --train wikitext2:train
    --test wikitext2:test --test c4 --predictors bayes,lina,dop,ef,sps,bf --png chart.png
    """
    from moefleet.io import write_json_atomic
    from moefleet.predict import evaluate, make_predictors, plot_results, results_table
    from moefleet.predict.harness import parse_names

    with user_errors():
        check_outputs(("--out", out), ("--png", png))
        _check_tokens(max_tokens)
        if save_traces is not None:
            check_output_dir(save_traces, "--save-traces")
        names = parse_names(predictors)
        tests = _split_list(test)
        if not tests:
            raise MoefleetError("no --test source given", "pass e.g. --test wikitext2:test")
        sources = _Sources(model, max_length, as_json, save_traces)
        train_trace = sources.trace(train, max_tokens)
        test_traces: dict[str, Any] = {}
        for ref in tests:
            trace = sources.trace(ref, test_tokens)
            test_traces[_label(ref, trace, test_traces)] = trace
        preds = make_predictors(names, _context(names, embed, seed, sources, train_trace))
        fit_s: dict[str, float] = {}
        with progress() as bar:
            task = bar.add_task("fitting", total=len(preds))
            for n, pred in preds.items():
                bar.update(task, description=f"fitting {n}")
                t0 = time.perf_counter()
                pred.fit(train_trace)
                fit_s[n] = time.perf_counter() - t0
                bar.update(task, advance=1)
        results: dict[str, Any] = {}
        for tname, ttrace in test_traces.items():
            with progress() as bar:
                task = bar.add_task(f"scoring on {tname}", total=len(preds))
                res = evaluate(preds, None, ttrace, batch_tokens=batch_tokens,
                               progress=_ticker(bar, task, tname))
            res["train"] = {"source": train, "tokens": train_trace.num_tokens,
                            "requests": int(train_trace.meta.get("num_requests", 0))}
            for n, r in res["predictors"].items():
                r["fit_s"] = fit_s[n]
            results[tname] = res
        report = {"train": train, "predictors": names, "seed": seed, "embed": embed,
                  "max_tokens": max_tokens, "tests": results}
        if out is not None:
            write_json_atomic(out, report)
        if png is not None:
            plot_results(results, png, title=f"{train_trace.meta.get('model', '')} "
                                             f"trained on {Path(train).name}")
    if as_json:
        emit_json(report)
        return
    con = out_console(False)
    con.print(results_table(results, title=f"trained on {train}"))
    for path in (out, png):
        if path is not None:
            con.print(f"wrote {path}")


@app.command("fit")
def fit_cmd(
    train: TrainOpt,
    model: ModelOpt = None,
    predictor: Annotated[str, typer.Option(help="One predictor name (see `eval`).")] = "bayes",
    max_tokens: MaxTokensOpt = 65536,
    max_length: MaxLengthOpt = 256,
    embed: EmbedOpt = "adapter",
    seed: SeedOpt = 0,
    out: Annotated[Path, typer.Option("--out", "-o", help="Predictor file (.npz).")] = Path(
        "predictor.npz"),
    as_json: JsonOpt = False,
) -> None:
    """Fit one predictor on a trace or dataset and save it (.npz, no pickle).

    Example: moefleet predict fit --model minilm-moe-e8 --train wikitext2:train
    --predictor bayes -o predictor.npz
    """
    from moefleet.predict import make_predictors
    from moefleet.predict.harness import parse_names

    with user_errors():
        check_outputs(("--out", out))
        _check_tokens(max_tokens)
        if out.suffix != ".npz":
            raise MoefleetError(f"--out {out}: a predictor file is .npz (numpy arrays)",
                                f"use e.g. -o {out.with_suffix('.npz')}")
        names = parse_names(predictor)
        if len(names) != 1:
            raise MoefleetError(f"fit takes one predictor, got {', '.join(names)}",
                                "run fit once per predictor")
        sources = _Sources(model, max_length, as_json)
        trace = sources.trace(train, max_tokens)
        pred = make_predictors(names, _context(names, embed, seed, sources, trace))[names[0]]
        pred.fit(trace)
        pred.save(out)
    summary = {"predictor": names[0], "kind": pred.kind, "out": str(out),
               "model": trace.meta.get("model", ""), "tokens": trace.num_tokens,
               "requests": int(trace.meta.get("num_requests", 0)),
               "moe_layers": trace.moe_layers}
    if as_json:
        emit_json(summary)
        return
    out_console(False).print(f"fitted {names[0]} on {summary['tokens']} tokens of {train}; "
                             f"wrote {out}")
