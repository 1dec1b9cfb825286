"""Prometheus metrics of the core (`--metrics-port`) and of a gateway (`GET /metrics`), scraped
over HTTP on loopback and parsed with prometheus_client's own parser: the counters equal the
requests made, the histograms saw each request, the gauges follow the engine."""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from trellis.generate.v1 import generate_service_pb2 as spb
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

from core.server import start_core
from tests.conftest import core_config
from tests.integration.core_helpers import generate, request

MODEL = "mock"


async def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of `url` by (name, sorted labels)."""
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def body(text: str = "Once upon a time", max_new: int = 6) -> dict:
    return {"text": text, "stopping": {"maxNewTokens": max_new}}


@pytest.fixture(scope="module")
async def metered(start_mock_core):
    return await start_mock_core(metrics_port=0, max_batch_size=4, max_queue_size=4, mock_step_ms=5.0)


async def test_core_counters_match_the_requests(metered):
    url = f"http://127.0.0.1:{metered.metrics.port}/metrics"
    async with grpc.aio.insecure_channel(metered.address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        runs = await asyncio.gather(*(generate(stub, body(f"prompt {i}", max_new=5 + i)) for i in range(3)))
    samples = await scrape(url)
    m = {"model_name": MODEL}
    prompt = sum(r[-1].usage.prompt_tokens for r in runs)
    generated = sum(r[-1].usage.completion_tokens for r in runs)
    assert generated == 5 + 6 + 7
    assert value(samples, "trellis_core_prompt_tokens_total", **m) == prompt
    assert value(samples, "trellis_core_generation_tokens_total", **m) == generated
    assert value(samples, "trellis_core_requests_total", finish_reason="length", **m) == 3
    assert value(samples, "trellis_core_requests_total", finish_reason="error", **m) == 0
    # one TTFT per request, one inter-token gap per later token (the mock gives one per step)
    assert value(samples, "trellis_core_time_to_first_token_seconds_count", **m) == 3
    assert value(samples, "trellis_core_inter_token_latency_seconds_count", **m) == generated - 3
    assert value(samples, "trellis_core_e2e_request_latency_seconds_count", **m) == 3
    assert value(samples, "trellis_core_request_queue_time_seconds_count", **m) == 3
    assert value(samples, "trellis_core_e2e_request_latency_seconds_bucket", le="+Inf", **m) == 3
    assert value(samples, "trellis_core_time_to_first_token_seconds_bucket", le="0.001", **m) <= 3
    assert value(samples, "trellis_core_e2e_request_latency_seconds_sum", **m) > 0
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert value(samples, name, **m) == 0
    assert ("process_cpu_seconds_total", ()) in samples
    assert not [key for key in samples if "prefix_cache" in key[0]]  # the mock engine has no prefix cache


async def test_core_counts_which_path_each_output_took(metered):
    """`trellis_core_stream_outputs_total{path}`: a Generate call's outputs all take the delta
    path; the plain decode steps of a MultiplexGenerate request started with `steps` take the
    step path (its first and last tokens still travel whole)."""
    url = f"http://127.0.0.1:{metered.metrics.port}/metrics"
    m = {"model_name": MODEL}

    def paths(samples) -> tuple[float, float]:
        return tuple(value(samples, "trellis_core_stream_outputs_total", path=p, **m) for p in ("step", "delta"))

    async with grpc.aio.insecure_channel(metered.address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        start = paths(await scrape(url))
        await generate(stub, {**body("a", max_new=6), "stopping": {"maxNewTokens": 6, "ignoreEos": True}})
        after_generate = paths(await scrape(url))
        call = stub.MultiplexGenerate()
        req = request({**body("b"), "stopping": {"maxNewTokens": 6, "ignoreEos": True}})
        await call.write(spb.MultiplexGenerateRequest(starts=[spb.MultiplexStart(id=1, request=req, steps=True)]))
        entries = 0
        while True:
            msg = await call.read()
            entries += len(msg.steps.ids)
            if any(ev.HasField("status") for ev in msg.events):
                break
        call.cancel()
        end = paths(await scrape(url))
    assert after_generate[0] == start[0] and after_generate[1] > start[1]
    assert end[0] - after_generate[0] == entries == 4  # six tokens: the first and the last whole


async def test_core_gauges_follow_the_batch_and_rejections_are_counted(metered):
    url = f"http://127.0.0.1:{metered.metrics.port}/metrics"
    m = {"model_name": MODEL}
    before = value(await scrape(url), "trellis_core_admission_rejections_total", **m)
    async with grpc.aio.insecure_channel(metered.address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        # 4 run, 4 wait, the rest find the queue full
        tasks = [asyncio.create_task(generate(stub, body(max_new=60))) for _ in range(12)]
        await asyncio.sleep(0.15)
        during = await scrape(url)
        results = await asyncio.gather(*tasks, return_exceptions=True)
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert refused and all(r.code() is grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
    assert value(during, "trellis_core_num_requests_running", **m) == 4
    assert value(during, "vllm:num_requests_running", **m) == 4
    assert value(during, "vllm:num_requests_waiting", **m) == 12 - 4 - len(refused)
    assert value(during, "vllm:kv_cache_usage_perc", **m) == 1.0
    assert value(during, "trellis_core_batch_size", **m) == 4
    after = await scrape(url)
    assert value(after, "trellis_core_admission_rejections_total", **m) == before + len(refused)


async def test_core_counts_cancelled_requests_and_sessions(metered):
    url = f"http://127.0.0.1:{metered.metrics.port}/metrics"
    m = {"model_name": MODEL}
    before = value(await scrape(url), "trellis_core_requests_total", finish_reason="cancelled", **m)
    async with grpc.aio.insecure_channel(metered.address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        session = {"text": "keep this", "sessionId": "metrics-s1", "stopping": {"maxNewTokens": 3}}
        await generate(stub, session)
        call = stub.Generate(request(body(max_new=500)))
        async for _ in call:
            break
        call.cancel()
    for _ in range(100):
        after = await scrape(url)
        if value(after, "trellis_core_requests_total", finish_reason="cancelled", **m) == before + 1:
            break
        await asyncio.sleep(0.02)
    assert value(after, "trellis_core_requests_total", finish_reason="cancelled", **m) == before + 1
    assert value(after, "trellis_core_sessions", **m) >= 1
    assert value(after, "trellis_core_session_tokens", **m) > 0


@pytest.fixture(scope="module")
async def hf_metered(tiny_model_dir):
    """A core on the HF engine (in its own process, prefix cache on) with a metrics port."""
    server = await start_core(core_config(tiny_model_dir, metrics_port=0))
    yield server
    await server.stop(0)


async def test_core_counts_prefix_cache_queries_hits_and_blocks(hf_metered):
    """vLLM's counters in tokens: every prompt looked up counts its tokens as queries, the
    tokens whose KV was reused as hits (= usage.cached_tokens); a prompt asking for prompt
    logprobs skips the lookup. The gauge counts the blocks held."""
    url = f"http://127.0.0.1:{hf_metered.metrics.port}/metrics"
    m = {"model_name": "tiny"}
    text = "A long road runs through the valley past the mill and the old stone bridge. " * 3
    async with grpc.aio.insecure_channel(hf_metered.address) as channel:
        stub = spb_grpc.GenerateServiceStub(channel)
        first = await generate(stub, body(text, max_new=2))
        second = await generate(stub, body(text, max_new=2))
        with_logprobs = {**body(text, max_new=2), "output": {"promptLogprobs": 1}}
        third = await generate(stub, with_logprobs)
    prompt = first[-1].usage.prompt_tokens
    reused = (prompt - 1) // 16 * 16
    assert (first[-1].usage.cached_tokens, second[-1].usage.cached_tokens) == (0, reused)
    assert third[-1].usage.cached_tokens == 0
    samples = await scrape(url)
    for prefix in ("trellis_core", "vllm:"):
        sep = "_" if prefix == "trellis_core" else ""
        assert value(samples, f"{prefix}{sep}prefix_cache_queries_total", **m) == 2 * prompt
        assert value(samples, f"{prefix}{sep}prefix_cache_hits_total", **m) == reused
    # the prompt's blocks and those of its first generated token
    assert value(samples, "trellis_core_prefix_cache_blocks", **m) == (prompt + 1) // 16


async def test_core_without_metrics_port_serves_none(mock_core):
    assert mock_core.metrics is None


async def test_core_metrics_port_in_use_fails_the_start(start_mock_core, metered):
    with pytest.raises(OSError, match="cannot serve metrics"):
        await start_mock_core(metrics_port=metered.metrics.port)


@pytest.fixture(scope="module")
async def gateway(start_gateway, metered):
    return await start_gateway("openai", core=metered.address)


async def test_gateway_counts_requests_by_route_and_status(gateway):
    client = openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)
    hi = [{"role": "user", "content": "hello"}]
    for _ in range(2):
        await client.chat.completions.create(model=MODEL, messages=hi, max_tokens=3)
    stream = await client.chat.completions.create(model=MODEL, messages=hi, max_tokens=3, stream=True)
    chunks = [c async for c in stream]
    assert chunks
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=MODEL, messages=hi, temperature=-1)
    await client.close()
    async with aiohttp.ClientSession() as s, s.get(f"{gateway}/nowhere") as r:
        assert r.status == 404
    samples = await scrape(f"{gateway}/metrics")
    route = "/v1/chat/completions"
    assert value(samples, "trellis_gateway_requests_total", route=route, method="POST", status="200") == 3
    assert value(samples, "trellis_gateway_requests_total", route=route, method="POST", status="400") == 1
    assert value(samples, "trellis_gateway_requests_total", route="unmatched", method="GET", status="404") == 1
    assert value(samples, "trellis_gateway_time_to_first_token_seconds_count", route=route) == 1
    assert value(samples, "trellis_gateway_e2e_request_latency_seconds_count", route=route) == 4
    assert value(samples, "trellis_gateway_active_streams") == 0


async def test_gateway_counts_client_disconnects_and_active_streams(gateway):
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "stream": True}
    async with aiohttp.ClientSession() as s:
        r = await s.post(f"{gateway}/v1/chat/completions", json=payload)
        await r.content.readline()
        during = await scrape(f"{gateway}/metrics")
        r.close()
    assert value(during, "trellis_gateway_active_streams") == 1
    for _ in range(100):
        after = await scrape(f"{gateway}/metrics")
        if ("trellis_gateway_client_disconnects_total", (("route", "/v1/chat/completions"),)) in after:
            break
        await asyncio.sleep(0.02)
    assert value(after, "trellis_gateway_client_disconnects_total", route="/v1/chat/completions") == 1
    assert value(after, "trellis_gateway_active_streams") == 0
