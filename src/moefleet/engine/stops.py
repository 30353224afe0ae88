"""When a request stops: the one rule, used by the engine and by the simulator's engine.

A sampled token ends its request when it is end-of-sequence (unless ``ignore_eos``) or one
of ``stop_token_ids`` (reason ``stop``), or when the request has its ``max_tokens``
(reason ``length``); a stop string in the decoded text (``stop``) is found by the
detokenizer, which only the engine has. Prefill-only requests (``max_tokens`` 0) end with
reason ``length`` once their prompt is computed.
"""

from __future__ import annotations

from moefleet.engine.request import SamplingParams


def token_stop(params: SamplingParams, token: int, num_output: int,
               eos: int | None) -> str | None:
    """``stop``, ``length`` or None (keep going) after ``token``, the ``num_output``-th
    output token. End-of-sequence and stop ids win over length: a request that ends on
    its stop token at its last allowed position stopped, it was not cut."""
    if (eos is not None and token == eos and not params.ignore_eos) \
            or token in params.stop_token_ids:
        return "stop"
    if num_output >= params.max_tokens:
        return "length"
    return None
