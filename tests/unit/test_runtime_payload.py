"""Payload packets: safetensors + JSON, spilling to the store, forward contexts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moefleet.models.hf import HFMoEAdapter
from moefleet.models.tiny import tiny_model
from moefleet.platform import LocalObjectStore
from moefleet.runtime.errors import PayloadError
from moefleet.runtime.payload import (
    flatten_context,
    need,
    pack,
    pack_spilling,
    resolve,
    unflatten_context,
    unpack,
)


def test_roundtrip_tensors_meta_refs() -> None:
    x = torch.randn(3, 4)
    view = x[:, :2]  # non-contiguous
    cplx = torch.randn(2, 2, dtype=torch.complex64)
    data = pack({"x": x, "view": view, "same": x, "c": cplx, "empty": torch.zeros(0, 5)},
                meta={"op": "pre", "n": [1, 2]}, refs={"h": "k/h"})
    p = unpack(data)
    assert torch.equal(p.tensors["x"], x) and torch.equal(p.tensors["view"], view)
    assert torch.equal(p.tensors["same"], x) and torch.equal(p.tensors["c"], cplx)
    assert p.tensors["empty"].shape == (0, 5)
    assert p.meta == {"op": "pre", "n": [1, 2]} and p.refs == {"h": "k/h"}
    assert p.names() == {"x", "view", "same", "c", "empty", "h"}


@pytest.mark.parametrize("data", [b"", b"not a packet", b"\xff" * 64])
def test_garbage_is_a_clear_error(data: bytes) -> None:
    with pytest.raises(PayloadError, match="not a moefleet packet"):
        unpack(data)


def test_need_names_the_missing_tensor() -> None:
    with pytest.raises(PayloadError, match="'y'"):
        need(unpack(pack({"x": torch.ones(1)})), "x", "y")


def test_spill_keeps_packets_under_the_limit(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    big, small = torch.randn(256, 64), torch.randn(4)
    data = pack_spilling({"big": big, "small": small}, {"a": 1}, None, max_bytes=16 * 1024,
                         store=store, prefix="spill/x")
    assert len(data) <= 16 * 1024
    p = unpack(data)
    assert set(p.tensors) == {"small"} and p.refs == {"big": "spill/x/big"}
    resolve(p, store)
    assert torch.equal(p.tensors["big"], big) and not p.refs
    # Without a store nothing can spill: the caller's payload check reports the size.
    assert len(pack_spilling({"big": big}, {}, None, max_bytes=1024, store=None,
                             prefix="p")) > 1024
    with pytest.raises(PayloadError, match="no object store"):
        resolve(unpack(pack(refs={"big": "k"})), None)


def test_forward_context_roundtrip() -> None:
    adapter = HFMoEAdapter(tiny_model("mixtral"))
    ids = torch.randint(0, 1000, (2, 5))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    _, ctx = adapter.begin(ids, mask)
    tensors, skeleton = flatten_context(ctx)
    back = unflatten_context(unpack(pack(tensors, {"ctx": skeleton})).tensors, skeleton)
    assert torch.equal(back.input_ids_BT, ids) and torch.equal(back.attention_mask_BT, mask)
    masks = back.extras["masks"]
    assert isinstance(masks, list) and torch.equal(masks[0], ctx.extras["masks"][0])
    assert isinstance(back.extras["rope"], tuple)


def test_context_with_an_object_is_refused() -> None:
    from moefleet.models.base import ForwardContext

    ctx = ForwardContext(torch.ones(1, 1), None, torch.zeros(1, 1), {"bad": object()})
    with pytest.raises(PayloadError, match=r"extras\.bad is a object"):
        flatten_context(ctx)
