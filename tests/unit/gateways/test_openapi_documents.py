"""Each gateway's OpenAPI document under every setting that changes it: valid OpenAPI 3.1, the
same routes and methods the app registers (no more, no fewer), and the API-key scheme as the
auth middleware applies it. The responses themselves are checked against real gateways in
tests/integration/test_openapi.py."""

from __future__ import annotations

import importlib
import json
from typing import Any

import pytest
from openapi_spec_validator import validate

from gateways.common.config import GatewayConfig, load
from gateways.common.openapi import OPENAPI_KEY

SETTINGS = [
    ("openai", []),
    ("lmi", []),
    ("lmi", ["--tgi-compat"]),
    ("lmi", ["--batching", "dynamic"]),
    ("triton", []),
    ("triton", ["--ignore-unknown-parameters"]),
    ("ws", []),
]
PUBLIC = {"/health", "/ping", "/v2/health/live", "/v2/health/ready", "/openapi.json"}


def served_document(name: str, argv: list[str]) -> tuple[dict[str, Any], set[tuple[str, str]]]:
    """The document the app serves, and the (method, path) pairs its router has (HEAD aside)."""
    module = importlib.import_module(f"gateways.{name}")
    config = load(name, module.DEFAULT_PORT, module.add_arguments, ["--core", "127.0.0.1:1", *argv], {})
    app = module.make_app(config)
    routes = {
        (r.method.lower(), r.resource.canonical)
        for r in app.router.routes()
        if r.method != "HEAD" and r.resource is not None
    }
    return json.loads(app[OPENAPI_KEY]), routes


@pytest.mark.parametrize("name, argv", SETTINGS)
def test_the_document_is_valid_and_lists_exactly_the_apps_routes(name, argv):
    doc, routes = served_document(name, argv)
    validate(doc)
    documented = {(method, path) for path, item in doc["paths"].items() for method in item}
    assert documented == routes


@pytest.mark.parametrize("name", ["openai", "lmi", "triton", "ws"])
@pytest.mark.parametrize("metrics_require_key", [False, True])
def test_with_keys_every_operation_but_the_open_ones_needs_the_bearer_scheme(name, metrics_require_key):
    argv = ["--api-key", "k", *(["--metrics-require-key"] if metrics_require_key else [])]
    doc, _ = served_document(name, argv)
    validate(doc)
    public = PUBLIC | (set() if metrics_require_key else {"/metrics"})
    for path, item in doc["paths"].items():
        for operation in item.values():
            if path in public:
                assert operation["security"] == [] and "401" not in operation["responses"], path
            else:
                assert "security" not in operation and "401" in operation["responses"], path


def test_the_document_is_a_pure_function_of_the_settings():
    module = importlib.import_module("gateways.triton.openapi")
    settings = importlib.import_module("gateways.triton.config").TritonSettings(server_version="1")
    config = GatewayConfig(name="triton", core="127.0.0.1:1")
    assert module.document(config, settings) == module.document(config, settings)
    refused = module.document(config, settings)["components"]["schemas"]["GenerateRequest"]
    assert refused["additionalProperties"] is False
