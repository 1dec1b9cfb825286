"""A faithful double of TensorRT-LLM's LLM API (`tensorrt_llm.LLM`, 1.x; the only serving API
after the executor's removal in v1.3, `shared/reference/trtllm-executor.md` §0, §2).

As in the real package, the LLM drives an executor (§2 "How the LLM API builds the executor
Request"): here the executor double of `tests.fakes.trtllm_executor` (era E2), fed from an
in-memory engine config, with one awaiter thread handing responses to each RequestOutput on the
caller's event loop. What the LLM layer adds, per §2:
  * `SamplingParams` (kw-only dataclass) with its validation: 0 <= top_p <= 1, top_k >= 0,
    temperature >= 0; greedy implied when temperature, top_p and top_k are all None, or
    top_k == 1, top_p == 0 or temperature == 0; n/best_of > 1 with greedy raises unless
    TLLM_ALLOW_N_GREEDY_DECODING=1; end_id must be given when the tokenizer is skipped;
  * `generate_async(inputs, sampling_params, streaming)` -> RequestOutput, both an async
    iterator (yielding itself, updated, per step) and awaitable via `aresult()`;
    `max_tokens` deduced as min(asked, max_seq_len - prompt_len); `end_id` -1 and no stop
    words with `ignore_eos`; stop_token_ids / bad_token_ids as one-token words;
  * CompletionOutput with cumulative `token_ids` and `logprobs` (a list of {token_id: Logprob}
    per token, the 1.x shape), `finish_reason` in {'stop', 'length', 'timeout', 'cancelled'},
    `stop_reason` (the stop token id), stop tokens trimmed unless include_stop_str_in_output,
    diff helpers;
  * `RequestOutput.abort()` -> executor.cancel_request, ending in 'cancelled'; per-request
    error responses raise `RequestError` from the iteration.

Test hooks: `fake_executor` (the executor double inside), `fake_kill()`, `fake_fail_submit()`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import threading
import types
from collections import namedtuple
from pathlib import Path
from typing import ClassVar

from tests.fakes import trtllm_executor

Logprob = namedtuple("Logprob", ["logprob", "rank"])
_FINISH = {"END_ID": "stop", "STOP_WORDS": "stop", "LENGTH": "length", "TIMED_OUT": "timeout", "CANCELLED": "cancelled"}


class RequestError(RuntimeError):
    """A per-request failure reported by the executor (tensorrt_llm.executor.utils.RequestError)."""


@dataclasses.dataclass(kw_only=True)
class SamplingParams:
    """§2 SamplingParams (the fields the adapter may use); None = runtime default."""

    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int = 32
    bad: str | list[str] | None = None
    bad_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    embedding_bias: object = None
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    temperature: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_p: float | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    exclude_input_from_output: bool = True
    ignore_eos: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True

    def __post_init__(self):
        if self.top_p is not None and not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError("best_of must be >= n")
        width = max(self.n, self.best_of or 1)
        if width > 1 and self._greedy() and os.environ.get("TLLM_ALLOW_N_GREEDY_DECODING") != "1":
            raise ValueError(
                "Greedy decoding in the LLM API does not allow multiple returns. Please set to best_of=1, got "
                f"best_of={width}. Please set to best_of=1 or set an environment variable "
                "TLLM_ALLOW_N_GREEDY_DECODING=1 to allow best_of > 1 under the greedy decoding."
            )

    def _greedy(self) -> bool:
        return (
            (self.temperature is None and self.top_p is None and self.top_k is None)
            or self.top_k == 1
            or self.top_p == 0
            or self.temperature == 0
        )


class CompletionOutput:
    """§2 CompletionOutput: cumulative token_ids/logprobs plus diff helpers."""

    def __init__(self, index: int):
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] = []
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.generation_logits = None
        self._last_token_ids_len = 0
        self._last_logprobs_len = 0

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len :]

    @property
    def logprobs_diff(self) -> list:
        return self.logprobs[self._last_logprobs_len :]


class RequestOutput:
    """§2 RequestOutput: async-iterable (yields itself per update) and `aresult()`."""

    def __init__(self, llm: LLM, rid: int, prompt_ids: list[int], params: SamplingParams, streaming: bool, stops):
        self._llm = llm
        self.request_id = rid
        self.prompt = None
        self.prompt_token_ids = prompt_ids
        self.outputs = [CompletionOutput(i) for i in range(max(params.n, params.best_of or 1))]
        self.finished = False
        self.context_logits = None
        self._params = params
        self._streaming = streaming
        self._stops = stops
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        self._error: BaseException | None = None
        self._aborted = False

    # called on the loop by the LLM's awaiter thread
    def _on_response(self, response) -> None:
        if response.has_error():
            self._error = RequestError(response.error_msg)
            self.finished = True
            self._events.put_nowait(None)
            return
        res = response.result
        out = self.outputs[res.sequence_index]
        for o in self.outputs:
            o._last_token_ids_len, o._last_logprobs_len = len(o.token_ids), len(o.logprobs)
        new = list(res.output_token_ids[0])
        out.token_ids += new
        if res.log_probs is not None:
            values = res.log_probs[0][len(out.logprobs) :]  # the executor's list is cumulative
            out.logprobs += [{t: Logprob(v, 1)} for t, v in zip(new, values, strict=False)]
            out.cumulative_logprob = res.cum_log_probs[0] if res.cum_log_probs else None
        if res.is_sequence_final:
            name = res.finish_reasons[0].name
            out.finish_reason = _FINISH.get(name)
            if name == "STOP_WORDS":
                for word in self._stops:
                    if out.token_ids[-len(word) :] == word:
                        out.stop_reason = word[0] if len(word) == 1 else word
                        if not self._params.include_stop_str_in_output:  # result.py trims them
                            del out.token_ids[-len(word) :]
                            del out.logprobs[len(out.token_ids) :]
                        break
        if res.is_final:
            self.finished = True
        if self._streaming or self.finished:
            self._events.put_nowait(None)

    def _on_failure(self, error: BaseException) -> None:
        self._error = error
        self.finished = True
        self._events.put_nowait(None)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self._events.empty() and self.finished and self._error is None:
            raise StopAsyncIteration
        await self._events.get()
        if self._error is not None:
            raise self._error
        return self

    async def aresult(self) -> RequestOutput:
        async for _ in self:
            pass
        return self

    def abort(self) -> None:
        """Cancel in the executor; the request then finishes with 'cancelled'."""
        if not self.finished and not self._aborted:
            self._aborted = True
            self._llm.fake_executor.cancel_request(self.request_id)

    def aborted(self) -> bool:
        return self._aborted


class KvCacheConfig:
    """`tensorrt_llm.llmapi.KvCacheConfig`: a pydantic mirror, extra fields forbidden (§2)."""

    _fields: ClassVar[dict] = {
        "enable_block_reuse": True,
        "max_tokens": None,
        "free_gpu_memory_fraction": None,
        "host_cache_size": None,
        "enable_partial_reuse": True,
    }

    def __init__(self, **kwargs):
        unknown = set(kwargs) - set(self._fields)
        if unknown:
            raise ValueError(f"KvCacheConfig: extra fields not permitted: {sorted(unknown)}")
        for name, default in self._fields.items():
            setattr(self, name, kwargs.get(name, default))


class LLM:
    """§2 `LLM(model, tokenizer=None, ..., **kwargs)` over an HF checkpoint directory."""

    _llm_args: ClassVar[set[str]] = {
        "max_batch_size",
        "max_num_tokens",
        "max_seq_len",
        "max_input_len",
        "kv_cache_config",
        "backend",
        "pipeline_parallel_size",
        "dtype",
        "revision",
        "tokenizer_revision",
        "tokenizer_mode",
        "trust_remote_code",
        "tensor_parallel_size",
        "skip_tokenizer_init",
        "tokenizer",
    }

    def __init__(self, model, tokenizer=None, **kwargs):
        unknown = set(kwargs) - self._llm_args
        if unknown:
            raise ValueError(f"TorchLlmArgs: extra fields not permitted: {sorted(unknown)}")
        config_file = Path(model) / "config.json"
        if not config_file.is_file():
            raise ValueError(f"{model} is not a Hugging Face checkpoint directory (no config.json)")
        hf = json.loads(config_file.read_text())
        max_seq_len = int(kwargs.get("max_seq_len") or hf.get("max_position_embeddings") or 2048)
        self.args = types.SimpleNamespace(
            model=str(model),
            tokenizer=tokenizer,
            max_seq_len=max_seq_len,
            max_batch_size=kwargs.get("max_batch_size") or 8,
            max_num_tokens=kwargs.get("max_num_tokens") or 8192,
            kv_cache_config=kwargs.get("kv_cache_config") or KvCacheConfig(),
            tensor_parallel_size=kwargs.get("tensor_parallel_size", 1),
            pipeline_parallel_size=kwargs.get("pipeline_parallel_size", 1),
            skip_tokenizer_init=bool(kwargs.get("skip_tokenizer_init", False)),
        )
        self.fake_module = trtllm_executor.make_module("E2")
        tl = self.fake_module
        engine = trtllm_executor.engine_config(
            vocab_size=int(hf["vocab_size"]),
            max_input_len=int(kwargs.get("max_input_len") or max_seq_len),
            max_seq_len=max_seq_len,
            max_batch_size=self.args.max_batch_size,
            max_num_tokens=self.args.max_num_tokens,
        )
        config = tl.ExecutorConfig(
            max_beam_width=1,
            max_batch_size=self.args.max_batch_size,
            kv_cache_config=tl.KvCacheConfig(enable_block_reuse=True),
        )
        self.fake_executor = tl.Executor(b"engine", json.dumps(engine), tl.ModelType.DECODER_ONLY, config)
        self._outputs: dict[int, RequestOutput] = {}
        self._lock = threading.Lock()
        self._dead: BaseException | None = None
        self._fail_submit: BaseException | None = None
        self._shutdown = False
        self._client_ids = itertools.count(1)
        self._thread = threading.Thread(target=self._await_loop, name="fake-llm-awaiter", daemon=True)
        self._thread.start()

    def generate_async(
        self, inputs, sampling_params: SamplingParams | None = None, streaming: bool = False, **_ignored
    ) -> RequestOutput:
        """Submit one prompt (token ids, a `{"prompt_token_ids": ...}` dict, or text)."""
        if self._shutdown:
            raise RuntimeError("LLM is shut down")
        if self._fail_submit is not None:
            error, self._fail_submit = self._fail_submit, None
            raise error
        if self._dead is not None:
            raise RuntimeError(f"Executor worker died: {self._dead}")
        p = sampling_params or SamplingParams()
        if isinstance(inputs, dict):
            inputs = inputs["prompt_token_ids"]
        if isinstance(inputs, str):
            if self.args.skip_tokenizer_init:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init=True)")
            raise NotImplementedError("the double takes token ids")
        if self.args.skip_tokenizer_init and (p.end_id is None or p.stop or p.bad):
            raise ValueError("without a tokenizer, end_id must be set and stop/bad strings cannot be encoded")
        prompt = [int(t) for t in inputs]
        tl = self.fake_module
        width = max(p.n, p.best_of or 1)
        sc = {
            "beam_width": 1,
            "num_return_sequences": width if width > 1 else None,
            "seed": p.seed,
            "min_tokens": p.min_tokens,
            "repetition_penalty": p.repetition_penalty,
            "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty,
            "min_p": p.min_p,
        }
        if not p._greedy():
            sc |= {"top_k": p.top_k, "top_p": p.top_p, "temperature": p.temperature}
        stops = [] if p.ignore_eos else [[t] for t in (p.stop_token_ids or [])]
        request = tl.Request(
            input_token_ids=prompt,
            max_tokens=max(1, min(p.max_tokens, self.args.max_seq_len - len(prompt))),
            streaming=streaming,
            sampling_config=tl.SamplingConfig(**{k: v for k, v in sc.items() if v is not None}),
            output_config=tl.OutputConfig(return_log_probs=p.logprobs is not None, exclude_input_from_output=True),
            end_id=-1 if p.ignore_eos else p.end_id,
            pad_id=p.pad_id,
            stop_words=stops or None,
            bad_words=[[t] for t in p.bad_token_ids] if p.bad_token_ids else None,
            embedding_bias=p.embedding_bias,
            client_id=next(self._client_ids),
            return_all_generated_tokens=False,
        )
        with self._lock:
            rid = self.fake_executor.enqueue_request(request)
            out = RequestOutput(self, rid, prompt, p, streaming, stops)
            self._outputs[rid] = out
        return out

    def _await_loop(self) -> None:
        import datetime

        while not self._shutdown:
            try:
                responses = self.fake_executor.await_responses(timeout=datetime.timedelta(milliseconds=5))
            except Exception as e:
                if not self._shutdown:
                    self._dead = e
                    with self._lock:
                        pending = list(self._outputs.values())
                        self._outputs.clear()
                    for out in pending:
                        out._loop.call_soon_threadsafe(out._on_failure, RuntimeError(f"Executor worker died: {e}"))
                return
            for r in responses:
                with self._lock:
                    out = self._outputs.get(r.request_id)
                    if out is not None and (r.has_error() or r.result.is_final):
                        del self._outputs[r.request_id]
                if out is not None:
                    out._loop.call_soon_threadsafe(out._on_response, r)

    def shutdown(self) -> None:
        if self._shutdown:
            return
        self._shutdown = True
        self.fake_executor.shutdown()
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        return False

    # test hooks
    def fake_kill(self, message: str = "executor worker died") -> None:
        self.fake_executor.fake_kill(message)

    def fake_fail_submit(self, error: BaseException) -> None:
        """Make the next generate_async raise `error`."""
        self._fail_submit = error


def install(monkeypatch, *, version: str = "1.3.0") -> types.ModuleType:
    """Put the LLM API double into sys.modules as `tensorrt_llm` (with `tensorrt_llm.llmapi`,
    `tensorrt_llm.executor`, and a `tensorrt_llm.bindings.executor` that, as after v1.3.0rc20,
    has the config classes but no `Executor`); returns the top-level module."""
    import sys

    top = types.ModuleType("tensorrt_llm")
    top.__version__ = version
    top.LLM = LLM
    top.SamplingParams = SamplingParams
    top.fake_instances = []
    original_init = LLM.__init__

    class TrackedLLM(LLM):
        def __init__(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            top.fake_instances.append(self)

    top.LLM = TrackedLLM
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.KvCacheConfig = KvCacheConfig
    llmapi.LLM = TrackedLLM
    llmapi.SamplingParams = SamplingParams
    executor_pkg = types.ModuleType("tensorrt_llm.executor")
    executor_pkg.RequestError = RequestError
    bindings_exec = trtllm_executor.make_module("E2")
    del bindings_exec.Executor  # PR #16369: the Executor binding class is gone (§0)
    bindings = types.ModuleType("tensorrt_llm.bindings")
    bindings.executor = bindings_exec
    top.llmapi, top.executor, top.bindings = llmapi, executor_pkg, bindings
    for name, module in {
        "tensorrt_llm": top,
        "tensorrt_llm.llmapi": llmapi,
        "tensorrt_llm.executor": executor_pkg,
        "tensorrt_llm.bindings": bindings,
        "tensorrt_llm.bindings.executor": bindings_exec,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    return top
