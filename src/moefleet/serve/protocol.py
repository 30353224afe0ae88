"""Request bodies of the OpenAI-compatible API, validated field by field.

Unknown fields are ignored (OpenAI clients send many); every known field is checked and a
bad one is answered with 400 naming it. Bounds keep what one request can ask for finite.
Types are strict (JSON's own types: no booleans as numbers, no numeric strings). OpenAI
parameters this server does not implement are declared so that a request setting one to
anything but its neutral value gets a 400 naming it (:meth:`_Sampling.unsupported`),
never a 200 that silently ignores it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

MAX_PROMPTS = 64  # prompts in one completions request (lm-eval batches them)
MAX_N = 16
MAX_CHOICES = 64  # engine requests one API request may start
MAX_STOP = 16
MAX_MESSAGES = 256
MAX_TOKEN_IDS = 65_536
MAX_LOGIT_BIAS = 1024  # entries in one logit_bias map
STRICT = ConfigDict(extra="ignore", strict=True)


def _utf8(s: str) -> str:
    """Reject lone surrogates (JSON can carry them; no tokenizer can encode them)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text is not valid unicode (lone surrogate)") from None
    return s


Text = Annotated[str, AfterValidator(_utf8)]
NonEmpty = Annotated[str, Field(min_length=1), AfterValidator(_utf8)]
TokenId = Annotated[int, Field(ge=0)]


def _absent(v: Any) -> bool:
    return v is None


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == ""


#: OpenAI (and vLLM) parameters not implemented here -> when a value counts as "not set".
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "response_format": lambda v: v is None or v == {"type": "text"},
    "min_p": lambda v: v is None or v == 0, "repetition_penalty": lambda v: v in (None, 1),
    "min_tokens": lambda v: v in (None, 0), "use_beam_search": lambda v: v in (None, False),
    "length_penalty": lambda v: v in (None, 1), "guided_json": _absent,
    "guided_regex": _absent, "guided_choice": _absent, "guided_grammar": _absent,
    "structured_outputs": _absent, "logits_processors": _empty}
CHAT_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "tools": _empty, "tool_choice": lambda v: v in (None, "none"), "functions": _empty,
    "function_call": lambda v: v in (None, "none"), "parallel_tool_calls": _absent,
    "audio": _absent, "modalities": lambda v: v in (None, ["text"]), "prediction": _absent,
    "reasoning_effort": _absent, "web_search_options": _absent}
COMPLETION_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {"suffix": _empty}


def _logit_bias(v: dict[str, float] | None) -> dict[str, float] | None:
    if v is None:
        return v
    if len(v) > MAX_LOGIT_BIAS:
        raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
    for k, b in v.items():
        if not (k.isascii() and k.isdigit()) or len(k) > 9:
            raise ValueError(f"keys must be token ids written as decimal strings, got {k!r}")
        if not (math.isfinite(b) and -100 <= b <= 100):
            raise ValueError(f"biases must be in [-100, 100], got {b!r} for token {k}")
    return v


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = STRICT

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKEN_IDS)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1_000_000)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: NonEmpty | list[NonEmpty] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    ignore_eos: bool = False
    user: str | None = Field(None, max_length=256)
    logit_bias: Annotated[dict[str, float] | None, AfterValidator(_logit_bias)] = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # declared only to be refused when set (see UNSUPPORTED); strict Any takes any JSON
    response_format: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    min_tokens: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    logits_processors: Any = None

    def unsupported(self) -> tuple[str, Any] | None:
        """The first unimplemented parameter set to a value that would change the output
        (name, value), or None. The routes answer it with 400."""
        table = {**UNSUPPORTED, **self._own_unsupported()}
        for name, neutral in table.items():
            v = getattr(self, name, None)
            if not neutral(v):
                return name, v
        return None

    def _own_unsupported(self) -> dict[str, Callable[[Any], bool]]:
        return {}

    @field_validator("temperature", "top_p", "frequency_penalty", "presence_penalty")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    @model_validator(mode="after")
    def _stream_opts(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def engine_kwargs(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "seed": self.seed, "stop": self.stops(),
                "stop_token_ids": tuple(self.stop_token_ids or ()),
                "ignore_eos": self.ignore_eos,
                "logit_bias": tuple((int(k), float(b)) for k, b in
                                    (self.logit_bias or {}).items()),
                "frequency_penalty": self.frequency_penalty,
                "presence_penalty": self.presence_penalty}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


Prompt = NonEmpty | list[NonEmpty] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKEN_IDS)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: Any = None

    def _own_unsupported(self) -> dict[str, Callable[[Any], bool]]:
        # best_of == n draws n and keeps all n: exactly what n alone does
        return {**COMPLETION_UNSUPPORTED, "best_of": lambda v: v is None or v == self.n}

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Prompt) -> Prompt:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if len(v) > MAX_TOKEN_IDS:
                raise ValueError(f"at most {MAX_TOKEN_IDS} entries")
            if isinstance(v[0], list | str) and len(v) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
            for p in v:
                if isinstance(p, list) and (not p or len(p) > MAX_TOKEN_IDS):
                    raise ValueError(f"a token-id prompt needs 1..{MAX_TOKEN_IDS} ids")
                if isinstance(p, list | int) and any(t < 0 for t in (p if isinstance(p, list)
                                                                       else [p])):
                    raise ValueError("token ids must be >= 0")
        return v

    @model_validator(mode="after")
    def _choices(self) -> CompletionRequest:
        k = len(self.prompts()) * self.n
        if k > MAX_CHOICES:
            raise ValueError(f"prompts x n = {k} choices; at most {MAX_CHOICES} per request")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[dict[str, Any]] | None = None
    name: str | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _text_only(self) -> ChatMessage:
        self.text()  # raises ValueError (-> 400) on non-text parts
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(_utf8(part["text"]))
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKEN_IDS)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None

    def _own_unsupported(self) -> dict[str, Callable[[Any], bool]]:
        return CHAT_UNSUPPORTED

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = Field(None, max_length=256)
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = Field(None, max_length=256)
    tokens: list[TokenId] = Field(max_length=MAX_TOKEN_IDS)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
