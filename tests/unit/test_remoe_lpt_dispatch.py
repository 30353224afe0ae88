"""Remoe's LPT groups reach the runtime: a group's ``replica_experts`` sends each expert's
slots to its own replica (scatter.assign), and bad groups are refused when the plan loads."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from moefleet.plan.plan import ExpertGroup
from moefleet.runtime import scatter


def test_owned_experts_go_whole_to_their_replica_and_others_split_evenly() -> None:
    ids_NK = torch.tensor([[0, 1], [1, 2], [0, 2], [1, -1]])
    shares = scatter.assign(0, ids_NK, [2, 2, 2], replica_of={0: 1, 1: 0})
    got = {(s.expert, s.replica): s.tokens_n.tolist() for s in shares}
    assert got == {(0, 1): [0, 2], (1, 0): [0, 1, 3], (2, 0): [1], (2, 1): [2]}
    # without replica_of, every expert's slots are split over both replicas
    plain = {(s.expert, s.replica) for s in scatter.assign(0, ids_NK, [2, 2, 2])}
    assert (0, 0) in plain and (1, 1) in plain


def test_group_owners_and_validation_name_the_bad_value() -> None:
    g = ExpertGroup(layer=1, experts=[2, 3, 5], memory_mb=1024, replicas=2,
                    replica_experts=[[5, 2], [3]])
    assert g.replica_of() == {5: 0, 2: 0, 3: 1}
    assert ExpertGroup(layer=1, experts=[2], memory_mb=1024).replica_of() is None
    # fewer sets than replicas, an expert twice, an empty set, an expert missing
    for bad in ([[2, 3, 5]], [[2, 3], [3, 5]], [[2, 3, 5], []], [[2], [3]]):
        with pytest.raises(ValidationError, match="replica_experts"):
            ExpertGroup(layer=1, experts=[2, 3, 5], memory_mb=1024, replicas=2,
                        replica_experts=bad)
