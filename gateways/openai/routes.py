"""aiohttp handlers of the OpenAI gateway: `POST /v1/chat/completions`, `POST /v1/completions`,
`POST /v1/responses` with `GET`/`DELETE /v1/responses/{id}` and `GET
/v1/responses/{id}/input_items`, `GET /v1/models`, `GET /v1/models/{model}`, `GET /health`,
vLLM's LoRA routes `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (refused
unless the core runs with --enable-lora-management; docs/lora.md), and Anthropic's
`POST /v1/messages` and `POST /v1/messages/count_tokens` (gateways.openai.messages_route).

The chat completions path is gateways.common.chat.route.handle_chat, with OpenAI's framing
(SSE, then `data: [DONE]`) and finish reasons.
"""

from __future__ import annotations

from aiohttp import web

from gateways.common import framing as wire
from gateways.common.app import core_client, read_json
from gateways.common.chat import errors
from gateways.common.chat.completion_route import handle_completion
from gateways.common.chat.route import handle_chat
from gateways.common.chat.schema import any_model
from gateways.common.status import GatewayError
from gateways.openai import messages_errors, responses_route, translate
from gateways.openai.config import SETTINGS_KEY
from gateways.openai.messages_route import handle_count_tokens, handle_messages
from gateways.openai.responses_store import make_store


def add_routes(app: web.Application) -> None:
    """Register the gateway's routes on `app`."""
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    settings = app[SETTINGS_KEY]
    store = make_store(settings.response_store, settings.response_store_max, settings.response_store_ttl)
    app[responses_route.STORE_KEY] = store

    async def close_store(app: web.Application) -> None:
        await store.close()

    app.on_cleanup.append(close_store)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/responses/{response_id}", responses_route.handle_retrieve)
    app.router.add_delete("/v1/responses/{response_id}", responses_route.handle_delete)
    app.router.add_get("/v1/responses/{response_id}/input_items", responses_route.handle_input_items)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", retrieve_model)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """`POST /v1/chat/completions` (OpenAI SSE framing and finish reasons)."""
    try:
        body = await read_json(request, json_only=True)
    except GatewayError as err:
        return errors.render_before_stream(err)
    settings = request.app[SETTINGS_KEY]
    if settings.accept_any_model:
        body = any_model(body)
    return await handle_chat(
        request,
        body,
        reasoning_parser=settings.reasoning_parser,
        fill_context=settings.default_max_tokens == "context",
    )


async def completions(request: web.Request) -> web.StreamResponse:
    """`POST /v1/completions` (OpenAI's legacy completions; gateways.common.chat.completion_route)."""
    try:
        body = await read_json(request)
    except GatewayError as err:
        return errors.render_before_stream(err)
    if request.app[SETTINGS_KEY].accept_any_model:
        body = any_model(body)
    return await handle_completion(request, body)


async def messages(request: web.Request) -> web.StreamResponse:
    """`POST /v1/messages` (Anthropic's Messages API; gateways.openai.messages_route)."""
    try:
        body = await read_json(request, json_only=True)
    except GatewayError as err:
        return messages_errors.render_before_stream(err)
    return await handle_messages(request, body, reasoning_parser=request.app[SETTINGS_KEY].reasoning_parser)


async def count_tokens(request: web.Request) -> web.Response:
    """`POST /v1/messages/count_tokens` (Anthropic's token counting)."""
    try:
        body = await read_json(request, json_only=True)
    except GatewayError as err:
        return messages_errors.render_before_stream(err)
    return await handle_count_tokens(request, body)


async def responses(request: web.Request) -> web.StreamResponse:
    """`POST /v1/responses` (OpenAI's Responses API; gateways.openai.responses_route)."""
    try:
        body = await read_json(request, json_only=True)
    except GatewayError as err:
        return errors.render_before_stream(err)
    reasoning_parser = request.app[SETTINGS_KEY].reasoning_parser
    return await responses_route.handle_create(request, body, reasoning_parser=reasoning_parser)


async def list_models(request: web.Request) -> web.Response:
    """`GET /v1/models`: the served model and its LoRA adapters in OpenAI's list shape."""
    client = core_client(request)
    try:
        info = await client.model_info()
        adapters = (await client.list_adapters()).adapters
    except GatewayError as err:
        return errors.render_before_stream(err)
    created = request.app[SETTINGS_KEY].created
    return web.json_response(translate.model_list(info, created, adapters), dumps=wire.dumps)


async def retrieve_model(request: web.Request) -> web.Response:
    """`GET /v1/models/{model}`: the card of the served model (by its name or an alias) or of
    an adapter; any other name is 404, or the served model's card with --accept-any-model."""
    client = core_client(request)
    name = request.match_info["model"]
    try:
        info = await client.model_info()
        created = request.app[SETTINGS_KEY].created
        if name == info.model_name or name in info.model_aliases:
            return web.json_response(translate.model_card(info, created, name), dumps=wire.dumps)
        for adapter in (await client.list_adapters()).adapters:
            if adapter.name == name:
                return web.json_response(translate.adapter_card(adapter, info.model_name, created), dumps=wire.dumps)
    except GatewayError as err:
        return errors.render_before_stream(err)
    if request.app[SETTINGS_KEY].accept_any_model:
        return web.json_response(translate.model_card(info, created), dumps=wire.dumps)
    return errors.error_response(
        404,
        f"The model '{name}' does not exist; this server serves '{info.model_name}'.",
        param="model",
        code="model_not_found",
    )


async def load_lora_adapter(request: web.Request) -> web.Response:
    """`POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}` (vLLM's route), on every core
    (gateways.common.adapter_admin): 200 with vLLM's success text, or the refusal in OpenAI's
    error shape (400 while management is off or for a bad adapter, 404 for a path without one,
    409 for a name taken)."""
    try:
        name, path = translate.adapter_request(await read_json(request, json_only=True), load=True)
        await core_client(request).load_adapter(name, path)
    except GatewayError as err:
        return errors.render_before_stream(err)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """`POST /v1/unload_lora_adapter` `{"lora_name"}` (vLLM's route): 200 with vLLM's success
    text, or the core's refusal in OpenAI's error shape (404 for an unknown adapter)."""
    try:
        name, _ = translate.adapter_request(await read_json(request, json_only=True), load=False)
        await core_client(request).unload_adapter(name)
    except GatewayError as err:
        return errors.render_before_stream(err)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def health(request: web.Request) -> web.Response:
    """`GET /health`: 200 while the core reports SERVING, 503 otherwise."""
    if await core_client(request).serving():
        return web.json_response({"status": "serving"})
    return web.json_response({"status": "not_serving"}, status=503)
