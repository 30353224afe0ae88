"""Typed messages: round trips, and clear errors for unknown kinds and bad fields."""

from __future__ import annotations

import pytest

from moefleet.remoe.messages import Generate
from moefleet.runtime.calls import (
    ExpertDirect,
    ExpertPipelined,
    ExpertStorage,
    SegmentPost,
    SegmentPre,
    Transfer,
)
from moefleet.runtime.errors import PayloadError
from moefleet.runtime.messages import Warm, decode, encode
from moefleet.runtime.payload import pack, unpack

ALL = (SegmentPre, SegmentPost, ExpertDirect, ExpertStorage, ExpertPipelined, Warm, Generate)


@pytest.mark.parametrize("msg", [
    SegmentPre(None, "p/spill-0-pre"),
    SegmentPre({"a": 1}, "p/s", Transfer("p", "pipelined", 4, (1, 2)).to_json()),
    SegmentPost({"a": [1, 2]}, "p/s", Transfer("p", "storage", 1, (3,)).to_json()),
    ExpertDirect(((0, 2), (5, 3))),
    ExpertStorage(3, ("in/0",), ("out/0",), 7),
    ExpertPipelined(3, ("in/0", "in/1"), ("out/0", "out/1"), 9),
    Warm(),
    Generate(("a", "b"), ((1, 2), (3,)), 4),
])
def test_round_trip_through_a_packet(msg: object) -> None:
    meta = unpack(pack(meta=encode(msg))).meta  # through JSON, as on the wire
    assert decode(meta, *ALL) == msg  # type: ignore[call-overload]


def test_unknown_kind_names_what_is_accepted() -> None:
    with pytest.raises(PayloadError, match=r"unknown message kind 'op=pre'.*segment.pre"):
        decode({"kind": "op=pre"}, SegmentPre, SegmentPost)
    with pytest.raises(PayloadError, match="unknown message kind None"):
        decode({"op": "pre"}, SegmentPre)  # the old string-keyed format


@pytest.mark.parametrize("meta,needle", [
    ({"kind": "expert.direct"}, "field 'runs' is missing"),
    ({"kind": "expert.direct", "runs": [[0, 2]], "mode": "direct"}, r"unknown fields \['mode'\]"),
    ({"kind": "expert.direct", "runs": [[0, "2"]]}, r"expert.direct.runs\[0\]"),
    ({"kind": "expert.direct", "runs": []}, "must be non-empty"),
    ({"kind": "expert.storage", "expert": 1, "in_keys": ["a"], "out_keys": [], "tokens": 1},
     "one output key per input"),
    ({"kind": "expert.storage", "expert": True, "in_keys": ["a"], "out_keys": ["b"],
      "tokens": 1}, "expected int"),
    ({"kind": "segment.pre", "ctx": None, "spill_prefix": "p",
      "scatter": {"prefix": "p", "method": "direct", "beta": 1, "replicas": [1]}},
     "is not one of"),
    ({"kind": "remoe.generate", "request_ids": ["a"], "prompts": [[1], [2]],
      "max_tokens": 3}, "1 ids for 2 prompts"),
])
def test_bad_fields_are_named(meta: dict, needle: str) -> None:
    with pytest.raises(PayloadError, match=needle):
        decode(meta, *ALL)  # type: ignore[call-overload]
