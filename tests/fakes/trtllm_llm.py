"""A faithful double of TensorRT-LLM's LLM API (`tensorrt_llm.LLM`, 1.x), PyTorch backend as it
is, plus the TRT-flow backend where it differs.

As in the real package, the LLM drives an executor: here the executor double of
`tests.fakes.trtllm_executor` (era "1.0") with one awaiter thread handing responses to each
RequestOutput on the event loop it was created on. What the LLM layer adds, each from upstream
source (NVIDIA/TensorRT-LLM):
  * `SamplingParams`, a kw-only dataclass (`tensorrt_llm/sampling_params.py`): an unknown
    field is a TypeError, its validation a ValueError; `__post_init__` sets `pad_id = end_id`
    where unset and `best_of = best_of or n`; greedy with best_of > 1 refused unless the
    environment has TLLM_ALLOW_N_GREEDY_DECODING set to any non-empty value
    (`os.environ.get('TLLM_ALLOW_N_GREEDY_DECODING', None)`, read in 0.19 to 1.x);
  * `generate_async` (`llmapi/llm.py`, `executor/base_worker.py` `_enqueue_request`): a
    prompt over max_num_tokens is refused unless `enable_chunked_prefill` is on
    (`_check_arguments`, PyTorch backend: "should not exceed max_num_tokens") with a plain
    ValueError in the releases whose `llm.py` raises it (1.0 to 1.2 here) and `RequestError`
    (a RuntimeError, `executor/utils.py`; `tests/unittest/llmapi/test_llm.py`
    `test_max_num_token_check` expects it) later; a prompt leaving no room under max_seq_len
    fails with `RequestError` (`_deduce_max_tokens`' ValueError, wrapped); `end_id=-1` with
    ignore_eos; `stop_words` with ignore_eos: kept by the 1.0-era worker
    (`executor/worker.py`), `[]` from 1.1 (`base_worker.py`: "stop_words=[] if ignore_eos")
    -- the release boundaries of these two changes are modelled, not pinned;
  * the `RequestOutput` (`executor/result.py`) binds its async queue to the loop running at
    creation ("if has_event_loop(): self.aqueue = AsyncQueue()"); created without one, async
    iteration fails ("The asyncio event loop was not present during initialization");
  * the PyTorch backend's samplers, chosen per release (RELEASES) as
    `_torch/pyexecutor/_util.py` `instantiate_sampler` does:
      - TorchSampler before PRs #16485/#16590/#17172 ("torch-legacy", `_torch/pyexecutor/
        sampler.py`): the end token is appended before the request finishes by END_ID, so it
        is in `token_ids`; one generator seeded 42 serves every request (a client's seed does
        not reproduce); no penalty or min_p code; from 1.1 logprobs are keyed by the top-k
        tokens of `log_softmax` (k = logprobs), so a sampled token outside them has none;
      - TorchSampler after them ("torch", the only sampler once PR #18232 removed
        TRTLLMSampler and `sampler_type`, 2026-08-26, 1.3.0rc26 and 1.4.0rc4): penalties,
        min_p and the request's seed; the end token appended as before; logprobs hold the
        sampled token first, then the top-k (`_torch/pyexecutor/sampler/sampler.py`);
      - TRTLLMSampler, the C++ decoder ("trtllm"): chosen by `enable_trtllm_sampler=True`
        (1.0), by default while the switch was `use_torch_sampler` (PR #6216 to PR #6831, the
        1.1 pre-releases), by `sampler_type="TRTLLMSampler"` (PR #6831 to PR #18232): the
        executor's behaviour, so no end token in `token_ids`, per-request seeds, penalties,
        min_p, the sampled token's logprob; it does not normalize logprobs;
  * TRT-flow backend (`backend="tensorrt"`): the C++ executor's behaviour (end token
    excluded, per-request seeds, sampled-token logprobs), `ExecutorConfig.normalize_log_probs`
    from the LLM's args (`llm.py`, False by default);
  * guided decoding (`sampling_params.py`): `GuidedDecodingParams(json, regex, grammar,
    json_object, structural_tag)`, a kw-only dataclass whose `_validate` refuses more than one
    guide, in `SamplingParams.guided_decoding`, turned into the executor's GuidedDecodingParams
    as `_get_guided_decoding_params` does (json_object -> JSON, json -> JSON_SCHEMA, dicts
    serialized, regex -> REGEX, grammar -> EBNF_GRAMMAR, structural_tag -> STRUCTURAL_TAG);
    the LLM's `guided_decoding_backend` ("xgrammar" | "llguidance", `llmapi/llm_args.py`) gives
    the executor its GuidedDecodingConfig from the tokenizer (`_xgrammar_tokenizer_info`);
    without one, a guided request is refused (the executor double's error response, as a
    `RequestError`), and a guide the grammar backend cannot compile fails the whole batch.

KV-cache block reuse: the LLM's `KvCacheConfig(enable_block_reuse=True)` (the default) turns
on the executor double's block reuse, with blocks of `KvCacheConfig.tokens_per_block` tokens
(32 by default, `llmapi/llm_args.py`; that every modelled release has the field is
[UNCONFIRMED] for 1.0). `SamplingParams(return_perf_metrics=True)` (1.0 release notes: "Add
request_perf_metrics to LLMAPI") puts the executor's `RequestPerfMetrics` on each
CompletionOutput (`result.py` `_handle_sequence`); from the releases with PR #7637 (merged
September 2025; here 1.2 and later, `Release.cached_tokens`) the RequestOutput also carries
`cached_tokens`, the request's exact reused prompt tokens (`result.py`
`GenerationResultBase.cached_tokens`). KV cache events of the LLM API are not modelled.

LoRA (`tensorrt_llm.executor.LoRARequest(lora_name, lora_int_id, lora_path="",
lora_ckpt_source="hf")`, `executor/request.py`; the LLM's `lora_config=LoraConfig(lora_dir=[...],
max_lora_rank=64, lora_target_modules=[], max_loras=4, max_cpu_loras=4, ...)`,
`tensorrt_llm/lora_helper.py`, examples/llm-api/llm_multilora.py): with a LoraConfig the
executor double runs an engine with the LoRA plugin for the modules the adapters of `lora_dir`
target (or `lora_target_modules`) and a PEFT cache of `max_loras` adapters.
`generate_async(..., lora_request=...)` loads and converts the adapter at its path the first
time its `lora_int_id` is seen (`base_worker.py` `_load_lora_adapter`: the LoraManager's CPU
cache keyed by that id) and sends `LoraConfig(task_id=id, weights, config)` then, and
`LoraConfig(task_id=id)` after; the conversion is `hf_lora_convert.py`'s (A [r, in] flattened,
then scale * B [out, r], per module and layer). A `lora_request` without a LoraConfig is refused
with a ValueError, and a lora_path without adapter_config.json with a ValueError at the
LoRARequest (both wordings the double's [UNCONFIRMED]).

Test hooks: `fake_executor` (the executor double inside), `fake_kill()`, `fake_fail_submit()`,
`fake_lora_loads` (the ids whose weights were read, in order).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import itertools
import json
import os
import random
import threading
import types
from collections import namedtuple
from pathlib import Path
from typing import ClassVar

from tests.fakes import trtllm_executor

Logprob = namedtuple("Logprob", ["logprob", "rank"])
_FINISH = {"END_ID": "stop", "STOP_WORDS": "stop", "LENGTH": "length", "TIMED_OUT": "timeout", "CANCELLED": "cancelled"}


_HF_TO_TRT = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_dense",
    "gate_proj": "mlp_h_to_4h",
    "down_proj": "mlp_4h_to_h",
    "up_proj": "mlp_gate",
}


@dataclasses.dataclass
class LoRARequest:
    """`tensorrt_llm.executor.request.LoRARequest`."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    lora_ckpt_source: str = "hf"

    def __post_init__(self):
        if self.lora_ckpt_source not in ("hf", "nemo"):
            raise ValueError(f"lora_ckpt_source must be one of 'hf' or 'nemo', got {self.lora_ckpt_source}")
        if not (Path(self.lora_path) / "adapter_config.json").is_file():
            raise ValueError(f"lora_path {self.lora_path} is not a LoRA checkpoint directory")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id


@dataclasses.dataclass
class LoraConfig:
    """`tensorrt_llm.lora_helper.LoraConfig` (the fields the double reads)."""

    lora_dir: list = dataclasses.field(default_factory=list)
    lora_ckpt_source: str = "hf"
    max_lora_rank: int = 64
    lora_target_modules: list = dataclasses.field(default_factory=list)
    trtllm_modules_to_hf_modules: dict = dataclasses.field(default_factory=dict)
    max_loras: int | None = None
    max_cpu_loras: int | None = None


def _lora_modules(config: LoraConfig) -> list[str]:
    """The TensorRT-LLM modules of the LoRA engine: those the adapters of lora_dir target,
    else lora_target_modules."""
    found: set[str] = set()
    for d in config.lora_dir:
        targets = json.loads((Path(d) / "adapter_config.json").read_text()).get("target_modules") or []
        found |= {_HF_TO_TRT[t] for t in targets if t in _HF_TO_TRT}
    return sorted(found or set(config.lora_target_modules))


def _convert_lora(path: str, dtype):
    """hf_lora_convert.py's layout: weights [n, row], config [n, 3] int32."""
    import re

    import torch
    from safetensors.torch import load_file

    cfg = json.loads((Path(path) / "adapter_config.json").read_text())
    r = cfg["r"]
    scale = cfg.get("lora_alpha", r) / (r**0.5 if cfg.get("use_rslora") else r)
    pairs: dict = {}
    for key, w in load_file(str(Path(path) / "adapter_model.safetensors")).items():
        m = re.match(r".*\.layers\.([0-9]+)\..*?([a-z_]+)\.lora_(A|B)\.weight", key)
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = w
    rows, config = [], []
    ids = trtllm_executor._LORA_MODULE_IDS
    for (layer, module), ab in sorted(pairs.items()):
        rows.append(torch.cat([ab["A"].flatten(), (ab["B"] * scale).flatten()]).to(dtype))
        config.append([ids[_HF_TO_TRT[module]], layer, int(ab["A"].shape[0])])
    width = max(x.shape[0] for x in rows)
    weights = torch.stack([torch.nn.functional.pad(x, (0, width - x.shape[0])) for x in rows])
    return weights, torch.tensor(config, dtype=torch.int32)


class RequestError(RuntimeError):
    """A per-request failure reported by the executor (tensorrt_llm.executor.utils.RequestError)."""


@dataclasses.dataclass(kw_only=True)
class GuidedDecodingParams:
    """`tensorrt_llm.sampling_params.GuidedDecodingParams`: only one guide per request."""

    json: str | dict | None = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def _validate(self) -> None:
        num_guides = sum(bool(getattr(self, f.name)) for f in dataclasses.fields(self))
        if num_guides > 1:
            raise ValueError(f"Only one guide can be used for a request, but got {num_guides}.")


@dataclasses.dataclass(kw_only=True)
class SamplingParams:
    """SamplingParams (the fields the adapter may use); None = runtime default."""

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
    guided_decoding: GuidedDecodingParams | None = None
    return_perf_metrics: bool = False

    def __post_init__(self):
        if self.pad_id is None:
            self.pad_id = self.end_id
        self.best_of = self.best_of or self.n
        if self.guided_decoding is not None:
            self.guided_decoding._validate()
        if self.top_p is not None and not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.best_of < self.n:
            raise ValueError("best_of must be >= n")
        if self.best_of > 1 and self._greedy() and not os.environ.get("TLLM_ALLOW_N_GREEDY_DECODING", None):
            raise ValueError(
                "Greedy decoding in the LLM API does not allow multiple returns. Please set to best_of=1, got "
                f"best_of={self.best_of}. Please set to best_of=1 or set an environment variable "
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
    """CompletionOutput: cumulative token_ids/logprobs plus diff helpers."""

    def __init__(self, index: int):
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] = []
        self.cumulative_logprob: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.generation_logits = None
        self.request_perf_metrics = None
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
    """RequestOutput: async-iterable (yields itself per update) and `aresult()`."""

    def __init__(
        self, llm: LLM, rid: int, prompt_ids: list[int], params: SamplingParams, streaming: bool, stops, sampler: str
    ):
        self._llm = llm
        self.request_id = rid
        self.prompt = None
        self.prompt_token_ids = prompt_ids
        self.outputs = [CompletionOutput(i) for i in range(params.best_of)]
        self.finished = False
        self.context_logits = None
        self._params = params
        self._streaming = streaming
        self._stops = stops
        self._sampler = sampler  # "torch-legacy", "torch" (TorchSampler), "trtllm" (C++ sampler), "trt" (TRT flow)
        try:  # result.py: the async queue exists only when created on a running loop
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._events: asyncio.Queue = asyncio.Queue()
        self._error: BaseException | None = None
        self._aborted = False
        if llm.fake_cached_tokens:
            self.cached_tokens = 0

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
        name = res.finish_reasons[0].name if res.is_sequence_final else None
        values = list(res.log_probs[0][len(out.logprobs) :]) if res.log_probs is not None else None
        if name == "END_ID" and self._sampler in ("torch", "torch-legacy"):
            # TorchSampler: the end token is added before the request finishes by END_ID
            new.append(self._params.end_id)
            if values is not None:
                context = self.prompt_token_ids + out.token_ids + new[:-1]
                values.append(float(self._llm.fake_log_softmax(context, self._params)[self._params.end_id]))
        perf = getattr(res, "request_perf_metrics", None)
        if perf is not None:
            out.request_perf_metrics = perf
        if self._llm.fake_cached_tokens:  # the prepopulated prompt length (PR #7637)
            metrics = self._llm.fake_executor.fake_kv_metrics(self.request_id)
            if metrics is not None:
                self.cached_tokens = metrics["num_reused_blocks"] * self._llm.args.kv_cache_config.tokens_per_block
        base = self.prompt_token_ids + out.token_ids
        out.token_ids += new
        if values is not None:
            style = self._llm.fake_logprobs if self._sampler in ("torch", "torch-legacy") else "sampled"
            if style != "sampled":
                k = int(self._params.logprobs or 1)
                for i, token in enumerate(new):
                    dist = self._llm.fake_log_softmax(base + new[:i], self._params)
                    top = dist.topk(k)
                    entry = {}
                    if style == "sampled+topk":  # the sampled token first, with its rank
                        entry[token] = Logprob(float(dist[token]), int((dist > dist[token]).sum()) + 1)
                    for r, (t, v) in enumerate(zip(top.indices, top.values, strict=True)):
                        entry.setdefault(int(t), Logprob(float(v), r + 1))
                    out.logprobs.append(entry)
            else:
                out.logprobs += [{t: Logprob(v, 1)} for t, v in zip(new, values, strict=False)]
            out.cumulative_logprob = res.cum_log_probs[0] if res.cum_log_probs else None
        if res.is_sequence_final:
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
        if self._loop is None:
            raise AssertionError(
                "The asyncio event loop was not present during initialization, so async operations are not available."
            )
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
    """`tensorrt_llm.llmapi.KvCacheConfig`: a pydantic mirror, extra fields forbidden."""

    _fields: ClassVar[dict] = {
        "enable_block_reuse": True,
        "max_tokens": None,
        "free_gpu_memory_fraction": None,
        "host_cache_size": None,
        "enable_partial_reuse": True,
        "tokens_per_block": 32,
    }

    def __init__(self, **kwargs):
        unknown = set(kwargs) - set(self._fields)
        if unknown:
            raise ValueError(f"KvCacheConfig: extra fields not permitted: {sorted(unknown)}")
        for name, default in self._fields.items():
            setattr(self, name, kwargs.get(name, default))


class LLM:
    """`LLM(model, tokenizer=None, ..., **kwargs)` over an HF checkpoint directory; its args
    model forbids fields the release does not have (`fake_release_args`)."""

    fake_release: ClassVar[str] = "1.2.0"
    fake_backend: ClassVar[str] = "pytorch"
    fake_release_args: ClassVar[frozenset[str]] = frozenset({"sampler_type"})
    fake_sampler_types: ClassVar[frozenset[str]] = frozenset({"TRTLLMSampler", "TorchSampler", "auto"})
    fake_torch_sampler: ClassVar[str] = "torch-legacy"
    fake_cached_tokens: ClassVar[bool] = True
    fake_logprobs: ClassVar[str] = "topk"
    fake_ignore_eos_drops_stops: ClassVar[bool] = True
    fake_length_error: ClassVar[type[Exception]] = ValueError
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
        "guided_decoding_backend",
        "enable_chunked_prefill",
        "normalize_log_probs",
        "lora_config",
    }

    def __init__(self, model, tokenizer=None, **kwargs):
        unknown = set(kwargs) - self._llm_args - self.fake_release_args
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
        self.args.enable_chunked_prefill = bool(kwargs.get("enable_chunked_prefill", False))
        sampler_type = kwargs.get("sampler_type")
        if sampler_type is not None and sampler_type not in self.fake_sampler_types:
            raise ValueError(f"TorchLlmArgs: sampler_type: Input should be one of {sorted(self.fake_sampler_types)}")
        if self.fake_backend == "tensorrt":
            self.fake_sampler = "trt"
        elif sampler_type == "TRTLLMSampler" or kwargs.get("enable_trtllm_sampler"):
            self.fake_sampler = "trtllm"
        elif "use_torch_sampler" in self.fake_release_args and not kwargs.get("use_torch_sampler"):
            self.fake_sampler = "trtllm"  # PR #6216: the C++ sampler by default
        else:
            self.fake_sampler = self.fake_torch_sampler
        self._global_generator = random.Random(42)  # TorchSampler: one generator seeded 42 for all
        self.fake_module = trtllm_executor.make_module("1.0")
        tl = self.fake_module
        lora = kwargs.get("lora_config")
        self.args.lora_config = lora
        self.fake_lora_loads: list[int] = []
        self._lora_cpu: set[int] = set()
        engine = trtllm_executor.engine_config(
            vocab_size=int(hf["vocab_size"]),
            max_input_len=int(kwargs.get("max_input_len") or max_seq_len),
            max_seq_len=max_seq_len,
            max_batch_size=self.args.max_batch_size,
            max_num_tokens=self.args.max_num_tokens,
            tokens_per_block=self.args.kv_cache_config.tokens_per_block,
            lora_target_modules=_lora_modules(lora) if lora is not None else (),
            max_lora_rank=lora.max_lora_rank if lora is not None else 8,
            num_layers=int(hf.get("num_hidden_layers") or 2),
            hidden_size=int(hf.get("hidden_size") or 64),
            intermediate_size=hf.get("intermediate_size"),
            num_heads=int(hf.get("num_attention_heads") or 4),
            num_kv_heads=hf.get("num_key_value_heads"),
        )
        peft = None
        if lora is not None:
            module_layers = (lora.max_loras or 4) * int(hf.get("num_hidden_layers") or 2) * 8
            peft = tl.PeftCacheConfig(num_host_module_layer=module_layers, num_device_module_layer=module_layers)
        guided = None
        backend = kwargs.get("guided_decoding_backend")
        if backend is not None:
            if self.args.skip_tokenizer_init:  # llm.py: _xgrammar_tokenizer_info(self.tokenizer) with no tokenizer
                raise AttributeError("'NoneType' object has no attribute 'eos_token_id'")
            if backend not in ("xgrammar", "llguidance"):
                raise ValueError(
                    f"TorchLlmArgs: guided_decoding_backend must be 'xgrammar' or 'llguidance', got {backend}"
                )
            from transformers import AutoTokenizer

            hf_tok = AutoTokenizer.from_pretrained(tokenizer or model)
            vocab = hf_tok.get_vocab()
            guided = tl.GuidedDecodingConfig(
                tl.GuidedDecodingConfig.GuidedDecodingBackend.XGRAMMAR,  # the executor double's decoder
                encoded_vocab=[t for t, _ in sorted(vocab.items(), key=lambda x: x[1])],
                tokenizer_str=hf_tok.backend_tokenizer.to_str(),
                stop_token_ids=[hf_tok.eos_token_id],
            )
        self.fake_guided_backend = backend
        config = tl.ExecutorConfig(
            max_beam_width=1,
            max_batch_size=self.args.max_batch_size,
            max_num_tokens=self.args.max_num_tokens,
            kv_cache_config=tl.KvCacheConfig(enable_block_reuse=self.args.kv_cache_config.enable_block_reuse),
            enable_chunked_context=self.args.enable_chunked_prefill,
            # llm.py: normalize_log_probs from the LLM's args (False); the PyTorch backend's
            # samplers do not normalize either (PR #12366's description)
            normalize_log_probs=bool(kwargs.get("normalize_log_probs", False)),
            guided_decoding_config=guided,
            peft_cache_config=peft,
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
        self,
        inputs,
        sampling_params: SamplingParams | None = None,
        streaming: bool = False,
        lora_request: LoRARequest | None = None,
        **_ignored,
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
        if not self.args.enable_chunked_prefill and len(prompt) > self.args.max_num_tokens:  # _check_arguments
            raise self.fake_length_error(
                f"The sum of prompt length ({float(len(prompt))}), query length (0) should not exceed max_num_tokens "
                f"({self.args.max_num_tokens})"
            )
        room = self.args.max_seq_len - len(prompt)
        if room <= 0:  # base_worker.py _deduce_max_tokens raises ValueError, wrapped in RequestError
            raise RequestError(
                f"`default_max_tokens` ({room}) must be greater than 0, `default_max_tokens` ({room}) = max_seq_len "
                f"({self.args.max_seq_len}) - `splited_prompt_len` ({len(prompt)})"
            )
        tl = self.fake_module
        lora = None
        if lora_request is not None:
            if self.args.lora_config is None:
                raise ValueError("LoRA request given but the LLM was built without a lora_config")
            uid = lora_request.adapter_id
            if uid in self._lora_cpu:
                lora = tl.LoraConfig(task_id=uid)
            else:
                import torch

                weights, config = _convert_lora(lora_request.lora_path, torch.float16)
                self._lora_cpu.add(uid)
                self.fake_lora_loads.append(uid)
                lora = tl.LoraConfig(task_id=uid, weights=weights, config=config)
        width = p.best_of
        torch_sampler = self.fake_sampler == "torch-legacy"
        sc = {
            "beam_width": 1,
            "num_return_sequences": width if width > 1 else None,
            # early TorchSampler: the client's seed is not used; draws come from the shared generator
            "seed": self._global_generator.randrange(1 << 63) if torch_sampler else p.seed,
            "min_tokens": p.min_tokens,
        }
        if not torch_sampler:  # the early TorchSampler has no penalty or min_p code
            sc |= {
                "repetition_penalty": p.repetition_penalty,
                "presence_penalty": p.presence_penalty,
                "frequency_penalty": p.frequency_penalty,
                "min_p": p.min_p,
            }
        if not p._greedy():
            sc |= {"top_k": p.top_k, "top_p": p.top_p, "temperature": p.temperature}
        stops = [[t] for t in (p.stop_token_ids or [])]
        if p.ignore_eos and self.fake_ignore_eos_drops_stops:  # base_worker.py: stop_words=[] if ignore_eos
            stops = []
        request = tl.Request(
            input_token_ids=prompt,
            max_tokens=max(1, min(p.max_tokens, room)),
            streaming=streaming,
            sampling_config=tl.SamplingConfig(**{k: v for k, v in sc.items() if v is not None}),
            output_config=tl.OutputConfig(
                return_log_probs=p.logprobs is not None,
                exclude_input_from_output=True,
                return_perf_metrics=p.return_perf_metrics,
            ),
            end_id=-1 if p.ignore_eos else p.end_id,
            pad_id=p.pad_id,
            stop_words=stops or None,
            bad_words=[[t] for t in p.bad_token_ids] if p.bad_token_ids else None,
            embedding_bias=p.embedding_bias,
            client_id=next(self._client_ids),
            return_all_generated_tokens=False,
            guided_decoding_params=_executor_guide(tl, p.guided_decoding),
            lora_config=lora,
        )
        with self._lock:
            rid = self.fake_executor.enqueue_request(request)
            out = RequestOutput(self, rid, prompt, p, streaming, stops, self.fake_sampler)
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
                        if out._loop is not None:
                            out._loop.call_soon_threadsafe(out._on_failure, RuntimeError(f"Executor worker died: {e}"))
                return
            for r in responses:
                with self._lock:
                    out = self._outputs.get(r.request_id)
                    if out is not None and (r.has_error() or r.result.is_final):
                        del self._outputs[r.request_id]
                if out is not None and out._loop is not None:
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
    def fake_log_softmax(self, context: list[int], params: SamplingParams):
        """The distribution TorchSampler takes its top-k logprobs from."""
        x = self.fake_executor.model.logits(context)
        if params.embedding_bias is not None:
            x[: len(params.embedding_bias)] += params.embedding_bias
        return x.log_softmax(-1)

    def fake_kill(self, message: str = "executor worker died") -> None:
        self.fake_executor.fake_kill(message)

    def fake_fail_submit(self, error: BaseException) -> None:
        """Make the next generate_async raise `error`."""
        self._fail_submit = error


def _executor_guide(tl, g: GuidedDecodingParams | None):
    """`SamplingParams._get_guided_decoding_params`."""
    if g is None:
        return None
    types = tl.GuidedDecodingParams.GuideType
    if g.json_object:
        return tl.GuidedDecodingParams(types.JSON)
    if g.json is not None:
        text = g.json if isinstance(g.json, str) else json.dumps(g.json)
        return tl.GuidedDecodingParams(types.JSON_SCHEMA, text)
    if g.regex is not None:
        return tl.GuidedDecodingParams(types.REGEX, g.regex)
    if g.grammar is not None:
        return tl.GuidedDecodingParams(types.EBNF_GRAMMAR, g.grammar)
    if g.structural_tag is not None:
        return tl.GuidedDecodingParams(types.STRUCTURAL_TAG, g.structural_tag)
    return None


@dataclasses.dataclass(frozen=True)
class Release:
    """What changes between the LLM API releases the double models.

    Attributes:
        sampler_args: the LLM args that pick the sampler.
        sampler_types: `llm_args.SamplerType` members, where the release has the enum.
        torch_sampler: the TorchSampler of the release ("torch-legacy" or "torch").
        logprobs: how TorchSampler fills `CompletionOutput.logprobs`: "sampled" (the sampled
            token only), "topk" (the top-k of log_softmax), "sampled+topk" (the sampled token,
            then the top-k).
        ignore_eos_drops_stops: the worker sends `stop_words=[]` with ignore_eos.
        length_error: what `_check_arguments` raises for a prompt over max_num_tokens.
        version: `tensorrt_llm.__version__`.
        cached_tokens: the RequestOutput carries `cached_tokens` (PR #7637).
    """

    sampler_args: frozenset[str]
    sampler_types: frozenset[str]
    torch_sampler: str
    logprobs: str
    ignore_eos_drops_stops: bool
    length_error: type[Exception]
    version: str
    cached_tokens: bool = True


_SAMPLER_TYPES = frozenset({"TRTLLMSampler", "TorchSampler", "auto"})
RELEASES = {
    # 1.0: `enable_trtllm_sampler` (docs/source/1.0/features/sampling.md)
    "1.0.0": Release(
        frozenset({"enable_trtllm_sampler"}), frozenset(), "torch-legacy", "sampled", False, ValueError, "1.0.0", False
    ),
    # PR #6216 (July 2025) to PR #6831 (August 2025): `use_torch_sampler`, TRTLLMSampler by default
    "1.1.0rc0": Release(
        frozenset({"use_torch_sampler"}), frozenset(), "torch-legacy", "topk", True, ValueError, "1.1.0rc0", False
    ),
    # PR #6831: `sampler_type` (auto -> TorchSampler)
    "1.2.0": Release(frozenset({"sampler_type"}), _SAMPLER_TYPES, "torch-legacy", "topk", True, ValueError, "1.2.0"),
    "1.3.0": Release(
        frozenset({"sampler_type"}), _SAMPLER_TYPES, "torch-legacy", "topk", True, RequestError, "1.3.0rc10"
    ),
    # PR #18232 (2026-08-26): TRTLLMSampler and `sampler_type` removed; TorchSampler has PRs
    # #16485 (penalties), #16590 (min_p), #17172 (per-request seeds)
    "1.4.0": Release(frozenset(), frozenset(), "torch", "sampled+topk", True, RequestError, "1.4.0rc4"),
}


def install(
    monkeypatch, *, version: str = "1.2.0", backend: str = "pytorch", sampler_switch: bool = True
) -> types.ModuleType:
    """Put the LLM API double into sys.modules as `tensorrt_llm` (with `tensorrt_llm.llmapi`,
    `tensorrt_llm.llmapi.llm_args`, `tensorrt_llm.executor`, and
    `tensorrt_llm.bindings.executor` -- without `Executor` from 1.3, as after v1.3.0rc20);
    returns the top-level module.

    Args:
        version: one of RELEASES.
        backend: "pytorch" (the 1.x default) or "tensorrt" (the TRT flow).
        sampler_switch: False models a release whose LLM args have no way to pick the C++
            sampler (the early TorchSampler only).
    """
    import sys

    release = RELEASES[version]
    top = types.ModuleType("tensorrt_llm")
    top.__version__ = release.version
    top.SamplingParams = SamplingParams
    top.fake_instances = []

    class TrackedLLM(LLM):
        fake_release = version
        fake_backend = backend
        fake_release_args = release.sampler_args if sampler_switch else frozenset()
        fake_sampler_types = release.sampler_types if sampler_switch else frozenset()
        fake_torch_sampler = release.torch_sampler
        fake_logprobs = release.logprobs
        fake_ignore_eos_drops_stops = release.ignore_eos_drops_stops
        fake_length_error = release.length_error
        fake_cached_tokens = release.cached_tokens

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            top.fake_instances.append(self)

    class TorchLlmArgs:  # the pydantic args model: its fields are what LLM(**kwargs) accepts
        model_fields: ClassVar[dict[str, None]] = dict.fromkeys(LLM._llm_args | TrackedLLM.fake_release_args)

    top.LLM = TrackedLLM
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.KvCacheConfig = KvCacheConfig
    llmapi.LLM = TrackedLLM
    llmapi.SamplingParams = SamplingParams
    llmapi.GuidedDecodingParams = GuidedDecodingParams
    llmapi.TorchLlmArgs = TorchLlmArgs
    llm_args = types.ModuleType("tensorrt_llm.llmapi.llm_args")
    llm_args.TorchLlmArgs = TorchLlmArgs
    if TrackedLLM.fake_sampler_types:
        llm_args.SamplerType = enum.Enum("SamplerType", {name: name for name in sorted(TrackedLLM.fake_sampler_types)})
    llmapi.llm_args = llm_args
    executor_pkg = types.ModuleType("tensorrt_llm.executor")
    executor_utils = types.ModuleType("tensorrt_llm.executor.utils")
    executor_pkg.RequestError = executor_utils.RequestError = RequestError
    executor_pkg.LoRARequest = LoRARequest
    lora_helper = types.ModuleType("tensorrt_llm.lora_helper")
    lora_helper.LoraConfig = LoraConfig
    top.lora_helper = lora_helper
    bindings_exec = trtllm_executor.make_module("1.0")
    if version >= "1.3":
        del bindings_exec.Executor  # PR #16369: the Executor binding class is gone
    bindings = types.ModuleType("tensorrt_llm.bindings")
    bindings.executor = bindings_exec
    top.llmapi, top.executor, top.bindings = llmapi, executor_pkg, bindings
    for name, module in {
        "tensorrt_llm": top,
        "tensorrt_llm.llmapi": llmapi,
        "tensorrt_llm.llmapi.llm_args": llm_args,
        "tensorrt_llm.executor": executor_pkg,
        "tensorrt_llm.executor.utils": executor_utils,
        "tensorrt_llm.lora_helper": lora_helper,
        "tensorrt_llm.bindings": bindings,
        "tensorrt_llm.bindings.executor": bindings_exec,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    return top
