"""What a user asks of the engine (:class:`SamplingParams`), a request's state while it
lives in the scheduler (:class:`Sequence`), and what the engine streams back
(:class:`RequestOutput`).

Times are seconds on the engine's clock (monotonic; a fake clock in tests).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from enum import Enum

import torch

from moefleet.errors import MoefleetError


class EngineError(MoefleetError):
    """A request the engine cannot take (bad parameter, too long, wrong model)."""


MAX_REQUEST_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated on construction.

    ``temperature`` 0 is greedy; ``top_k`` 0 means all tokens; ``seed`` makes a
    request's draws independent of what else is in the batch; ``logprobs`` n returns the
    chosen token's log-probability and the n most likely (0: just the chosen one);
    ``prompt_logprobs`` returns the log-probability of every prompt token (echo), with
    the ``logprobs`` most likely alternatives at each prompt position;
    ``ignore_eos`` keeps generating past end-of-sequence (benchmarks with fixed lengths).
    ``max_tokens`` 0 asks for the prompt alone (scoring, loglikelihood, embeddings): no
    token is sampled, and the request's one output carries ``prompt_outputs``, the model's
    output at every prompt position.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or self.max_tokens < 0:
            raise EngineError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}",
                              "ask for 0 (the prompt only) or more tokens")
        if not isinstance(self.temperature, int | float) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise EngineError(f"temperature must be a finite number >= 0, got "
                              f"{self.temperature!r}", "use 0 for greedy, e.g. 0.7 to sample")
        if not isinstance(self.top_p, int | float) or not (0 < self.top_p <= 1):
            raise EngineError(f"top_p must be in (0, 1], got {self.top_p!r}",
                              "use 1 to keep every token")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise EngineError(f"top_k must be an integer >= 0, got {self.top_k!r}",
                              "use 0 to keep every token")
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= MAX_REQUEST_SEED):
            # torch's generators take 64-bit seeds; a larger one would fail mid-request.
            raise EngineError(f"seed must be an integer in [0, 2**63-1], got {self.seed!r}",
                              "omit it for a random seed")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise EngineError(f"stop strings must be non-empty, got {list(self.stop)!r}",
                              "remove the empty stop string")
        if self.logprobs is not None and (not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= 20):
            raise EngineError(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}",
                              "ask for at most 20 alternatives")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def prefill_only(self) -> bool:
        return self.max_tokens == 0


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request inside the scheduler. ``num_computed``: tokens whose K/V the runner's
    cache holds (0 again after a preemption: the request is recomputed)."""

    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0
    blocks: int = 0
    finish_reason: str | None = None
    prompt_logprobs_done: bool = False
    preemptions: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Tokens still to compute before the next token can be sampled."""
        return self.num_tokens - self.num_computed


@dataclass
class RequestTimes:
    """A request's clock readings; latencies derive from them."""

    arrival: float
    scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None

    @property
    def queue_s(self) -> float | None:
        return None if self.scheduled is None else self.scheduled - self.arrival

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: gaps between consecutive output tokens."""
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than 2)."""
        t = self.token_times
        return None if len(t) < 2 else (t[-1] - t[0]) / (len(t) - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class RequestOutput:
    """A streamed delta: the tokens and text a request produced since its last output.
    ``prompt_logprobs`` arrives once, with the first delta (None for the first prompt
    token, which nothing predicts), with ``prompt_top_logprobs`` (token id ->
    log-probability of the ``logprobs`` most likely tokens at each prompt position).
    ``times`` is the request's live clock record (complete, with ``finished``, on the
    final delta). A request the engine could not finish ends with
    ``finish_reason="error"`` and ``error`` saying why. ``prompt_outputs`` (prefill-only
    requests, ``max_tokens`` 0): the model's output at every prompt position, ``[T, V]``
    logits of a language model or ``[T, D]`` hidden states of an encoder."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_ids: list[int] | None = None
    times: RequestTimes | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    prompt_outputs: torch.Tensor | None = None
