"""Replica shares, minibatches and the exactly-once gather."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moefleet.models.base import combine_experts
from moefleet.runtime.errors import GatherError
from moefleet.runtime.scatter import (
    assign,
    gather,
    minibatches,
    object_beta,
    share_inputs,
    share_keys,
)


def _ids(N: int = 50, K: int = 2, E: int = 8, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])


def test_assign_splits_ceil_d_over_g_and_covers_every_slot() -> None:
    ids = _ids()
    replicas = [1, 2, 3, 1, 4, 1, 1, 7]
    shares = assign(0, ids, replicas)
    counts = torch.bincount(ids.reshape(-1), minlength=8).tolist()
    for e, (d, g) in enumerate(zip(counts, replicas, strict=True)):
        sizes = [s.size for s in shares if s.expert == e]
        assert sum(sizes) == d and max(sizes) == math.ceil(d / g) and len(sizes) <= g
        assert all(s.size > 0 for s in shares)
    seen = np.zeros(ids.numel(), dtype=int)
    for s in shares:
        np.add.at(seen, s.tokens_n * 2 + s.slots_n, 1)
        assert (ids[torch.from_numpy(s.tokens_n), torch.from_numpy(s.slots_n)] == s.expert).all()
        assert (np.diff(s.tokens_n) >= 0).all()
    assert (seen == 1).all()


def test_more_replicas_than_tokens_leaves_no_empty_share() -> None:
    ids = torch.tensor([[0], [0], [1]])
    shares = assign(3, ids, [5, 1])
    assert [(s.expert, s.replica, s.size) for s in shares] == [(0, 0, 1), (0, 1, 1), (1, 0, 1)]


def test_bad_expert_id_is_an_error() -> None:
    with pytest.raises(GatherError, match="8 experts"):
        assign(0, torch.tensor([[8]]), [1] * 8)


def test_minibatches_and_keys() -> None:
    assert minibatches(7, 3) == [(0, 3), (3, 6), (6, 7)]
    assert minibatches(0, 3) == []
    with pytest.raises(ValueError):
        minibatches(3, 0)
    assert object_beta("pipelined", 3, 10) == 3 and object_beta("storage", 3, 10) == 10
    (share,) = assign(2, torch.tensor([[1]] * 7), [1, 1])
    ins, outs = share_keys("p", share, 3)
    assert ins == ["p/L2/e1-r0/in-0", "p/L2/e1-r0/in-1", "p/L2/e1-r0/in-2"]
    assert outs[-1] == "p/L2/e1-r0/out-2"


def test_gather_equals_the_monolithic_combination() -> None:
    torch.manual_seed(0)
    N, D, E, K = 40, 16, 8, 2
    experts = [torch.nn.Linear(D, D) for _ in range(E)]
    x, ids = torch.randn(N, D), _ids(N, K, E)
    w = torch.softmax(torch.randn(N, K), -1)
    shares = assign(0, ids, [2] * E)
    with torch.no_grad():
        parts = []
        for s in shares:
            x_n, w_n = share_inputs(s, x, w)
            parts.append((s, experts[s.expert](x_n) * w_n[:, None]))
        want = combine_experts(experts, x, ids, w)
    got = gather(0, N, K, parts, x)
    assert torch.allclose(got, want, atol=1e-6)
    with pytest.raises(GatherError, match="never gathered"):
        gather(0, N, K, parts[1:], x)
    with pytest.raises(GatherError, match="more than once"):
        gather(0, N, K, [*parts, parts[0]], x)
    with pytest.raises(GatherError, match="rows for"):
        gather(0, N, K, [(parts[0][0], parts[0][1][:-1]), *parts[1:]], x)


def test_fit_payload_cuts_an_oversize_share_into_fitting_pieces() -> None:
    import numpy as np

    from moefleet.runtime.scatter import Share, fit_payload

    share = Share(0, 3, 1, np.arange(10, dtype=np.int64), np.zeros(10, dtype=np.int64))
    assert fit_payload(share, row_bytes=100, limit=4096 + 1000) == [(share, 0, 10)]
    cut = fit_payload(share, row_bytes=100, limit=4096 + 300)  # 3 rows per payload
    assert [(s, e) for _, s, e in cut] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert np.concatenate([p.tokens_n for p, _, _ in cut]).tolist() == list(range(10))
    assert {(p.expert, p.replica) for p, _, _ in cut} == {(3, 1)}
    assert len(fit_payload(share, row_bytes=10**6, limit=10)) == 10  # never 0 rows a piece
