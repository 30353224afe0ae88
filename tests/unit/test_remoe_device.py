"""Where a Remoe main function runs its non-expert modules (``remoe.main_model``) and how
the split moves token rows to the experts' device. What needs a GPU is checked on CPU
through its logic: device choice with ``torch.cuda.is_available`` patched, placement onto
the ``meta`` device (which moves tensors like CUDA would, without computing)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from moefleet.experts.split import SplitExperts, held_experts
from moefleet.experts.stack import ExpertStack
from moefleet.models.hf import HFMoEAdapter
from moefleet.models.tiny import small_mixtral
from moefleet.runtime.main_model import DeviceError, gpu_label, main_device, place_non_experts


@pytest.mark.parametrize(("gpu_gb", "cuda", "requested", "want"), [
    (2.0, False, "auto", "cpu"),    # GPU plan, no GPU here: emulated
    (0.0, True, "auto", "cpu"),     # CPU plan on a GPU machine: the plan says CPU
    (2.0, True, "auto", "cuda"),
    (2.0, True, "cpu", "cpu"),
    (2.0, True, "cuda:0", "cuda:0"),
])
def test_main_device_follows_the_plan_and_the_machine(
        monkeypatch: pytest.MonkeyPatch, gpu_gb: float, cuda: bool, requested: str,
        want: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert main_device(gpu_gb, requested) == torch.device(want)


def test_main_device_refuses_what_cannot_run_and_names_the_fix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="no CUDA GPU here") as err:
        main_device(2.0, "cuda")
    assert "--device auto or cpu" in err.value.hint
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(DeviceError, match="main function has no GPU") as err:
        main_device(0.0, "cuda")
    assert "--device cpu" in err.value.hint
    with pytest.raises(DeviceError, match="unknown device 'tpu'"):
        main_device(2.0, "tpu")


def test_gpu_label() -> None:
    assert gpu_label(0.0, torch.device("cpu")) == "none"
    assert gpu_label(2.0, torch.device("cpu")) == "emulated"
    assert gpu_label(2.0, torch.device("cuda:0")) == "cuda:0"


def test_place_non_experts_moves_everything_but_the_routed_experts() -> None:
    adapter = HFMoEAdapter(small_mixtral())
    experts = {p.data_ptr() for layer in adapter.moe_layers
               for p in adapter.stacked_expert_weights(layer)[:2]}  # type: ignore[index]
    place_non_experts(adapter, torch.device("cpu"))  # the CPU: nothing moves
    assert all(p.device.type == "cpu" for p in adapter.model.parameters())
    place_non_experts(adapter, torch.device("meta"))  # stands in for CUDA
    moved = [(n, t) for n, t in [*adapter.model.named_parameters(),
                                 *adapter.model.named_buffers()]]
    stay = [n for n, t in moved if t.device.type == "cpu"]
    assert stay and all(".experts." in n for n in stay)  # only routed experts stay
    assert all(t.device.type == "meta" for n, t in moved if ".experts." not in n)
    assert {t.data_ptr() for n, t in moved if t.device.type == "cpu"} == experts
    assert adapter.device.type == "meta"  # the KV cache and step inputs follow it


def test_split_on_the_experts_device_is_a_no_op_and_forwards_owners() -> None:
    adapter = HFMoEAdapter(small_mixtral())
    layer = adapter.moe_layers[0]
    held = held_experts({layer: {e: adapter.expert_view(layer, e) for e in range(4)}})
    owners: list[list[str] | None] = []

    class Remote(ExpertStack):  # a piece that bills owners, as RemoteExperts does
        def set_owners(self, o: Sequence[str] | None) -> None:
            owners.append(None if o is None else list(o))

        def __call__(self, lay: int, x: torch.Tensor, ids: torch.Tensor,
                     w: torch.Tensor) -> torch.Tensor:
            return held(lay, x, ids, w)

    keep = torch.tensor([True, True, False, False])
    split = SplitExperts(held, Remote(), {layer: keep}, expert_device="cpu")
    split.set_owners(["a", "b"])
    assert owners == [["a", "b"]]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, adapter.hidden_size, generator=g)
    ids = torch.randint(0, 4, (6, 2), generator=g)
    w = torch.rand(6, 2, generator=g)
    y = split(layer, x, ids, w)
    assert y.device == x.device
    torch.testing.assert_close(y, held(layer, x, ids, w), rtol=1e-5, atol=1e-6)
