"""TensorRT-LLM LLM-API engine (`trellis-core --engine trtllm-llm --model <HF checkpoint dir>`).

For TensorRT-LLM releases after the C++ executor's removal (v1.3 and later, where the PyTorch
backend is the only one), and usable on 1.x generally. It speaks the same token-level engine
protocol as `core.engine.trtllm` over `tensorrt_llm.LLM(...).generate_async(token_ids,
SamplingParams(...), streaming=True)`, with `RequestOutput.abort()` for cancellation, and shares
its sampling defaults (core.engine.trtllm_defaults). Facts: `shared/reference/trtllm-executor.md`
§2 (cited as §N).

Differences from `--engine trtllm`, each because the LLM API has no way to do it:
  * the LLM is built with `skip_tokenizer_init=True` (the core tokenizes and detokenizes), so
    multi-token stop strings are matched by the pipeline on text (and the request aborted),
    not by the runtime, and multi-token bad words are refused;
  * the queue bound (`--max-queue-size`) is kept by this engine (requests without output yet);
  * `--trt-scheduler-policy`, `--trt-enable-chunked-context` and the stats flags are executor
    options and are not applied; SCHEDULED and PREFILLED are both reported at the first output.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import logging
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from core.engine.base import EngineLifecycle, OutputStream
from core.engine.trtllm import (
    INSTALL_HINT,
    SEED_MASK,
    classify_error,
    embedding_bias,
    first_stop_token,
    special_ids,
)
from core.engine.trtllm_defaults import resolve_trtllm_sampling
from core.errors import CoreError, EngineDead, EngineFailure, InvalidArgument, Overloaded
from core.types import (
    EngineInfo,
    EngineOutput,
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestState,
    ResolvedSampling,
    SamplingOptions,
    SequenceStep,
)

log = logging.getLogger(__name__)


def import_llm_api() -> types.SimpleNamespace:
    """`LLM`, `SamplingParams` and `KvCacheConfig` of the installed TensorRT-LLM.

    Raises:
        RuntimeError: TensorRT-LLM is missing (the message names the `trtllm` extra).
    """
    try:
        top = importlib.import_module("tensorrt_llm")
        llmapi = importlib.import_module("tensorrt_llm.llmapi")
    except ImportError as e:
        raise RuntimeError(
            f"--engine trtllm-llm needs TensorRT-LLM 1.x, which is not installed ({e}). On a machine with an NVIDIA "
            f"GPU run {INSTALL_HINT}; see docs/tensorrt-llm.md."
        ) from e
    return types.SimpleNamespace(
        LLM=top.LLM,
        SamplingParams=top.SamplingParams,
        KvCacheConfig=llmapi.KvCacheConfig,
        version=getattr(top, "__version__", "unknown"),
    )


def llm_sampling_kwargs(
    req: EngineRequest, *, end_id: int, pad_id: int, extra_eos: frozenset[int]
) -> dict[str, object]:
    """SamplingParams keywords for an engine request (§2).

    Greedy leaves temperature, top_p and top_k unset (the LLM API's own greedy test); sampling
    sends the resolved values (never top_p 0 nor temperature 0). Stop tokens are kept in the
    output (include_stop_str_in_output) because the pipeline trims their text itself; with
    min_new_tokens > 0 no stop tokens are sent (the runtime would stop early) and the engine
    matches them. `embedding_bias` is filled by the caller (needs torch).
    """
    s: ResolvedSampling = req.sampling
    kw: dict[str, object] = {
        "max_tokens": req.max_new_tokens,
        "end_id": end_id,
        "pad_id": pad_id,
        "n": req.num_sequences,
        "seed": s.seed & SEED_MASK,
        "ignore_eos": req.ignore_eos,
        "include_stop_str_in_output": True,
        "detokenize": False,
    }
    if s.do_sample:
        for name in ("top_k", "top_p", "temperature", "min_p"):
            value = getattr(s, name)
            if value is not None and (name in ("top_k", "min_p") or value > 0):
                kw[name] = value
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if value is not None:
            kw[name] = value
    if req.min_new_tokens > 0:
        kw["min_tokens"] = req.min_new_tokens
    else:
        stops = sorted(req.stop_token_ids) + ([] if req.ignore_eos else sorted(extra_eos))
        if stops:
            kw["stop_token_ids"] = list(dict.fromkeys(stops))
    if req.bad_words_ids:
        kw["bad_token_ids"] = [w[0] for w in req.bad_words_ids]
    if req.logprobs:
        kw["logprobs"] = 1
    return kw


def logprob_values(entries: Sequence, tokens: Sequence[int]) -> list[float]:
    """Per-token logprobs from CompletionOutput.logprobs entries: floats (early 1.x) or
    {token_id: Logprob} dicts (later); missing entries read as 0.0."""
    out = []
    for i, token in enumerate(tokens):
        entry = entries[i] if i < len(entries) else None
        if isinstance(entry, dict):
            entry = entry.get(token)
            entry = getattr(entry, "logprob", entry)
        out.append(float(entry) if entry is not None else 0.0)
    return out


def build(config, tokenizer) -> TrtllmLlmEngine:
    """Engine factory for `--engine trtllm-llm` (see core.engine.registry).

    Raises:
        RuntimeError: TensorRT-LLM missing, or `config.model` is not a Hugging Face checkpoint.
    """
    api = import_llm_api()
    from core.engine.registry import tokenizer_path

    return TrtllmLlmEngine(api, config, tokenizer, tokenizer_dir=tokenizer_path(config))


@dataclass(eq=False, slots=True)
class _Seq:
    received: int = 0
    done: bool = False


@dataclass(eq=False, slots=True)
class _Live:
    request: EngineRequest
    output: object = None  # the LLM's RequestOutput
    pump: asyncio.Task | None = None  # TrtllmLlmEngine._pump
    seqs: list[_Seq] = field(default_factory=list)
    started: bool = False
    aborted: bool = False


class TrtllmLlmEngine(EngineLifecycle):
    """Token-level engine over TensorRT-LLM's LLM API (see the module docstring).

    Args:
        api: `import_llm_api()`.
        config: the CoreConfig (model dir, batch and queue sizes, `trt_*` options).
        tokenizer: the served model's core.tokenizer.Tokenizer.
        tokenizer_dir: where the tokenizer lives (given to the LLM for its metadata).
    """

    kind = "trtllm-llm"

    def __init__(self, api, config, tokenizer, *, tokenizer_dir: str):
        super().__init__()
        self._api = api
        self._config = config
        self._tokenizer_dir = tokenizer_dir
        hf_file = Path(config.model) / "config.json"
        if not hf_file.is_file():
            raise RuntimeError(
                f"{config.model} has no config.json; --engine trtllm-llm serves a Hugging Face checkpoint"
            )
        hf = json.loads(hf_file.read_text())
        if "build_config" in hf:
            raise RuntimeError(f"{config.model} is a TensorRT engine directory; serve it with --engine trtllm")
        self._ids = special_ids(tokenizer)
        self._model_vocab = int(hf.get("vocab_size") or tokenizer.vocab_size)
        self._vocab_size = int(tokenizer.vocab_size)
        context = hf.get("max_position_embeddings") or hf.get("n_positions") or 2048
        self.info = self._make_info(int(context))
        self._llm = None
        self._live: dict[str, _Live] = {}

    def _make_info(self, context: int) -> EngineInfo:
        cfg = self._config
        return EngineInfo(
            engine=self.kind,
            max_context_length=context,
            vocab_size=self._vocab_size,
            max_num_beams=1,
            max_n=min(cfg.max_n, cfg.max_batch_size),
            unsupported_sampling_fields=frozenset({"typical_p"}),
            max_top_logprobs=0,
            supports_prompt_logprobs=False,
        )

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Construct the LLM (loads the model; spawns MPI workers when parallel)."""
        cfg = self._config
        kwargs: dict[str, object] = {
            "tokenizer": self._tokenizer_dir,
            "skip_tokenizer_init": True,
            "tensor_parallel_size": cfg.trt_tensor_parallel_size,
            "pipeline_parallel_size": cfg.trt_pipeline_parallel_size,
            "max_batch_size": cfg.max_batch_size,
            "kv_cache_config": self._api.KvCacheConfig(
                free_gpu_memory_fraction=cfg.trt_kv_cache_free_gpu_memory_fraction,
                enable_block_reuse=cfg.trt_enable_block_reuse,
            ),
        }
        if cfg.trt_max_num_tokens:
            kwargs["max_num_tokens"] = cfg.trt_max_num_tokens
        ignored = [
            flag
            for flag, value, default in (
                ("--trt-scheduler-policy", cfg.trt_scheduler_policy, "guaranteed_no_evict"),
                ("--trt-enable-chunked-context", cfg.trt_enable_chunked_context, False),
                ("--trt-request-stats-max-iterations", cfg.trt_request_stats_max_iterations, 0),
            )
            if value != default
        ]
        if ignored:
            log.warning("trtllm-llm engine: %s apply to --engine trtllm only; ignored", ", ".join(ignored))
        self._llm = self._api.LLM(cfg.model, **kwargs)
        max_seq_len = getattr(getattr(self._llm, "args", None), "max_seq_len", None)
        if max_seq_len:
            self.info = self._make_info(int(max_seq_len))
        self._started = self._alive = True
        log.info("trtllm-llm engine: %s (TensorRT-LLM %s)", cfg.model, self._api.version)

    async def shutdown(self) -> None:
        """Abort what is still running and shut the LLM down (the server has ended its calls
        by then, core.server.CoreServer.stop); new requests get NotReady."""
        self._stopping = True
        self._alive = False
        for live in list(self._live.values()):
            self._abort(live)
        if self._llm is not None:
            try:
                await asyncio.to_thread(self._llm.shutdown)
            except Exception as e:
                log.warning("LLM shutdown: %s", e)

    def resolve_sampling(self, opts: SamplingOptions, *, random_seed: int) -> ResolvedSampling:
        """TensorRT-LLM's defaults (core.engine.trtllm_defaults), shared with --engine trtllm."""
        return resolve_trtllm_sampling(opts, random_seed=random_seed)

    def stats(self) -> EngineStats:
        """Requests with output so far (active) and without (queued)."""
        queued = sum(1 for live in self._live.values() if not live.started)
        return EngineStats(active=len(self._live) - queued, queued=queued)

    def abort(self, request_id: str) -> None:
        """Abort the request's RequestOutput (the LLM cancels it in its executor)."""
        live = self._live.get(request_id)
        if live is not None:
            self._abort(live)

    def _abort(self, live: _Live) -> None:
        if live.output is not None and not live.aborted:
            live.aborted = True
            try:
                live.output.abort()
            except Exception as e:
                log.warning("abort %s: %s", live.request.request_id, e)

    # ---------------------------------------------------------------- requests

    def generate(self, request: EngineRequest) -> OutputStream:
        """Submit a request and stream its outputs; see core.engine.base.Engine for the contract.

        Raises:
            NotReady / EngineDead: the engine is not serving (EngineDead also when the LLM
                fails at submission).
            InvalidArgument: the request id is already running, a multi-token bad word, greedy
                n > 1, or values the LLM API refuses.
            Overloaded: --max-queue-size requests have no output yet, or the LLM's queue is full.
        """
        live = self._submit(request)
        queued = EngineOutput(request.request_id, state=RequestState.QUEUED, time=time.monotonic())
        stream = OutputStream(queued, functools.partial(self._closed, live))
        live.pump = asyncio.ensure_future(self._pump(live, stream))
        return stream

    def _closed(self, live: _Live, finished: bool) -> None:
        """The consumer is done: abort an unfinished request and forget it."""
        if not finished:
            self._abort(live)
        live.pump.cancel()  # no-op once it ended; the LLM ends an aborted request by itself
        if self._live.get(live.request.request_id) is live:
            del self._live[live.request.request_id]

    async def _pump(self, live: _Live, stream: OutputStream) -> None:
        """Post the RequestOutput's updates (§2) to the stream until the final output; any
        failure becomes the stream's final (error) output, so the consumer never waits forever."""
        request_id = live.request.request_id
        updates = aiter(live.output)
        while True:
            try:
                ro = await anext(updates)
            except StopAsyncIteration:
                error = EngineFailure("The LLM ended the request without finishing it.")
                break
            except Exception as e:
                error = self._request_error(e)
                break
            try:
                outputs = self._outputs(live, ro)
            except Exception as e:  # a bug here, not an LLM failure: the engine stays up
                log.exception("request %s: cannot read the LLM's output", request_id)
                self._abort(live)
                error = EngineFailure(f"Cannot read the LLM's output: {e}")
                break
            for out in outputs:
                stream.put(out)
            if any(out.finished for out in outputs):
                return
        stream.put(EngineOutput(request_id, error=error, finished=True, time=time.monotonic()))

    def _request_error(self, error: Exception) -> CoreError:
        """A per-request RequestError maps like an executor error response; anything else means
        the LLM itself failed (the engine is then dead)."""
        if type(error).__name__ == "RequestError":
            return classify_error(str(error))
        self._mark_dead(error)
        return EngineDead(f"The TensorRT-LLM LLM failed: {error}")

    def _submit(self, req: EngineRequest) -> _Live:
        self._check_serving()
        if req.request_id in self._live:
            raise InvalidArgument(f"A request with id '{req.request_id}' is already running.", field="request_id")
        if any(len(w) > 1 for w in req.bad_words_ids):
            raise InvalidArgument(
                "The trtllm-llm engine bans single tokens only; a bad word here tokenizes to several tokens.",
                field="sampling.bad_words",
            )
        if req.num_sequences > 1 and not req.sampling.do_sample:
            raise InvalidArgument(
                "n > 1 needs sampling on the trtllm-llm engine (the LLM API refuses greedy n > 1).", field="sampling.n"
            )
        queued = self.stats().queued
        if self._config.max_queue_size and queued >= self._config.max_queue_size:
            raise Overloaded(f"The server is at capacity ({queued} requests waiting); retry later.")
        ids = self._ids
        kwargs = llm_sampling_kwargs(req, end_id=ids.end_id, pad_id=ids.pad_id, extra_eos=ids.extra_eos)
        if req.logit_bias:
            kwargs["embedding_bias"] = embedding_bias(req.logit_bias, self._model_vocab)
        try:
            params = self._api.SamplingParams(**kwargs)
        except ValueError as e:
            raise InvalidArgument(f"TensorRT-LLM refused the sampling parameters: {e}") from e
        live = _Live(req, seqs=[_Seq() for _ in range(req.num_sequences)])
        try:
            live.output = self._llm.generate_async(list(req.prompt_ids), sampling_params=params, streaming=True)
        except ValueError as e:
            raise InvalidArgument(f"TensorRT-LLM refused the request: {e}") from e
        except Exception as e:
            if "queue" in str(e).lower():
                raise Overloaded("The server is at capacity (the TensorRT-LLM queue is full); retry later.") from e
            self._mark_dead(e)
            raise EngineDead(f"The TensorRT-LLM LLM cannot take requests: {e}") from e
        self._live[req.request_id] = live
        return live

    def _outputs(self, live: _Live, ro) -> list[EngineOutput]:
        """EngineOutputs for one update of a RequestOutput (cumulative token_ids per sequence)."""
        req = live.request
        now = time.monotonic()
        steps, trailing = [], []
        for comp in ro.outputs:
            if comp.index >= len(live.seqs):
                continue
            seq = live.seqs[comp.index]
            if seq.done:
                continue
            ids = list(comp.token_ids)
            new = [int(t) for t in ids[seq.received :]]
            lps = logprob_values(list(comp.logprobs or [])[seq.received :], new) if req.logprobs else None
            seq.received = len(ids)
            reason, stop_token, excluded_end = None, None, False
            if req.min_new_tokens > 0:
                new, lps, reason, stop_token = first_stop_token(
                    req, new, lps, before=seq.received - len(new), extra_eos=self._ids.extra_eos
                )
            if reason is None and comp.finish_reason:
                reason, stop_token, excluded_end = self._finish(req, comp, live)
            step = SequenceStep(comp.index, new, lps)
            if reason is not None:
                seq.done = True
                if excluded_end and new:
                    trailing.append(SequenceStep(comp.index, [], [] if req.logprobs else None, finish_reason=reason))
                else:
                    step.finish_reason, step.stop_token_id = reason, stop_token
            if new or step.finish_reason is not None:
                steps.append(step)
        outputs = [EngineOutput(req.request_id, sequences=steps, time=now)]
        if trailing:
            outputs.append(EngineOutput(req.request_id, sequences=trailing, time=now))
        if not live.started and any(s.token_ids for s in steps):
            live.started = True
            outputs[0].state = RequestState.PREFILLED
        if all(s.done for s in live.seqs) or ro.finished:
            outputs[-1].finished = True
            if not ro.finished:
                self._abort(live)
        return [o for o in outputs if o.sequences or o.state is not None or o.finished]

    def _finish(self, req: EngineRequest, comp, live: _Live) -> tuple[FinishReason, int | None, bool]:
        """'stop' / 'length' / 'timeout' / 'cancelled' (§2) -> (reason, stop token id, end token excluded)."""
        reason = comp.finish_reason
        if reason == "length":
            return FinishReason.LENGTH, None, False
        if reason == "timeout":
            return FinishReason.TIME_LIMIT, None, False
        if reason == "cancelled":
            return FinishReason.CANCELLED, None, False
        stop = comp.stop_reason
        if isinstance(stop, int):
            if stop in req.stop_token_ids:
                return FinishReason.STOP_SEQUENCE, stop, False
            return FinishReason.EOS, None, False  # an EOS id given as a stop token (kept in the output)
        if stop is not None:
            return FinishReason.STOP_SEQUENCE, None, False
        return FinishReason.EOS, None, True
