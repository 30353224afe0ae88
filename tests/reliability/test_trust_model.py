"""The trust model (docs/trust-model.md), one crafted file per kind of reader: a pickle
whose loading would run ``touch MARKER``, a YAML python tag, a ``.npy``/``.npz`` with
pickled objects, a Parquet field asking for a pickled extension type, a callable named
in a config, a forged safetensors header. Each test asserts that MARKER does not exist
and that the failure is one clean error (one ``error:`` line and its hint, non-zero
exit). Then the outputs: devices, FIFOs, sockets and symlinks that lead anywhere but a
regular file are refused and left as they were; ``-`` is stdout where a command prints
data. Every node is made inside the test's folder; the system's are never touched."""

from __future__ import annotations

import ast
import json
import os
import pickle
import shlex
import socket
import stat
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from moefleet.cli import app
from moefleet.errors import MoefleetError
from tests.reliability.hostile import seed_files

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


class RunsCode:
    """Pickles as a call of ``os.system('touch MARKER')``: unpickling it runs code."""

    def __init__(self, marker: Path) -> None:
        self.cmd = f"touch {shlex.quote(str(marker))}"

    def __reduce__(self) -> tuple[Callable[[str], int], tuple[str]]:
        return os.system, (self.cmd,)


def cli(args: list[str], cwd: Path) -> tuple[int, str, str]:
    old = Path.cwd()
    os.chdir(cwd)
    try:
        res = runner.invoke(app, args)
    finally:
        os.chdir(old)
    return res.exit_code, res.stdout, res.stderr


def one_error(code: int, stderr: str, needle: str = "") -> str:
    """The error line of a clean failure: non-zero exit, ``error:`` then at most a hint."""
    assert code != 0, stderr
    lines = stderr.strip().splitlines()
    assert lines and lines[0].startswith("error:"), stderr
    assert len(lines) == 1 or (len(lines) == 2 and lines[1].startswith("hint:")), stderr
    assert needle in lines[0], stderr
    return lines[0]


def one_line(err: MoefleetError, needle: str = "") -> None:
    assert "\n" not in str(err) and needle in str(err), str(err)


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("seeds")
    return seed_files(folder)


# ---- torch pickles: sMoE checkpoints, the converter, every weights_only reader --------
@pytest.mark.parametrize("case", ["eval-zip", "eval-raw-pickle", "train-resume"])
def test_a_crafted_smoe_checkpoint_runs_nothing(case: str, tmp_path: Path) -> None:
    import torch

    marker, ck = tmp_path / "MARKER", tmp_path / "smoe.pt"
    state = {"format": 1, "history": RunsCode(marker)}
    if case == "eval-raw-pickle":
        ck.write_bytes(pickle.dumps(state, protocol=2))
    else:
        torch.save(state, ck)
    args = (["autoscale", "eval", "-c", str(ck), "--windows", "1"] if case != "train-resume"
            else ["autoscale", "train", "--resume", "--out", str(ck), "--episodes", "1"])
    code, _, err = cli(args, tmp_path)
    assert not marker.exists(), "unpickling the checkpoint ran its code"
    one_error(code, err, "format-1 sMoE checkpoint")
    assert "convert-checkpoint" in err


def test_the_converter_refuses_a_crafted_pickle(tmp_path: Path) -> None:
    import torch

    marker, old, new = tmp_path / "MARKER", tmp_path / "old.pt", tmp_path / "new.safetensors"
    torch.save({"format": 1, "setup": RunsCode(marker)}, old)
    code, _, err = cli(["autoscale", "convert-checkpoint", str(old), str(new)], tmp_path)
    assert not marker.exists() and not new.exists()
    line = one_error(code, err, "refused without loading them")
    assert "posix.system" in line and "weights_only=False" not in err


def test_weights_only_readers_run_nothing(tmp_path: Path) -> None:
    import torch

    from moefleet.brownout.united import load_entry
    from moefleet.torch_io import load_torch_data

    marker = tmp_path / "MARKER"
    torch.save({"ways": 2, "groups": RunsCode(marker)}, tmp_path / "united.pt")
    with pytest.raises(MoefleetError) as got:
        load_entry(tmp_path, adapter=None)  # type: ignore[arg-type]  # fails before use
    one_line(got.value, "refused without loading them")
    (tmp_path / "streams.pt").write_bytes(pickle.dumps({"train": RunsCode(marker)}, protocol=2))
    with pytest.raises(MoefleetError) as got:
        load_torch_data(tmp_path / "streams.pt", "token streams")
    one_line(got.value, "token streams")
    assert not marker.exists()


def test_a_hf_checkpoint_with_pickled_weights_runs_nothing(tmp_path: Path) -> None:
    import torch
    from transformers import MixtralConfig

    from moefleet.models.registry import load_adapter

    marker, model = tmp_path / "MARKER", tmp_path / "model"
    MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                  num_experts_per_tok=1, architectures=["MixtralForCausalLM"]
                  ).save_pretrained(model)
    torch.save({"model.embed_tokens.weight": RunsCode(marker)}, model / "pytorch_model.bin")
    with pytest.raises(MoefleetError) as got:
        load_adapter(model)
    one_line(got.value, "refused without loading them")
    assert not marker.exists()


# ---- numpy: .npy / .npz holding pickled objects ---------------------------------------
@pytest.mark.parametrize("reader", ["plan-counts", "remoe-activation", "predictor-npz"])
def test_numpy_files_with_pickled_objects_run_nothing(reader: str, seeds: dict[str, Path],
                                                      tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    objects = np.array([[RunsCode(marker)] * 2] * 2, dtype=object)
    np.save(tmp_path / "evil.npy", objects, allow_pickle=True)
    np.savez(tmp_path / "evil.npz", meta=objects, table=objects)
    args = {
        "plan-counts": ["plan", "--profile", str(seeds["profile"]), "--counts", "evil.npy",
                        "--slo", "30", "-o", "p.yaml"],
        "remoe-activation": ["plan", "--policy", "remoe", "--activation", "evil.npy",
                             "--platform", "gcp-cloud-run-l4", "--ttft", "30", "--tpot", "1",
                             "-o", "r.yaml"],
        "predictor-npz": ["plan", "bo", "--profile", str(seeds["profile"]), "--predictor",
                          "evil.npz", "--bo-trace", str(seeds["trace"]), "--slo", "2",
                          "-o", "p.yaml"],
    }[reader]
    code, _, err = cli(args, tmp_path)
    assert not marker.exists()
    one_error(code, err)
    assert not (tmp_path / "p.yaml").exists() and not (tmp_path / "r.yaml").exists()


# ---- YAML: python tags ---------------------------------------------------------------
@pytest.mark.parametrize("reader", ["plan show", "platforms show", "export"])
def test_yaml_python_tags_run_nothing(reader: str, tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    evil = tmp_path / "evil.yaml"
    cmd = json.dumps(f"touch {shlex.quote(str(marker))}")
    evil.write_text(f"model: !!python/object/apply:os.system [{cmd}]\nlayers: []\n")
    args = {"plan show": ["plan", "show", str(evil)],
            "platforms show": ["platforms", "show", str(evil)],
            "export": ["export", str(evil), "--format", "knative"]}[reader]
    code, _, err = cli(args, tmp_path)
    assert not marker.exists()
    one_error(code, err)


# ---- Parquet: a field asking for pyarrow's pickled extension type ----------------------
def test_a_parquet_field_with_a_pickled_extension_type_runs_nothing(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    marker = tmp_path / "MARKER"
    field = pa.field("request_id", pa.binary(), metadata={
        b"ARROW:extension:name": b"arrow.py_extension_type",  # pyarrow < 14.0.1 unpickled it
        b"ARROW:extension:metadata": pickle.dumps(RunsCode(marker))})
    pq.write_table(pa.table({"request_id": [b"r0"]}, schema=pa.schema([field])),
                   tmp_path / "evil.parquet")
    code, _, err = cli(["traces", "show", "evil.parquet"], tmp_path)
    assert not marker.exists()
    one_error(code, err)


# ---- JSON configs naming callables -----------------------------------------------------
def test_configs_can_name_only_moefleet_callables(tmp_path: Path) -> None:
    from moefleet.runtime.base import HandlerRef
    from moefleet.runtime.host import make_handler
    from moefleet.runtime.stores import build_store

    marker = tmp_path / "MARKER"
    with pytest.raises(MoefleetError) as got:
        build_store({"url": str(tmp_path), "wrap": "os:system",
                     "wrap_options": {"command": f"touch {marker}"}})
    one_line(got.value, "only moefleet's own modules")
    with pytest.raises(MoefleetError) as got:
        make_handler(HandlerRef("subprocess:getoutput", {"cmd": f"touch {marker}"}),
                     None)  # type: ignore[arg-type]  # refused before it is used
    one_line(got.value, "only moefleet's own modules")
    assert not marker.exists()


# ---- safetensors: forged headers -------------------------------------------------------
@pytest.mark.parametrize("forgery", ["huge-header", "header-not-json", "pickle-in-metadata"])
def test_forged_safetensors_headers_are_one_line_errors(forgery: str, tmp_path: Path) -> None:
    marker, ck = tmp_path / "MARKER", tmp_path / "smoe.safetensors"
    if forgery == "huge-header":
        ck.write_bytes((2**62).to_bytes(8, "little") + b"{" + b" " * 64)
    elif forgery == "header-not-json":
        ck.write_bytes((16).to_bytes(8, "little") + b"{not json at all")
    else:
        meta = {"moefleet.smoe": pickle.dumps(RunsCode(marker)).hex()}
        header = json.dumps({"__metadata__": meta}).encode()
        ck.write_bytes(len(header).to_bytes(8, "little") + header)
    code, _, err = cli(["autoscale", "eval", "-c", str(ck), "--windows", "1"], tmp_path)
    assert not marker.exists()
    one_error(code, err, str(ck))


# ---- the audit, kept: no unsafe loader comes back into src/ -----------------------------
UNSAFE_CALLS = {"pickle.load", "pickle.loads", "cPickle.load", "marshal.load",
                "marshal.loads", "yaml.load", "yaml.unsafe_load", "yaml.full_load",
                "yaml.load_all", "dill.load", "dill.loads", "cloudpickle.load",
                "cloudpickle.loads", "shelve.open", "jsonpickle.decode", "ast.literal_eval"}
UNSAFE_KEYWORDS = {("weights_only", False), ("allow_pickle", True),
                   ("trust_remote_code", True)}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def test_src_has_no_unsafe_reader() -> None:
    """Every reader in src/ is one of the audited safe ones (docs/trust-model.md):
    no pickle/marshal/yaml.load, no builtin eval/exec, no unsafe loader flag, and
    ``torch.load`` only inside ``moefleet.torch_io.load_torch_data``."""
    found = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            name, where = _dotted(node.func), f"{path.relative_to(ROOT)}:{node.lineno}"
            if name in UNSAFE_CALLS or name in ("eval", "exec", "compile", "__import__"):
                found.append(f"{where} {name}()")
            if name == "torch.load" and not path.match("moefleet/torch_io.py"):
                found.append(f"{where} torch.load outside moefleet.torch_io.load_torch_data")
            for kw in node.keywords:
                if (isinstance(kw.value, ast.Constant)
                        and (kw.arg, kw.value.value) in UNSAFE_KEYWORDS):
                    found.append(f"{where} {name}({kw.arg}={kw.value.value})")
    assert found == []


# ---- outputs: regular files only -------------------------------------------------------
def _make(kind: str, d: Path) -> Path:
    """An output path of ``kind`` inside ``d`` (skips where the node cannot be made)."""
    p = d / "out.yaml"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "char-device":
        try:  # the same device numbers as /dev/null, as a node of our own
            os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("mknod needs CAP_MKNOD here")
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(p))
        sock.close()
    elif kind == "link-to-fifo":
        os.mkfifo(d / "fifo")
        p.symlink_to(d / "fifo")
    elif kind == "link-to-stdout":
        p.symlink_to("/proc/self/fd/1")
    elif kind == "dangling-link":
        p.symlink_to(d / "nowhere" / "x.yaml")
    elif kind == "link-loop":
        p.symlink_to(p)
    elif kind == "link-to-dir":
        (d / "adir").mkdir()
        p.symlink_to(d / "adir")
    return p


def _snapshot(p: Path) -> tuple[int, str]:
    st = os.lstat(p)
    return stat.S_IFMT(st.st_mode), os.readlink(p) if stat.S_ISLNK(st.st_mode) else ""


KINDS = ["fifo", "char-device", "socket", "link-to-fifo", "link-to-stdout", "dangling-link",
         "link-loop", "link-to-dir"]


@pytest.mark.parametrize("kind", KINDS)
def test_outputs_refuse_what_is_not_a_regular_file(kind: str, seeds: dict[str, Path],
                                                   tmp_path: Path) -> None:
    from moefleet.io import write_text_atomic

    p = _make(kind, tmp_path)
    before = _snapshot(p)
    with pytest.raises(MoefleetError) as got:
        write_text_atomic(p, "x")
    one_line(got.value, str(p))
    code, out, err = cli(["plan", "--profile", str(seeds["profile"]), "--counts",
                          str(seeds["trace"]), "--slo", "30", "-o", str(p)], tmp_path)
    one_error(code, err, str(p))
    assert _snapshot(p) == before and out == ""  # left as it was, nothing printed
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_a_symlink_to_a_regular_file_is_written_through(tmp_path: Path) -> None:
    from moefleet.io import write_text_atomic

    (tmp_path / "real").mkdir()
    target, link = tmp_path / "real" / "plan.yaml", tmp_path / "plan.yaml"
    target.write_text("old\n")
    link.symlink_to(target)
    write_text_atomic(link, "new\n")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new\n"
    assert sorted(os.listdir(tmp_path / "real")) == ["plan.yaml"]  # no temp file left


def test_dash_is_stdout_where_a_command_prints_data(seeds: dict[str, Path],
                                                    tmp_path: Path) -> None:
    from moefleet.plan import DeploymentPlan

    plan_args = ["plan", "--profile", str(seeds["profile"]), "--counts", str(seeds["trace"]),
                 "--slo", "30"]
    code, out, err = cli([*plan_args, "-o", "-"], tmp_path)
    assert code == 0, err
    plan = DeploymentPlan.model_validate(yaml.safe_load(out))  # stdout is the plan alone
    assert plan.layers and "wrote" not in err
    assert os.listdir(tmp_path) == []  # no file named "-"
    (tmp_path / "plan.yaml").write_text(out)
    code, out, err = cli(["export", "plan.yaml", "--format", "knative", "-o", "-"], tmp_path)
    assert code == 0 and yaml.safe_load_all(out), err
    code, _, err = cli([*plan_args, "-o", "-", "--json"], tmp_path)
    one_error(code, err, "--json")
    for args in (["predict", "fit", "--train", str(seeds["trace"]), "-o", "-"],  # .npz
                 ["traces", "show", str(seeds["trace"]), "--png", "-"]):
        code, out, err = cli(args, tmp_path)
        one_error(code, err, "stdout")
    assert sorted(os.listdir(tmp_path)) == ["plan.yaml"]
