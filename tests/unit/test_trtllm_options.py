"""Choices `core.engine.trtllm.options` and `core.engine.trtllm.guides` make per release, as
pure functions of what the installed TensorRT-LLM offers.

Sources (NVIDIA/TensorRT-LLM): `tensorrt_llm/llmapi/llm_args.py` (`enable_trtllm_sampler` in
1.0; `use_torch_sampler` from PR #6216; `sampler_type` and `SamplerType` from PR #6831, removed
by PR #18232), `cpp/tensorrt_llm/executor/executorConfig.cpp` (`normalize_log_probs`, default
True until PR #12366), `cpp/tensorrt_llm/batch_manager/guidedDecoder.cpp` (XGrammar calls).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from core.engine.trtllm.bindings import LlmApi, detect_api
from core.engine.trtllm.engine_dir import EngineLayout
from core.engine.trtllm.guides import XGrammarCheck
from core.engine.trtllm.options import TrtllmOptions, executor_config, llm_kwargs, release_at_least, select_sampler
from core.errors import InvalidArgument
from core.types import Guide
from tests.fakes import trtllm_executor

ALL_TYPES = frozenset({"TRTLLMSampler", "TorchSampler", "auto"})
BASE = frozenset({"max_batch_size", "max_num_tokens"})


def api(args: frozenset[str], version: str = "1.2.0", sampler_types: frozenset[str] = frozenset()) -> LlmApi:
    return LlmApi(
        llm=None,
        sampling_params=None,
        kv_cache_config=dict,
        request_error=None,
        llm_args=BASE | args,
        version=version,
        sampler_types=sampler_types,
    )


@pytest.mark.parametrize(
    "args, version, types, switch, sampler",
    [
        ({"enable_trtllm_sampler"}, "1.0.0", frozenset(), {"enable_trtllm_sampler": True}, "trtllm"),
        ({"use_torch_sampler"}, "1.1.0rc0", frozenset(), {"use_torch_sampler": False}, "trtllm"),
        ({"sampler_type"}, "1.2.0", ALL_TYPES, {"sampler_type": "TRTLLMSampler"}, "trtllm"),
        ({"sampler_type"}, "1.3.0rc26", frozenset({"TorchSampler", "auto"}), {}, "torch"),  # the member is gone
        (set(), "1.4.0rc4", frozenset(), {}, "torch"),
        (set(), "1.3.0rc26", frozenset(), {}, "torch"),
        (set(), "1.2.0", frozenset(), {}, "torch-legacy"),
        (set(), "unknown", frozenset(), {}, "torch-legacy"),
    ],
)
def test_the_sampler_follows_what_the_release_has(args, version, types, switch, sampler):
    assert select_sampler(api(frozenset(args), version, types)) == (switch, sampler)


def test_an_unreadable_args_model_is_the_cautious_sampler():
    bare = LlmApi(None, None, dict, None, frozenset(), "1.4.0rc4")
    assert select_sampler(bare) == ({}, "torch-legacy")


def test_release_order_is_pep_440():
    assert release_at_least("1.3.0rc26", "1.3.0rc26") and release_at_least("1.4.0rc1", "1.3.0rc26")
    assert not release_at_least("1.3.0rc25", "1.3.0rc26") and not release_at_least("not a version", "1.0")


@pytest.mark.parametrize(
    "has_field, wanted, sent", [(True, True, True), (True, False, False), (False, True, None), (False, False, None)]
)
def test_chunked_prefill_is_asked_for_where_the_llm_takes_it(has_field, wanted, sent):
    fields = frozenset({"enable_chunked_prefill"}) if has_field else frozenset()
    opts = TrtllmOptions(enable_chunked_prefill=wanted)
    kwargs, _ = llm_kwargs(api(fields | {"sampler_type"}), opts, tokenizer_dir="t")
    assert kwargs.get("enable_chunked_prefill") is sent


@pytest.mark.parametrize("era", trtllm_executor.ERAS)
def test_the_executor_never_normalizes_logprobs(era):
    tl = trtllm_executor.make_module(era)
    binding_api = detect_api(tl)
    layout = EngineLayout(Path("e"), 16, 32, 8, 1, 64, 4096, paged_context_fmha=True)
    config = executor_config(tl, binding_api, TrtllmOptions(), layout)
    assert binding_api.normalize_log_probs and config.normalize_log_probs is False


def test_without_xgrammar_every_guide_passes_and_it_is_said_once(caplog):
    with caplog.at_level(logging.WARNING):
        check = XGrammarCheck(None)
    assert not check.active and "xgrammar is not importable" in caplog.text
    check.check(Guide("regex", r"\p{L}+"))


def test_xgrammar_compiles_as_the_runtime_does():
    xgrammar = pytest.importorskip("xgrammar", reason="xgrammar is not installed (TensorRT-LLM brings it)")
    check = XGrammarCheck(xgrammar)
    for guide in (Guide("regex", "[0-9]+"), Guide("json_object"), Guide("choice", choices=("a", "b"))):
        check.check(guide)
    with pytest.raises(InvalidArgument) as e:
        check.check(Guide("regex", r"\p{L}+"))
    assert e.value.field == "guided_decoding.regex" and "Regex parsing error" in str(e.value)
    assert not str(e.value).split("compile this regex: ")[1].startswith("[")  # no C++ time/file prefix
