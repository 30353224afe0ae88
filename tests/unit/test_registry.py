"""Loading checkpoints: round trips per family and every error path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moefleet.errors import DataError, UnknownNameError, UnsupportedModelError
from moefleet.models import load_adapter, supported_architectures
from moefleet.models.tiny import tiny_model
from tests.conftest import FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
def test_save_load_round_trip(family: str, tmp_path: Path) -> None:
    model = tiny_model(family, vocab_size=300, seed=4)
    model.save_pretrained(tmp_path)
    adapter = load_adapter(tmp_path)
    assert adapter.family == family
    ids = torch.arange(9).unsqueeze(0)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    assert torch.allclose(adapter.forward_layerwise(ids), want, atol=1e-5)


def test_supported_architectures_listed() -> None:
    archs = supported_architectures()
    for a in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "OlmoeForCausalLM",
              "DeepseekV2ForCausalLM"):
        assert a in archs


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(UnsupportedModelError) as err:
        load_adapter(tmp_path)
    assert "LlamaForCausalLM" in err.value.message
    assert "MixtralForCausalLM" in err.value.hint


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"config\.json"):
        load_adapter(tmp_path)


def test_corrupt_weights_give_a_clear_error(tmp_path: Path) -> None:
    tiny_model("mixtral", vocab_size=300).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated download
    with pytest.raises(DataError) as err:
        load_adapter(tmp_path)
    assert "corrupt" in err.value.hint


def test_invalid_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        load_adapter(tmp_path)


def test_unknown_name_is_rejected_without_the_hub() -> None:
    with pytest.raises(UnknownNameError) as err:
        load_adapter("no-such-model")
    assert "tiny-mixtral-random" in err.value.hint


def test_missing_path() -> None:
    with pytest.raises(DataError, match="not a directory"):
        load_adapter("./no/such/dir")


def test_corrupted_zoo_entry_is_detected_and_rebuilt() -> None:
    from moefleet.models import zoo

    name = "tiny-olmoe-random"
    zoo.build(name)
    assert zoo.verify(name) == []
    weights = zoo.model_dir(name) / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])  # a disk error / truncated copy
    assert zoo.verify(name) == ["model.safetensors"]
    adapter = zoo.load(name)
    assert zoo.verify(name) == []
    assert weights.read_bytes() == good  # deterministic rebuild
    assert adapter.family == "olmoe"


def test_unknown_zoo_entry_to_build() -> None:
    from moefleet.models import zoo

    with pytest.raises(UnknownNameError, match="unknown zoo model"):
        zoo.build("no-such-entry")
