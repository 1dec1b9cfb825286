"""Pure mapping functions of the TensorRT-LLM engines: requests -> binding keywords, responses
-> core results, engine directories -> limits, and feature detection per binding era."""

from __future__ import annotations

import json

import pytest

from core.engine.trtllm.bindings import BindingApi, detect_api
from core.engine.trtllm.engine_dir import read_engine_layout
from core.engine.trtllm.mapping import (
    classify_enqueue_error,
    classify_error,
    executor_priority,
    llm_sampling_kwargs,
    logprob_values,
    new_logprobs,
    sampling_kwargs,
    stop_words_for,
)
from core.engine.trtllm.options import TrtllmOptions
from core.engine.trtllm.options import executor_config as make_executor_config
from core.errors import ContextLengthExceeded, EngineDead, EngineFailure, InvalidArgument, NotReady, Overloaded
from core.types import EngineRequest, ResolvedSampling
from tests.fakes import trtllm_executor
from tests.fakes.trtllm_llm import Logprob

GREEDY = ResolvedSampling(do_sample=False, seed=9, temperature=0.8)
SAMPLE = ResolvedSampling(do_sample=True, seed=9, temperature=0.7, top_k=5, top_p=0.85)
OLD = BindingApi(
    max_tokens="max_new_tokens",
    seed="random_seed",
    min_tokens="min_length",
    num_return_sequences=False,
    min_p=False,
    finish_reasons=False,
    executor_config_fields=frozenset({"max_batch_size"}),
    perf_metrics=False,
    kv_events=False,
    priority=False,
)


@pytest.mark.parametrize(
    "sampling, api, n, min_new, expected",
    [
        (GREEDY, BindingApi(), 1, 0, {"beam_width": 1, "seed": 9}),
        (SAMPLE, BindingApi(), 1, 0, {"beam_width": 1, "seed": 9, "top_k": 5, "top_p": 0.85, "temperature": 0.7}),
        (
            SAMPLE,
            OLD,
            1,
            3,
            {"beam_width": 1, "random_seed": 9, "min_length": 3, "top_k": 5, "top_p": 0.85, "temperature": 0.7},
        ),
        (
            SAMPLE,
            BindingApi(),
            4,
            2,
            {
                "beam_width": 1,
                "seed": 9,
                "min_tokens": 2,
                "num_return_sequences": 4,
                "top_k": 5,
                "top_p": 0.85,
                "temperature": 0.7,
            },
        ),
        (
            ResolvedSampling(do_sample=False, seed=-1, temperature=0.0, repetition_penalty=1.1),
            BindingApi(),
            1,
            0,
            {"beam_width": 1, "seed": (1 << 64) - 1, "repetition_penalty": 1.1},
        ),
        (
            ResolvedSampling(
                do_sample=True,
                seed=1,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                min_p=0.1,
                presence_penalty=0.5,
                frequency_penalty=0.2,
            ),
            BindingApi(),
            1,
            0,
            {
                "beam_width": 1,
                "seed": 1,
                "top_k": 0,
                "top_p": 1.0,
                "temperature": 1.0,
                "min_p": 0.1,
                "presence_penalty": 0.5,
                "frequency_penalty": 0.2,
            },
        ),
        (
            ResolvedSampling(do_sample=True, seed=1, temperature=1.0, top_k=5, top_p=0.85, min_p=0.1),
            OLD,
            1,
            0,
            {"beam_width": 1, "random_seed": 1, "top_k": 5, "top_p": 0.85, "temperature": 1.0},
        ),
    ],
)
def test_sampling_kwargs(sampling, api, n, min_new, expected):
    assert sampling_kwargs(sampling, api, n=n, min_new_tokens=min_new) == expected


def _req(**fields) -> EngineRequest:
    return EngineRequest("r", [1, 2], GREEDY, 5, **fields)


@pytest.mark.parametrize(
    "req, extra_eos, expected",
    [
        (_req(), {7}, [[7]]),
        (_req(ignore_eos=True), {7}, []),
        (_req(stop_words_ids=[[5, 6], [9]], stop_token_ids=frozenset({9, 4})), {7}, [[5, 6], [9], [4], [7]]),
        (_req(stop_token_ids=frozenset({7})), {7}, [[7]]),
        (_req(stop_words_ids=[[5, 6]], stop_token_ids=frozenset({4}), min_new_tokens=2), {7}, []),
    ],
)
def test_stop_words(req, extra_eos, expected):
    assert stop_words_for(req, extra_eos) == expected


@pytest.mark.parametrize(
    "values, received, count, expected",
    [
        (None, 0, 1, None),
        ([-1.0], 0, 1, [-1.0]),  # first response: cumulative and per-token agree
        ([-1.0, -2.0, -3.0], 2, 1, [-3.0]),  # cumulative (E2)
        ([-3.0], 2, 1, [-3.0]),  # per-token
        ([-1.0, -2.0, -3.0, -4.0], 1, 2, [-2.0, -3.0]),  # cumulative, two new tokens
        ([-1.0, -2.0], 0, 0, [-1.0, -2.0][:0]),  # an empty final response
        ([-1.0], 3, 2, None),  # inconsistent: no usable values
    ],
)
def test_new_logprobs(values, received, count, expected):
    assert new_logprobs(values, received, count) == expected


@pytest.mark.parametrize(
    "message, kind, field",
    [
        (
            "Encountered an error when fetching new request: Prompt length (300) exceeds maximum input length (256).",
            ContextLengthExceeded,
            None,
        ),
        (
            "Encountered an error when fetching new request: Request sequence length is potentially greater than max "
            "input length.",
            InvalidArgument,
            "stopping.max_new_tokens",
        ),
        ("Encountered an error in forwardAsync function: CUDA error", EngineFailure, None),
        (
            "Encountered an error when fetching new request: embedding bias shape is not as expected",
            EngineFailure,
            None,
        ),
    ],
)
def test_error_responses(message, kind, field):
    err = classify_error(message)
    assert type(err) is kind and err.field == field and message in err.message


@pytest.mark.parametrize(
    "message, stopping, kind",
    [
        ("[TensorRT-LLM][ERROR] Maximum queue size of 4 has been reached, please try again later", False, Overloaded),
        ("[TensorRT-LLM][ERROR] Shutdown called", True, NotReady),
        ("[TensorRT-LLM][ERROR] Shutdown called", False, EngineDead),
        ("unknown logits post processor", False, EngineFailure),
    ],
)
def test_enqueue_errors(message, stopping, kind):
    assert type(classify_enqueue_error(RuntimeError(message), stopping=stopping)) is kind


@pytest.mark.parametrize(
    "era, expected",
    [
        ("1.0", BindingApi(guide_types=frozenset({"JSON", "JSON_SCHEMA", "REGEX", "EBNF_GRAMMAR", "STRUCTURAL_TAG"}))),
        ("0.15", BindingApi(num_return_sequences=False, min_p=False, perf_metrics=False, kv_events=False)),
        ("0.11", OLD),
    ],
)
def test_detect_api(era, expected):
    assert detect_api(trtllm_executor.make_module(era)) == expected


def test_executor_priority_keeps_trellis_order_in_the_executors_range():
    values = [executor_priority(p) for p in (-1000, -5, -1, 0, 1, 5, 1000)]
    assert values[3] == 0.5  # the executor's kDefaultPriority
    assert all(0.0 <= v <= 1.0 for v in values)
    assert values == sorted(values, reverse=True)  # lower Trellis priority -> higher executor priority
    assert len(set(values[1:-1])) == 5


@pytest.mark.parametrize("era", ["0.11", "0.15", "1.0"])
def test_executor_config(tmp_path, era):
    tl = trtllm_executor.make_module(era)
    layout = read_engine_layout(trtllm_executor.write_engine_dir(tmp_path, max_batch_size=8))
    opts = TrtllmOptions(
        max_batch_size=32,
        max_queue_size=4,
        max_num_tokens=512,
        scheduler_policy="max_utilization",
        request_stats_max_iterations=10,
    )
    cfg = make_executor_config(tl, detect_api(tl), opts, layout)
    assert cfg.max_beam_width == 1 and cfg.request_stats_max_iterations == 10
    assert cfg.kv_cache_config.enable_block_reuse is True and cfg.kv_cache_config.free_gpu_memory_fraction == 0.9
    assert cfg.scheduler_config.capacity_scheduler_policy.name == "MAX_UTILIZATION"
    if era == "0.11":  # the constructor took max_batch_size; the binding has no property for it
        assert not hasattr(cfg, "max_queue_size") and not hasattr(cfg, "max_batch_size")
        assert cfg.fake_max_batch_size == 8
    else:
        assert (cfg.max_batch_size, cfg.max_num_tokens, cfg.max_queue_size) == (8, 512, 4)
    if era == "0.11":
        with pytest.raises(RuntimeError, match="static_batch"):
            make_executor_config(tl, detect_api(tl), TrtllmOptions(scheduler_policy="static_batch"), layout)


def test_layout_from_manifest_and_engine_config(tmp_path):
    trtllm_executor.write_engine_dir(
        tmp_path / "engine", vocab_size=1001, tp=2, max_input_len=100, max_seq_len=200, gather_context_logits=True
    )
    manifest = {"engine_dir": "engine", "tokenizer_dir": "tokenizer", "tensorrt_llm_version": "1.2.0"}
    (tmp_path / "trellis-engine.json").write_text(json.dumps(manifest))
    layout = read_engine_layout(tmp_path)
    assert layout.engine_dir == tmp_path / "engine"
    assert (layout.max_input_len, layout.max_seq_len, layout.tp, layout.world_size) == (100, 200, 2, 2)
    assert layout.vocab_size == 1001 and layout.vocab_size_padded == 1002  # logits padded to tp * pp
    assert layout.gather_context_logits and layout.paged_context_fmha
    assert layout.version == "1.0.0"  # the engine's own record wins
    assert read_engine_layout(tmp_path / "engine").max_seq_len == 200


def test_layout_errors(tmp_path):
    with pytest.raises(RuntimeError, match="not a TensorRT-LLM engine directory"):
        read_engine_layout(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"build_config": {"max_input_len": 1}}))
    with pytest.raises(RuntimeError, match="vocab_size"):
        read_engine_layout(tmp_path)
    config = {"build_config": {"max_input_len": 1}, "pretrained_config": {"vocab_size": 8}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(RuntimeError, match="max_seq_len"):
        read_engine_layout(tmp_path)


def test_options_from_config():
    from core.config import CoreConfig

    opts = TrtllmOptions.from_config(
        CoreConfig(model="m", trt_max_num_tokens=0, trt_await_timeout_ms=0, max_queue_size=7)
    )
    assert opts.max_num_tokens is None and opts.await_timeout_ms == 1 and opts.max_queue_size == 7


# ------------------------------------------------------------------------- LLM API mapping


@pytest.mark.parametrize(
    "req, expected",
    [
        (_req(), {"n": 1, "stop_token_ids": [7]}),
        (
            EngineRequest("r", [1], SAMPLE, 5, num_sequences=3, logprobs=True),
            {"n": 3, "top_k": 5, "top_p": 0.85, "temperature": 0.7, "logprobs": 1, "stop_token_ids": [7]},
        ),
        (_req(ignore_eos=True, stop_token_ids=frozenset({4})), {"n": 1, "ignore_eos": True}),  # matched locally
        (_req(min_new_tokens=2, stop_token_ids=frozenset({4})), {"n": 1, "min_tokens": 2}),
        (_req(bad_words_ids=[[11], [12]]), {"n": 1, "bad_token_ids": [11, 12], "stop_token_ids": [7]}),
    ],
)
def test_llm_sampling_kwargs(req, expected):
    logprobs = expected.get("logprobs", 0)
    base = {
        "max_tokens": 5,
        "end_id": 2,
        "pad_id": 0,
        "seed": req.sampling.seed,
        "ignore_eos": False,
        "include_stop_str_in_output": True,
        "detokenize": False,
    }
    assert llm_sampling_kwargs(req, end_id=2, pad_id=0, extra_eos=frozenset({7}), logprobs=logprobs) == base | expected


@pytest.mark.parametrize(
    "entries, tokens, expected",
    [
        ([-0.5, -1.0], [3, 4], [-0.5, -1.0]),
        ([{3: Logprob(-0.5, 1)}, {4: Logprob(-1.0, 1), 9: Logprob(-0.1, 2)}], [3, 4], [-0.5, -1.0]),
        ([{3: -0.25}], [3, 4], [-0.25, None]),  # missing: unknown, never 0.0
        ([{9: Logprob(-0.1, 1)}], [3], [None]),  # top-k keyed, the sampled token not among them
    ],
)
def test_llm_logprob_values(entries, tokens, expected):
    assert logprob_values(entries, tokens) == expected
