"""DJL-Serving's adapter management routes on the LMI gateway (docs.djl.ai, "DJL Serving
Adapters Management API"), over the cores' ListAdapters, LoadAdapter and UnloadAdapter (every
core the gateway knows: gateways.common.adapter_admin):

- `GET /models/{model_name}/adapters` (`limit`, default 100, and `next_page_token`, an
  offset): `{"adapters": [{"name", "src"}], "nextPageToken"?}`;
- `GET /models/{model_name}/adapters/{adapter_name}`: `[{"name", "src"}]`;
- `POST /models/{model_name}/adapters?name=..&src=..`: `{"status": "Adapter NAME registered"}`;
- `DELETE /models/{model_name}/adapters/{adapter_name}`: `{"status": "Adapter NAME unregistered"}`.

Errors are DJL's management error shape, `{"code": status, "type": exception name, "message"}`
(DJL's ErrorResponse): 404 for a model that is not served or an unknown adapter, 400 for a bad
query or while the core runs without --enable-lora-management, 409 for a name taken. Requests
then select an adapter with `"adapters": "NAME"` in the body (gateways.lmi.schema).
"""

from __future__ import annotations

from typing import Any

import grpc
from aiohttp import web

from gateways.common.app import core_client
from gateways.common.framing import dumps
from gateways.common.status import GatewayError

#: DJL's exception names by HTTP status, for the `type` field.
_TYPES = {400: "BadRequestException", 404: "ModelNotFoundException", 409: "ConflictException"}
PAGE = 100


def add_routes(app: web.Application) -> None:
    """Register the adapter management routes on `app`."""
    app.router.add_get("/models/{model_name}/adapters", list_adapters)
    app.router.add_post("/models/{model_name}/adapters", register_adapter)
    app.router.add_get("/models/{model_name}/adapters/{adapter_name}", describe_adapter)
    app.router.add_delete("/models/{model_name}/adapters/{adapter_name}", unregister_adapter)


def error_response(err: GatewayError) -> web.Response:
    """`{"code", "type", "message"}` with the error's HTTP status."""
    status = err.http_status()
    body = {"code": status, "type": _TYPES.get(status, "ServiceUnavailableException"), "message": err.message}
    return web.json_response(body, status=status, dumps=dumps)


def adapter_record(adapter: Any) -> dict[str, str]:
    """One adapter as DJL lists it: `{"name", "src"}`."""
    return {"name": adapter.name, "src": adapter.path}


def page(records: list[dict[str, str]], limit: str | None, token: str | None) -> dict[str, Any]:
    """One page of `records` (DJL's `limit` and `next_page_token`, the latter an offset).

    Raises:
        GatewayError: INVALID_ARGUMENT for a limit or token that is not a non-negative integer
            (a limit of at least 1).
    """
    try:
        size = PAGE if limit is None else int(limit)
        start = 0 if token is None else int(token)
    except ValueError:
        raise GatewayError(
            grpc.StatusCode.INVALID_ARGUMENT, "limit and next_page_token must be integers.", param="limit"
        ) from None
    if size < 1 or start < 0:
        raise GatewayError(
            grpc.StatusCode.INVALID_ARGUMENT, "limit must be at least 1 and next_page_token at least 0.", param="limit"
        )
    out: dict[str, Any] = {"adapters": records[start : start + size]}
    if start + size < len(records):
        out["nextPageToken"] = str(start + size)
    return out


async def _check_model(request: web.Request) -> None:
    """Raise NOT_FOUND unless the path's model is the served one."""
    name = request.match_info["model_name"]
    info = await core_client(request).model_info()
    if name != info.model_name:
        raise GatewayError(
            grpc.StatusCode.NOT_FOUND, f"Model not found: '{name}'; this server serves '{info.model_name}'."
        )


async def list_adapters(request: web.Request) -> web.Response:
    """`GET /models/{model_name}/adapters`."""
    try:
        await _check_model(request)
        adapters = (await core_client(request).list_adapters()).adapters
        body = page(
            [adapter_record(a) for a in adapters], request.query.get("limit"), request.query.get("next_page_token")
        )
    except GatewayError as err:
        return error_response(err)
    return web.json_response(body, dumps=dumps)


async def describe_adapter(request: web.Request) -> web.Response:
    """`GET /models/{model_name}/adapters/{adapter_name}`."""
    name = request.match_info["adapter_name"]
    try:
        await _check_model(request)
        for adapter in (await core_client(request).list_adapters()).adapters:
            if adapter.name == name:
                return web.json_response([adapter_record(adapter)], dumps=dumps)
        raise GatewayError(grpc.StatusCode.NOT_FOUND, f"Adapter not found: '{name}'.")
    except GatewayError as err:
        return error_response(err)


async def register_adapter(request: web.Request) -> web.Response:
    """`POST /models/{model_name}/adapters?name=..&src=..`."""
    name, src = request.query.get("name"), request.query.get("src")
    try:
        await _check_model(request)
        if not name or not src:
            raise GatewayError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "Register an adapter with the query parameters name and src.",
                param="name" if not name else "src",
            )
        await core_client(request).load_adapter(name, src)
    except GatewayError as err:
        return error_response(err)
    return web.json_response({"status": f"Adapter {name} registered"}, dumps=dumps)


async def unregister_adapter(request: web.Request) -> web.Response:
    """`DELETE /models/{model_name}/adapters/{adapter_name}`."""
    name = request.match_info["adapter_name"]
    try:
        await _check_model(request)
        await core_client(request).unload_adapter(name)
    except GatewayError as err:
        return error_response(err)
    return web.json_response({"status": f"Adapter {name} unregistered"}, dumps=dumps)


def openapi_paths(error: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI paths of these routes; `error`: the schema of the management error."""
    record = {
        "type": "object",
        "required": ["name", "src"],
        "properties": {"name": {"type": "string"}, "src": {"type": "string"}},
    }
    model = {"name": "model_name", "in": "path", "required": True, "schema": {"type": "string"}}
    adapter = {"name": "adapter_name", "in": "path", "required": True, "schema": {"type": "string"}}

    def query(name: str, description: str, required: bool = False) -> dict[str, Any]:
        return {
            "name": name,
            "in": "query",
            "required": required,
            "schema": {"type": "string"},
            "description": description,
        }

    def answer(schema: dict[str, Any], statuses: tuple[int, ...]) -> dict[str, Any]:
        out: dict[str, Any] = {"200": {"description": "OK", "content": {"application/json": {"schema": schema}}}}
        for status in statuses:
            out[str(status)] = {"description": str(status), "content": {"application/json": {"schema": error}}}
        return out

    status = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
    listing = {
        "type": "object",
        "required": ["adapters"],
        "properties": {"adapters": {"type": "array", "items": record}, "nextPageToken": {"type": "string"}},
    }
    return {
        "/models/{model_name}/adapters": {
            "get": {
                "operationId": "listAdapters",
                "summary": "The registered LoRA adapters (DJL's adapters management API).",
                "parameters": [
                    model,
                    query("limit", "Adapters per page (default 100)."),
                    query("next_page_token", "Where the page starts (a previous page's nextPageToken)."),
                ],
                "responses": answer(listing, (400, 404, 503)),
            },
            "post": {
                "operationId": "registerAdapter",
                "summary": "Register a PEFT LoRA adapter (the core needs --enable-lora-management).",
                "parameters": [
                    model,
                    query("name", "The adapter's name.", True),
                    query("src", "The adapter's directory on the core.", True),
                ],
                "responses": answer(status, (400, 404, 409, 503)),
            },
        },
        "/models/{model_name}/adapters/{adapter_name}": {
            "get": {
                "operationId": "describeAdapter",
                "summary": "One registered adapter.",
                "parameters": [model, adapter],
                "responses": answer({"type": "array", "items": record}, (404, 503)),
            },
            "delete": {
                "operationId": "unregisterAdapter",
                "summary": "Unregister an adapter (the core needs --enable-lora-management).",
                "parameters": [model, adapter],
                "responses": answer(status, (400, 404, 503)),
            },
        },
    }


#: The management error's schema.
ERROR_SCHEMA = {
    "type": "object",
    "required": ["code", "type", "message"],
    "properties": {"code": {"type": "integer"}, "type": {"type": "string"}, "message": {"type": "string"}},
}
