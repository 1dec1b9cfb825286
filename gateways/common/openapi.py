"""`GET /openapi.json`: the OpenAPI 3.1.0 document of a gateway, and the pieces every gateway's
description is built from.

Each gateway has an `openapi.py` next to its routes with one pure function,
`document(config, settings) -> dict`, which `make_gateway_app` calls once at start-up; the
document is encoded once and served as is (`add_openapi`). Request bodies come from the
gateway's pydantic models (`Components.model`: `model_json_schema(ref_template=REF)`, its
`$defs` collected into `components.schemas`); bodies built by hand (responses, Triton's open
parameter object) are written out in the gateway's module, from the schema section its
docstring names.

Streams: OpenAPI 3.1 has no field for the schema of one event or line of a stream (3.2 adds
`itemSchema` to the Media Type Object). A streamed media type here gives the schema of one item,
the JSON of one SSE `data:` event or one JSON line, under the extension `x-itemSchema`; an SSE
media type's `schema` describes one event with that JSON as its `data` (`stream_content`).

Every document has `/metrics` (Prometheus text) and `/openapi.json`. With --api-key, the
document declares the bearer scheme (`components.securitySchemes.bearer`, RFC 6750), requires it
for every operation, and lists the open routes (health, `/openapi.json`, `/metrics` unless
--metrics-require-key) with `security: []`; those operations have no 401.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from gateways.common.config import GatewayConfig
from gateways.common.framing import SSE_CONTENT_TYPE, dumps

OPENAPI_PATH = "/openapi.json"
OPENAPI_VERSION = "3.1.0"
REF = "#/components/schemas/{model}"
#: Where a streamed media type keeps the schema of one item (module docstring).
ITEM_SCHEMA = "x-itemSchema"

Schema = dict[str, Any]

#: The reason phrase of each status a document lists, its response's description.
DESCRIPTIONS = {
    400: "Bad request: a field has the wrong shape, type or value.",
    401: "Missing or invalid API key (`Authorization: Bearer <key>`); `WWW-Authenticate: Bearer` is set.",
    404: "Not found: the model named is not the served one.",
    413: "The request body is larger than --max-body-bytes.",
    415: "The request body declares a Content-Type other than JSON.",
    424: "Malformed payload (DJL's status for an input the handler cannot read).",
    426: "Upgrade required: the route speaks WebSocket only.",
    429: "The model server's queue is full; retry after `Retry-After` seconds.",
    500: "An unexpected failure in the gateway or the engine.",
    503: "The model server cannot be reached, is starting or draining; retry after `Retry-After` seconds.",
    504: "The request did not finish within --request-timeout, or waited in the queue past --queue-timeout.",
}

#: The statuses a generation route answers before its first byte (the gRPC code table,
#: gateways.common.status.GRPC_TO_HTTP), besides its schema's own ones.
GENERATION_ERRORS = (400, 404, 413, 429, 500, 503, 504)

#: `Retry-After` on 429 and 503 (gateways.common.app RETRY_STATUSES).
RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer"}}}


def ref(name: str) -> Schema:
    """A reference to `components.schemas[name]`."""
    return {"$ref": REF.format(model=name)}


class Components:
    """The `components.schemas` of one document, filled as operations are described."""

    def __init__(self) -> None:
        self.schemas: dict[str, Schema] = {}

    def model(self, model: type[BaseModel], *, extra: Mapping[str, Schema] | None = None) -> Schema:
        """Add a pydantic model's validation schema (and the models it uses) and return a
        reference to it.

        Args:
            model: the request model.
            extra: properties the route accepts besides the model's fields (e.g. OpenAI fields
                that are read and ignored), added to the model's own schema.
        """
        schema = model.model_json_schema(ref_template=REF, mode="validation")
        self.schemas.update(schema.pop("$defs", {}))
        if extra:
            schema["properties"] = {**schema["properties"], **extra}
        self.schemas[model.__name__] = schema
        return ref(model.__name__)

    def add(self, name: str, schema: Schema) -> Schema:
        """Add a hand-written schema under `name` and return a reference to it."""
        self.schemas[name] = schema
        return ref(name)


def json_content(schema: Schema) -> dict[str, Any]:
    """`content` of an `application/json` body."""
    return {"application/json": {"schema": schema}}


def stream_content(media_type: str, item: Schema, *, done: bool = False) -> dict[str, Any]:
    """`content` of a streamed body, `item` being the schema of one SSE `data:` event's JSON or
    one JSON line, under `x-itemSchema` (module docstring).

    For `text/event-stream`, `schema` describes one event, as tools read it before OpenAPI 3.2
    (schemathesis, 3.2's own SSE example): `{"data": <text>}` whose JSON (`contentMediaType`)
    matches `item` (`contentSchema`), or is `[DONE]` when `done` (OpenAI's end of stream).
    For JSON lines, `schema` is the body as text.
    """
    if media_type != SSE_CONTENT_TYPE:
        schema: Schema = {"type": "string", "description": f"JSON lines; each line matches {ITEM_SCHEMA}."}
        return {media_type: {"schema": schema, ITEM_SCHEMA: item}}
    data: Schema = {"type": "string", "contentMediaType": "application/json", "contentSchema": item}
    if done:
        data = {"anyOf": [{"const": "[DONE]"}, data]}
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {"data": data, "event": {"type": "string"}, "id": {"type": "string"}},
        "description": "One Server-Sent Event.",
    }
    return {media_type: {"schema": event, ITEM_SCHEMA: item}}


def request_body(schema: Schema, *, description: str = "") -> dict[str, Any]:
    """A required `application/json` request body."""
    body: dict[str, Any] = {"required": True, "content": json_content(schema)}
    if description:
        body["description"] = description
    return body


def responses(ok: dict[str, Any] | None, errors: Mapping[int, Schema], *, ok_description: str = "OK") -> dict[str, Any]:
    """A `responses` object: 200 with `ok` as its content (None: an empty body), and each error
    status with its body schema (application/json); 429 and 503 carry `Retry-After`."""
    out: dict[str, Any] = {"200": {"description": ok_description}}
    if ok is not None:
        out["200"]["content"] = ok
    for status in sorted(errors):
        response: dict[str, Any] = {"description": DESCRIPTIONS.get(status, str(status))}
        response["content"] = json_content(errors[status])
        if status in (429, 503):
            response["headers"] = RETRY_AFTER
        out[str(status)] = response
    return out


def errors_as(schema: Schema, statuses: Iterable[int]) -> dict[int, Schema]:
    """Every status in `statuses` with the same error body."""
    return {status: schema for status in statuses}


def _status_object(word: str) -> Schema:
    """A health route's body, `{"status": word}`."""
    return {"type": "object", "required": ["status"], "properties": {"status": {"const": word}}}


def health_path(operation_id: str, serving: str, not_serving: str) -> dict[str, Any]:
    """A health route: 200 `{"status": serving}` while the core reports SERVING, else 503
    `{"status": not_serving}`."""
    return {
        "get": {
            "operationId": operation_id,
            "summary": "200 while the core reports SERVING, 503 otherwise.",
            "responses": responses(json_content(_status_object(serving)), {503: _status_object(not_serving)}),
        }
    }


def path_parameter(name: str, description: str) -> dict[str, Any]:
    """A required string path parameter."""
    return {"name": name, "in": "path", "required": True, "description": description, "schema": {"type": "string"}}


def document(
    config: GatewayConfig,
    *,
    title: str,
    description: str,
    paths: dict[str, Any],
    components: Components,
    error: Schema,
    open_paths: Iterable[str] = (),
) -> dict[str, Any]:
    """The whole OpenAPI 3.1.0 document of a gateway.

    Adds `GET /metrics` and `GET /openapi.json`, and the API-key scheme when `config.api_key`
    is set (module docstring): every operation then lists 401 with `error` as its body, except
    those on `open_paths` (the gateway's health routes), `/openapi.json`, and `/metrics` unless
    --metrics-require-key.

    Args:
        config: the gateway's common settings (API keys).
        title, description: `info`.
        paths: the gateway's own routes (`paths` object).
        components: the schemas its operations refer to.
        error: the schema of the gateway's HTTP-level error body (401, 500).
        open_paths: routes that need no key.
    """
    paths = dict(paths)
    paths["/metrics"] = {
        "get": {
            "operationId": "metrics",
            "summary": "Prometheus metrics of this gateway.",
            "responses": responses(
                {"text/plain": {"schema": {"type": "string"}}},
                {},
                ok_description="The Prometheus text exposition format, version 0.0.4.",
            ),
        }
    }
    paths[OPENAPI_PATH] = {
        "get": {
            "operationId": "openapi",
            "summary": "This document.",
            "responses": responses(json_content({"type": "object"}), {}),
        }
    }
    doc: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {"title": title, "version": "0.1.0", "description": description},
        "paths": paths,
        "components": {"schemas": dict(sorted(components.schemas.items()))},
    }
    if config.api_key:
        public = {*open_paths, OPENAPI_PATH} | (set() if config.metrics_require_key else {"/metrics"})
        doc["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer", "description": "One of the gateway's --api-key keys."}
        }
        doc["security"] = [{"bearer": []}]
        for path, item in paths.items():
            for operation in item.values():
                if not isinstance(operation, dict) or "responses" not in operation:
                    continue
                if path in public:
                    operation["security"] = []
                else:
                    operation["responses"]["401"] = {
                        "description": DESCRIPTIONS[401],
                        "headers": {"WWW-Authenticate": {"schema": {"type": "string"}}},
                        "content": json_content(error),
                    }
    return doc


OPENAPI_KEY = web.AppKey("openapi_document", bytes)


def add_openapi(app: web.Application, doc: dict[str, Any]) -> None:
    """Serve `doc` on `GET /openapi.json` (encoded once, here)."""
    app[OPENAPI_KEY] = dumps(doc).encode()
    app.router.add_get(OPENAPI_PATH, openapi_route)


async def openapi_route(request: web.Request) -> web.Response:
    """`GET /openapi.json`: the gateway's OpenAPI document."""
    return web.Response(body=request.app[OPENAPI_KEY], content_type="application/json")
