"""lm-evaluation-harness ``local-completions`` loglikelihood against the server.

The request is shaped as lm-eval's ``LocalCompletionsAPI._create_payload(generate=False)``
builds it (token-id prompts, batched; temperature 0, max_tokens 1, logprobs 1, seed,
echo), and the answer is read as its ``parse_logprobs`` reads it: the sum of
``token_logprobs[ctxlen:-1]``, greedy when every one of them equals the maximum of its
``top_logprobs`` entry. Both must match a direct fp32 forward of the model.
"""

from __future__ import annotations

from typing import Any

import pytest
import requests
import torch

from tests.serve.conftest import MODEL, Server, tiny_adapter


def _lm_eval_payload(prompts: list[list[int]]) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}


def _lm_eval_parse(out: dict[str, Any], ctxlens: list[int]) -> list[tuple[float, bool]]:
    res = []
    choices = sorted(out["choices"], key=lambda c: c["index"])
    for choice, ctxlen in zip(choices, ctxlens, strict=True):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(v == max(t.values()) for v, t in zip(lps, tops, strict=True))
        res.append((sum(lps), greedy))
    return res


def _direct(ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    adapter = tiny_adapter()
    full = ctx + cont
    with torch.no_grad():
        logits_TV = adapter.reference_forward(torch.tensor([full]))[0].float()
    lp_TV = torch.log_softmax(logits_TV, dim=-1)
    rows = range(len(ctx) - 1, len(full) - 1)  # row t predicts token t + 1
    total = sum(lp_TV[t, full[t + 1]].item() for t in rows)
    greedy = all(int(lp_TV[t].argmax()) == full[t + 1] for t in rows)
    return total, greedy


def _greedy_continuation(ctx: list[int], k: int) -> list[int]:
    adapter = tiny_adapter()
    ids = list(ctx)
    with torch.no_grad():
        for _ in range(k):
            ids.append(int(adapter.reference_forward(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(ctx):]


def test_lm_eval_loglikelihood_matches_a_direct_forward(server: Server) -> None:
    tok = tiny_adapter().tokenizer
    ctx_a = tok.encode("The old castle stood on a hill above the")
    ctx_b = tok.encode("Question: what colour is the sky? Answer:")
    greedy_cont = _greedy_continuation(ctx_a, 3)
    other_cont = tok.encode(" purple elephant")  # an unlikely, non-greedy continuation
    cases = [(ctx_a, greedy_cont), (ctx_a, other_cont), (ctx_b, tok.encode(" blue"))]
    # lm-eval sends context + continuation as one prompt; ctxlen = len(context)
    resp = requests.post(server.url + "/v1/completions",
                         json=_lm_eval_payload([c + k for c, k in cases]), timeout=120)
    assert resp.status_code == 200, resp.text
    got = _lm_eval_parse(resp.json(), [len(c) for c, _ in cases])
    want = [_direct(c, k) for c, k in cases]
    for (g_ll, g_greedy), (w_ll, w_greedy) in zip(got, want, strict=True):
        assert g_ll == pytest.approx(w_ll, abs=1e-3)
        assert g_greedy == w_greedy
    assert [g for _, g in got][:2] == [True, False]  # both outcomes are exercised


def test_prompt_top_logprobs_hold_n_alternatives_and_the_prompt_token(server: Server) -> None:
    ids = tiny_adapter().tokenizer.encode("A small dog ran across the road")
    resp = requests.post(server.url + "/v1/completions", json={
        "model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True,
        "logprobs": 3}, timeout=60)
    assert resp.status_code == 200, resp.text
    lp = resp.json()["choices"][0]["logprobs"]
    assert lp["top_logprobs"][0] is None and lp["token_logprobs"][0] is None
    for tok_s, v, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:],
                             lp["top_logprobs"][1:], strict=True):
        assert 3 <= len(top) <= 4  # the 3 most likely, plus the prompt token if not among them
        assert top[tok_s] == v
        ranked = sorted(top.values(), reverse=True)
        assert v in ranked[:3] or len(top) == 4
