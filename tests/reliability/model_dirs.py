"""Malformed model directories, built from one valid tiny Mixtral checkpoint.

``seed_model(folder)`` writes a real checkpoint (2 blocks of 4 experts, vocab 1024, ~1 MB)
with ``save_pretrained``; each entry of :data:`CASES` copies it and breaks one thing:
``config.json`` (not an object, wrong types, out-of-range or inconsistent sizes, sizes
too big for memory, unsupported architectures), the safetensors files (missing,
truncated, padded, malformed headers, shapes that disagree with the config, missing
tensors, NaN weights) or the directory itself (devices, FIFOs, files in its place).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

WEIGHTS = "model.safetensors"
Mutation = Callable[[Path], None]


def seed_model(folder: Path) -> Path:
    """A valid tiny Mixtral checkpoint directory (config.json + model.safetensors)."""
    from moefleet.models.tiny import small_mixtral

    small_mixtral(layers=2, experts=4, vocab_size=1024).save_pretrained(folder)
    return folder


def config(d: Path) -> dict[str, Any]:
    return json.loads((d / "config.json").read_text())


def set_config(**changes: Any) -> Mutation:
    def apply(d: Path) -> None:
        cfg = config(d)
        for k, v in changes.items():
            if v is _DROP:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (d / "config.json").write_text(json.dumps(cfg))
    return apply


_DROP = object()


def config_text(text: str | bytes) -> Mutation:
    def apply(d: Path) -> None:
        data = text.encode() if isinstance(text, str) else text
        (d / "config.json").write_bytes(data)
    return apply


def header(d: Path) -> tuple[dict[str, Any], bytes]:
    raw = (d / WEIGHTS).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_header(d: Path, head: dict[str, Any], data: bytes) -> None:
    blob = json.dumps(head).encode()
    (d / WEIGHTS).write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def edit_header(fn: Callable[[dict[str, Any]], None]) -> Mutation:
    def apply(d: Path) -> None:
        head, data = header(d)
        fn(head)
        write_header(d, head, data)
    return apply


def weights_bytes(fn: Callable[[bytes], bytes]) -> Mutation:
    def apply(d: Path) -> None:
        (d / WEIGHTS).write_bytes(fn((d / WEIGHTS).read_bytes()))
    return apply


def drop_tensor(suffix: str) -> Mutation:
    """Remove one tensor and its bytes, leaving a well-formed file."""
    def apply(d: Path) -> None:
        from safetensors.numpy import load_file, save_file

        tensors = load_file(str(d / WEIGHTS))
        name = next(k for k in tensors if k.endswith(suffix))
        del tensors[name]
        save_file(tensors, str(d / WEIGHTS), metadata={"format": "pt"})
    return apply


def nan_weights(d: Path) -> None:
    import numpy as np
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(d / WEIGHTS))
    name = next(k for k in tensors if k.endswith("embed_tokens.weight"))
    tensors[name] = np.full_like(tensors[name], np.nan)
    save_file(tensors, str(d / WEIGHTS), metadata={"format": "pt"})


def _reshape_embed(head: dict[str, Any]) -> None:
    key = next(k for k in head if k.endswith("embed_tokens.weight"))
    head[key]["shape"] = [512, 128]  # same bytes, other shape


def _first_tensor(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def fn(head: dict[str, Any]) -> None:
        key = next(k for k in head if k != "__metadata__")
        head[key][field] = value
    return fn


def _remove(name: str) -> Mutation:
    def apply(d: Path) -> None:
        p = d / name
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    return apply


def _replace_with(name: str, kind: str) -> Mutation:
    def apply(d: Path) -> None:
        p = d / name
        p.unlink()
        if kind == "dir":
            p.mkdir()
        elif kind == "fifo":
            os.mkfifo(p)
        elif kind == "dev-zero":
            p.symlink_to("/dev/zero")
        elif kind == "dangling":
            p.symlink_to(d / "nowhere.json")
    return apply


def _index(text: str) -> Mutation:
    def apply(d: Path) -> None:
        (d / "model.safetensors.index.json").write_text(text)
    return apply


BIG = 1 << 20
CASES: dict[str, Mutation] = {
    # config.json: the file itself
    "config-missing": _remove("config.json"),
    "config-is-dir": _replace_with("config.json", "dir"),
    "config-is-fifo": _replace_with("config.json", "fifo"),
    "config-is-dev-zero": _replace_with("config.json", "dev-zero"),
    "config-dangling-link": _replace_with("config.json", "dangling"),
    "config-empty": config_text(""),
    "config-list": config_text("[1, 2]"),
    "config-null": config_text("null"),
    "config-number": config_text("42"),
    "config-string": config_text('"MixtralForCausalLM"'),
    "config-truncated": config_text('{"architectures": ["MixtralForCausalLM"], "hidden_si'),
    "config-binary": config_text(bytes(range(256))),
    "config-latin1": config_text(b'{"architectures": ["Mixtral\xe9"]}'),
    "config-nan-constant": config_text('{"hidden_size": NaN}'),
    "config-huge": config_text('{"pad": "' + "x" * (BIG + 10) + '"}'),
    # architectures
    "arch-missing": set_config(architectures=_DROP),
    "arch-empty": set_config(architectures=[]),
    "arch-string": set_config(architectures="MixtralForCausalLM"),
    "arch-number": set_config(architectures=[1]),
    "arch-llama": set_config(architectures=["LlamaForCausalLM"]),
    "arch-bert": set_config(architectures=["BertModel"]),
    "arch-long-name": set_config(architectures=["X" * 10_000]),
    # types
    "hidden-string": set_config(hidden_size="64"),
    "hidden-bool": set_config(hidden_size=True),
    "hidden-float": set_config(hidden_size=64.0),
    "hidden-list": set_config(hidden_size=[64]),
    "layers-string": set_config(num_hidden_layers="2"),
    "experts-string": set_config(num_local_experts="4"),
    "topk-float": set_config(num_experts_per_tok=2.5),
    "vocab-null": set_config(vocab_size=None),
    # ranges
    "hidden-zero": set_config(hidden_size=0),
    "hidden-negative": set_config(hidden_size=-64),
    "hidden-huge": set_config(hidden_size=10**9),
    "layers-zero": set_config(num_hidden_layers=0),
    "layers-huge": set_config(num_hidden_layers=10**7),
    "vocab-huge": set_config(vocab_size=2**40),
    "experts-zero": set_config(num_local_experts=0),
    "experts-huge": set_config(num_local_experts=10**6),
    "topk-zero": set_config(num_experts_per_tok=0),
    "heads-zero": set_config(num_attention_heads=0),
    "intermediate-zero": set_config(intermediate_size=0),
    "intermediate-huge": set_config(intermediate_size=2**30),
    "positions-zero": set_config(max_position_embeddings=0),
    "head-dim-zero": set_config(head_dim=0),
    "eps-negative": set_config(rms_norm_eps=-1.0),
    "eps-zero": set_config(rms_norm_eps=0),
    "eps-string": set_config(rms_norm_eps="NaN"),
    "rope-theta-negative": set_config(rope_parameters={"rope_theta": -1.0,
                                                       "rope_type": "default"}),
    # missing fields
    "hidden-missing": set_config(hidden_size=_DROP),
    "layers-missing": set_config(num_hidden_layers=_DROP),
    "vocab-missing": set_config(vocab_size=_DROP),
    "experts-missing": set_config(num_local_experts=_DROP),
    "topk-missing": set_config(num_experts_per_tok=_DROP),
    # consistency
    "topk-above-experts": set_config(num_experts_per_tok=9),
    "heads-not-dividing": set_config(num_attention_heads=3, num_key_value_heads=1),
    "kv-heads-not-dividing": set_config(num_key_value_heads=3),
    "kv-heads-above-heads": set_config(num_key_value_heads=8),
    # in range, but far past this machine's memory
    "memory-layers": set_config(num_hidden_layers=1024, hidden_size=65_536,
                                num_attention_heads=64, num_key_value_heads=8),
    "memory-vocab": set_config(vocab_size=4_000_000, hidden_size=65_536,
                               num_attention_heads=64, num_key_value_heads=8),
    "memory-experts": set_config(num_local_experts=4096, intermediate_size=1 << 20,
                                 hidden_size=8192, num_attention_heads=64,
                                 num_key_value_heads=8),
    # the weights files
    "weights-missing": _remove(WEIGHTS),
    "weights-is-dir": _replace_with(WEIGHTS, "dir"),
    "weights-empty": weights_bytes(lambda b: b""),
    "weights-4-bytes": weights_bytes(lambda b: b[:4]),
    "weights-header-only": weights_bytes(lambda b: b[:8 + struct.unpack("<Q", b[:8])[0]]),
    "weights-half": weights_bytes(lambda b: b[: len(b) // 2]),
    "weights-last-byte-gone": weights_bytes(lambda b: b[:-1]),
    "weights-trailing-bytes": weights_bytes(lambda b: b + b"\0" * 64),
    "weights-header-length-huge": weights_bytes(lambda b: struct.pack("<Q", 2**60) + b[8:]),
    "weights-header-garbage": weights_bytes(lambda b: b[:8] + b"\xff" * 64 + b[72:]),
    "weights-header-list": weights_bytes(lambda b: struct.pack("<Q", 2) + b"[]"),
    "weights-bad-dtype": edit_header(_first_tensor("dtype", "F33")),
    "weights-reversed-offsets": edit_header(_first_tensor("data_offsets", [64, 0])),
    "weights-negative-shape": edit_header(_first_tensor("shape", [-1, 64])),
    "weights-shape-vs-bytes": edit_header(_first_tensor("shape", [7, 7])),
    # weights that disagree with the config
    "mismatch-embed-shape": edit_header(_reshape_embed),
    "mismatch-vocab": set_config(vocab_size=2048),
    "mismatch-hidden": set_config(hidden_size=128),
    "mismatch-more-layers": set_config(num_hidden_layers=3),
    "mismatch-fewer-layers": set_config(num_hidden_layers=1),
    "mismatch-fewer-experts": set_config(num_local_experts=2),
    "mismatch-more-experts": set_config(num_local_experts=8),
    "tensor-missing-norm": drop_tensor("model.norm.weight"),
    "tensor-missing-q-proj": drop_tensor("layers.1.self_attn.q_proj.weight"),
    "weights-nan": nan_weights,
    # sharded checkpoints
    "index-missing-shard": _index(json.dumps({"weight_map": {"x": "model-00001.safetensors"}})),
    "index-escaping-shard": _index(json.dumps({"weight_map": {"x": "../../etc/passwd"}})),
    "index-not-json": _index("{weight_map"),
    "index-no-map": _index(json.dumps({"metadata": {}})),
}

#: Cases whose refusal needs the weights loaded (the rest are refused from headers).
LOADING = {"tensor-missing-norm", "tensor-missing-q-proj", "weights-nan"}
