"""The messages of Remoe's main function (typed, see :mod:`moefleet.runtime.messages`).

``remoe.generate``: a batch of requests (token ids), each decoded greedily for
``max_tokens`` tokens (``ignore_eos``: fixed lengths, as the cost figures assume);
``remoe.result``: per request the tokens and the times measured inside the function.
"""

from __future__ import annotations

from dataclasses import dataclass

from moefleet.runtime.messages import message

MAX_REQUESTS = 1024  # per invocation: bounds the main function's batch
MAX_TOKENS = 4096  # output tokens per request


@message("remoe.generate")
@dataclass(frozen=True)
class Generate:
    request_ids: tuple[str, ...]
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int
    ignore_eos: bool = True
    max_num_seqs: int = 64

    def __post_init__(self) -> None:
        if not 1 <= len(self.prompts) <= MAX_REQUESTS:
            raise ValueError(f"{len(self.prompts)} requests; send 1..{MAX_REQUESTS}")
        if len(self.request_ids) != len(self.prompts):
            raise ValueError(f"{len(self.request_ids)} ids for {len(self.prompts)} prompts")
        if len(set(self.request_ids)) != len(self.request_ids):
            raise ValueError("request ids repeat")
        if any(not p for p in self.prompts):
            raise ValueError("a prompt is empty")
        if not 1 <= self.max_tokens <= MAX_TOKENS:
            raise ValueError(f"max_tokens={self.max_tokens} is outside 1..{MAX_TOKENS}")
        if not 1 <= self.max_num_seqs <= MAX_REQUESTS:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} is outside 1..{MAX_REQUESTS}")


@dataclass(frozen=True)
class RequestResult:
    request_id: str
    tokens: tuple[int, ...]
    ttft_s: float
    tpot_s: float
    e2e_s: float


@message("remoe.result")
@dataclass(frozen=True)
class Result:
    request_ids: tuple[str, ...]
    tokens: tuple[tuple[int, ...], ...]
    ttft_s: tuple[float, ...]
    tpot_s: tuple[float, ...]
    e2e_s: tuple[float, ...]
    remote_invocations: int
    remote_s: float  # wall time inside RemoteExperts (overlaps local compute)
    steps: int
    device: str = "cpu"  # where the main function's non-expert modules ran

    def requests(self) -> list[RequestResult]:
        return [RequestResult(*row) for row in zip(self.request_ids, self.tokens, self.ttft_s,
                                                   self.tpot_s, self.e2e_s, strict=True)]
