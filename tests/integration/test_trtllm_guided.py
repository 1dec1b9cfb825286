"""Guided decoding on the TensorRT-LLM engines, against the doubles of each upstream shape.

Sources (NVIDIA/TensorRT-LLM): the executor's `GuidedDecodingParams`/`GuideType` and the Request's
`guided_decoding_params` in `cpp/tensorrt_llm/pybind/executor/request.cpp`, `GuidedDecodingConfig`
in `executorConfig.cpp`, the runtime's handling in `cpp/tensorrt_llm/batch_manager/guidedDecoder.cpp`,
the tokenizer description in `tensorrt_llm/llmapi/tokenizer.py` (`_xgrammar_tokenizer_info`), the
LLM API's `GuidedDecodingParams` and its executor mapping in `tensorrt_llm/sampling_params.py`
(1.0.0rc4 and later), `guided_decoding_backend` in `tensorrt_llm/llmapi/llm_args.py`; first
release with guided decoding 0.16.0 (docs/source/release-notes.md). Eras 0.11 and 0.15 of the
executor double have none of it.
"""

from __future__ import annotations

import json
import re

import grpc
import pytest
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from core.engine.trtllm import executor as trtllm
from core.engine.trtllm import llm as trtllm_llm
from core.engine.trtllm.mapping import guide_text, llm_guided_kwargs
from core.types import Guide
from gateways.common.status import GatewayError
from tests.conftest import core_config
from tests.fakes import trtllm_executor
from tests.fakes import trtllm_llm as fake_llm
from tests.fakes.trtllm_harness import collect, finish_of, make_engine_output, serve_engine, text_of

ALL_BUT_LARK = ["json_object", "json_schema", "regex", "ebnf_grammar", "choice"]


@pytest.fixture
def engine_out(tmp_path, tiny_model_dir):
    return lambda **limits: make_engine_output(tmp_path / "out", tiny_model_dir, **limits)


def guided(guide: pb.GuidedDecoding, max_new_tokens: int = 24) -> spb.GenerateRequest:
    return spb.GenerateRequest(
        text="hello", stopping=pb.StoppingParams(max_new_tokens=max_new_tokens), guided_decoding=guide
    )


def last_sent(server):
    requests = server.engine._executor.fake_requests
    return requests[max(requests)]


@pytest.mark.parametrize(
    "guide, kind, text",
    [
        (Guide("json_object"), "JSON_SCHEMA", '{"type": "object"}'),
        (Guide("json_schema", '{"type": "integer"}'), "JSON_SCHEMA", '{"type": "integer"}'),
        (Guide("regex", "[0-9]+"), "REGEX", "[0-9]+"),
        (Guide("ebnf_grammar", 'root ::= "a"'), "EBNF_GRAMMAR", 'root ::= "a"'),
        (Guide("choice", choices=("yes", 'say "no"')), "EBNF_GRAMMAR", 'root ::= "yes" | "say \\"no\\""'),
    ],
)
def test_guides_map_to_the_executor_and_llm_api_types(guide, kind, text):
    assert guide_text(guide) == text
    key = {"JSON_SCHEMA": "json", "REGEX": "regex", "EBNF_GRAMMAR": "grammar"}[kind]
    assert llm_guided_kwargs(guide) == {key: text}


@pytest.mark.parametrize("era", ["0.11", "0.15"])
async def test_releases_without_guided_decoding_refuse_it_before_the_first_message(
    monkeypatch, tokenizer, engine_out, era
):
    trtllm_executor.install(monkeypatch, era)
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (server, stub):
        info = await stub.GetModelInfo(spb.GetModelInfoRequest())
        assert list(info.guided_decoding) == []
        call = stub.Generate(guided(pb.GuidedDecoding(regex="[0-9]+")))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "does not support guided decoding by regex" in err.value.details()
        assert GatewayError.from_rpc_error(err.value).param == "guided_decoding.regex"
        assert server.engine._executor.fake_requests == {}
        assert getattr(server.engine._executor.config, "guided_decoding_config", None) is None


async def test_the_executor_gets_an_xgrammar_config_from_the_tokenizer(monkeypatch, tokenizer, engine_out):
    tl = trtllm_executor.install(monkeypatch, "1.0")
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (server, stub):
        info = await stub.GetModelInfo(spb.GetModelInfoRequest())
        assert list(info.guided_decoding) == ALL_BUT_LARK
        config = server.engine._executor.config.guided_decoding_config
        assert config.backend == tl.GuidedDecodingConfig.GuidedDecodingBackend.XGRAMMAR
        vocab = tokenizer.hf.get_vocab()
        assert len(config.encoded_vocab) == len(vocab)
        assert all(vocab[token] == i for i, token in enumerate(config.encoded_vocab))
        assert json.loads(config.tokenizer_str)["model"]["type"] == "BPE"
        assert config.stop_token_ids == [2, 7]  # end_id first, then the model's other EOS


async def test_choice_and_regex_constrain_the_executor_output(monkeypatch, tokenizer, engine_out):
    tl = trtllm_executor.install(monkeypatch, "1.0")
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (server, stub):
        msgs = await collect(stub, guided(pb.GuidedDecoding(choice=pb.Choices(choices=["alpha", "beta"]))))
        params = last_sent(server).guided_decoding_params
        assert params.guide_type == tl.GuidedDecodingParams.GuideType.EBNF_GRAMMAR
        assert params.guide == 'root ::= "alpha" | "beta"'
        assert text_of(msgs) in ("alpha", "beta") and finish_of(msgs).finish_reason == pb.FINISH_REASON_EOS

        msgs = await collect(stub, guided(pb.GuidedDecoding(regex="[a-c]{2}-[0-9]{3}")))
        params = last_sent(server).guided_decoding_params
        assert (params.guide_type, params.guide) == (tl.GuidedDecodingParams.GuideType.REGEX, "[a-c]{2}-[0-9]{3}")
        assert re.fullmatch("[a-c]{2}-[0-9]{3}", text_of(msgs))
        assert finish_of(msgs).finish_reason == pb.FINISH_REASON_EOS


async def test_json_object_and_schema_are_sent_as_json_schema(monkeypatch, tokenizer, engine_out):
    tl = trtllm_executor.install(monkeypatch, "1.0")
    schema = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (server, stub):
        for guide, text in [
            (pb.GuidedDecoding(json_object=True), '{"type": "object"}'),
            (pb.GuidedDecoding(json_schema=schema), schema),
        ]:
            msgs = await collect(stub, guided(guide, max_new_tokens=12))
            params = last_sent(server).guided_decoding_params
            assert (params.guide_type, params.guide) == (tl.GuidedDecodingParams.GuideType.JSON_SCHEMA, text)
            assert text_of(msgs).lstrip().startswith("{")


async def test_lark_and_a_bad_schema_are_refused_before_the_engine(monkeypatch, tokenizer, engine_out):
    trtllm_executor.install(monkeypatch, "1.0")
    async with serve_engine(trtllm.build, engine_out(), tokenizer, engine="trtllm") as (server, stub):
        for guide, param in [
            (pb.GuidedDecoding(lark_grammar='start: "a"'), "guided_decoding.lark_grammar"),
            (pb.GuidedDecoding(json_schema='{"type": "objectx"}'), "guided_decoding.json_schema"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, guided(guide))
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert GatewayError.from_rpc_error(err.value).param == param
        assert server.engine._executor.fake_requests == {}


async def test_guided_decoding_off_leaves_the_config_out(monkeypatch, tokenizer, engine_out):
    trtllm_executor.install(monkeypatch, "1.0")
    async with serve_engine(
        trtllm.build, engine_out(), tokenizer, engine="trtllm", trt_guided_decoding_backend="none"
    ) as (server, stub):
        info = await stub.GetModelInfo(spb.GetModelInfoRequest())
        assert list(info.guided_decoding) == []
        assert server.engine._executor.config.guided_decoding_config is None


async def test_llguidance_is_refused_by_the_executor_engine(monkeypatch, tokenizer, engine_out):
    trtllm_executor.install(monkeypatch, "1.0")
    engine = trtllm.build(
        core_config(engine_out(), engine="trtllm", trt_guided_decoding_backend="llguidance"), tokenizer
    )
    with pytest.raises(RuntimeError, match="works with --engine trtllm-llm only"):
        await engine.start()


def test_the_double_refuses_llguidance_and_beam_search_as_the_runtime_does(tmp_path, tokenizer):
    tl = trtllm_executor.make_module("1.0")
    write = trtllm_executor.write_engine_dir(tmp_path / "e", max_beam_width=2)
    config = tl.GuidedDecodingConfig(tl.GuidedDecodingConfig.GuidedDecodingBackend.LLGUIDANCE, encoded_vocab=["a"])
    with pytest.raises(RuntimeError, match="LLGuidance is not supported"):
        tl.Executor(str(write), tl.ModelType.DECODER_ONLY, tl.ExecutorConfig(guided_decoding_config=config))
    params = tl.GuidedDecodingParams(tl.GuidedDecodingParams.GuideType.JSON)
    with pytest.raises(RuntimeError, match="does not support with beam search"):
        tl.Request([1, 2], 4, sampling_config=tl.SamplingConfig(beam_width=2), guided_decoding_params=params)
    assert not hasattr(trtllm_executor.make_module("0.15"), "GuidedDecodingParams")


# ------------------------------------------------------------------------------------- LLM API


async def test_llm_api_engine_sends_guided_decoding_params(monkeypatch, tokenizer, tiny_model_dir):
    fake = fake_llm.install(monkeypatch)
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm") as (_server, stub):
        info = await stub.GetModelInfo(spb.GetModelInfoRequest())
        assert list(info.guided_decoding) == ALL_BUT_LARK
        llm = fake.fake_instances[-1]
        assert llm.fake_guided_backend == "xgrammar" and not llm.args.skip_tokenizer_init
        tl = llm.fake_module
        msgs = await collect(stub, guided(pb.GuidedDecoding(choice=pb.Choices(choices=["up", "down"]))))
        requests = llm.fake_executor.fake_requests
        params = requests[max(requests)].guided_decoding_params
        assert (params.guide_type, params.guide) == (
            tl.GuidedDecodingParams.GuideType.EBNF_GRAMMAR,
            'root ::= "up" | "down"',
        )
        assert text_of(msgs) in ("up", "down")


async def test_llm_api_without_a_backend_lists_no_kinds(monkeypatch, tokenizer, tiny_model_dir):
    fake = fake_llm.install(monkeypatch)
    async with serve_engine(
        trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm", trt_guided_decoding_backend="none"
    ) as (_server, stub):
        info = await stub.GetModelInfo(spb.GetModelInfoRequest())
        assert list(info.guided_decoding) == []
        llm = fake.fake_instances[-1]
        assert llm.fake_guided_backend is None and llm.args.skip_tokenizer_init


def test_llm_api_guided_decoding_params_take_one_guide():
    with pytest.raises(ValueError, match="Only one guide"):
        fake_llm.SamplingParams(guided_decoding=fake_llm.GuidedDecodingParams(json="{}", regex="a"))
