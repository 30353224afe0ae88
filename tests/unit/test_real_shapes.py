"""Real-shape zoo entries, dtypes and the KV cache sized from memory (issue #24)."""

from __future__ import annotations

import pytest
import torch

from moefleet.compose import in_process_engine
from moefleet.engine.kv_sizing import parse_size
from moefleet.errors import MoefleetError
from moefleet.models.dtypes import resolve_dtype
from moefleet.models.real_shapes import RANDOM_NOTE, SHAPES, hf_config, parse_ref
from moefleet.models.registry import load_adapter


def test_published_configs() -> None:
    olmoe = hf_config(SHAPES["olmoe-1b-7b"], 16)
    assert (olmoe.hidden_size, olmoe.num_experts, olmoe.num_experts_per_tok) == (2048, 64, 8)
    mixtral = hf_config(SHAPES["mixtral-8x7b"], 32)
    assert (mixtral.hidden_size, mixtral.num_local_experts, mixtral.num_key_value_heads) \
        == (4096, 8, 8)
    ds = hf_config(SHAPES["deepseek-v2-lite"], 27)
    assert (ds.kv_lora_rank, ds.n_routed_experts, ds.first_k_dense_replace) == (512, 64, 1)
    qwen = hf_config(SHAPES["qwen1.5-moe-a2.7b"], 24)
    assert (qwen.num_experts, qwen.moe_intermediate_size) == (60, 1408)


@pytest.mark.parametrize("ref", ["olmoe-1b-7b:layers=17", "olmoe-1b-7b:layers=0",
                                 "olmoe-1b-7b:layers=x", "mixtral-8x7b:layers=33"])
def test_slice_beyond_depth_is_one_line(ref: str) -> None:
    with pytest.raises(MoefleetError) as err:
        load_adapter(ref)
    assert "outside 1.." in str(err.value) and "\n" not in str(err.value)


def test_two_layer_slice_bytes_and_dtype() -> None:
    _shape, layers = parse_ref("olmoe-1b-7b:layers=2")
    assert layers == 2
    adapter = load_adapter("olmoe-1b-7b:layers=2", dtype="bfloat16")
    assert {p.dtype for p in adapter.model.parameters()} == {torch.bfloat16}
    assert adapter.num_layers == 2 and adapter.num_experts(0) == 64 and adapter.top_k == 8
    # embed + head + 2 blocks of (attention 4 D^2 + router 64 D + 64 experts x 3 D F + norms)
    D, F, V, E = 2048, 1024, 50304, 64
    params = 2 * V * D + 2 * (4 * D * D + E * D + E * 3 * D * F + 2 * D + 2 * 128) + D
    assert adapter.summary().total_param_bytes == pytest.approx(2 * params, rel=1e-3)
    assert RANDOM_NOTE in adapter.notes
    # the same seed gives the same weights
    again = load_adapter("olmoe-1b-7b:layers=2", dtype="bfloat16")
    assert torch.equal(adapter.model.lm_head.weight, again.model.lm_head.weight)
    opened = in_process_engine(adapter, kv_budget_bytes=64 << 20, max_model_len=256)
    assert RANDOM_NOTE in opened.notes
    assert opened.runner.cache.layout.dtype == torch.bfloat16  # KV in the model's dtype


def test_dtype_choice() -> None:
    assert resolve_dtype(None, torch.float32).dtype == torch.float32
    choice = resolve_dtype("float32", torch.bfloat16)
    assert choice.dtype == torch.float32 and "checkpoint bfloat16" in choice.reason
    auto = resolve_dtype("auto", torch.float32, "cpu")
    assert auto.dtype in (torch.bfloat16, torch.float32)
    assert (auto.reason == "") == (auto.dtype == torch.float32)  # a change is always said
    with pytest.raises(MoefleetError, match="unknown --dtype"):
        resolve_dtype("fp8", torch.float32)


def test_kv_sizes() -> None:
    assert parse_size("4GiB") == 4 << 30 and parse_size("512MiB") == 512 << 20
    assert parse_size("1000") == 1000
    for bad in ("lots", "4 parsecs", "0"):
        with pytest.raises(MoefleetError):
            parse_size(bad)


def test_kv_cache_too_small_for_one_sequence(tiny_adapter_olmoe) -> None:  # type: ignore[no-untyped-def]
    per_token = tiny_adapter_olmoe.kv_layout().bytes_per_token
    with pytest.raises(MoefleetError, match="less than one sequence of max_model_len=256"):
        in_process_engine(tiny_adapter_olmoe, kv_budget_bytes=per_token * 64,
                          max_model_len=256)
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(MoefleetError, match="gpu-memory-utilization"):
            in_process_engine(tiny_adapter_olmoe, gpu_memory_utilization=bad)
    opened = in_process_engine(tiny_adapter_olmoe, kv_budget_bytes=per_token * 64)
    assert opened.runner.max_model_len == 64  # the default context lowered to the cache
    assert opened.runner.kv_capacity.tokens == 64


@pytest.fixture(scope="module")
def tiny_adapter_olmoe():  # type: ignore[no-untyped-def]
    from moefleet.models.hf import HFMoEAdapter
    from moefleet.models.tiny import tiny_model

    return HFMoEAdapter(tiny_model("olmoe"))


@pytest.mark.parametrize(("args", "needle"), [
    (["-m", "olmoe-1b-7b:layers=99"], "outside 1..16"),
    (["-m", "tiny-mixtral-random", "--dtype", "fp8"], "unknown --dtype 'fp8'"),
    pytest.param(["-m", "tiny-mixtral-random", "--dtype", "float16"],
                 "use --dtype bfloat16 or float32", marks=pytest.mark.skipif(
                     torch.cpu._is_amx_fp16_supported(), reason="this CPU has fp16 units")),
    (["-m", "tiny-mixtral-random", "--kv-cache-memory", "lots"], "is not a size"),
    (["-m", "tiny-mixtral-random", "--gpu-memory-utilization", "0"], "(0, 1]"),
    (["-m", "tiny-mixtral-random", "--gpu-memory-utilization", "1.5"], "(0, 1]"),
])
def test_cli_bad_sizes_and_dtypes_are_one_line(args: list[str], needle: str) -> None:
    from typer.testing import CliRunner

    from moefleet.cli import app

    r = CliRunner().invoke(app, ["generate", *args, "--prompt", "x"])
    assert r.exit_code != 0
    assert needle in r.stderr and "Traceback" not in r.output
    assert len([ln for ln in r.stderr.splitlines() if ln.startswith("error:")]) == 1


def test_cli_generates_with_a_real_shape_slice() -> None:
    import json

    from typer.testing import CliRunner

    from moefleet.cli import app

    r = CliRunner().invoke(app, ["generate", "-m", "olmoe-1b-7b:layers=1", "--dtype",
                                 "bfloat16", "--kv-cache-memory", "64MiB", "--prompt",
                                 "The castle was", "--max-tokens", "2", "--ignore-eos",
                                 "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert RANDOM_NOTE in out["notes"]
    assert len(out["outputs"][0]["token_ids"]) == 2, (out["outputs"], r.stderr)
    assert "KV cache: " in r.stderr and "(as given)" in r.stderr


def test_bf16_slice_on_a_cpu_without_bf16_units_runs_its_linears_blocked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the blocked float32 path pays (forced here: a CPU with bf16 units would not
    take it), the loaded model's linears take it, it is said, and the logits of a prefill
    (every linear, and the fused experts' segment path: 64 tokens x 8 / 64 experts = 8
    pairs per expert) agree with the plain bf16 matmuls'."""
    from moefleet.experts.kernels import in_process_experts
    from moefleet.models.cpu_bf16 import UpcastLinear

    monkeypatch.setenv("MOEFLEET_CPU_BF16_UPCAST", "1")
    adapter = load_adapter("olmoe-1b-7b:layers=1", dtype="bfloat16")
    assert any("float32 blocks" in n for n in adapter.notes)
    assert type(adapter.lm_head) is UpcastLinear
    ids = torch.randint(0, adapter.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    fused = in_process_experts(adapter, "fused")
    got = adapter.forward_layerwise(ids, expert_fn=fused)
    monkeypatch.setenv("MOEFLEET_CPU_BF16_UPCAST", "0")  # every matmul plain bf16
    want = adapter.forward_layerwise(ids, expert_fn=fused)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.05)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
