"""schemathesis against the server's own OpenAPI schema, with its default checks: no 5xx,
every status and content type documented. Bounded in examples so CI stays fast."""

from __future__ import annotations

import pytest

from tests.serve.conftest import MODEL, Server

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402


def test_schema_declares_400_not_422(server: Server) -> None:
    import json
    import urllib.request

    doc = json.loads(urllib.request.urlopen(server.url + "/openapi.json").read())
    for path, ops in doc["paths"].items():
        for op in ops.values():
            assert "422" not in op["responses"], path
            if "requestBody" in op:
                assert "400" in op["responses"], path


def test_api_conforms_to_its_schema(server: Server) -> None:
    from hypothesis import given

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert len(ops) >= 8
    for op in ops:

        @given(case=op.as_strategy())
        @settings(max_examples=12, deadline=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        def check(case) -> None:
            _bound(case)
            # Schema-valid is not always acceptable: token ids must lie in this model's
            # vocabulary and prompt + max_tokens in its context, bounds only known at run
            # time (and answered with 400), so that one check is left out.
            case.call_and_validate(excluded_checks=[positive_data_acceptance], timeout=120)

        check()


def _bound(case) -> None:
    body = case.body
    if isinstance(body, dict):
        # Most generated names would only meet the 404 path; keep them on the served
        # model so the fuzzing reaches field validation and generation.
        if "model" in body:
            body["model"] = MODEL
        # Bound the work one example can ask for (valid values stay valid).
        for key, cap in (("max_tokens", 8), ("max_completion_tokens", 8), ("n", 2)):
            v = body.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > cap:
                body[key] = cap
        if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 4:
            body["prompt"] = body["prompt"][:4]
