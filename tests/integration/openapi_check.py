"""Checks a real response against a gateway's own `/openapi.json`: the status is listed for the
operation, the media type is listed for the status, and the body (or, for a stream, each SSE
`data:` event and each JSON line) validates against the schema the document gives for it (the
body's `schema`, or a stream's `x-itemSchema`; gateways.common.openapi). The validator is
openapi-schema-validator's OAS 3.1 one; the document itself is checked with
openapi-spec-validator first."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from openapi_schema_validator import OAS31Validator
from openapi_spec_validator import validate as validate_spec

from gateways.common.openapi import ITEM_SCHEMA

STREAM_TYPES = ("text/event-stream", "application/jsonlines")


class OpenApiDoc:
    """A gateway's document, checked as OpenAPI 3.1 on construction."""

    def __init__(self, doc: dict[str, Any]):
        validate_spec(doc)
        self.doc = doc
        self._paths = [(re.compile("^" + re.sub(r"\{[^/]+\}", "[^/]+", path) + "$"), path) for path in doc["paths"]]

    def operation(self, method: str, path: str) -> dict[str, Any]:
        """The operation serving `method` on a concrete `path` (a query string left out)."""
        path = path.split("?", 1)[0]
        for pattern, template in self._paths:
            if pattern.match(path) and method.lower() in self.doc["paths"][template]:
                return self.doc["paths"][template][method.lower()]
        raise AssertionError(f"{method} {path} is not in the document")

    def validator(self, schema: dict[str, Any]) -> OAS31Validator:
        """A validator of `schema` whose `#/components/...` references resolve in this document."""
        return OAS31Validator({**schema, "components": self.doc["components"]})

    def media(self, method: str, path: str, status: int, content_type: str) -> dict[str, Any]:
        """The media type object for a response (asserting the status and type are listed)."""
        responses = self.operation(method, path)["responses"]
        assert str(status) in responses, f"{method} {path}: status {status} is not documented ({sorted(responses)})"
        content = responses[str(status)].get("content", {})
        media = content_type.split(";")[0].strip()
        assert media in content, f"{method} {path} {status}: {media} is not documented ({sorted(content)})"
        return content[media]

    def check(
        self, method: str, path: str, status: int, content_type: str, body: bytes, headers: Mapping[str, str] = {}
    ) -> list[Any]:
        """Validate one response; returns the JSON items checked (the body, or each streamed item).

        Raises:
            AssertionError: the status or media type is undocumented, a documented header is
                missing from `headers`, or a body or item does not match its schema (the
                validator's message).
        """
        documented = self.operation(method, path)["responses"].get(str(status), {}).get("headers", {})
        missing = [name for name in documented if name not in headers]
        assert not missing, f"{method} {path} {status}: documented headers {missing} are missing"
        if not body and not content_type:
            responses = self.operation(method, path)["responses"]
            assert str(status) in responses and "content" not in responses[str(status)], (method, path, status)
            return []
        media = self.media(method, path, status, content_type)
        media_type = content_type.split(";")[0].strip()
        if media_type in STREAM_TYPES:
            schema, items = media[ITEM_SCHEMA], stream_items(media_type, body.decode())
        elif media_type == "application/json":
            schema, items = media["schema"], [json.loads(body)]
        else:
            return []
        validator = self.validator(schema)
        for item in items:
            errors = sorted(validator.iter_errors(item), key=lambda e: e.path)
            assert not errors, f"{method} {path} {status}: {item!r} does not match: {errors[0].message}"
        return items


def stream_items(media_type: str, text: str) -> list[Any]:
    """The JSON items of a stream body: each SSE `data:` payload but `[DONE]`, or each line."""
    if media_type == "text/event-stream":
        payloads = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
        return [json.loads(p) for p in payloads if p != "[DONE]"]
    return [json.loads(line) for line in text.splitlines() if line.strip()]
