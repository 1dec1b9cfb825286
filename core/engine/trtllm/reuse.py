"""KV-cache block reuse on TensorRT-LLM: the reused prompt tokens of a request, and the
counters behind the prefix cache metrics, read from what the release reports.

Block reuse (`KvCacheConfig(enable_block_reuse=True)`, upstream's default on the LLM API and on
the executor's 1.x `KvCacheConfig`; it needs an engine built with paged context FMHA) keeps the
blocks of finished prompts in a radix tree and hands a new request the longest chain of blocks
its prompt starts with. Upstream never reuses a prompt's last token: `BlockManager::addSequence`
(`cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp`) keys the blocks by the first `prompt
length - 1` tokens, because the last one must be computed to produce the first logits. With
partial reuse (1.x) the last matched block may be matched only in part, so `reused blocks x
tokens_per_block` can exceed the tokens actually reused; this module caps it at `prompt length -
1` and says so.

What each release reports, per request:
  * `RequestOutput.cached_tokens` (LLM API, PyTorch backend: PR #7637, merged September 2025,
    `tensorrt_llm/executor/result.py` `GenerationResultBase.cached_tokens`, the request's
    prepopulated prompt length, exact): used as is;
  * `Result.request_perf_metrics.kv_cache_metrics.num_reused_blocks` (executor bindings from
    0.16, `cpp/tensorrt_llm/pybind/executor/request.cpp` `KvCacheMetrics`; Triton's
    tensorrtllm_backend v0.16.0 `model.py` reads it; asked for with
    `OutputConfig(return_perf_metrics=True)`), and on the LLM API
    `CompletionOutput.request_perf_metrics` (1.0 release notes: "Add request_perf_metrics to
    LLMAPI", asked for with `SamplingParams(return_perf_metrics=True)`): `reused_tokens`;
  * nothing (executor before 0.16; an LLM API without either field): 0, never a guess.

KV cache events (`KvCacheConfig(event_buffer_max_size=N)`, then the executor's
`get_kv_cache_event_manager().get_latest_events(timeout)`; the LLM API's
`LLM.get_kv_cache_events(timeout)` is not read): each event's `data` is a `KVCacheCreatedData`,
`KVCacheStoredData` (`blocks`), `KVCacheRemovedData` (`block_hashes`) or `KVCacheUpdatedData`
(`cpp/tensorrt_llm/pybind/executor/bindings.cpp`, the `kv_cache` submodule);
`ReuseCounter.on_events` counts the blocks stored and removed, which gives the blocks held for
reuse.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from core.types import PrefixCacheStats

#: Events kept by the runtime between two drains (`KvCacheConfig.event_buffer_max_size`);
#: older events are dropped by the runtime when the buffer is full.
EVENT_BUFFER_MAX_SIZE = 4096


def reused_tokens(reused_blocks: int | None, tokens_per_block: int | None, prompt_len: int) -> int:
    """Prompt tokens whose KV came from reused blocks: `reused_blocks * tokens_per_block`,
    capped at `prompt_len - 1` (upstream never reuses a prompt's last token, and a partially
    matched last block counts as a whole block in `num_reused_blocks`); 0 when either count is
    unknown (None), never an estimate."""
    if reused_blocks is None or tokens_per_block is None or reused_blocks <= 0 or prompt_len <= 1:
        return 0
    return min(int(reused_blocks) * int(tokens_per_block), prompt_len - 1)


def perf_reused_blocks(perf: Any) -> int | None:
    """`num_reused_blocks` of a `RequestPerfMetrics` (None: no perf metrics, or no KV cache
    metrics in them)."""
    metrics = getattr(perf, "kv_cache_metrics", None) if perf is not None else None
    value = getattr(metrics, "num_reused_blocks", None)
    return None if value is None else int(value)


def exact_cached_tokens(output: Any, prompt_len: int) -> int | None:
    """The LLM API's exact `cached_tokens` of a RequestOutput, clamped to `[0, prompt_len - 1]`
    (None where the release has no such attribute)."""
    value = getattr(output, "cached_tokens", None)
    if value is None:
        return None
    return max(0, min(int(value), max(prompt_len - 1, 0)))


class ReuseCounter:
    """The prefix cache counters of a TensorRT-LLM engine (core.types.PrefixCacheStats, vLLM's
    meaning): prompt tokens of the requests whose reuse was reported (`queries`), their reused
    tokens (`hits`), and the blocks held for reuse as the KV cache events tell (`blocks`:
    stored minus removed; 0 without events). Thread-safe: events are drained on a thread of
    the engine's own, requests counted on the core's loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queries = 0
        self._hits = 0
        self._stored = 0
        self._removed = 0
        self.events = 0

    def record(self, prompt_len: int, cached: int) -> None:
        """Count one request: `prompt_len` tokens looked up, `cached` of them reused."""
        with self._lock:
            self._queries += prompt_len
            self._hits += cached

    def on_events(self, events: Iterable[Any]) -> None:
        """Count the blocks of `KVCacheStoredData` and `KVCacheRemovedData` events; other
        kinds (created, updated) hold no block count."""
        with self._lock:
            for event in events:
                self.events += 1
                data = getattr(event, "data", None)
                kind = type(data).__name__
                if kind == "KVCacheStoredData":
                    self._stored += len(getattr(data, "blocks", ()) or ())
                elif kind == "KVCacheRemovedData":
                    self._removed += len(getattr(data, "block_hashes", ()) or ())

    def stats(self) -> PrefixCacheStats:
        """The counters now (capacity 0: the runtime does not say how many blocks reuse may
        keep)."""
        with self._lock:
            return PrefixCacheStats(queries=self._queries, hits=self._hits, blocks=max(0, self._stored - self._removed))
