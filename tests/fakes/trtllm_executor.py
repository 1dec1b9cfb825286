"""A faithful double of `tensorrt_llm.bindings.executor` (the C++ executor's Python bindings).

One era per upstream binding shape, each rebuilt from the bindings' own source
(NVIDIA/TensorRT-LLM `cpp/tensorrt_llm/pybind/executor/bindings.cpp`, later `request.cpp`,
`executorConfig.cpp`, `executor.cpp`); `make_module(era)` returns a module-shaped object:

  era    | upstream source read                        | shape
  -------|---------------------------------------------|------------------------------------------------
  "0.11" | bindings.cpp at 0.11.0.dev2024062500 (main,  | Request(input_token_ids, max_new_tokens, streaming,
         | the 0.11 branch point; v0.11.0 = 05316d33)   | ...) and SamplingConfig(beam_width, top_k, ...,
         |                                              | random_seed, temperature, min_length, ...,
         |                                              | no_repeat_ngram_size) positional-or-keyword, old
         |                                              | names only; no num_return_sequences; Result
         |                                              | without finish_reasons/sequence_index; Response
         |                                              | without client_id; ExecutorConfig takes
         |                                              | max_batch_size in the constructor only (no
         |                                              | property), no max_num_tokens/max_queue_size;
         |                                              | CapacitySchedulerPolicy without STATIC_BATCH; no
         |                                              | module __version__; block reuse off by default
  "0.15" | bindings.cpp with `py::kw_only()` and        | keyword-only after input_token_ids; max_tokens or
         | "max_new_tokens is being deprecated"          | max_new_tokens (new wins), seed/random_seed,
         |                                              | min_tokens/min_length; FinishReason with 4 values;
         |                                              | finish_reasons/sequence_index/is_sequence_final;
         |                                              | client_id; num_return_sequences on the Request
         |                                              | (Triton's model.py v0.14-v0.15 sets it there), not
         |                                              | on SamplingConfig; no min_p
  "1.0"  | request.cpp (pybind and nanobind), 1.x       | Request(input_token_ids, max_tokens, *, ...); new
         |                                              | names only; FinishReason adds TIMED_OUT and
         |                                              | CANCELLED; SamplingConfig has num_return_sequences
         |                                              | and min_p; block reuse on by default; guided
         |                                              | decoding (below)
  "1.3"  | the same files in the 1.3.0rc releases that  | as "1.0", except that ExecutorConfig's
         | still ship the executor (up to rc20), after  | normalize_log_probs defaults to False
         | PR #12366 (March 2026, "Do not normalize log |
         | probs by default", executorConfig.h)         |

Log probabilities (every era): `ExecutorConfig.normalize_log_probs` (True by default until
PR #12366) makes the decoder report each token's logprob in the distribution it was drawn
from after temperature and top-k/top-p truncation, renormalized: a greedy token's is then 0.0
(triton-inference-server/tensorrtllm_backend issue #276: "the default setting is greedy search
and the probability of candidate is always 1. And hence the log prob is always 0";
NVIDIA/TensorRT-LLM issue #2406 on 0.14, "TRTGptModel normalizeLogProbs: 1"). With it off
the value is the token's logprob in the model's full distribution (after logit bias and
penalties), which is what the double computes from its FakeModel.

Guided decoding (era "1.0"; absent before, as in 0.11-0.15: first released in 0.16.0):
`GuidedDecodingParams(guide_type, guide=None)` with `GuidedDecodingParams.GuideType` (JSON,
JSON_SCHEMA, REGEX, EBNF_GRAMMAR, STRUCTURAL_TAG) and read-only `guide_type`/`guide`; the
Request's `guided_decoding_params` (refused with beam search: requestImpl.h "Guided decoding
does not support with beam search."); `GuidedDecodingConfig(backend, encoded_vocab=None,
tokenizer_str=None, stop_token_ids=None)` with `GuidedDecodingConfig.GuidedDecodingBackend`
(XGRAMMAR, LLGUIDANCE) as `ExecutorConfig(guided_decoding_config=...)`. The executor then
behaves as `batch_manager/guidedDecoder.cpp`: LLGUIDANCE is refused at construction ("LLGuidance
is not supported for guided decoding in C++ runtime."); the tokenizer comes from encoded_vocab
and tokenizer_str with the padded vocabulary size; each guided request's grammar is compiled at
its first context step by `GuidedDecoder::build`, which runs inside `forwardAsync` for the whole
scheduled batch (JSON: the builtin JSON grammar; JSON_SCHEMA: `CompileJSONSchema`; REGEX:
`Grammar::FromRegex`; EBNF_GRAMMAR: `Grammar::FromEBNF`), and its token mask is applied to
the logits before sampling, the matcher advancing with each token. A guide that does not
compile throws there, and `forwardAsync`'s handler (`trtGptModelInflightBatching.cpp`,
`executorImpl.cpp` `terminateActiveRequests`) fails every active request with "Encountered an
error in forwardAsync function: ...". The double decides what compiles with XGrammar itself
where the `xgrammar` package is importable (the same calls through its Python API), else with
llguidance, and builds the masks with llguidance (the grammar library this project ships); the
masks are what each guide allows either way. Guided parameters on an executor without a
GuidedDecodingConfig are refused with an error response for that request (no GuidedDecoder
exists to honour them; the wording of that error is the double's).

KV-cache block reuse (every era, when `KvCacheConfig.enable_block_reuse` is on; it needs an
engine built with paged context FMHA): a request's prompt is looked up as a chain of full blocks
of `build_config.plugin_config.tokens_per_block` tokens over its first `prompt length - 1`
tokens (`BlockManager::addSequence`, `kvCacheManager.cpp`: the last prompt token is always
computed), and the full blocks of its prompt are stored for reuse once its context phase is
done, the least recently used beyond `fake_reuse_capacity` blocks evicted. Partial reuse of a
block (1.x `enable_partial_reuse`) is not modelled. What each era reports of it:
  * "0.11", "0.15": nothing per request (`Result` has no `request_perf_metrics`: Triton's
    tensorrtllm_backend reads it from v0.16.0), and no KV cache events;
  * "1.0", "1.3": `OutputConfig(return_perf_metrics=True)` puts a `RequestPerfMetrics` on every
    result whose `kv_cache_metrics` has `num_total_allocated_blocks`, `num_new_allocated_blocks`,
    `num_reused_blocks`, `num_missed_blocks` and `kv_cache_hit_rate` (`request.cpp`
    `KvCacheMetrics`); `KvCacheConfig(event_buffer_max_size=N)` (N > 0) makes
    `Executor.get_kv_cache_event_manager()` return a `KVCacheEventManager` whose
    `get_latest_events(timeout=None)` drains `KVCacheEvent(event_id, data)`s: one
    `KVCacheCreatedData` at start, a `KVCacheStoredData(parent_hash, blocks)` per stored chain
    (`KVCacheStoredBlockData(block_hash, tokens, lora_id, cache_level, priority)`), a
    `KVCacheRemovedData(block_hashes)` per eviction (`bindings.cpp`, the `kv_cache` submodule);
    without a buffer it returns None.

LoRA (every era: `LoraConfig(task_id, weights=None, config=None)` and `PeftCacheConfig(
num_host_module_layer=0, num_device_module_layer=0, optimal_adapter_size=8, max_adapter_size=64,
..., device_cache_percent=None, host_cache_size=None)` in `ExecutorConfig(peft_cache_config=...)`;
that 0.11's PeftCacheConfig already has the last two is [UNCONFIRMED]): the engine's config.json
records `plugin_config.lora_plugin` and `build_config.lora_config` when built with the LoRA
plugin, and a request's LoraConfig is checked and cached as the executor does when it fetches
the request (`_FakePeftCache`: `peftCacheManager.cpp`, `loraUtils.cpp`), including "LoRA task
<id> not found in cache. Please send LoRA weights with request" for a task id without weights
that the cache does not hold. A cached adapter shifts the fake model's logits by a function of
its weights, so different adapters give different tokens.

Behaviour common to every era, from the same sources: `LlmRequest::createResponse` sends
`log_probs` cumulative (all generated so far) and `context_logits` on every result when
asked; `LlmRequest::validate` clips max_tokens to max_seq_len - prompt with a warning; the
embedding bias must be [vocab_size] of the unpadded vocabulary (the decoder checks
`ModelConfig::getVocabSize()`), while logits are padded to the world size
(`getVocabSizePadded(tp * pp)`); `await_responses` takes a timedelta or a float of seconds
(pybind11/nanobind chrono casters) and refuses an int.

The fake "GPU" is an execution-loop thread stepping a FakeModel: one token per active
sequence per iteration, context phases split by max_num_tokens when chunked context is on.
What upstream source leaves open is marked [UNCONFIRMED] where the double models it.

Test hooks (not part of the real API) are prefixed `fake_`: pause/resume the loop, fail the
next forward step, kill the executor, and inspect what the adapter sent (`fake_requests`,
`fake_cancel_calls`).
"""

from __future__ import annotations

import collections
import datetime
import enum
import inspect
import itertools
import json
import logging
import math
import random
import threading
import time
import types
from collections.abc import Sequence
from pathlib import Path

import torch

from tests.fakes.trtllm_model import FakeModel

log = logging.getLogger("tensorrt_llm.fake")

_EMPTY = inspect.Parameter.empty
K_MAX_BEAM_WIDTH = 1024
ERAS = ("0.11", "0.15", "1.0", "1.3")
VERSIONS = {"0.11": "0.11.0", "0.15": "0.15.0", "1.0": "1.0.0", "1.3": "1.3.0rc20"}


def _signature(positional: Sequence[tuple[str, object]], keyword_only: Sequence[tuple[str, object]] = ()):
    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d) for n, d in positional]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d) for n, d in keyword_only]
    return inspect.Signature(params)


def _read_only_config(cls_name: str, sig: inspect.Signature) -> type:
    """A config class as pybind11 binds it with read-only properties: constructed by `sig`
    (`_bind`), its fields readable, none settable."""

    def __init__(self, *args, **kwargs):
        object.__setattr__(self, "_v", _bind(sig, cls_name, args, kwargs))

    def __getattr__(self, name):
        v = object.__getattribute__(self, "_v")
        if name in v:
            return v[name]
        raise AttributeError(name)

    def __setattr__(self, name, value):
        raise AttributeError(f"can't set attribute {name!r}")

    return type(cls_name, (), {"__init__": __init__, "__getattr__": __getattr__, "__setattr__": __setattr__})


def _bind(sig: inspect.Signature, cls_name: str, args, kwargs) -> dict:
    """Bind like pybind11 does: wrong arguments raise TypeError ("incompatible constructor
    arguments")."""
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(
            f"{cls_name}.__init__(): incompatible constructor arguments ({e}). Invoked with: "
            f"{args!r}, kwargs: {kwargs!r}"
        ) from None
    bound.apply_defaults()
    return dict(bound.arguments)


def _check(cond: bool, what: str) -> None:
    """TLLM_CHECK: surfaces in Python as RuntimeError (pybind11 translates std::runtime_error)."""
    if not cond:
        raise RuntimeError(f"[TensorRT-LLM][ERROR] Assertion failed: {what}")


def make_module(era: str = "1.0", *, rank: int = 0, first_request_id: int | None = None) -> types.ModuleType:
    """A module-shaped fake of `tensorrt_llm.bindings.executor` for one binding era.

    Args:
        era: "0.11", "0.15", "1.0" or "1.3" (see the module docstring).
        rank: this process's MPI rank; only rank 0 may enqueue (leader mode).
        first_request_id: the first id `enqueue_request` returns (default random, so tests
            cannot depend on it).
    """
    if era not in ERAS:
        raise ValueError(f"era must be one of {ERAS}")
    m = types.ModuleType("tensorrt_llm.bindings.executor")
    m.fake_era = era
    early, late = era == "0.11", era in ("1.0", "1.3")
    m.fake_rank = rank
    m.fake_instances = []
    m.fake_leader_shutdown = threading.Event()
    m.fake_follower_waiting = threading.Event()  # a non-leader rank is blocked in shutdown()
    m.fake_first_request_id = first_request_id if first_request_id is not None else random.randrange(1, 1 << 20)
    if not early:
        m.__version__ = VERSIONS[era]  # `m.attr("__version__") = tle::version()` from 0.12

    # ------------------------------------------------------------------ enums
    m.ModelType = enum.IntEnum(
        "ModelType",
        {"DECODER_ONLY": 0, "ENCODER_ONLY": 1, "ENCODER_DECODER": 2},
    )
    if not early:
        reasons = {"NOT_FINISHED": 0, "END_ID": 1, "STOP_WORDS": 2, "LENGTH": 3}
        if late:
            reasons |= {"TIMED_OUT": 4, "CANCELLED": 5}
        m.FinishReason = enum.IntEnum("FinishReason", reasons)
    policies = {"MAX_UTILIZATION": 0, "GUARANTEED_NO_EVICT": 1} | ({} if early else {"STATIC_BATCH": 2})
    policy = enum.IntEnum("CapacitySchedulerPolicy", policies)
    m.CapacitySchedulerPolicy = policy
    m.BatchingType = enum.IntEnum("BatchingType", {"STATIC": 0, "INFLIGHT": 1})
    m.RequestStage = enum.IntEnum(
        "RequestStage",
        {
            "QUEUED": 0,
            "ENCODER_IN_PROGRESS": 1,
            "CONTEXT_IN_PROGRESS": 2,
            "GENERATION_IN_PROGRESS": 3,
            "GENERATION_COMPLETE": 4,
        },
    )

    # ------------------------------------------------------------------ SamplingConfig
    canonical = [
        "top_k",
        "top_p",
        "top_p_min",
        "top_p_reset_ids",
        "top_p_decay",
        "seed",
        "temperature",
        "min_tokens",
        "beam_search_diversity_rate",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "length_penalty",
        "early_stopping",
    ]
    if early:
        names = [{"seed": "random_seed", "min_tokens": "min_length"}.get(n, n) for n in canonical]
        names.append("no_repeat_ngram_size")
        sc_sig = _signature([("beam_width", 1)] + [(n, None) for n in names])
        sc_aliases = {"random_seed": "seed", "min_length": "min_tokens"}
        sc_readable = {"beam_width", *names}
    else:
        extra = ["no_repeat_ngram_size"] + (["num_return_sequences", "min_p"] if late else [])
        kw = canonical + extra + ([] if late else ["random_seed", "min_length"])
        sc_sig = _signature([("beam_width", 1)], [(n, None) for n in kw])
        sc_aliases = {} if late else {"random_seed": "seed", "min_length": "min_tokens"}
        sc_readable = {"beam_width", *canonical, *extra, *sc_aliases}

    class SamplingConfig:
        """`samplingConfig.cpp`: all fields Optional, None = runtime default, unset fields read back None;
        validated in the constructor (TLLM_CHECK)."""

        def __init__(self, *args, **kwargs):
            v = _bind(sc_sig, "SamplingConfig", args, kwargs)
            for old, new in sc_aliases.items():
                if era == "0.15" and v.get(old) is not None:
                    log.warning("%s is being deprecated; please use %s instead.", old, new)
                    if v.get(new) is None:  # "the new name wins if both given"
                        v[new] = v[old]
                if old in v:
                    value = v.pop(old)
                    if early:
                        v[new] = value
            seed = v.get("seed")
            if seed is not None and not (isinstance(seed, int) and 0 <= seed < 1 << 64):
                raise TypeError(f"SamplingConfig: seed must be an unsigned 64-bit int, got {seed!r}")
            self._v = v
            self._validate()

        def _validate(self) -> None:
            g = self._v.get
            _check(0 < g("beam_width") <= K_MAX_BEAM_WIDTH, "beamWidth > 0")
            _check(g("top_k") is None or g("top_k") >= 0, "topK >= 0")
            _check(g("top_p") is None or 0 < g("top_p") <= 1, "topP > 0.f && topP <= 1.f")
            _check(g("top_p_min") is None or 0 <= g("top_p_min") <= 1, "topPMin")
            _check(g("top_p_reset_ids") is None or g("top_p_reset_ids") >= 0, "topPResetIds >= 0")
            _check(g("top_p_decay") is None or 0 < g("top_p_decay") <= 1, "topPDecay")
            _check(g("temperature") is None or g("temperature") >= 0, "temperature >= 0")
            _check(g("min_tokens") is None or g("min_tokens") >= 0, "minTokens >= 0")
            _check(g("repetition_penalty") is None or g("repetition_penalty") > 0, "repetitionPenalty > 0")
            _check(g("length_penalty") is None or g("length_penalty") >= 0, "lengthPenalty >= 0")
            _check(g("early_stopping") is None or g("early_stopping") >= 0, "earlyStopping >= 0")
            _check(g("no_repeat_ngram_size") is None or g("no_repeat_ngram_size") >= 0, "noRepeatNgramSize >= 0")
            _check(
                g("beam_search_diversity_rate") is None or g("beam_search_diversity_rate") >= 0,
                "beamSearchDiversityRate >= 0",
            )
            nrs = g("num_return_sequences")
            _check(
                nrs is None or (nrs > 0 and (g("beam_width") == 1 or nrs <= g("beam_width"))),
                "numReturnSequences > 0 && (beamWidth == 1 || numReturnSequences <= beamWidth)",
            )
            _check(g("min_p") is None or 0 <= g("min_p") <= 1, "minP >= 0 && minP <= 1")

        def __getattr__(self, name):
            if name.startswith("_") or name not in sc_readable:
                raise AttributeError(name)
            return self._v.get(sc_aliases.get(name, name))

        def __setattr__(self, name, value):
            if name == "_v":
                object.__setattr__(self, name, value)
            elif name not in sc_readable:
                raise AttributeError(f"can't set attribute {name!r}")
            else:
                self._v[sc_aliases.get(name, name)] = value
                self._validate()

        def __repr__(self):
            return f"SamplingConfig({ {k: v for k, v in self._v.items() if v is not None} })"

    m.SamplingConfig = SamplingConfig

    # ------------------------------------------------------------------ OutputConfig
    oc_fields = [
        ("return_log_probs", False),
        ("return_context_logits", False),
        ("return_generation_logits", False),
        ("exclude_input_from_output", False),
    ]
    oc_fields += [("return_encoder_output", False)] + ([] if early else [("return_perf_metrics", False)])
    oc_sig = _signature(oc_fields)

    class OutputConfig:
        """read/write attributes."""

        def __init__(self, *args, **kwargs):
            self.__dict__.update(_bind(oc_sig, "OutputConfig", args, kwargs))

    m.OutputConfig = OutputConfig

    # ------------------------------------------------------------------ guided decoding (1.0)
    if late:
        guide_types = enum.IntEnum(
            "GuideType", {"JSON": 0, "JSON_SCHEMA": 1, "REGEX": 2, "EBNF_GRAMMAR": 3, "STRUCTURAL_TAG": 4}
        )
        gdp_sig = _signature([("guide_type", _EMPTY), ("guide", None)])

        class GuidedDecodingParams:
            """request.cpp: (guide_type, guide=None); read-only properties."""

            GuideType = guide_types

            def __init__(self, *args, **kwargs):
                v = _bind(gdp_sig, "GuidedDecodingParams", args, kwargs)
                if not isinstance(v["guide_type"], guide_types):
                    raise TypeError("GuidedDecodingParams.__init__(): incompatible constructor arguments (guide_type)")
                object.__setattr__(self, "_v", v)

            @property
            def guide_type(self):
                return self._v["guide_type"]

            @property
            def guide(self):
                return self._v["guide"]

            def __setattr__(self, name, value):
                raise AttributeError(f"can't set attribute {name!r}")

        backend_enum = enum.IntEnum("GuidedDecodingBackend", {"XGRAMMAR": 0, "LLGUIDANCE": 1})
        gdc_sig = _signature(
            [("backend", _EMPTY), ("encoded_vocab", None), ("tokenizer_str", None), ("stop_token_ids", None)]
        )

        class GuidedDecodingConfig:
            """executorConfig.cpp: (backend, encoded_vocab=None, tokenizer_str=None,
            stop_token_ids=None); read/write properties."""

            GuidedDecodingBackend = backend_enum

            def __init__(self, *args, **kwargs):
                v = _bind(gdc_sig, "GuidedDecodingConfig", args, kwargs)
                if not isinstance(v["backend"], backend_enum):
                    raise TypeError("GuidedDecodingConfig.__init__(): incompatible constructor arguments (backend)")
                self.__dict__.update(v)

        m.GuidedDecodingParams = GuidedDecodingParams
        m.GuidedDecodingConfig = GuidedDecodingConfig

    # ------------------------------------------------------------------ Request
    common_req = [
        ("streaming", False),
        ("sampling_config", None),
        ("output_config", None),
        ("end_id", None),
        ("pad_id", None),
        ("bad_words", None),
        ("stop_words", None),
        ("embedding_bias", None),
        ("prompt_tuning_config", None),
        ("lora_config", None),
        ("logits_post_processor_name", None),
    ]
    if early:  # bindings.cpp at 0.11: positional-or-keyword, old name only, no client_id
        req_sig = _signature(
            [("input_token_ids", _EMPTY), ("max_new_tokens", _EMPTY), *common_req, ("encoder_input_token_ids", None)]
        )
    else:
        later = [("client_id", None), ("return_all_generated_tokens", False), ("priority", 0.5)]
        if not late:  # keyword-only, both names, num_return_sequences on the Request
            req_sig = _signature(
                [("input_token_ids", _EMPTY)],
                [("max_tokens", None), ("max_new_tokens", None), *common_req, *later, ("num_return_sequences", 1)],
            )
        else:
            req_sig = _signature(
                [("input_token_ids", _EMPTY), ("max_tokens", _EMPTY)],
                [*common_req, *later, ("guided_decoding_params", None), ("allotted_time_ms", None)],
            )

    class Request:
        """constructor names by era; read-only properties."""

        def __init__(self, *args, **kwargs):
            v = _bind(req_sig, "Request", args, kwargs)
            if era == "0.15":
                if v.get("max_new_tokens") is not None:
                    log.warning("max_new_tokens is being deprecated; please use max_tokens instead.")
                    if v.get("max_tokens") is None:
                        v["max_tokens"] = v["max_new_tokens"]
                if v.get("max_tokens") is None:
                    raise TypeError("Request.__init__(): missing required argument max_tokens")
                v.pop("max_new_tokens")
            elif early:
                v["max_tokens"] = v.pop("max_new_tokens")
            ids = v["input_token_ids"]
            _check(isinstance(ids, list) and len(ids) > 0, "inputTokenIds must not be empty")
            _check(isinstance(v["max_tokens"], int) and v["max_tokens"] > 0, "maxTokens > 0")
            if v["sampling_config"] is None:
                v["sampling_config"] = SamplingConfig()
            if v["output_config"] is None:
                v["output_config"] = OutputConfig()
            for words in ("bad_words", "stop_words"):
                w = v.get(words)
                _check(w is None or all(isinstance(x, list) and x for x in w), f"{words}: list of non-empty lists")
            if v.get("guided_decoding_params") is not None and v["sampling_config"].beam_width > 1:
                raise RuntimeError("[TensorRT-LLM][ERROR] Guided decoding does not support with beam search.")
            object.__setattr__(self, "_v", v)

        def __getattr__(self, name):
            v = object.__getattribute__(self, "_v")
            if name == "max_new_tokens" and not late:
                return v["max_tokens"]
            if name == "max_tokens" and early:
                raise AttributeError(name)
            if name in v:
                return v[name]
            raise AttributeError(name)

        def __setattr__(self, name, value):
            raise AttributeError(f"can't set attribute {name!r}")

    m.Request = Request

    # ------------------------------------------------------------------ Result / Response
    result_fields = [
        "is_final",
        "output_token_ids",
        "cum_log_probs",
        "log_probs",
        "context_logits",
        "generation_logits",
    ]
    if not early:
        result_fields += ["finish_reasons", "sequence_index", "is_sequence_final", "decoding_iter"]
    if late:
        result_fields += ["request_perf_metrics"]

    class Result:
        """read/write struct, constructible for tests; 0.11 lacks finish_reasons and
        sequence fields."""

        __slots__ = tuple(result_fields)

        def __init__(self):
            self.is_final = False
            self.output_token_ids = []
            self.cum_log_probs = None
            self.log_probs = None
            self.context_logits = None
            self.generation_logits = None
            if not early:
                self.finish_reasons = []
                self.sequence_index = 0
                self.is_sequence_final = False
                self.decoding_iter = 0
            if late:
                self.request_perf_metrics = None

    m.Result = Result
    if late:
        m.KvCacheMetrics = types.SimpleNamespace
        m.RequestPerfMetrics = types.SimpleNamespace
        kv_events = types.SimpleNamespace(
            KVCacheCreatedData=type("KVCacheCreatedData", (types.SimpleNamespace,), {}),
            KVCacheStoredData=type("KVCacheStoredData", (types.SimpleNamespace,), {}),
            KVCacheStoredBlockData=type("KVCacheStoredBlockData", (types.SimpleNamespace,), {}),
            KVCacheRemovedData=type("KVCacheRemovedData", (types.SimpleNamespace,), {}),
            KVCacheEvent=type("KVCacheEvent", (types.SimpleNamespace,), {}),
        )
        m.kv_cache = kv_events

    class Response:
        """`has_error()` is a method; `error_msg` / `result` throw when absent."""

        def __init__(self, request_id: int, error_msg_or_result, client_id: int | None = None):
            self._id = request_id
            self._client_id = client_id
            self._error = error_msg_or_result if isinstance(error_msg_or_result, str) else None
            self._result = None if self._error is not None else error_msg_or_result

        @property
        def request_id(self) -> int:
            return self._id

        def has_error(self) -> bool:
            return self._error is not None

        @property
        def error_msg(self) -> str:
            _check(self._error is not None, "Cannot get the error message: the response has no error")
            return self._error

        @property
        def result(self):
            _check(self._error is None, f"Cannot get the result of a response with an error: {self._error}")
            return self._result

        def __repr__(self):
            return f"Response(id={self._id}, error={self._error!r}, result={self._result!r})"

    if not early:
        Response.client_id = property(lambda self: self._client_id)
    m.Response = Response

    # ------------------------------------------------------------------ configs
    kv_sig = _signature(
        [
            ("enable_block_reuse", late),
            ("max_tokens", None),
            ("max_attention_window", None),
            ("sink_token_length", None),
            ("free_gpu_memory_fraction", None),
            ("host_cache_size", None),
            ("onboard_blocks", True),
        ]
        + ([("event_buffer_max_size", 0)] if late else [])
    )

    class KvCacheConfig:
        """enable_block_reuse defaults to False before 1.0 and True from 1.0."""

        def __init__(self, *args, **kwargs):
            v = _bind(kv_sig, "KvCacheConfig", args, kwargs)
            f = v["free_gpu_memory_fraction"]
            _check(f is None or 0 < f <= 1, "freeGpuMemoryFraction in (0, 1]")
            self.__dict__.update(v)

    m.KvCacheConfig = KvCacheConfig

    # ------------------------------------------------------------------ LoRA
    class LoraConfig(
        _read_only_config("LoraConfig", _signature([("task_id", _EMPTY), ("weights", None), ("config", None)]))
    ):
        """`LoraConfig(task_id, weights=None, config=None)` (every era); read-only properties.
        The bindings take the tensors as they are; the checks happen when the executor fetches
        the request (see `_Peft`)."""

        def __init__(self, task_id, weights=None, config=None):
            if not isinstance(task_id, int) or isinstance(task_id, bool) or task_id < 0:
                raise TypeError("LoraConfig.__init__(): incompatible function arguments (task_id)")
            super().__init__(task_id, weights, config)

    m.LoraConfig = LoraConfig
    peft_fields = [
        ("num_host_module_layer", 0),
        ("num_device_module_layer", 0),
        ("optimal_adapter_size", 8),
        ("max_adapter_size", 64),
        ("num_put_workers", 1),
        ("num_ensure_workers", 1),
        ("num_copy_streams", 1),
        ("max_pages_per_block_host", 24),
        ("max_pages_per_block_device", 8),
        ("device_cache_percent", None),
        ("host_cache_size", None),
    ]
    peft_sig = _signature(peft_fields)

    # `PeftCacheConfig(num_host_module_layer=0, num_device_module_layer=0, ...)`
    m.PeftCacheConfig = _read_only_config("PeftCacheConfig", peft_sig)

    sched_sig = _signature(
        [
            ("capacity_scheduler_policy", policy.GUARANTEED_NO_EVICT),
            ("context_chunking_policy", None),
            ("dynamic_batch_config", None),
        ]
    )

    # read-only properties
    SchedulerConfig = m.SchedulerConfig = _read_only_config("SchedulerConfig", sched_sig)

    ec_fields = [
        ("max_beam_width", 1),
        ("scheduler_config", None),
        ("kv_cache_config", None),
        ("enable_chunked_context", False),
        ("normalize_log_probs", era != "1.3"),  # PR #12366 turned the default off
        ("iter_stats_max_iterations", 1000),
        ("request_stats_max_iterations", 0),
        ("batching_type", m.BatchingType.INFLIGHT),
        ("parallel_config", None),
        ("peft_cache_config", None),
    ]
    if early:  # bindings.cpp at 0.11: max_batch_size in the constructor only (no property)
        ec_fields += [("max_batch_size", None), ("logits_post_processor_map", None), ("decoding_config", None)]
    else:
        ec_fields += [
            ("max_batch_size", None),
            ("max_num_tokens", None),
            ("logits_post_processor_config", None),
            ("decoding_config", None),
            ("gpu_weights_percent", 1.0),
            ("max_queue_size", None),
            ("recv_poll_period_ms", 0),
            ("max_seq_idle_microseconds", 180_000_000),
        ]
    if late:
        ec_fields += [("gather_generation_logits", False), ("guided_decoding_config", None)]
    ec_sig = _signature(ec_fields)
    ec_names = {n for n, _ in ec_fields} - ({"max_batch_size"} if early else set())

    class ExecutorConfig:
        """keyword constructor, every field also a read/write property; fields a version
        lacks do not exist (so `hasattr` feature-detects them)."""

        def __init__(self, *args, **kwargs):
            v = _bind(ec_sig, "ExecutorConfig", args, kwargs)
            if v["scheduler_config"] is None:
                v["scheduler_config"] = SchedulerConfig()
            if v["kv_cache_config"] is None:
                v["kv_cache_config"] = KvCacheConfig()
            self.__dict__["fake_max_batch_size"] = v.pop("max_batch_size", None)
            self.__dict__.update({k: x for k, x in v.items() if k in ec_names})
            if not early:
                self.__dict__["max_batch_size"] = self.__dict__.pop("fake_max_batch_size")

        def __setattr__(self, name, value):
            if name not in ec_names:
                raise AttributeError(f"'ExecutorConfig' object has no attribute {name!r}")
            self.__dict__[name] = value

    m.ExecutorConfig = ExecutorConfig

    # ------------------------------------------------------------------ stats
    m.KvCacheStats = types.SimpleNamespace
    m.InflightBatchingStats = types.SimpleNamespace

    class IterationStats(types.SimpleNamespace):
        """The executor's IterationStats fields; `to_json_str()`."""

        def to_json_str(self) -> str:
            def plain(x):
                return vars(x) if isinstance(x, types.SimpleNamespace) else str(x)

            return json.dumps(vars(self), default=plain)

    m.IterationStats = IterationStats
    m.RequestStats = types.SimpleNamespace
    m.RequestStatsPerIteration = types.SimpleNamespace

    m.Executor = _make_executor_class(m, era)
    return m


class _Seq:
    """One returned sequence (a child request when num_return_sequences > 1)."""

    def __init__(self, index: int):
        self.index = index
        self.generated: list[int] = []
        self.logprobs: list[float] = []
        self.sent = 0  # generated tokens already delivered (streaming)
        self.done = False
        self.reason = 0  # FinishReason value
        self.matcher = None  # guided decoding state (an llguidance matcher)


class _Live:
    """A request inside the fake executor."""

    def __init__(self, rid: int, req, n: int):
        self.id = rid
        self.req = req
        self.seqs = [_Seq(i) for i in range(n)]
        self.context_done = 0  # prompt tokens processed
        self.max_tokens = object.__getattribute__(req, "_v")["max_tokens"]  # any era's name
        self.context_logits = None
        self.finals_sent = 0
        self.kv_metrics = None  # KvCacheMetrics fields, set when the context blocks are allocated
        self.lora_key: int | None = None  # the adapter's effect on the fake model, once fetched

    @property
    def n(self) -> int:
        return len(self.seqs)


def _make_executor_class(m: types.ModuleType, era: str):
    FinishReason = getattr(m, "FinishReason", None)
    early, late = era == "0.11", era in ("1.0", "1.3")

    def reason(name: str):
        if FinishReason is None:  # 0.11 has no finish reasons at all
            return 0
        return FinishReason[name] if hasattr(FinishReason, name) else FinishReason.NOT_FINISHED

    class Executor:
        """Constructors: (engine dir, model type, config) reading the directory's config.json,
        or (engine bytes, config.json text, model type, config); methods as tabled there."""

        def __init__(self, *args):
            if len(args) == 4 and isinstance(args[0], bytes | bytearray):  # (engine_buffer, json_config_str, ...)
                cfg = json.loads(args[1])
                model_type, executor_config = args[2], args[3]
            elif len(args) == 3:  # (model_path, model_type, executor_config)
                path = Path(args[0])
                cfg_file = path / "config.json"
                if not cfg_file.is_file() or not (path / "rank0.engine").is_file():
                    raise RuntimeError(f"[TensorRT-LLM][ERROR] File does not exist: {cfg_file}")
                cfg = json.loads(cfg_file.read_text())
                model_type, executor_config = args[1], args[2]
            else:
                raise TypeError(f"Executor.__init__(): incompatible constructor arguments: {args!r}")
            _check(model_type == m.ModelType.DECODER_ONLY, "fake executor: decoder-only engines only")
            build = cfg.get("build_config", {})
            pre = cfg.get("pretrained_config", {})
            mapping = pre.get("mapping", {})
            tp = int(mapping.get("tp_size", 1))
            world = tp * int(mapping.get("pp_size", 1))
            _check(world == 1 or m.fake_rank < world, "world size must equal tp * pp")
            self._vocab_unpadded = int(pre["vocab_size"])
            # logits are padded to the world size (ModelConfig::getVocabSizePadded(worldSize)); the
            # embedding bias is checked against the unpadded size (createNewDecoderRequests.cpp)
            self._vocab = int(math.ceil(self._vocab_unpadded / world) * world)
            self._max_input_len = int(build["max_input_len"])
            self._max_seq_len = int(build["max_seq_len"])
            self._max_beam_width = int(build.get("max_beam_width", 1))
            self._gather_context = bool(build.get("gather_context_logits", False))
            self._paged_context_fmha = bool(build.get("plugin_config", {}).get("use_paged_context_fmha", False))
            ec = executor_config
            _check(ec.max_beam_width <= self._max_beam_width, "maxBeamWidth <= engine's max_beam_width")
            asked_batch = getattr(ec, "max_batch_size", None) or getattr(ec, "fake_max_batch_size", None)
            self._max_batch = int(asked_batch or build.get("max_batch_size", 8))
            self._max_batch = min(self._max_batch, int(build.get("max_batch_size", self._max_batch)))
            self._max_num_tokens = int(getattr(ec, "max_num_tokens", None) or build.get("max_num_tokens", 8192))
            self._max_queue = getattr(ec, "max_queue_size", None)
            self._chunked = bool(ec.enable_chunked_context)
            if self._chunked:
                _check(self._paged_context_fmha, "Chunked context requires paged context FMHA")
            if ec.kv_cache_config.enable_block_reuse:
                _check(self._paged_context_fmha, "KV cache block reuse requires paged context FMHA")
            self._tokens_per_block = int(build.get("plugin_config", {}).get("tokens_per_block", 32))
            self._reuse = bool(ec.kv_cache_config.enable_block_reuse)
            self._blocks: collections.OrderedDict[int, list[int]] = collections.OrderedDict()  # hash -> tokens, LRU
            self.fake_reuse_capacity = 1024
            self._kv_by_id: dict[int, dict] = {}
            buffer = getattr(ec.kv_cache_config, "event_buffer_max_size", 0) or 0
            self._events = _FakeEventManager(m, buffer, self) if late and buffer > 0 else None
            sched = ec.scheduler_config
            self._policy = sched.capacity_scheduler_policy
            self._normalize = ec.normalize_log_probs
            self._guides = _FakeGuidedDecoder(m, getattr(ec, "guided_decoding_config", None), self._vocab)
            self.fake_peft = _FakePeftCache(cfg, ec.peft_cache_config)
            self.config = ec
            self.model = FakeModel(self._vocab)
            self.fake_requests: dict[int, object] = {}
            self.fake_cancel_calls: list[int] = []
            self.fake_step_seconds = 0.001
            self._ids = itertools.count(m.fake_first_request_id)
            self._cv = threading.Condition()
            self._queue: collections.deque[_Live] = collections.deque()
            self._active: list[_Live] = []
            self._ready: collections.deque = collections.deque()
            self._cancel: set[int] = set()
            self._terminated: set[int] = set()
            self._iter = 0
            self._iter_stats = collections.deque(maxlen=max(0, ec.iter_stats_max_iterations))
            self._req_stats = collections.deque(maxlen=max(0, ec.request_stats_max_iterations or 0))
            self._shutdown = False
            self._paused = False
            self._fail_next: str | None = None
            self._killed: str | None = None
            self._in_enqueue = 0
            self.fake_concurrent_enqueues = 0
            self._leader = m.fake_rank == 0
            m.fake_instances.append(self)
            self._thread = threading.Thread(target=self._loop, name="fake-trtllm-executor", daemon=True)
            if self._leader:
                self._thread.start()

        # -------------------------------------------------------------- context manager
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.shutdown()
            return False

        # -------------------------------------------------------------- API
        def _raise_if_shutdown(self) -> None:
            if self._shutdown:
                raise RuntimeError("[TensorRT-LLM][ERROR] Shutdown called")
            if self._killed is not None:
                raise RuntimeError(self._killed)

        def can_enqueue_requests(self) -> bool:
            """False after shutdown and on non-leader ranks."""
            return self._leader and not self._shutdown and self._killed is None

        def enqueue_request(self, request) -> int:
            return self.enqueue_requests([request])[0]

        def enqueue_requests(self, requests) -> list[int]:
            """Ids are unique and increasing; raises after shutdown and when max_queue_size would be
            exceeded, counting child requests."""
            self._in_enqueue += 1
            try:
                if self._in_enqueue > 1:  # thread safety of concurrent enqueues is unknown
                    self.fake_concurrent_enqueues += 1
                with self._cv:
                    self._raise_if_shutdown()
                    _check(self._leader, "Cannot enqueue requests on a non-leader rank")
                    new = [self._children(r) for r in requests]
                    queued = sum(x.n for x in self._queue)
                    if self._max_queue is not None and self._max_queue > 0 and queued + sum(new) > self._max_queue:
                        raise RuntimeError(
                            f"[TensorRT-LLM][ERROR] Maximum queue size of {self._max_queue} has been reached, "
                            "please try again later"
                        )
                    ids = []
                    for r, n in zip(requests, new, strict=True):
                        rid = next(self._ids)
                        self.fake_requests[rid] = r
                        self._queue.append(_Live(rid, r, n))
                        ids.append(rid)
                    self._cv.notify_all()
                    return ids
            finally:
                self._in_enqueue -= 1

        @staticmethod
        def _children(r) -> int:
            if early:
                return 1
            if not late:  # num_return_sequences was a Request field before SamplingConfig had it
                return int(object.__getattribute__(r, "_v").get("num_return_sequences") or 1)
            sc = r.sampling_config
            return 1 if sc.beam_width > 1 else (sc.num_return_sequences or 1)

        def await_responses(self, *args, timeout=None):
            """Three overloads: all requests / one id / a list of ids. Returns [] on timeout,
            blocks without one, returns when shutdown() is called, raises afterwards."""
            target = None
            if args and isinstance(args[0], int | list):
                target, args = args[0], args[1:]
            if args:
                timeout = args[0]
            # std::chrono::milliseconds through pybind11/nanobind's chrono caster: a timedelta,
            # or a float taken as seconds; an int is refused (pybind11/chrono.h duration_caster)
            if isinstance(timeout, datetime.timedelta):
                timeout = timeout.total_seconds()
            elif timeout is not None and not isinstance(timeout, float):
                raise TypeError("await_responses(): incompatible function arguments (timeout)")
            deadline = None if timeout is None else time.monotonic() + timeout
            with self._cv:
                self._raise_if_shutdown()
                if isinstance(target, list):
                    return [self._await_one(i, deadline) for i in target]
                if target is not None:
                    return self._await_one(target, deadline)
                while not self._ready and not self._shutdown and self._killed is None:
                    if not self._wait(deadline):
                        return []
                if self._killed is not None:
                    raise RuntimeError(self._killed)
                out = list(self._ready)
                self._ready.clear()
                return out

        def _await_one(self, rid: int, deadline):
            def mine():
                return [r for r in self._ready if r.request_id == rid]

            if rid in self._terminated and not mine():
                return [m.Response(rid, f"ReqId {rid} has already been processed and was terminated.")]
            while not mine() and not self._shutdown and self._killed is None:
                if not self._wait(deadline):
                    return []
            got = mine()
            for r in got:
                self._ready.remove(r)
            return got

        def _wait(self, deadline) -> bool:
            if deadline is None:
                self._cv.wait()
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._cv.wait(left)
            return True

        def get_num_responses_ready(self, id: int | None = None) -> int:
            with self._cv:
                self._raise_if_shutdown()
                return sum(1 for r in self._ready if id is None or r.request_id == id)

        def cancel_request(self, id: int) -> None:
            """Asynchronous: takes effect at the next iteration; no-op on terminated ids."""
            with self._cv:
                self._raise_if_shutdown()
                self.fake_cancel_calls.append(id)
                if id in self._terminated:
                    log.info("Ignoring already terminated request %d", id)
                    return
                self._cancel.add(id)
                self._cv.notify_all()

        def shutdown(self) -> None:
            """Blocks until the loop exits; idempotent; wakes blocked await_responses.
            On a non-leader rank it blocks until the leader shuts down."""
            if not self._leader:
                m.fake_follower_waiting.set()
                m.fake_leader_shutdown.wait()
            with self._cv:
                self._shutdown = True
                self._cv.notify_all()
            if self._thread.is_alive() and threading.current_thread() is not self._thread:
                self._thread.join()
            if self._leader:
                m.fake_leader_shutdown.set()

        def get_latest_iteration_stats(self):
            """Drains a deque of at most iter_stats_max_iterations entries."""
            with self._cv:
                self._raise_if_shutdown()
                out = collections.deque(self._iter_stats)
                self._iter_stats.clear()
                return out

        if late:

            def get_kv_cache_event_manager(self):
                """The KVCacheEventManager, or None when KvCacheConfig.event_buffer_max_size is 0."""
                return self._events

        def get_latest_request_stats(self):
            with self._cv:
                self._raise_if_shutdown()
                out = collections.deque(self._req_stats)
                self._req_stats.clear()
                return out

        # -------------------------------------------------------------- test hooks
        def fake_pause(self) -> None:
            """Stop iterating (requests stay queued or active) until fake_resume()."""
            with self._cv:
                self._paused = True

        def fake_resume(self) -> None:
            with self._cv:
                self._paused = False
                self._cv.notify_all()

        def fake_fail_forward(self, message: str = "CUDA error: an illegal memory access was encountered") -> None:
            """Make the next forward step fail: every active request gets an error Response."""
            with self._cv:
                self._fail_next = message
                self._cv.notify_all()

        def fake_kill(self, message: str = "[TensorRT-LLM][ERROR] executor worker died") -> None:
            """Simulate a dead executor: the loop stops and every later call raises `message`."""
            with self._cv:
                self._killed = message
                self._cv.notify_all()

        def fake_kv_metrics(self, rid: int) -> dict | None:
            """The KvCacheMetrics fields of a request (None: its context blocks are not
            allocated yet)."""
            with self._cv:
                return self._kv_by_id.get(rid)

        @property
        def fake_live_count(self) -> int:
            with self._cv:
                return len(self._queue) + len(self._active)

        # -------------------------------------------------------------- execution loop
        def _loop(self) -> None:
            while True:
                with self._cv:
                    while not (self._shutdown or self._killed) and (
                        self._paused or not (self._queue or self._active or self._fail_next)
                    ):
                        self._cv.wait()
                    if self._shutdown or self._killed:
                        return
                    self._iteration()
                    self._cv.notify_all()
                time.sleep(self.fake_step_seconds)

        def _iteration(self) -> None:
            self._iter += 1
            started = time.monotonic()
            completed = 0
            if self._fail_next is not None:
                msg, self._fail_next = self._fail_next, None
                for live in self._active:
                    self._error(live, f"Encountered an error in forwardAsync function: {msg}")
                completed += len(self._active)
                self._active = []
            # cancellation is checked once per iteration; only active requests end.
            for live in [x for x in self._active if x.id in self._cancel]:
                self._terminate_cancelled(live)
                completed += 1
            for error in self._schedule():
                # GuidedDecoder::build throws inside forwardAsync: every active request ends
                for live in self._active:
                    self._error(live, f"Encountered an error in forwardAsync function: {error}")
                completed += len(self._active)
                self._active = []
                break
            stages = {}
            for live in list(self._active):
                prompt = live.req.input_token_ids
                if live.context_done < len(prompt):
                    stages[live.id] = m.RequestStage.CONTEXT_IN_PROGRESS
                    if live.kv_metrics is None:
                        live.kv_metrics = self._kv_by_id[live.id] = self._allocate(list(prompt))
                    chunk = self._max_num_tokens if self._chunked else len(prompt)
                    live.context_done = min(len(prompt), live.context_done + chunk)
                    if live.context_done < len(prompt):
                        continue
                    self._store(list(prompt))
                else:
                    stages[live.id] = m.RequestStage.GENERATION_IN_PROGRESS
                self._step(live)
                if all(s.done for s in live.seqs):
                    self._active.remove(live)
                    self._terminated.add(live.id)
                    self._cancel.discard(live.id)
                    completed += 1
            latency = (time.monotonic() - started) * 1000.0
            if self._req_stats.maxlen:
                stats = [
                    m.RequestStats(
                        id=x.id,
                        stage=stages.get(x.id, m.RequestStage.GENERATION_COMPLETE),
                        context_prefill_position=x.context_done,
                        num_generated_tokens=sum(len(s.generated) for s in x.seqs),
                        scheduled=True,
                        paused=False,
                    )
                    for x in self._active
                ]
                stats += [
                    m.RequestStats(
                        id=x.id,
                        stage=m.RequestStage.QUEUED,
                        context_prefill_position=0,
                        num_generated_tokens=0,
                        scheduled=False,
                        paused=False,
                    )
                    for x in self._queue
                ]
                self._req_stats.append(m.RequestStatsPerIteration(iter=self._iter, request_stats=stats))
            if self._iter_stats.maxlen:
                active_seqs = sum(x.n for x in self._active)
                self._iter_stats.append(
                    m.IterationStats(
                        timestamp=time.strftime("%m-%d-%Y %H:%M:%S"),
                        iter=self._iter,
                        iter_latency_ms=latency,
                        new_active_requests_queue_latency_ms=0.0,
                        num_new_active_requests=0,
                        num_active_requests=len(self._active),
                        num_queued_requests=len(self._queue),
                        num_completed_requests=completed,
                        max_num_active_requests=self._max_batch,
                        gpu_mem_usage=0,
                        cpu_mem_usage=0,
                        pinned_mem_usage=0,
                        kv_cache_stats=m.KvCacheStats(
                            max_num_blocks=1024,
                            free_num_blocks=1024 - active_seqs,
                            used_num_blocks=active_seqs,
                            tokens_per_block=32,
                            alloc_total_blocks=active_seqs,
                            alloc_new_blocks=0,
                            reused_blocks=0,
                            missed_blocks=0,
                            cache_hit_rate=0.0,
                        ),
                        inflight_batching_stats=m.InflightBatchingStats(
                            num_scheduled_requests=len(self._active),
                            num_context_requests=0,
                            num_gen_requests=len(self._active),
                            num_paused_requests=0,
                            num_ctx_tokens=0,
                            micro_batch_id=0,
                            avg_num_decoded_tokens_per_iter=1.0,
                        ),
                        static_batching_stats=None,
                    )
                )

        def _schedule(self) -> list[str]:
            """Move queued requests into the batch while sequences fit; validate them as the
            executor does when it fetches new requests (`executorImpl.cpp`: one error response
            for that request). Returns the compile errors of guides scheduled this step, which
            the caller turns into the whole batch's failure (guidedDecoder.cpp, see the module
            docstring)."""
            guide_errors = []
            while self._queue and sum(x.n for x in self._active) + self._queue[0].n <= self._max_batch:
                live = self._queue.popleft()
                error = self._validate(live)
                if error is not None:
                    self._error(live, f"Encountered an error when fetching new request: {error}")
                    continue
                lora = live.req.lora_config
                if lora is not None:
                    in_use = {x.req.lora_config.task_id for x in self._active if x.req.lora_config is not None}
                    try:
                        live.lora_key = self.fake_peft.add_request(lora, in_use)
                    except _PeftTaskNotCached as e:  # PeftTaskNotCachedException: its own message
                        self._error(live, str(e))
                        continue
                    except RuntimeError as e:
                        self._error(live, f"Encountered an error when fetching new request: {e}")
                        continue
                error = self._guides.start(live)
                if error is not None:
                    guide_errors.append(error)
                room = self._max_seq_len - len(live.req.input_token_ids)
                if live.max_tokens > room:  # silently clipped, with a warning
                    log.warning("Number of requested output tokens is changed to (%d)", room)
                    live.max_tokens = room
                self._active.append(live)
            return guide_errors

        def _validate(self, live: _Live) -> str | None:
            req = live.req
            plen = len(req.input_token_ids)
            if plen > self._max_input_len:
                return (
                    f"Prompt length ({plen}) exceeds maximum input length ({self._max_input_len}). Set log "
                    "level to info and check TRTGptModel logs for how maximum input length is set"
                )
            if (
                self._policy == self._policy.__class__.MAX_UTILIZATION
                and req.streaming
                and not self._chunked
                and plen + live.max_tokens - 1 > self._max_input_len
            ):
                return (
                    "Request sequence length is potentially greater than max input length. This cannot be run "
                    "unless streaming is disabled, context chunking is enabled or the GUARANTEED_NO_EVICT "
                    "scheduling policy is used"
                )
            bias = req.embedding_bias
            if bias is not None and (
                not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (self._vocab_unpadded,)
            ):
                return (
                    "The embedding bias shape is not as expected. Expected last dimension to be same as vocab "
                    f"size: {self._vocab_unpadded}."
                )
            if getattr(req, "guided_decoding_params", None) is not None and self._guides.tokenizer is None:
                return "Guided decoding parameters were given, but the executor has no GuidedDecodingConfig"
            if req.output_config.return_context_logits and not self._gather_context:
                return "Return context logit need to build engine with gather_context_logits"
            if req.sampling_config.beam_width > self._max_beam_width:
                return f"Request beam width {req.sampling_config.beam_width} exceeds max beam width"
            return None

        # -------------------------------------------------------------- decoding
        def _step(self, live: _Live) -> None:
            """One token for every unfinished sequence, then its streaming Response."""
            req = live.req
            sc = req.sampling_config
            for seq in live.seqs:
                if seq.done:
                    continue
                tok, lp = self._next_token(live, seq, sc)
                if seq.matcher is not None:
                    seq.matcher.consume_token(tok)
                end_id = req.end_id
                if end_id is not None and end_id >= 0 and tok == end_id:
                    seq.done, seq.reason = True, reason("END_ID")  # the end token is excluded
                else:
                    seq.generated.append(tok)
                    seq.logprobs.append(lp)
                    if any(
                        len(w) <= len(seq.generated) and seq.generated[-len(w) :] == w for w in (req.stop_words or [])
                    ):
                        seq.done, seq.reason = True, reason("STOP_WORDS")  # stop tokens stay in the output
                    elif len(seq.generated) >= live.max_tokens:
                        seq.done, seq.reason = True, reason("LENGTH")
                if req.streaming or seq.done:
                    self._respond(live, seq)

        def _next_token(self, live: _Live, seq: _Seq, sc) -> tuple[int, float]:
            req = live.req
            context = list(req.input_token_ids) + seq.generated
            x = self.model.logits(context)
            if live.lora_key is not None:  # an adapter shifts the distribution by its weights
                x = x + 2.0 * self.model.logits([*context, live.lora_key])
            if req.embedding_bias is not None:
                x[: self._vocab_unpadded] += req.embedding_bias.to(torch.float32)
            rp = sc.repetition_penalty
            if rp is not None and rp != 1.0:
                idx = torch.tensor(sorted(set(context)))
                vals = x[idx]
                x[idx] = torch.where(vals > 0, vals / rp, vals * rp)
            if seq.generated and (sc.presence_penalty or sc.frequency_penalty):
                counts = torch.bincount(torch.tensor(seq.generated), minlength=self._vocab).to(torch.float32)
                x = x - (counts > 0).float() * (sc.presence_penalty or 0.0) - counts * (sc.frequency_penalty or 0.0)
            min_tokens = sc._v.get("min_tokens")
            # Runtime default min_tokens is 1: the end token is banned until then.
            if (
                req.end_id is not None
                and req.end_id >= 0
                and len(seq.generated) < (1 if min_tokens is None else min_tokens)
            ):
                x[req.end_id] = float("-inf")
            for word in req.bad_words or []:
                prefix = word[:-1]
                if not prefix or context[-len(prefix) :] == prefix:
                    x[word[-1]] = float("-inf")
            logprobs = x.log_softmax(-1)
            if seq.matcher is not None:  # GuidedDecoder::execute masks the logits before sampling
                x = self._guides.mask(seq.matcher, x)
            top_k = sc.top_k or 0
            top_p = sc.top_p or 0.0
            if top_k == 0 and top_p == 0.0:  # both unset = greedy (samplingConfig.cpp)
                tok = int(x.argmax())
                return tok, 0.0 if self._normalize else float(logprobs[tok])  # the one candidate: p = 1
            if top_p == 0.0:
                top_p = 1.0
            temperature = 1.0 if sc.temperature is None else sc.temperature
            if temperature == 0:  # allowed by validation, meaningless for sampling
                tok = int(x.argmax())
                return tok, 0.0 if self._normalize else float(logprobs[tok])
            probs = (x / temperature).softmax(-1)
            if top_k > 0:
                kth = probs.topk(min(top_k, self._vocab)).values[-1]
                probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
            min_p = sc._v.get("min_p")
            if min_p:
                probs = torch.where(probs >= probs.max() * min_p, probs, torch.zeros_like(probs))
            sorted_p, order = probs.sort(descending=True)
            cum = (sorted_p / sorted_p.sum()).cumsum(0)
            keep = cum - sorted_p / sorted_p.sum() < top_p
            mask = torch.zeros_like(probs, dtype=torch.bool)
            mask[order[keep]] = True
            probs = torch.where(mask, probs, torch.zeros_like(probs))
            seed = sc._v.get("seed") or 0  # unseeded = the runtime's default seed 0
            g = torch.Generator().manual_seed((seed * 1_000_003 + seq.index * 7919 + len(seq.generated)) % (1 << 63))
            drawn = probs / probs.sum()
            tok = int(torch.multinomial(drawn, 1, generator=g))
            return tok, float(drawn[tok].log()) if self._normalize else float(logprobs[tok])

        def _respond(self, live: _Live, seq: _Seq) -> None:
            req = live.req
            oc = req.output_config
            res = m.Result()
            if req.streaming:  # only the tokens not yet sent; never the prompt
                tokens = seq.generated[seq.sent :]
            elif oc.exclude_input_from_output:
                tokens = list(seq.generated)
            else:
                tokens = list(req.input_token_ids) + seq.generated
            seq.sent = len(seq.generated)
            res.output_token_ids = [tokens]
            if oc.return_log_probs:  # cumulative per response
                res.log_probs = [list(seq.logprobs)]
                res.cum_log_probs = [float(sum(seq.logprobs))]
            if oc.return_context_logits:  # on every result (LlmRequest::createResponse)
                if live.context_logits is None:
                    prompt = list(req.input_token_ids)
                    live.context_logits = torch.stack([self.model.logits(prompt[: i + 1]) for i in range(len(prompt))])
                res.context_logits = live.context_logits
            if late and oc.return_perf_metrics and live.kv_metrics is not None:  # on every result
                res.request_perf_metrics = m.RequestPerfMetrics(kv_cache_metrics=m.KvCacheMetrics(**live.kv_metrics))
            self._finish_fields(live, seq, res)
            self._ready.append(m.Response(live.id, res, *self._client_id(req)))

        # -------------------------------------------------------------- block reuse
        def _chain(self, tokens: list[int], limit: int) -> list[tuple[int, int | None, list[int]]]:
            """(hash, parent hash, tokens) of the full blocks in tokens[:limit]."""
            tpb = self._tokens_per_block
            out: list[tuple[int, int | None, list[int]]] = []
            parent = None
            for end in range(tpb, limit + 1, tpb):
                h = hash(tuple(tokens[:end])) & ((1 << 63) - 1)
                out.append((h, parent, tokens[end - tpb : end]))
                parent = h
            return out

        def _allocate(self, prompt: list[int]) -> dict:
            """The KvCacheMetrics of a request entering its context phase: the longest chain of
            stored blocks over its first len - 1 tokens is reused."""
            tpb = self._tokens_per_block
            total = -(-len(prompt) // tpb)
            reused = missed = 0
            if self._reuse:
                for h, _, _ in self._chain(prompt, len(prompt) - 1):
                    if h not in self._blocks:
                        break
                    self._blocks.move_to_end(h)
                    reused += 1
                missed = total - reused
            rate = reused / (reused + missed) if reused + missed else 0.0
            return {
                "num_total_allocated_blocks": total,
                "num_new_allocated_blocks": total - reused,
                "num_reused_blocks": reused,
                "num_missed_blocks": missed,
                "kv_cache_hit_rate": rate,
            }

        def _store(self, prompt: list[int]) -> None:
            """Keep the prompt's full blocks for reuse (a KVCacheStoredData for the new ones),
            evicting the least recently used beyond fake_reuse_capacity (KVCacheRemovedData)."""
            if not self._reuse:
                return
            new = []
            for h, parent, tokens in self._chain(prompt, len(prompt)):
                if h in self._blocks:
                    self._blocks.move_to_end(h)
                    continue
                self._blocks[h] = tokens
                new.append((h, parent, tokens))
            if new and self._events is not None:
                self._events.stored(new)
            evicted = []
            while len(self._blocks) > self.fake_reuse_capacity:
                evicted.append(self._blocks.popitem(last=False)[0])
            if evicted and self._events is not None:
                self._events.removed(evicted)

        def _finish_fields(self, live: _Live, seq: _Seq, res) -> None:
            if seq.done:
                live.finals_sent += 1
            res.is_final = live.finals_sent == live.n  # only when every sequence is done
            if not early:
                res.finish_reasons = [seq.reason if seq.done else reason("NOT_FINISHED")]
                res.sequence_index = seq.index
                res.is_sequence_final = seq.done
                res.decoding_iter = len(seq.generated)

        @staticmethod
        def _client_id(req) -> tuple:
            return () if early else (req.client_id,)

        def _terminate_cancelled(self, live: _Live) -> None:
            """The request ends with a final Response, finish reason CANCELLED and its
            generated tokens cleared. Earlier eras had no CANCELLED reason; whether they returned
            partial tokens is [UNCONFIRMED]: modelled as no tokens and NOT_FINISHED."""
            self._active.remove(live)
            self._cancel.discard(live.id)
            self._terminated.add(live.id)
            for seq in live.seqs:
                if seq.done:
                    continue
                seq.done, seq.reason = True, reason("CANCELLED")
                res = m.Result()
                res.output_token_ids = [[]]
                if live.req.output_config.return_log_probs:
                    res.log_probs, res.cum_log_probs = [[]], [0.0]
                self._finish_fields(live, seq, res)
                self._ready.append(m.Response(live.id, res, *self._client_id(live.req)))

        def _error(self, live: _Live, message: str) -> None:
            self._terminated.add(live.id)
            self._cancel.discard(live.id)
            self._ready.append(m.Response(live.id, message, *self._client_id(live.req)))

    return Executor


class _FakeEventManager:
    """The executor's KVCacheEventManager: a bounded buffer of KVCacheEvents (the oldest
    dropped when full), drained by `get_latest_events(timeout=None)`."""

    def __init__(self, m: types.ModuleType, size: int, executor) -> None:
        self._k = m.kv_cache
        self._buffer: collections.deque = collections.deque(maxlen=size)
        self._ids = itertools.count()
        self._executor = executor
        self._add(self._k.KVCacheCreatedData(num_blocks_per_cache_level=[1024, 0]))

    def _add(self, data) -> None:
        self._buffer.append(self._k.KVCacheEvent(event_id=next(self._ids), data=data))

    def stored(self, blocks: list[tuple[int, int | None, list[int]]]) -> None:
        stored = [
            self._k.KVCacheStoredBlockData(block_hash=h, tokens=tokens, lora_id=None, cache_level=0, priority=35)
            for h, _, tokens in blocks
        ]
        self._add(self._k.KVCacheStoredData(parent_hash=blocks[0][1], blocks=stored))

    def removed(self, hashes: list[int]) -> None:
        self._add(self._k.KVCacheRemovedData(block_hashes=hashes))

    def get_latest_events(self, timeout=None) -> list:
        """Drain the buffer (the executor's lock guards it); `timeout` (a timedelta or float
        seconds, std::optional<std::chrono::milliseconds>) is how long to wait for an event
        when there is none."""
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        elif timeout is not None and not isinstance(timeout, float):
            raise TypeError("get_latest_events(): incompatible function arguments (timeout)")
        with self._executor._cv:
            if not self._buffer and timeout:
                self._executor._cv.wait(timeout)
            out = list(self._buffer)
            self._buffer.clear()
            return out


class _FakeGuidedDecoder:
    """`batch_manager/guidedDecoder.cpp` for the double: built from the ExecutorConfig's
    GuidedDecodingConfig (None: guided parameters are ignored), compiles each guided request's
    grammar when it is scheduled, masks its logits (see the module docstring)."""

    def __init__(self, m: types.ModuleType, config, vocab_padded: int):
        self.config = config
        self.vocab = vocab_padded
        self.tokenizer = None
        if config is None:
            return
        _check(
            config.backend != m.GuidedDecodingConfig.GuidedDecodingBackend.LLGUIDANCE,
            "LLGuidance is not supported for guided decoding in C++ runtime.",
        )
        _check(config.encoded_vocab is not None, "guidedDecodingConfig.getEncodedVocab().value()")
        _check(config.tokenizer_str is not None, "fake executor: tokenizer_str is needed (no raw vocab decoding)")
        import llguidance

        self.tokenizer = llguidance.LLTokenizer(
            config.tokenizer_str, n_vocab=vocab_padded, eos_token=list(config.stop_token_ids or [])
        )
        self.types = m.GuidedDecodingParams.GuideType

    def start(self, live: _Live) -> str | None:
        """Give each sequence of a scheduled request its matcher; an error message when the
        guide does not compile."""
        params = getattr(live.req, "guided_decoding_params", None)
        if params is None or self.tokenizer is None:
            return None
        from llguidance import LLMatcher, grammar_from

        t, guide = params.guide_type, params.guide
        error = self._xgrammar_error(t, guide)
        if error is not None:
            return error
        if t == self.types.JSON:
            grammar = LLMatcher.grammar_from_json_schema('{"type": ["object", "array"]}')
        elif t == self.types.JSON_SCHEMA:
            grammar = LLMatcher.grammar_from_json_schema(guide)
        elif t == self.types.REGEX:
            grammar = LLMatcher.grammar_from_regex(guide)
        elif t == self.types.EBNF_GRAMMAR:
            try:
                grammar = grammar_from("gbnf", guide)
            except ValueError as e:
                return str(e)
        else:
            return f"fake executor: guide type {t!r} is not modelled"
        for seq in live.seqs:
            seq.matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
            if seq.matcher.is_error():
                return seq.matcher.get_error()
        return None

    def _xgrammar_error(self, guide_type, guide: str | None) -> str | None:
        """What `GuidedDecoder::build` throws compiling this guide with XGrammar (its Python
        API makes the same calls), or None; None also where xgrammar is not installed."""
        try:
            import xgrammar
        except ImportError:
            return None
        try:
            if guide_type == self.types.JSON:
                xgrammar.Grammar.builtin_json_grammar()
            elif guide_type == self.types.JSON_SCHEMA:
                xgrammar.Grammar.from_json_schema(guide)
            elif guide_type == self.types.REGEX:
                xgrammar.Grammar.from_regex(guide)
            elif guide_type == self.types.EBNF_GRAMMAR:
                xgrammar.Grammar.from_ebnf(guide)
        except Exception as e:
            return str(e)
        return None

    def mask(self, matcher, logits: torch.Tensor) -> torch.Tensor:
        """The logits with every token the matcher does not allow at -inf."""
        allowed = torch.tensor(list(matcher.compute_bitmask()), dtype=torch.uint8)
        bits = ((allowed[:, None] >> torch.arange(8)) & 1).reshape(-1)[: self.vocab].bool()
        return logits.masked_fill(~bits, float("-inf"))


class _PeftTaskNotCached(RuntimeError):
    """`PeftTaskNotCachedException` (peftCacheManager.h)."""


#: `LoraManager.LORA_MODULE_IDS` (tensorrt_llm/lora_manager.py) / loraModule.h ModuleType.
_LORA_MODULE_IDS = {
    "attn_qkv": 0,
    "attn_q": 1,
    "attn_k": 2,
    "attn_v": 3,
    "attn_dense": 4,
    "mlp_h_to_4h": 5,
    "mlp_4h_to_h": 6,
    "mlp_gate": 7,
}


class _FakePeftCache:
    """The executor's PEFT cache (`PeftCacheManager`, cpp/tensorrt_llm/batch_manager/
    peftCacheManager.cpp, with the checks of `loraValidateRequestTensors`,
    cpp/tensorrt_llm/runtime/loraUtils.cpp), as the executor runs it when it fetches a request:

      * a LoraConfig with weights and config: both must be there ("Request for LoRA inference
        must have both lora_weights and lora_keys"); weights `[n, row]` of the model's dtype,
        config `[n, 3]` (or `[n, 4]` with is_dora) int32; per config row the layer is in range,
        adapter_size > 0 and <= the engine's max_lora_rank, the module is one the engine was
        built to adapt ("lora module <name> not enabled for this model"), and the row holds
        `adapter_size * (in + out)` values of that module ("lora_weights has to few values for
        <name>"); then the task goes into the cache under its id;
      * a LoraConfig with only a task id: "LoRA task <id> not found in cache. Please send LoRA
        weights with request" unless the cache holds the task.
    Capacity: `num_device_module_layer` rows (0: unbounded in the double [UNCONFIRMED]: upstream
    then sizes the cache from device_cache_percent); putting a task evicts the least recently
    used tasks no active request uses, and fails with "Cache is full. There are no done tasks
    to evict" when that is not enough. An engine built without the LoRA plugin refuses any
    LoraConfig (the wording is the double's [UNCONFIRMED]).

    Module shapes (in, out) come from the engine config's pretrained_config (hidden_size,
    intermediate_size, num_attention_heads, num_key_value_heads), as `LoraModule::
    createLoraModules` derives them. Test hooks: `tasks` (ids cached, LRU first), `puts`
    (task ids in the order their weights arrived), `evict(task_id)`.
    """

    def __init__(self, engine_cfg: dict, peft_config) -> None:
        build = engine_cfg.get("build_config", {})
        pre = engine_cfg.get("pretrained_config", {})
        self.enabled = bool(build.get("plugin_config", {}).get("lora_plugin"))
        lora = build.get("lora_config") or {}
        self.modules = set(lora.get("lora_target_modules") or [])
        self.max_rank = int(lora.get("max_lora_rank") or 0)
        self.layers = int(pre.get("num_hidden_layers") or 1)
        self.dtype = str(pre.get("dtype") or "float16")
        h = int(pre.get("hidden_size") or 0)
        inter = int(pre.get("intermediate_size") or 4 * h)
        heads = int(pre.get("num_attention_heads") or 1)
        kv = int(pre.get("num_key_value_heads") or heads)
        kv_out = kv * (h // heads) if heads else h
        self.shapes = {
            "attn_qkv": (h, h + 2 * kv_out),
            "attn_q": (h, h),
            "attn_k": (h, kv_out),
            "attn_v": (h, kv_out),
            "attn_dense": (h, h),
            "mlp_h_to_4h": (h, inter),
            "mlp_4h_to_h": (inter, h),
            "mlp_gate": (h, inter),
        }
        self.capacity = int(getattr(peft_config, "num_device_module_layer", 0) or 0) if peft_config else 0
        self._cache: collections.OrderedDict[int, tuple[int, int]] = collections.OrderedDict()  # id -> rows, key
        self.puts: list[int] = []

    @property
    def tasks(self) -> list[int]:
        return list(self._cache)

    def evict(self, task_id: int) -> None:
        self._cache.pop(task_id, None)

    def add_request(self, lora, in_use: set[int]) -> int:
        """Check a fetched request's LoraConfig and cache its weights; the fake model's key of
        the adapter. Raises _PeftTaskNotCached or RuntimeError (see the class docstring)."""
        if not self.enabled:
            raise RuntimeError("LoRA is not enabled for this model (engine built without the lora plugin)")
        tid, weights, config = lora.task_id, lora.weights, lora.config
        if weights is None and config is None:
            if tid not in self._cache:
                raise _PeftTaskNotCached(f"LoRA task {tid} not found in cache. Please send LoRA weights with request")
            self._cache.move_to_end(tid)
            return self._cache[tid][1]
        _check(
            weights is not None and config is not None,
            "Request for LoRA inference must have both lora_weights and lora_keys",
        )
        _check(weights.dim() == 2, "Invalid shape for lora_weights tensor")
        _check(config.dim() == 2, "Invalid shape for lora_keys tensor")
        _check(config.dtype == torch.int32, f"Expected  lora keys to have TYPE_INT32 but was {config.dtype}")
        _check(config.shape[0] == weights.shape[0], "Expected dim1 lora_weights and lora_keys to have the same size")
        _check(config.shape[1] in (3, 4), "Expected dim2 of lora_keys to have a size in [3, 4]")
        _check(
            weights.dtype == getattr(torch, self.dtype), "Expected lora weights to be the same data type as base model"
        )
        names = {v: k for k, v in _LORA_MODULE_IDS.items()}
        for module_id, layer, size, *_ in config.tolist():
            _check(0 <= layer < self.layers, "Expected layerId to be in the range [0, numModelLayers)")
            _check(size > 0, "Expected adapterSize to be > 0")
            name = names.get(module_id, str(module_id))
            _check(name in self.modules, f"lora module {name} not enabled for this model")
            fan_in, fan_out = self.shapes[name]
            _check(size * (fan_in + fan_out) <= weights.shape[1], f"lora_weights has to few values for {name}")
            _check(
                size <= self.max_rank,
                f"Invalid low_rank ({size}). low_rank must be smaller than mMaxLowRank ({self.max_rank})",
            )
        rows = int(config.shape[0])
        key = int(abs(float(weights.float().sum())) * 1000) % 997 + 1
        self._cache.pop(tid, None)
        if self.capacity:
            while sum(r for r, _ in self._cache.values()) + rows > self.capacity:
                victim = next((t for t in self._cache if t not in in_use), None)
                if victim is None:
                    raise RuntimeError("Cache is full. There are no done tasks to evict")
                del self._cache[victim]
        self._cache[tid] = (rows, key)
        self.puts.append(tid)
        return key


def engine_config(
    *,
    vocab_size: int = 4096,
    max_input_len: int = 256,
    max_seq_len: int = 512,
    max_batch_size: int = 8,
    max_num_tokens: int = 1024,
    max_beam_width: int = 1,
    tp: int = 1,
    pp: int = 1,
    use_paged_context_fmha: bool = True,
    gather_context_logits: bool = False,
    version: str = "1.0.0",
    tokens_per_block: int | None = 32,
    lora_target_modules: Sequence[str] = (),
    max_lora_rank: int = 8,
    num_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int | None = None,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
) -> dict:
    """The config.json trtllm-build writes into an engine directory (with
    `lora_target_modules`: built with `--lora_plugin float16 --lora_target_modules ...
    --max_lora_rank N`, which records `plugin_config.lora_plugin` and `build_config.lora_config`)."""
    lora = (
        {
            "lora_config": {
                "lora_dir": [],
                "lora_ckpt_source": "hf",
                "max_lora_rank": max_lora_rank,
                "lora_target_modules": list(lora_target_modules),
            }
        }
        if lora_target_modules
        else {}
    )
    return {
        "version": version,
        "pretrained_config": {
            "architecture": "LlamaForCausalLM",
            "dtype": "float16",
            "vocab_size": vocab_size,
            "num_hidden_layers": num_layers,
            "hidden_size": hidden_size,
            "intermediate_size": intermediate_size or 4 * hidden_size,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads or num_heads,
            "max_position_embeddings": max_seq_len,
            "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp},
        },
        "build_config": {
            "max_batch_size": max_batch_size,
            "max_input_len": max_input_len,
            "max_seq_len": max_seq_len,
            "max_num_tokens": max_num_tokens,
            "max_beam_width": max_beam_width,
            "gather_context_logits": gather_context_logits,
            "plugin_config": {
                "use_paged_context_fmha": use_paged_context_fmha,
                "paged_kv_cache": True,
                **({} if tokens_per_block is None else {"tokens_per_block": tokens_per_block}),
                **({"lora_plugin": "float16"} if lora_target_modules else {}),
            },
            **lora,
        },
    }


def write_engine_dir(path: Path, **limits) -> Path:
    """Write what trtllm-build leaves in an engine directory: config.json (see
    `engine_config` for the keyword arguments) and one rank{N}.engine per rank (placeholder bytes)."""
    path.mkdir(parents=True, exist_ok=True)
    config = engine_config(**limits)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    mapping = config["pretrained_config"]["mapping"]
    for rank in range(mapping["tp_size"] * mapping["pp_size"]):
        (path / f"rank{rank}.engine").write_bytes(b"fake TensorRT engine")
    return path


def install(monkeypatch, era: str = "1.0", **options) -> types.ModuleType:
    """Put the fake into sys.modules as `tensorrt_llm`, `tensorrt_llm.bindings` and
    `tensorrt_llm.bindings.executor` (undone by monkeypatch); returns the executor module."""
    import sys

    executor = make_module(era, **options)
    bindings = types.ModuleType("tensorrt_llm.bindings")
    bindings.executor = executor
    bindings.binding_type = "pybind"
    top = types.ModuleType("tensorrt_llm")
    top.__version__ = VERSIONS[era]
    top.bindings = bindings
    monkeypatch.setitem(sys.modules, "tensorrt_llm", top)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.bindings", bindings)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.bindings.executor", executor)
    return executor
