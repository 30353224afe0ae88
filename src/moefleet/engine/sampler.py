"""Token choice from a step's logits: greedy, temperature, top-k, top-p, per-request seed,
and log-probabilities.

Shape legend: B rows that sample this step, V vocabulary.

Log-probabilities are those of the model's own distribution (log-softmax of the raw
logits), whatever the sampling transform; this is what evaluation tools expect. A
request with a seed draws from its own generator, so its tokens do not depend on which
other requests share its batches. ``logit_bias`` and the frequency/presence penalties
change the logits every choice sees (greedy included), for the whole batch at once; the
log-probabilities reported stay the model's own.
"""

from __future__ import annotations

import math

import torch

from moefleet.engine.request import SamplingParams, TokenLogprob

_HALF = (torch.bfloat16, torch.float16)


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[int, torch.Generator] = {}
        self._default = torch.Generator().manual_seed(torch.seed() % (2**63))

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    def _generator(self, seq_id: int, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._default
        g = self._generators.get(seq_id)
        if g is None:
            g = self._generators[seq_id] = torch.Generator().manual_seed(params.seed)
        return g

    @torch.no_grad()
    def sample(self, logits_BV: torch.Tensor, seq_ids: list[int],
               params: list[SamplingParams], outputs: list[list[int]] | None = None
               ) -> tuple[list[int], list[TokenLogprob | None]]:
        """One token per row. ``outputs[b]``: the tokens row b's request has generated so
        far (what the penalties count); needed only when a request sets a penalty."""
        if all(p.greedy and p.logprobs is None and not p.adjusts_logits for p in params):
            # the step's one read of the tokens: argmax where the logits are. On the CPU a
            # half-precision argmax runs unvectorised (OLMoE's 8 x 50,304 bf16 logits: 1.46
            # ms against 0.37 through float32, one-off); widening is exact, so same token
            if logits_BV.device.type == "cpu" and logits_BV.dtype in _HALF:
                logits_BV = logits_BV.float()
            return logits_BV.argmax(dim=-1).tolist(), [None] * len(params)
        logits_BV = logits_BV.float().cpu()
        chosen_BV = adjusted(logits_BV, params, outputs)
        if all(p.greedy for p in params):
            tokens = chosen_BV.argmax(dim=-1).tolist()
        else:
            tokens = [self._one(chosen_BV[b], seq_ids[b], p) for b, p in enumerate(params)]
        logprobs: list[TokenLogprob | None] = [None] * len(params)
        want = [b for b, p in enumerate(params) if p.logprobs is not None]
        if want:
            lp_BV = torch.log_softmax(logits_BV[want], dim=-1)
            for r, b in enumerate(want):
                n = params[b].logprobs or 0
                top = {}
                if n:
                    vals, idx = lp_BV[r].topk(n)
                    top = dict(zip(idx.tolist(), vals.tolist(), strict=True))
                logprobs[b] = TokenLogprob(tokens[b], float(lp_BV[r, tokens[b]]), top)
        return tokens, logprobs

    def _one(self, logits_V: torch.Tensor, seq_id: int, p: SamplingParams) -> int:
        if p.greedy:
            return int(logits_V.argmax())
        scaled_V = logits_V / p.temperature
        if p.top_k and p.top_k < scaled_V.shape[0]:
            kth = scaled_V.topk(p.top_k).values[-1]
            scaled_V = scaled_V.masked_fill(scaled_V < kth, float("-inf"))
        probs_V = torch.softmax(scaled_V, dim=-1)
        if p.top_p < 1.0:
            sorted_V, order = probs_V.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always)
            drop = sorted_V.cumsum(0) - sorted_V >= p.top_p
            drop[0] = False  # top_p = 0 would otherwise drop every token
            sorted_V = sorted_V.masked_fill(drop, 0.0)
            probs_V = torch.zeros_like(probs_V).scatter_(0, order, sorted_V)
        total = float(probs_V.sum())
        if not math.isfinite(total) or total <= 0.0:
            # a temperature so small that logits / T overflow: its limit is greedy
            return int(logits_V.argmax())
        return int(torch.multinomial(probs_V, 1, generator=self._generator(seq_id, p)))


def adjusted(logits_BV: torch.Tensor, params: list[SamplingParams],
             outputs: list[list[int]] | None) -> torch.Tensor:
    """``logits_BV`` with each row's logit bias added and its penalties subtracted; the
    input itself when no row asks for either (the common case costs nothing)."""
    rows = [b for b, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits_BV
    out_BV = logits_BV.clone()
    bias_rows = [b for b in rows for _ in params[b].logit_bias]
    if bias_rows:
        ids = [t for b in rows for t, _ in params[b].logit_bias]
        vals = [float(v) for b in rows for _, v in params[b].logit_bias]
        out_BV.index_put_((torch.tensor(bias_rows), torch.tensor(ids)),
                          torch.tensor(vals), accumulate=True)
    pen = [b for b in rows if params[b].frequency_penalty or params[b].presence_penalty]
    if pen:
        if outputs is None:
            raise ValueError("frequency/presence penalties need the generated tokens")
        count_rows = [r for r, b in enumerate(pen) for _ in outputs[b]]
        if count_rows:  # a request's first token has nothing to penalise yet
            toks = [t for b in pen for t in outputs[b]]
            counts_PV = torch.zeros(len(pen), out_BV.shape[1])
            counts_PV.index_put_((torch.tensor(count_rows), torch.tensor(toks)),
                                 torch.ones(len(toks)), accumulate=True)
            freq_P1 = torch.tensor([[params[b].frequency_penalty] for b in pen])
            pres_P1 = torch.tensor([[params[b].presence_penalty] for b in pen])
            out_BV[pen] -= freq_P1 * counts_PV + pres_P1 * (counts_PV > 0).float()
    return out_BV


def prompt_logprobs(logits_TV: torch.Tensor, next_ids: list[int]) -> list[float]:
    """log p(next_ids[t] | tokens up to t) for every row t of ``logits_TV``."""
    return prompt_top_logprobs(logits_TV, next_ids, 0)[0]


def prompt_top_logprobs(logits_TV: torch.Tensor, next_ids: list[int], n: int
                        ) -> tuple[list[float], list[dict[int, float]]]:
    """Per row t: log p(next_ids[t] | tokens up to t), and the ``n`` most likely next
    tokens with their log-probabilities (empty dicts for n = 0).

    Invariant: both come from one log-softmax, so when next_ids[t] is the row's argmax its
    log-probability equals the largest value of the row's top dict exactly (evaluation
    tools test greediness with ``==``).
    """
    if not 0 <= n <= 20:
        raise ValueError(f"top-n must be in [0, 20], got {n}")
    lp_TV = torch.log_softmax(logits_TV.float(), dim=-1)
    idx = torch.as_tensor(next_ids, dtype=torch.long)
    chosen = lp_TV[torch.arange(len(next_ids)), idx].tolist()
    if n == 0:
        return chosen, [{} for _ in chosen]
    vals_TN, ids_TN = lp_TV.topk(n, dim=-1)
    tops = [dict(zip(i, v, strict=True))
            for i, v in zip(ids_TN.tolist(), vals_TN.tolist(), strict=True)]
    return chosen, tops
