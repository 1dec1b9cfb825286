"""TensorRT-LLM LLM-API engine (`trellis-core --engine trtllm-llm --model <HF checkpoint dir>`).

For TensorRT-LLM 1.x, and the only way in after the C++ executor's removal (v1.3 and later,
where the PyTorch backend is the only one). It speaks the same token-level engine protocol as
`core.engine.trtllm.executor` over `tensorrt_llm.LLM(...).generate_async(token_ids,
SamplingParams(...), streaming=True)`, with `RequestOutput.abort()` for cancellation, and
shares its sampling defaults and its per-sequence state machine (`sequence.SequenceTracker`).

The LLM runs on an event loop of its own, in a thread ("trtllm-llm-loop"), as Triton's
LLM-API model does: `generate_async` blocks on an inter-process round trip to the worker (the
proxy waits for the worker to accept or refuse the request), and its `GenerationResult` binds
its async queue to the loop running when it is created (`tensorrt_llm/executor/result.py`:
"if has_event_loop(): self.aqueue = AsyncQueue()", else async iteration is unavailable), so
it can neither run on the core's loop without stalling it nor in a plain worker thread.
Outputs are handed to the core's loop with `call_soon_threadsafe`.

Differences from `--engine trtllm`, each because the LLM API has no way to do it:
  * the LLM is built with `skip_tokenizer_init=True` (the core tokenizes and detokenizes), so
    multi-token stop strings are matched by the pipeline on text (and the request aborted),
    not by the runtime, and multi-token bad words are refused;
  * the queue bound (`--max-queue-size`) is kept by this engine (requests without output yet);
  * executor-only flags are not applied; SCHEDULED and PREFILLED come with the first output;
  * the sampler is the release's (`options.select_sampler`): the C++ TRTLLMSampler wherever
    it can be chosen; otherwise TorchSampler, whose gaps before PRs #16485/#16590/#17172 are
    refused (penalties, min_p, client seeds), and sampling requests report no seed where
    TorchSampler serves them (no seed reproduces across batches);
  * chunked prefill is on where the release takes `enable_chunked_prefill` (unless
    `--no-trt-enable-chunked-prefill`); elsewhere prompts are limited to the LLM's
    `max_num_tokens` (`llm.py` `_check_arguments`), and the engine says so
    (EngineInfo.max_input_length, GetModelInfoResponse.max_input_tokens) and refuses a longer
    prompt with CONTEXT_LENGTH_EXCEEDED before the LLM sees it.

KV-cache block reuse is on unless --no-trt-enable-block-reuse or --no-prefix-cache. A request's
reused prompt tokens (`cached_tokens`, and the prefix cache counters) are the RequestOutput's
exact `cached_tokens` where the release has it (PR #7637), else `reused blocks x
KvCacheConfig.tokens_per_block` (at most the prompt length - 1) from the CompletionOutput's
`request_perf_metrics` where `SamplingParams` takes `return_perf_metrics` (1.0 and later), else
0 (reuse.py). The LLM API's KV cache events are not read.

Guided decoding: the LLM is built with `guided_decoding_backend` (--trt-guided-decoding-backend,
xgrammar by default) and a guided request's `SamplingParams(guided_decoding=
GuidedDecodingParams(...))` carries the same guide the executor engine sends
(mapping.llm_guided_kwargs), once XGrammar compiled it here when that is the backend
(guides.XGrammarCheck).

LoRA (where the release has `LoRARequest` and the LLM a `lora_config`, options.llm_serves_lora):
the LLM is built with `LoraConfig(lora_dir=<the adapters at start>, max_lora_rank, max_loras,
max_cpu_loras)` (examples/llm-api/llm_multilora.py) when there are adapters at start or
--enable-lora-management; each registered adapter gets an id, and a request naming it goes
with `generate_async(..., lora_request=LoRARequest(name, id, path))`. The LLM loads and
converts the adapter itself and keeps its weights cached by that id (`executor/base_worker.py`
`_load_lora_adapter`), so ids are never reused for other weights.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.engine.base import EngineLifecycle, OutputStream
from core.engine.trtllm.bindings import LlmApi, import_llm_api
from core.engine.trtllm.defaults import resolve_trtllm_sampling
from core.engine.trtllm.guides import XGrammarCheck, import_xgrammar
from core.engine.trtllm.mapping import (
    binding_call,
    classify_error,
    embedding_bias,
    guided_kinds,
    llm_finish,
    llm_guided_kwargs,
    llm_logprobs_wanted,
    llm_sampling_kwargs,
    local_stop_tokens,
    logprob_values,
    special_ids,
)
from core.engine.trtllm.options import Sampler, TrtllmOptions, llm_kwargs, llm_serves_lora
from core.engine.trtllm.reuse import ReuseCounter, exact_cached_tokens, perf_reused_blocks, reused_tokens
from core.engine.trtllm.sequence import SequenceTracker
from core.errors import CoreError, EngineDead, EngineFailure, InvalidArgument, NotReady, Overloaded
from core.lora import AdapterSpec, AdapterStatus, adapter_exists, unknown_adapter
from core.types import (
    EngineInfo,
    EngineOutput,
    EngineRequest,
    EngineStats,
    RequestState,
    ResolvedSampling,
    SamplingOptions,
    SequenceStep,
)

if TYPE_CHECKING:
    from core.config import CoreConfig
    from core.engine.base import Engine
    from core.tokenizer import Tokenizer

log = logging.getLogger(__name__)

TORCH_SAMPLER_GAPS = frozenset({"repetition_penalty", "presence_penalty", "frequency_penalty", "min_p", "seed"})
"""What the PyTorch backend's TorchSampler does not honour in the releases before PRs #16485
(penalties), #16590 (min_p) and #17172 (per-request seeds; before it one generator seeded 42
serves every request, `_torch/pyexecutor/sampler.py` `TorchSampler._global_seed`): the
"torch-legacy" sampler of `options.select_sampler`."""


def build(config: CoreConfig, tokenizer: Tokenizer) -> Engine:
    """Engine factory for `--engine trtllm-llm` (see core.engine.registry).

    Raises:
        RuntimeError: TensorRT-LLM missing, or `config.model` is not a Hugging Face checkpoint.
    """
    api = import_llm_api()
    from core.engine.registry import tokenizer_path

    return TrtllmLlmEngine(api, config.model, tokenizer, TrtllmOptions.from_config(config), tokenizer_path(config))


def _unchunked_reason(asked: bool | None) -> str:
    """Why the LLM runs without chunked prefill, given the `enable_chunked_prefill` it was
    built with (None: the release does not take it)."""
    if asked is None:
        return "this TensorRT-LLM release cannot chunk the prefill"
    if not asked:
        return "chunked prefill is off (--no-trt-enable-chunked-prefill)"
    return "the LLM reports chunked prefill off"


@dataclass(eq=False)
class _Live:
    request: EngineRequest
    stream: OutputStream
    seqs: list[SequenceTracker]
    params: Any
    output: Any = None  # the LLM's RequestOutput, set on the LLM loop
    task: asyncio.Future[None] | None = None
    started: bool = False
    aborted: bool = False
    closed: bool = False
    cached: int | None = None  # reused prompt tokens, once the LLM reported them
    lora_request: Any = None  # the LLM API's LoRARequest of the request's adapter


class TrtllmLlmEngine(EngineLifecycle):
    """Token-level engine over TensorRT-LLM's LLM API (see the module docstring).

    Args:
        api: `bindings.import_llm_api()`.
        model: the Hugging Face checkpoint directory.
        tokenizer: the served model's core.tokenizer.Tokenizer.
        options: the engine's options.
        tokenizer_dir: where the tokenizer lives (given to the LLM for its metadata).

    Raises:
        RuntimeError: `model` has no config.json, is a TensorRT engine directory, or the
            tokenizer has no EOS token.
    """

    kind = "trtllm-llm"

    def __init__(self, api: LlmApi, model: str, tokenizer: Tokenizer, options: TrtllmOptions, tokenizer_dir: str):
        super().__init__()
        self._api = api
        self._model = model
        self.options = options
        self._tokenizer_dir = tokenizer_dir
        hf_file = Path(model) / "config.json"
        if not hf_file.is_file():
            raise RuntimeError(f"{model} has no config.json; --engine trtllm-llm serves a Hugging Face checkpoint")
        hf = json.loads(hf_file.read_text())
        if "build_config" in hf:
            raise RuntimeError(f"{model} is a TensorRT engine directory; serve it with --engine trtllm")
        self._ids = special_ids(tokenizer)
        self._model_vocab = int(hf.get("vocab_size") or tokenizer.vocab_size)
        self._vocab_size = int(tokenizer.vocab_size)
        self._context = int(hf.get("max_position_embeddings") or hf.get("n_positions") or 2048)
        self.sampler: Sampler = "torch-legacy"
        self._guides: XGrammarCheck | None = None  # set at start, where the import's seconds are spent
        self.info = self._make_info(self._context, None)
        self._llm: Any = None
        self._main: asyncio.AbstractEventLoop | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._live: dict[str, _Live] = {}
        self._reuse = ReuseCounter() if options.enable_block_reuse else None
        self._tokens_per_block: int | None = None  # the LLM's KvCacheConfig.tokens_per_block, read at start
        self.max_loras = options.max_loras if llm_serves_lora(api, options) else 0
        self._adapters: dict[str, tuple[AdapterSpec, int]] = {}  # name -> (spec, LoRARequest.lora_int_id)
        self._lora_ids = itertools.count(1)

    # ---------------------------------------------------------------- adapters

    def has_adapter(self, name: str) -> bool:
        """Whether the adapter `name` is registered."""
        return name in self._adapters

    def adapters(self) -> list[AdapterStatus]:
        """Every registered adapter with its running and waiting requests (the LLM does not
        say which adapters its caches hold: resident means a request has used it)."""
        out = []
        for name in sorted(self._adapters):
            spec, _ = self._adapters[name]
            mine = [live for live in self._live.values() if live.request.adapter == name]
            waiting = sum(1 for live in mine if not live.started)
            out.append(AdapterStatus(spec, bool(mine), len(mine) - waiting, waiting))
        return out

    async def load_adapter(self, spec: AdapterSpec) -> None:
        """Register an adapter (its config was checked by core.lora.read_spec; the LLM reads
        the weights at its first request).

        Raises:
            AdapterExists: the name is registered already.
        """
        if spec.name in self._adapters:
            raise adapter_exists(spec.name)
        self._adapters[spec.name] = (spec, next(self._lora_ids))

    async def unload_adapter(self, name: str) -> None:
        """Unregister an adapter; requests running with it finish with it.

        Raises:
            AdapterNotFound: `name` is not registered.
        """
        if self._adapters.pop(name, None) is None:
            raise unknown_adapter(name)

    def _make_info(self, context: int, max_input: int | None) -> EngineInfo:
        """The engine's facts; `max_input` is the longest prompt the LLM takes (None: the
        context bounds it). Seeds reproduce on the C++ sampler only: TorchSampler's
        per-request seeds (PR #17172) reach only the first row of a FlashInfer sampling call
        (flashinfer-ai/flashinfer PR #4861), so a seeded request's tokens depend on its batch."""
        opts = self.options
        return EngineInfo(
            engine=self.kind,
            max_context_length=context,
            vocab_size=self._vocab_size,
            max_num_beams=1,
            max_n=min(opts.max_n, opts.max_batch_size),
            unsupported_sampling_fields=frozenset({"typical_p"})
            | (TORCH_SAMPLER_GAPS if self.sampler == "torch-legacy" else frozenset()),
            max_input_length=max_input,
            max_top_logprobs=0,
            supports_prompt_logprobs=False,
            reproducible_seeds=self.sampler == "trtllm",
            guided_decoding=self._guide_kinds(),
        )

    def _guide_kinds(self) -> frozenset[str]:
        """All the executor's guide types where the release has GuidedDecodingParams and the LLM
        takes a guided decoding backend (EBNF_GRAMMAR and the rest: `sampling_params.py`)."""
        api = self._api
        if (
            self.options.guided_decoding_backend == "none"
            or api.guided_decoding_params is None
            or "guided_decoding_backend" not in api.llm_args
        ):
            return frozenset()
        return guided_kinds(("JSON_SCHEMA", "REGEX", "EBNF_GRAMMAR"))

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start the LLM's event-loop thread and construct the LLM on it (loads the model;
        spawns MPI workers when parallel)."""
        self._main = asyncio.get_running_loop()
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="trtllm-llm-loop", daemon=True)
        self._thread.start()
        kwargs, self.sampler = llm_kwargs(self._api, self.options, tokenizer_dir=self._tokenizer_dir)
        self._llm = await self._on_llm_loop(self._construct(kwargs))
        args = getattr(self._llm, "args", None)
        context = int(getattr(args, "max_seq_len", None) or self._context)
        max_num_tokens = getattr(args, "max_num_tokens", None)
        chunked = bool(getattr(args, "enable_chunked_prefill", False))
        # Without chunked prefill `_check_arguments` refuses a prompt over max_num_tokens.
        max_input = None if chunked or not max_num_tokens else min(int(max_num_tokens), context - 1)
        if max_input is not None:
            log.warning(
                "trtllm-llm engine: %s; prompts are limited to max_num_tokens (%d tokens; --trt-max-num-tokens "
                "raises it)",
                _unchunked_reason(kwargs.get("enable_chunked_prefill")),
                max_input,
            )
        if self._guide_kinds() and kwargs.get("guided_decoding_backend") == "xgrammar":
            self._guides = XGrammarCheck(await asyncio.to_thread(import_xgrammar))
        self.info = self._make_info(context, max_input)
        block = getattr(getattr(args, "kv_cache_config", None), "tokens_per_block", None)
        self._tokens_per_block = int(block) if block else None
        self._started = self._alive = True
        log.info("trtllm-llm engine: %s (TensorRT-LLM %s, %s sampler)", self._model, self._api.version, self.sampler)

    async def _construct(self, kwargs: dict[str, Any]) -> Any:
        return self._api.llm(self._model, **kwargs)

    def _on_llm_loop(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
        assert self._loop is not None
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def shutdown(self) -> None:
        """Abort what is still running and shut the LLM down; new requests get NotReady."""
        self._stopping = True
        self._alive = False
        if self._loop is not None and not self._loop.is_closed():
            await self._on_llm_loop(self._abort_all(list(self._live.values())))
        if self._llm is not None:
            try:
                await asyncio.to_thread(self._llm.shutdown)
            except Exception as e:
                log.warning("LLM shutdown: %s", e)
        if self._loop is not None and self._thread is not None:
            await self._on_llm_loop(self._cancel_runs())
            self._loop.call_soon_threadsafe(self._loop.stop)
            await asyncio.to_thread(self._thread.join)
            self._loop.close()
        now = time.monotonic()
        for live in list(self._live.values()):
            live.stream.put(EngineOutput(live.request.request_id, error=NotReady("The engine shut down."), time=now))
        self._live.clear()

    def resolve_sampling(self, opts: SamplingOptions, *, random_seed: int) -> ResolvedSampling:
        """TensorRT-LLM's defaults (core.engine.trtllm.defaults), shared with --engine trtllm."""
        return resolve_trtllm_sampling(opts, random_seed=random_seed)

    def stats(self) -> EngineStats:
        """Requests with output so far (active) and without (queued); with block reuse on, the
        prefix cache counters (reuse.ReuseCounter)."""
        queued = sum(1 for live in self._live.values() if not live.started)
        prefix = self._reuse.stats() if self._reuse is not None else None
        return EngineStats(active=len(self._live) - queued, queued=queued, prefix_cache=prefix)

    def abort(self, request_id: str) -> None:
        """Abort the request's RequestOutput (the LLM cancels it in its executor)."""
        live = self._live.get(request_id)
        if live is not None:
            self._abort(live)

    def _abort(self, live: _Live) -> None:
        if live.aborted or self._loop is None or self._loop.is_closed():
            return
        live.aborted = True
        self._loop.call_soon_threadsafe(self._abort_on_llm_loop, live)

    @staticmethod
    async def _cancel_runs() -> None:
        """On the LLM loop: end the request runners still waiting for updates."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _abort_all(self, lives: list[_Live]) -> None:
        for live in lives:
            live.aborted = True
            self._abort_on_llm_loop(live)

    @staticmethod
    def _abort_on_llm_loop(live: _Live) -> None:
        if live.output is None:
            return  # not submitted yet: the runner sees `aborted` and does not submit
        try:
            live.output.abort()
        except Exception as e:
            log.warning("abort %s: %s", live.request.request_id, e)

    # ---------------------------------------------------------------- requests

    def generate(self, request: EngineRequest) -> OutputStream:
        """Check a request and stream its outputs; see core.engine.base.Engine for the contract.

        The LLM's own refusals (a `RequestError` or a full queue from `generate_async`) arrive
        as the stream's first output, before QUEUED, so the core still answers them before any
        message.

        Raises:
            NotReady / EngineDead: the engine is not serving.
            InvalidArgument: the request id is already running, a multi-token bad word, greedy
                n > 1, values `SamplingParams` refuses, a logit_bias id beyond the model's
                vocabulary, or a guide XGrammar cannot compile.
            Overloaded: --max-queue-size requests have no output yet.
        """
        live = self._prepare(request)
        assert self._loop is not None
        self._live[request.request_id] = live
        live.task = self._on_llm_loop(self._run(live))
        return live.stream

    def _prepare(self, req: EngineRequest) -> _Live:
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
        lora_request = None
        if req.adapter:
            found = self._adapters.get(req.adapter)
            if found is None:
                raise unknown_adapter(req.adapter)
            spec, lora_id = found
            lora_request = binding_call(
                self._api.lora_request,
                "LoRA adapter",
                "adapter",
                lora_name=spec.name,
                lora_int_id=lora_id,
                lora_path=spec.path,
            )
        queued = self.stats().queued
        if self.options.max_queue_size and queued >= self.options.max_queue_size:
            raise Overloaded(f"The server is at capacity ({queued} requests waiting); retry later.")
        ids = self._ids
        kwargs = llm_sampling_kwargs(
            req, end_id=ids.end_id, pad_id=ids.pad_id, extra_eos=ids.extra_eos, logprobs=llm_logprobs_wanted(req)
        )
        if req.logit_bias:
            kwargs["embedding_bias"] = binding_call(
                embedding_bias, "logit_bias", "sampling.logit_bias", bias=req.logit_bias, width=self._model_vocab
            )
        if self._reuse is not None and self._api.perf_metrics:
            kwargs["return_perf_metrics"] = True
        if req.guide is not None:
            if req.guide.kind not in self.info.guided_decoding:
                raise InvalidArgument(
                    f"The trtllm-llm engine does not support {req.guide.kind}.", field=req.guide.field
                )
            if self._guides is not None:  # before the runtime, where a failure fails the whole batch
                self._guides.check(req.guide)
            kwargs["guided_decoding"] = binding_call(
                self._api.guided_decoding_params, "guide", req.guide.field, **llm_guided_kwargs(req.guide)
            )
        try:
            params = self._api.sampling_params(**kwargs)
        except (ValueError, TypeError) as e:  # TypeError: a field this release's dataclass lacks
            raise InvalidArgument(f"TensorRT-LLM refused the sampling parameters: {e}") from e
        sent = [[int(t)] for t in kwargs.get("stop_token_ids", ())]  # type: ignore[attr-defined]
        local = local_stop_tokens(req, ids.extra_eos)
        seqs = [
            SequenceTracker(i, req, ids.end_id, ids.extra_eos, stop_words=sent, local_stops=local)
            for i in range(req.num_sequences)
        ]
        stream = OutputStream(None, lambda finished: self._closed(req.request_id, finished))
        return _Live(req, stream, seqs, params, lora_request=lora_request)

    def _closed(self, request_id: str, finished: bool) -> None:
        """The consumer is done: abort an unfinished request and forget it."""
        live = self._live.pop(request_id, None)
        if live is None:
            return
        live.closed = True
        if not finished:
            self._abort(live)

    def _post(self, live: _Live, out: EngineOutput) -> None:
        """Hand an output to the core's loop (from the LLM loop)."""
        assert self._main is not None
        try:
            self._main.call_soon_threadsafe(live.stream.put, out)
        except RuntimeError:  # the core's loop is closed: the process is exiting
            pass

    async def _run(self, live: _Live) -> None:
        """On the LLM loop: submit, then post each RequestOutput update as EngineOutputs.

        Any failure becomes the stream's final (error) output, so the consumer never waits
        forever: a per-request `RequestError` maps like an executor error response, a full
        queue is Overloaded, and anything else from submission means the LLM failed (the
        engine is then dead).
        """
        req = live.request
        if live.aborted:
            self._post(live, EngineOutput(req.request_id, finished=True, time=time.monotonic()))
            return
        try:
            lora = {} if live.lora_request is None else {"lora_request": live.lora_request}
            live.output = self._llm.generate_async(
                list(req.prompt_ids), sampling_params=live.params, streaming=True, **lora
            )
        except Exception as e:
            self._post(live, EngineOutput(req.request_id, error=self._submit_error(e), time=time.monotonic()))
            return
        self._post(live, EngineOutput(req.request_id, state=RequestState.QUEUED, time=time.monotonic()))
        if live.aborted:  # aborted while submitting
            # The core's loop sets `aborted` meanwhile; mypy narrowed it from the check above.
            self._abort_on_llm_loop(live)  # type: ignore[unreachable]
        error: CoreError
        try:
            async for ro in live.output:
                outputs = self._outputs(live, ro)
                for out in outputs:
                    self._post(live, out)
                if any(out.finished for out in outputs):
                    return
            error = EngineFailure("The LLM ended the request without finishing it.")
        except Exception as e:
            error = self._request_error(e, live)
        self._post(live, EngineOutput(req.request_id, error=error, finished=True, time=time.monotonic()))

    def _is_request_error(self, error: BaseException) -> bool:
        cls = self._api.request_error
        return (cls is not None and isinstance(error, cls)) or type(error).__name__ == "RequestError"

    def _submit_error(self, error: Exception) -> CoreError:
        """The core error for an exception from `generate_async`: `RequestError` (a
        RuntimeError subclass, `tensorrt_llm/executor/utils.py`) is one request's failure --
        the worker wraps every enqueue failure in it (`base_worker.py` `_enqueue_request`), and
        recent `llm.py` `_check_arguments` raises it for a prompt over max_num_tokens;
        ValueError is an argument the LLM API refuses, the same prompt length check among
        them in earlier releases (1.0 to 1.2 `_check_arguments`), so its message is classified
        too; a full queue is Overloaded; anything else means the LLM itself cannot take
        requests."""
        if self._is_request_error(error):
            return classify_error(str(error))
        if isinstance(error, ValueError):
            classified = classify_error(str(error))
            if isinstance(classified, InvalidArgument):
                return classified
            return InvalidArgument(f"TensorRT-LLM refused the request: {error}")
        if "queue" in str(error).lower():
            return Overloaded("The server is at capacity (the TensorRT-LLM queue is full); retry later.")
        self._die(error)
        return EngineDead(f"The TensorRT-LLM LLM cannot take requests: {error}")

    def _request_error(self, error: Exception, live: _Live) -> CoreError:
        """An error while reading updates: `RequestError` fails this request only; a bug in
        our reading fails the request (aborting it); anything else means the LLM failed."""
        if self._is_request_error(error):
            return classify_error(str(error))
        if isinstance(error, _ReadError):
            log.error("request %s: cannot read the LLM's output: %s", live.request.request_id, error)
            self._abort_on_llm_loop(live)
            return EngineFailure(f"Cannot read the LLM's output: {error.__cause__}")
        self._die(error)
        return EngineDead(f"The TensorRT-LLM LLM failed: {error}")

    def _die(self, error: BaseException) -> None:
        """Mark the engine dead on the core's loop (the on-dead callback runs there)."""
        assert self._main is not None
        if self._stopping:  # the LLM is being shut down: its failures are expected
            return
        exc = error if isinstance(error, Exception) else RuntimeError(str(error))
        self._alive = False
        self._main.call_soon_threadsafe(self._mark_dead, exc)

    def _outputs(self, live: _Live, ro: Any) -> list[EngineOutput]:
        """EngineOutputs for one update of a RequestOutput (cumulative token_ids per sequence)."""
        try:
            return self._read(live, ro)
        except Exception as e:
            raise _ReadError(str(e)) from e

    def _read(self, live: _Live, ro: Any) -> list[EngineOutput]:
        req = live.request
        now = time.monotonic()
        steps: list[SequenceStep] = []
        trailing: list[SequenceStep] = []
        stopped_locally = False
        for comp in ro.outputs:
            if comp.index >= len(live.seqs):
                continue
            seq = live.seqs[comp.index]
            ids = list(comp.token_ids)
            new = [int(t) for t in ids[seq.received :]]
            lps = logprob_values(list(comp.logprobs or [])[seq.received :], new) if req.logprobs else None
            finish = llm_finish(comp.finish_reason, comp.stop_reason)
            advance = seq.advance(new, lps, final=finish is not None, finish=finish, cancel_sent=live.aborted)
            stopped_locally = stopped_locally or advance.stopped_locally
            if advance.step is not None:
                steps.append(advance.step)
            if advance.trailing is not None:
                trailing.append(advance.trailing)
        if self._reuse is not None:
            self._note_reuse(live, ro)
        outputs = [EngineOutput(req.request_id, sequences=steps, time=now, cached_tokens=live.cached or 0)]
        if trailing:
            outputs.append(EngineOutput(req.request_id, sequences=trailing, time=now))
        if not live.started and any(s.token_ids for s in steps):
            live.started = True
            outputs[0].state = RequestState.PREFILLED
        if all(s.done for s in live.seqs) or ro.finished:
            outputs[-1].finished = True
            if self._reuse is not None and live.cached is not None:
                self._reuse.record(len(req.prompt_ids), live.cached)
            if not ro.finished:  # stopped here (a local stop token): the LLM is still generating
                self._abort_on_llm_loop(live)
        return [o for o in outputs if o.sequences or o.state is not None or o.finished]

    def _note_reuse(self, live: _Live, ro: Any) -> None:
        """Take a request's reused prompt tokens from an update that reports them (see the
        module docstring; the largest seen wins). The request is counted in the prefix cache
        counters when it ends (on the LLM loop; the counter locks)."""
        prompt = len(live.request.prompt_ids)
        cached = exact_cached_tokens(ro, prompt)
        if cached is None and self._tokens_per_block is not None:
            blocks = next(
                (
                    b
                    for c in ro.outputs
                    if (b := perf_reused_blocks(getattr(c, "request_perf_metrics", None))) is not None
                ),
                None,
            )
            cached = None if blocks is None else reused_tokens(blocks, self._tokens_per_block, prompt)
        if cached is not None:
            live.cached = max(live.cached or 0, cached)


class _ReadError(Exception):
    """Reading a RequestOutput update failed (a bug on our side, not an LLM failure)."""
