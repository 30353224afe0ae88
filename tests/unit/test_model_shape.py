"""ModelShape: the one shape description; validation and every stored form it reads."""

from __future__ import annotations

import pytest

from moefleet.errors import DataError
from moefleet.models import ModelShape

BASE = dict(name="m", num_layers=4, moe_layers=[1, 3], num_experts=[4, 8], top_k=2)


def test_round_trip_and_derived_fields() -> None:
    s = ModelShape(**BASE, hidden_size=16, causal=False)  # type: ignore[arg-type]
    assert ModelShape.from_dict(s.to_dict()) == s
    assert s.num_moe_layers == 2 and s.max_experts == 8 and s.experts_of(3) == 8
    assert not s.decoder and s.layer_index(3) == 1
    assert s.mask_LE().sum() == 12
    with pytest.raises(DataError, match="not an MoE layer"):
        s.layer_index(2)


@pytest.mark.parametrize("bad, match", [
    (dict(num_layers=0), "at least one block"),
    (dict(moe_layers=[3, 1]), "increasing"),
    (dict(moe_layers=[1, 4]), "increasing"),
    (dict(num_experts=[4]), "expert counts"),
    (dict(top_k=5), "top_k=5"),
    (dict(num_experts=[0, 8]), "top_k"),
])
def test_bad_shapes_name_the_value(bad: dict, match: str) -> None:
    with pytest.raises(DataError, match=match):
        ModelShape(**{**BASE, **bad})


def test_reads_older_stored_forms() -> None:
    # predictor files stored MoE layers only; blocks are what the layers prove
    old_pred = ModelShape.from_dict({"layers": [1, 3], "num_experts": [4, 8], "top_k": 2})
    assert old_pred.moe_layers == [1, 3] and old_pred.num_layers == 4
    assert not old_pred.differences(ModelShape(**BASE))  # type: ignore[arg-type]
    # deployments stored a "structure" dict
    old_dep = ModelShape.from_dict({"name": "m", "family": "f", "num_layers": 6,
                                    "moe_layers": [1, 3], "num_experts": [4, 8], "top_k": 2,
                                    "hidden_size": 32})
    assert old_dep.num_layers == 6 and old_dep.hidden_size == 32 and old_dep.family == "f"
    with pytest.raises(DataError, match="not a model shape"):
        ModelShape.from_dict({"layers": [1]})
