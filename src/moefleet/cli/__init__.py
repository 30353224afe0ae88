"""The ``moefleet`` command line. Thin: parse arguments, call the library, print.

Every sub-command lives in its own module and is registered here.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys

import typer

from moefleet.cli import autoscale as _autoscale
from moefleet.cli import bench as _bench
from moefleet.cli import brownout as _brownout
from moefleet.cli import compare as _compare
from moefleet.cli import demo as _demo
from moefleet.cli import export as _export
from moefleet.cli import generate as _generate
from moefleet.cli import models as _models
from moefleet.cli import plan as _plan
from moefleet.cli import plan_bo as _plan_bo
from moefleet.cli import platforms as _platforms
from moefleet.cli import predict as _predict
from moefleet.cli import profile as _profile
from moefleet.cli import profile_compute as _profile_compute
from moefleet.cli import report as _report
from moefleet.cli import runtime as _runtime
from moefleet.cli import serve as _serve
from moefleet.cli import simulate as _simulate
from moefleet.cli import traces as _traces

app = typer.Typer(
    name="moefleet",
    help="Plan, deploy, serve and scale Mixture-of-Experts models on serverless platforms.\n\n"
    "Example: moefleet profile --model minilm-moe-e8 --dataset wikitext2 --max-tokens 2048 "
    "--out trace.parquet",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)
app.add_typer(_models.app, name="models")
app.add_typer(_autoscale.app, name="autoscale")
app.add_typer(_traces.app, name="traces")
app.add_typer(_platforms.app, name="platforms")
_plan.app.command("bo")(_plan_bo.bo_cmd)  # beside `plan show`; its own module (many options)
app.add_typer(_plan.app, name="plan")
app.add_typer(_predict.app, name="predict")
app.add_typer(_brownout.app, name="brownout")
app.add_typer(_bench.app, name="bench")
app.command("profile")(_profile.profile_cmd)
app.command("profile-compute")(_profile_compute.profile_compute_cmd)
app.command("demo")(_demo.demo_cmd)
app.command("deploy")(_runtime.deploy_cmd)
app.command("run")(_runtime.run_cmd)
app.command("simulate")(_simulate.simulate_cmd)
app.command("compare")(_compare.compare_cmd)
app.command("report")(_report.report_cmd)
app.command("export")(_export.export_cmd)
app.command("generate")(_generate.generate_cmd)
app.command("serve")(_serve.serve_cmd)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # SystemExit unwinds the stack, so `with TemporaryDirectory()` and `finally` blocks
    # (temporary object stores, deployments, partial builds) clean up as on Ctrl-C.
    raise SystemExit(128 + signum)


def main() -> None:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    # Hugging Face prints its own progress bars and hub warnings; ours are on stderr.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        app()
    except OSError as err:
        if err.filename is not None or err.errno not in _WRITE_ERRNOS:
            raise
        _output_failed(err)


#: Errors of writing the standard streams (``> /dev/full``, a closed pipe, a full quota).
_WRITE_ERRNOS = {errno.ENOSPC, errno.EPIPE, errno.EIO, errno.EDQUOT, errno.EFBIG,
                 errno.EACCES, errno.EBADF}


def _output_failed(err: OSError) -> None:
    """A write to stdout failed: one line on stderr, exit 1, no traceback. stdout is
    pointed at /dev/null first, so the interpreter's own flush at exit cannot fail again."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    if err.errno != errno.EPIPE:  # a closed pipe is the reader's choice, not an error
        with contextlib.suppress(OSError):
            sys.stderr.write(f"error: cannot write the output: {os.strerror(err.errno or 0)}\n"
                             "hint: free space on the disk, or write the output elsewhere\n")
            sys.stderr.flush()
    raise SystemExit(1)
