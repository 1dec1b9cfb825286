"""KV-cache block reuse on both TensorRT-LLM engines, against the doubles of each release era,
through the real core, gRPC and Prometheus on loopback.

What each era reports (core/engine/trtllm/reuse.py cites the upstream source of each):
  * executor "1.0" and "1.3": `Result.request_perf_metrics.kv_cache_metrics.num_reused_blocks`
    (bindings from 0.16) and KV cache events; reused tokens = reused blocks x the engine's
    tokens_per_block, at most the prompt length - 1;
  * executor "0.11" and "0.15": nothing per request, so `cached_tokens` is 0 however much the
    runtime reused;
  * LLM API 1.0 and the 1.1 pre-release: `CompletionOutput.request_perf_metrics`
    (`SamplingParams(return_perf_metrics=True)`); 1.2 and later also the exact
    `RequestOutput.cached_tokens` (PR #7637).
"""

from __future__ import annotations

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from trellis.generate.v1 import generate_service_pb2 as spb

from core.engine.trtllm import executor as trtllm
from core.engine.trtllm import llm as trtllm_llm
from tests.fakes import trtllm_executor
from tests.fakes import trtllm_llm as fake_llm
from tests.fakes.trtllm_harness import collect, make_engine_output, serve_engine
from tests.integration.core_helpers import request_of as request

TEXT = "A long road runs through the valley past the mill and the old stone bridge. " * 2
BLOCK = 8  # tokens_per_block of the executor tests' engine


@pytest.fixture
def engine_out(tmp_path, tiny_model_dir):
    def make(**limits):
        return make_engine_output(tmp_path / "out", tiny_model_dir, **limits)

    return make


async def scrape(port: int) -> dict[str, float]:
    """The core's samples by name (the model label is the only one here)."""
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
        text = await r.text()
    return {sample.name: sample.value for family in text_string_to_metric_families(text) for sample in family.samples}


async def twice(stub, text: str = TEXT) -> tuple[list, list]:
    """The same prompt twice, one after the other (the first stores its blocks)."""
    first = await collect(stub, request(text, stopping={"max_new_tokens": 3}))
    second = await collect(stub, request(text, stopping={"max_new_tokens": 3}))
    return first, second


# --------------------------------------------------------------------------------- executor


@pytest.mark.parametrize("era", ["1.0", "1.3"])
async def test_executor_reports_reused_tokens_and_counts_them(monkeypatch, tokenizer, engine_out, era):
    """The second request reuses the first one's full blocks over its first len - 1 tokens:
    usage.cached_tokens, the prefix cache counters (vLLM's names too) and the blocks gauge,
    which the KV cache events give (stored, none removed)."""
    tl = trtllm_executor.install(monkeypatch, era)
    out = engine_out(tokens_per_block=BLOCK)
    async with serve_engine(trtllm.build, out, tokenizer, engine="trtllm", metrics_port=0) as (server, stub):
        first, second = await twice(stub)
        prompt = first[-1].usage.prompt_tokens
        reused = (prompt - 1) // BLOCK * BLOCK
        assert prompt > 2 * BLOCK and reused > 0
        assert (first[-1].usage.cached_tokens, second[-1].usage.cached_tokens) == (0, reused)
        executor = server.engine._executor
        sent = executor.fake_requests[max(executor.fake_requests)]
        assert sent.output_config.return_perf_metrics is True
        assert executor.config.kv_cache_config.enable_block_reuse is True
        assert executor.config.kv_cache_config.event_buffer_max_size > 0
        assert tl.fake_era == era
        samples = await scrape(server.metrics.port)
    for name in ("trellis_core_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"):
        assert samples[name] == 2 * prompt
    for name in ("trellis_core_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"):
        assert samples[name] == reused
    assert samples["trellis_core_prefix_cache_blocks"] == prompt // BLOCK  # stored once, reused after


async def test_executor_counts_removed_blocks_from_events(monkeypatch, tokenizer, engine_out):
    """Blocks evicted from the reuse tree arrive as KVCacheRemovedData events and leave the
    gauge; a later request finds nothing to reuse."""
    trtllm_executor.install(monkeypatch, "1.0")
    async with serve_engine(trtllm.build, engine_out(tokens_per_block=BLOCK), tokenizer, engine="trtllm") as (
        server,
        stub,
    ):
        executor = server.engine._executor
        executor.fake_reuse_capacity = 2
        _first, second = await twice(stub)
        assert second[-1].usage.cached_tokens == 0  # only the last 2 blocks were kept: no chain from the start
        other = await collect(stub, request("Something else entirely, and short.", stopping={"max_new_tokens": 2}))
        assert other[-1].usage.cached_tokens == 0
        await collect(stub, request("hello", stopping={"max_new_tokens": 1}))  # one more drain of the events
        stats = server.engine.stats().prefix_cache
        assert stats is not None and stats.blocks == 2
        assert server.engine._reuse.events >= 3  # created, stored, removed


@pytest.mark.parametrize("era", ["0.11", "0.15"])
async def test_executor_without_perf_metrics_reports_zero(monkeypatch, tokenizer, engine_out, era, caplog):
    """Releases without request perf metrics report no reuse: cached_tokens is 0 and the
    counters stay at 0, never an estimate."""
    trtllm_executor.install(monkeypatch, era)
    caplog.set_level("INFO")
    out = engine_out(tokens_per_block=BLOCK)
    async with serve_engine(trtllm.build, out, tokenizer, engine="trtllm", metrics_port=0) as (server, stub):
        first, second = await twice(stub)
        assert (first[-1].usage.cached_tokens, second[-1].usage.cached_tokens) == (0, 0)
        sent = server.engine._executor.fake_requests
        assert "return_perf_metrics" not in vars(sent[max(sent)].output_config) or not (
            sent[max(sent)].output_config.return_perf_metrics
        )
        samples = await scrape(server.metrics.port)
    assert samples["vllm:prefix_cache_queries_total"] == 0 and samples["vllm:prefix_cache_hits_total"] == 0
    assert "per-request KV-cache reuse is not reported" in caplog.text


async def test_executor_engine_without_block_size_reports_zero(monkeypatch, tokenizer, engine_out):
    """An engine whose config.json does not record tokens_per_block gives reused blocks but no
    way to turn them into tokens: 0, and no perf metrics asked for."""
    trtllm_executor.install(monkeypatch, "1.0")
    async with serve_engine(trtllm.build, engine_out(tokens_per_block=None), tokenizer, engine="trtllm") as (
        server,
        stub,
    ):
        _first, second = await twice(stub)
        assert second[-1].usage.cached_tokens == 0
        sent = server.engine._executor.fake_requests
        assert sent[max(sent)].output_config.return_perf_metrics is False


@pytest.mark.parametrize("switch", [{"prefix_cache": False}, {"trt_enable_block_reuse": False}])
async def test_executor_reuse_off_by_either_switch(monkeypatch, tokenizer, engine_out, switch):
    """--no-prefix-cache (every engine) or --no-trt-enable-block-reuse turns reuse off: the
    executor gets enable_block_reuse=False and no event buffer, and reports nothing."""
    trtllm_executor.install(monkeypatch, "1.0")
    async with serve_engine(trtllm.build, engine_out(tokens_per_block=BLOCK), tokenizer, engine="trtllm", **switch) as (
        server,
        stub,
    ):
        _first, second = await twice(stub)
        assert second[-1].usage.cached_tokens == 0
        config = server.engine._executor.config.kv_cache_config
        assert config.enable_block_reuse is False and config.event_buffer_max_size == 0
        assert server.engine.stats().prefix_cache is None
        assert server.engine._executor.get_kv_cache_event_manager() is None


async def test_executor_reuse_reaches_the_openai_usage(monkeypatch, tokenizer, engine_out, start_gateway):
    """The OpenAI gateway renders the core's cached tokens as usage.prompt_tokens_details."""
    trtllm_executor.install(monkeypatch, "1.0")
    async with serve_engine(trtllm.build, engine_out(tokens_per_block=BLOCK), tokenizer, engine="trtllm") as (
        server,
        _stub,
    ):
        url = await start_gateway("openai", core=server.address)
        ids = tokenizer.encode(TEXT)
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
            await client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0)
            again = await client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // BLOCK * BLOCK


# --------------------------------------------------------------------------------- LLM API


@pytest.mark.parametrize(
    ("version", "exact"), [("1.0.0", False), ("1.1.0rc0", False), ("1.2.0", True), ("1.4.0", True)]
)
async def test_llm_reports_reused_tokens(monkeypatch, tokenizer, tiny_model_dir, version, exact):
    """Every era reports the second request's reused tokens: from the exact
    RequestOutput.cached_tokens where the release has it, else from the perf metrics' reused
    blocks x KvCacheConfig.tokens_per_block (32 here)."""
    fake = fake_llm.install(monkeypatch, version=version)
    text = TEXT * 2
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm") as (server, stub):
        first, second = await twice(stub, text)
        prompt = first[-1].usage.prompt_tokens
        reused = (prompt - 1) // 32 * 32
        assert reused > 0
        assert (first[-1].usage.cached_tokens, second[-1].usage.cached_tokens) == (0, reused)
        llm = fake.fake_instances[-1]
        sent = llm.fake_executor.fake_requests
        assert sent[max(sent)].output_config.return_perf_metrics is True
        assert llm.fake_cached_tokens is exact
        stats = server.engine.stats().prefix_cache
        assert stats is not None and (stats.queries, stats.hits) == (2 * prompt, reused)


async def test_llm_reuse_off_with_no_prefix_cache(monkeypatch, tokenizer, tiny_model_dir):
    fake = fake_llm.install(monkeypatch)
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm", prefix_cache=False) as (
        server,
        stub,
    ):
        _first, second = await twice(stub, TEXT * 2)
        assert second[-1].usage.cached_tokens == 0
        llm = fake.fake_instances[-1]
        assert llm.args.kv_cache_config.enable_block_reuse is False
        assert server.engine.stats().prefix_cache is None


async def test_llm_model_info_is_unchanged_by_reuse(monkeypatch, tokenizer, tiny_model_dir):
    """Reuse changes what is reported, not what is served: the same tokens come back."""
    fake_llm.install(monkeypatch)
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm") as (_server, stub):
        first, second = await twice(stub)
        assert [t.id for m in first for o in m.outputs for t in o.tokens] == [
            t.id for m in second for o in m.outputs for t in o.tokens
        ]
        info = await stub.GetModelInfo(spb.GetModelInfoRequest())
        assert info.engine == "trtllm-llm"
