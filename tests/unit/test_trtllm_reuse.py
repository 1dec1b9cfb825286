"""`core.engine.trtllm.reuse` (reused tokens from what a release reports, the prefix cache
counters and KV cache events) and the per-era probes and options that turn reuse reporting on.

Sources (NVIDIA/TensorRT-LLM): `cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp`
(`BlockManager::addSequence`: a prompt's last token is never reused), `cpp/tensorrt_llm/pybind/
executor/request.cpp` (`KvCacheMetrics`, `OutputConfig(return_perf_metrics=...)`),
`bindings.cpp` (KV cache events), `tensorrt_llm/executor/result.py` (`cached_tokens`, PR #7637).
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from core.engine.trtllm.bindings import LlmApi, detect_api
from core.engine.trtllm.engine_dir import EngineLayout, read_engine_layout
from core.engine.trtllm.options import TrtllmOptions, executor_config, llm_kwargs
from core.engine.trtllm.reuse import (
    EVENT_BUFFER_MAX_SIZE,
    ReuseCounter,
    exact_cached_tokens,
    perf_reused_blocks,
    reused_tokens,
)
from core.types import PrefixCacheStats
from tests.conftest import core_config
from tests.fakes import trtllm_executor

LAYOUT = EngineLayout(Path("e"), 16, 32, 8, 1, 64, 4096, paged_context_fmha=True, tokens_per_block=8)


@pytest.mark.parametrize(
    ("blocks", "per_block", "prompt", "tokens"),
    [
        (2, 8, 40, 16),
        (5, 8, 40, 39),  # a partially matched last block: capped at the prompt length - 1
        (0, 8, 40, 0),
        (None, 8, 40, 0),  # nothing reported
        (3, None, 40, 0),  # no block size: no estimate
        (1, 8, 1, 0),
    ],
)
def test_reused_tokens_are_blocks_times_block_size_capped(blocks, per_block, prompt, tokens):
    assert reused_tokens(blocks, per_block, prompt) == tokens


def test_perf_metrics_and_exact_counts_are_read_where_present():
    perf = types.SimpleNamespace(kv_cache_metrics=types.SimpleNamespace(num_reused_blocks=3))
    assert perf_reused_blocks(perf) == 3
    assert perf_reused_blocks(None) is None
    assert perf_reused_blocks(types.SimpleNamespace(kv_cache_metrics=None)) is None
    assert exact_cached_tokens(types.SimpleNamespace(cached_tokens=12), 40) == 12
    assert exact_cached_tokens(types.SimpleNamespace(cached_tokens=99), 40) == 39
    assert exact_cached_tokens(types.SimpleNamespace(), 40) is None


def test_counter_counts_requests_and_event_blocks():
    k = trtllm_executor.make_module("1.0").kv_cache
    counter = ReuseCounter()
    counter.record(40, 16)
    counter.record(10, 0)
    counter.on_events(
        [
            k.KVCacheEvent(event_id=0, data=k.KVCacheCreatedData(num_blocks_per_cache_level=[8, 0])),
            k.KVCacheEvent(event_id=1, data=k.KVCacheStoredData(parent_hash=None, blocks=[object()] * 3)),
            k.KVCacheEvent(event_id=2, data=k.KVCacheRemovedData(block_hashes=[1])),
        ]
    )
    assert counter.stats() == PrefixCacheStats(queries=50, hits=16, blocks=2)
    assert counter.events == 3


@pytest.mark.parametrize(
    ("era", "perf", "events"),
    [("0.11", False, False), ("0.15", False, False), ("1.0", True, True), ("1.3", True, True)],
)
def test_probes_follow_the_era(era, perf, events):
    binding_api = detect_api(trtllm_executor.make_module(era))
    assert (binding_api.perf_metrics, binding_api.kv_events) == (perf, events)


@pytest.mark.parametrize("era", trtllm_executor.ERAS)
def test_executor_config_keeps_events_only_where_the_release_has_them(era):
    tl = trtllm_executor.make_module(era)
    binding_api = detect_api(tl)
    config = executor_config(tl, binding_api, TrtllmOptions(), LAYOUT)
    assert config.kv_cache_config.enable_block_reuse is True
    assert getattr(config.kv_cache_config, "event_buffer_max_size", 0) == (
        EVENT_BUFFER_MAX_SIZE if binding_api.kv_events else 0
    )
    off = executor_config(tl, binding_api, TrtllmOptions(enable_block_reuse=False), LAYOUT)
    assert off.kv_cache_config.enable_block_reuse is False
    assert getattr(off.kv_cache_config, "event_buffer_max_size", 0) == 0


@pytest.mark.parametrize(
    ("overrides", "reuse"),
    [({}, True), ({"prefix_cache": False}, False), ({"trt_enable_block_reuse": False}, False)],
)
def test_either_switch_turns_reuse_off(tmp_path, overrides, reuse):
    assert TrtllmOptions.from_config(core_config(tmp_path, **overrides)).enable_block_reuse is reuse


def test_llm_gets_an_event_buffer_only_where_it_has_events():
    def api(kv_events: bool) -> LlmApi:
        return LlmApi(None, None, dict, None, frozenset({"sampler_type"}), "1.2.0", kv_events=kv_events)

    with_events, _ = llm_kwargs(api(True), TrtllmOptions(), tokenizer_dir="t")
    without, _ = llm_kwargs(api(False), TrtllmOptions(), tokenizer_dir="t")
    off, _ = llm_kwargs(api(True), TrtllmOptions(enable_block_reuse=False), tokenizer_dir="t")
    assert with_events["kv_cache_config"]["event_buffer_max_size"] == EVENT_BUFFER_MAX_SIZE
    assert "event_buffer_max_size" not in without["kv_cache_config"]
    assert (
        "event_buffer_max_size" not in off["kv_cache_config"] and off["kv_cache_config"]["enable_block_reuse"] is False
    )


@pytest.mark.parametrize(("recorded", "expected"), [(16, 16), (None, None)])
def test_engine_layout_reads_tokens_per_block(tmp_path, recorded, expected):
    engine = trtllm_executor.write_engine_dir(tmp_path / "engine", tokens_per_block=recorded)
    assert read_engine_layout(engine).tokens_per_block == expected
