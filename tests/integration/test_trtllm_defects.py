"""Behaviours of the real library that broke the TensorRT-LLM engines: one test each, against
the double of the era where the behaviour lives.

Every docstring names the upstream source (NVIDIA/TensorRT-LLM unless said otherwise) and the
releases the behaviour was read in.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import types
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from core.engine.trtllm import executor as trtllm
from core.engine.trtllm import llm as trtllm_llm
from core.errors import InvalidArgument
from core.types import EngineRequest, FinishReason, SamplingOptions
from gateways.common.status import GatewayError
from tests.conftest import core_config
from tests.fakes import trtllm_executor
from tests.fakes import trtllm_llm as fake_llm
from tests.fakes.trtllm_harness import collect, finish_of, make_engine_output, serve_engine, tokens_of
from tests.fakes.trtllm_model import FakeModel
from tests.integration.core_helpers import request_of as request
from tests.integration.core_helpers import wait_health

MODEL = FakeModel(4096)
LENGTH_MESSAGE = "The sum of prompt length (20.0), query length (0) should not exceed max_num_tokens (16)"


def _llm(fake):
    return fake.fake_instances[-1]


def _records(msgs: list[spb.GenerateResponse]) -> list[pb.Token]:
    """The token records (id, logprob) of a one-sequence stream, concatenated."""
    return [t for m in msgs for o in m.outputs for t in o.tokens]


async def _logprob_tokens(stub, max_new_tokens: int, **sampling: Any) -> list[pb.Token]:
    """The token records of one request for logprobs with these sampling fields."""
    stopping = {"max_new_tokens": max_new_tokens}
    return _records(await collect(stub, request(sampling=sampling, stopping=stopping, output={"logprobs": True})))


# --------------------------------------------------------------------------------- 1


async def test_1_request_error_at_submit_fails_the_request_not_the_engine(monkeypatch, tokenizer, tiny_model_dir):
    """`RequestError` (a RuntimeError, `tensorrt_llm/executor/utils.py`) is one request's
    failure; `tests/unittest/llmapi/test_llm.py::test_max_num_token_check` expects it from
    `llm.generate` for a prompt over max_num_tokens ("should not exceed max_num_tokens")."""
    fake = fake_llm.install(monkeypatch, version="1.3.0")
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm") as (server, stub):
        _llm(fake).fake_fail_submit(fake_llm.RequestError(LENGTH_MESSAGE))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, request("a prompt of more than four tokens, surely"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert GatewayError.from_rpc_error(e.value).reason == "CONTEXT_LENGTH_EXCEEDED"
        assert server.engine.alive
        await wait_health(server.address, health_pb2.HealthCheckResponse.SERVING)
        msgs = await collect(stub, request("hi", stopping={"max_new_tokens": 2}))
        assert len(tokens_of(msgs)) == 2


# --------------------------------------------------------------------------------- 4


async def test_4_eos_in_token_ids_is_not_reported(monkeypatch, tokenizer, tiny_model_dir):
    """PyTorch backend: TorchSampler appends the token, then finishes by END_ID
    (`_torch/pyexecutor/sampler.py`, `add_token` before `_handle_stop_criteria`), so the end
    token is in `CompletionOutput.token_ids`. It is not counted, given a logprob nor sent."""
    fake_llm.install(monkeypatch)
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm") as (_server, stub):
        msgs = await collect(stub, request(bias={2: 100.0}, stopping={"max_new_tokens": 10}, output={"logprobs": True}))
        assert finish_of(msgs).finish_reason == pb.FINISH_REASON_EOS
        toks = _records(msgs)
        assert [t.id for t in toks] == tokens_of(msgs) and 2 not in tokens_of(msgs) and len(toks) == 1
        assert msgs[-1].usage.completion_tokens == 1


# --------------------------------------------------------------------------------- 5


async def test_5_a_logprob_the_llm_did_not_give_is_left_unset(monkeypatch, tokenizer, tiny_model_dir):
    """From 1.1 TorchSampler keys logprobs by the top-k tokens (`handle_logprobs`,
    `py_topk_logprobs_*`); a sampled token outside them has none. Never report 0.0; with
    top-k sampling ask for top_k alternatives, which always hold the sampled token."""
    fake_llm.install(monkeypatch, sampler_switch=False)  # TorchSampler only
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm") as (_server, stub):
        toks = await _logprob_tokens(stub, 24, do_sample=True, top_k=0, top_p=1.0)
        assert toks and all(not t.HasField("logprob") or t.logprob < 0 for t in toks)
        assert any(not t.HasField("logprob") for t in toks)  # full-vocabulary sampling left some out
        toks = await _logprob_tokens(stub, 12, do_sample=True, top_k=5)
        assert all(t.HasField("logprob") and t.logprob < 0 for t in toks)


# --------------------------------------------------------------------------------- 6


@pytest.mark.parametrize("version", ["1.0.0", "1.2.0"])
async def test_6_stop_tokens_hold_with_ignore_eos(monkeypatch, tokenizer, tiny_model_dir, version):
    """With ignore_eos, `base_worker.py` sends `stop_words=[]` (2026 main) while the 1.0-era
    `worker.py` sends the client's stop words; the engine matches the client's stop tokens
    itself in both."""
    fake_llm.install(monkeypatch, version=version)
    greedy, _ = MODEL.greedy(tokenizer.encode("hello"), 10)
    i = next(k for k in range(2, 10) if greedy[k] not in greedy[:k])
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm") as (_server, stub):
        msgs = await collect(
            stub, request(stopping={"max_new_tokens": 10, "stop_token_ids": [greedy[i]], "ignore_eos": True})
        )
        last = finish_of(msgs)
        assert last.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE and last.stop_token_id == greedy[i]
        assert tokens_of(msgs) == greedy[: i + 1]


# --------------------------------------------------------------------------------- 7


async def test_7_torch_sampler_gaps_are_refused_and_no_seed_is_reported(monkeypatch, tokenizer, tiny_model_dir):
    """TorchSampler has no penalty or min_p code and one generator seeded 42 for every request
    (`TorchSampler._global_seed`) until PRs #16485/#16590/#17172 (July-August 2026). Where the
    release cannot select the C++ sampler, those fields are refused and sampling requests
    report no seed."""
    fake_llm.install(monkeypatch, sampler_switch=False)
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm") as (server, stub):
        for field, value in (("repetition_penalty", 1.3), ("min_p", 0.1), ("seed", 7)):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(stub, request(sampling={"do_sample": True, field: value}))
            assert GatewayError.from_rpc_error(e.value).param == f"sampling.{field}"
        msgs = await collect(stub, request(sampling={"do_sample": True}, stopping={"max_new_tokens": 2}))
        assert not msgs[-1].HasField("seed") and not msgs[-1].effective_sampling.HasField("seed")
        msgs = await collect(stub, request(stopping={"max_new_tokens": 2}))  # greedy needs no seed
        assert msgs[-1].HasField("seed")
        assert server.engine.sampler == "torch-legacy"


@pytest.mark.parametrize("version, arg", [("1.0.0", "enable_trtllm_sampler"), ("1.2.0", "sampler_type")])
async def test_7_the_cpp_sampler_is_selected_where_the_release_can(
    monkeypatch, tokenizer, tiny_model_dir, version, arg
):
    """`sampler_type="TRTLLMSampler"` (1.1+) or `enable_trtllm_sampler=True` (1.0,
    `docs/source/1.0/features/sampling.md`) gives per-request seeds and penalties."""
    fake = fake_llm.install(monkeypatch, version=version)
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm") as (server, stub):
        body = request(
            sampling={"do_sample": True, "seed": 11, "repetition_penalty": 1.2}, stopping={"max_new_tokens": 6}
        )
        a, b = await collect(stub, body), await collect(stub, body)
        assert a[-1].seed == 11 and tokens_of(a) == tokens_of(b)
        assert server.engine.sampler == "trtllm" and _llm(fake).fake_sampler == "trtllm"


# --------------------------------------------------------------------------------- 8


async def test_8_embedding_bias_has_the_unpadded_vocabulary_width(monkeypatch, tokenizer, tmp_path, tiny_model_dir):
    """The decoder checks `embedding_bias` against `ModelConfig::getVocabSize()`, the unpadded
    vocabulary (`createNewDecoderRequests.cpp` `initializeEmbeddingBias`; `GptDecoderBatch`
    built from `getVocabSize()` in 0.x), while logits are padded to
    `getVocabSizePadded(tp * pp)`. A vocabulary of 4097 over tp 2 x pp 2: bias width 4097,
    neither 4098 (padded to tp) nor 4100 (padded to tp * pp)."""
    out = make_engine_output(tmp_path / "tp2pp2", tiny_model_dir, vocab_size=4097, tp=2, pp=2)
    trtllm_executor.install(monkeypatch, "1.0")
    mpi = types.ModuleType("mpi4py")
    mpi.MPI = types.SimpleNamespace(COMM_WORLD=types.SimpleNamespace(Get_rank=lambda: 0, Get_size=lambda: 4))
    monkeypatch.setitem(sys.modules, "mpi4py", mpi)
    async with serve_engine(trtllm.build, out, tokenizer, engine="trtllm") as (server, stub):
        msgs = await collect(stub, request(bias={2: 100.0}, stopping={"max_new_tokens": 5}))
        assert finish_of(msgs).finish_reason == pb.FINISH_REASON_EOS
        sent = server.engine._executor.fake_requests
        assert tuple(sent[max(sent)].embedding_bias.shape) == (4097,)


# --------------------------------------------------------------------------------- 9


async def test_9_clipped_length_is_length_on_0_11(monkeypatch, tokenizer, tmp_path, tiny_model_dir):
    """0.11 results carry no finish_reasons; `LlmRequest::validate` clips max_tokens to
    max_seq_len - prompt ("Number of requested output tokens is changed to"), so a sequence
    that stopped there ended by LENGTH, not EOS."""
    trtllm_executor.install(monkeypatch, "0.11")
    out = make_engine_output(tmp_path / "e", tiny_model_dir, max_seq_len=20, max_input_len=16)
    engine = trtllm.build(core_config(out, engine="trtllm"), tokenizer)
    await engine.start()
    try:
        prompt = tokenizer.encode("hello there")
        req = EngineRequest("c", prompt, engine.resolve_sampling(SamplingOptions(), random_seed=1), 30)
        outs = [o async for o in engine.generate(req)]
        steps = [s for o in outs for s in o.sequences]
        assert sum(len(s.token_ids) for s in steps) == 20 - len(prompt)
        assert steps[-1].finish_reason is FinishReason.LENGTH
    finally:
        await engine.shutdown()


# --------------------------------------------------------------------------------- 10


async def test_10_the_0_11_shape_serves(monkeypatch, tokenizer, tmp_path, tiny_model_dir):
    """bindings.cpp at the 0.11 branch point: max_batch_size only in ExecutorConfig's
    constructor, no max_queue_size (the engine bounds its own queue), positional Request with
    max_new_tokens, no finish_reasons (inferred)."""
    trtllm_executor.install(monkeypatch, "0.11")
    out = make_engine_output(tmp_path / "e", tiny_model_dir, max_batch_size=4)
    async with serve_engine(trtllm.build, out, tokenizer, engine="trtllm", max_queue_size=3) as (server, stub):
        msgs = await collect(stub, request(stopping={"max_new_tokens": 4}))
        assert finish_of(msgs).finish_reason == pb.FINISH_REASON_LENGTH and len(tokens_of(msgs)) == 4
        ex = server.engine._executor
        assert ex.config.fake_max_batch_size == 4 and not hasattr(ex.config, "max_batch_size")
        assert server.engine._local_queue_limit == 3


# --------------------------------------------------------------------------------- 11


async def test_11_the_llm_double_keeps_upstream_behaviour(monkeypatch, tmp_path):
    """The LLM double itself: EOS in token_ids (PyTorch), top-k keyed logprobs, RequestError
    at submit, and no async iteration for a RequestOutput created off a running loop
    (`executor/result.py`)."""
    import json

    top = fake_llm.install(monkeypatch, version="1.3.0", sampler_switch=False)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 4096, "max_position_embeddings": 64}))
    if True:
        llm = top.LLM(tmp_path, skip_tokenizer_init=True, max_num_tokens=16)
        try:
            bias = __import__("torch").zeros(4096)
            bias[2] = 100.0
            params = top.SamplingParams(end_id=2, max_tokens=5, embedding_bias=bias, logprobs=1)
            ro = await llm.generate_async([5, 6, 7], params, streaming=False).aresult()
            assert ro.outputs[0].token_ids[-1] == 2 and ro.outputs[0].finish_reason == "stop"
            with pytest.raises(fake_llm.RequestError, match="max_num_tokens"):
                llm.generate_async(list(range(20)), top.SamplingParams(end_id=2))
            with pytest.raises(TypeError):
                top.SamplingParams(end_id=2, no_such_field=1)
            off_loop = []
            t = threading.Thread(target=lambda: off_loop.append(llm.generate_async([5], top.SamplingParams(end_id=2))))
            t.start()
            t.join()
            with pytest.raises(AssertionError, match="event loop was not present"):
                await off_loop[0].__anext__()
        finally:
            llm.shutdown()


# --------------------------------------------------------------------------------- 12


async def test_12_sampling_params_type_error_is_invalid_argument(monkeypatch, tokenizer, tiny_model_dir):
    """`SamplingParams(**kw)` is a dataclass (`tensorrt_llm/sampling_params.py`): a field the
    release lacks is a TypeError, refused as INVALID_ARGUMENT, not a crash."""
    fake_llm.install(monkeypatch)
    engine = trtllm_llm.build(core_config(tiny_model_dir, engine="trtllm-llm"), tokenizer)
    await engine.start()
    try:
        monkeypatch.setattr(engine, "_api", dataclasses.replace(engine._api, sampling_params=_raise_type_error))
        req = EngineRequest("t", [1, 5], engine.resolve_sampling(SamplingOptions(), random_seed=1), 3)
        with pytest.raises(InvalidArgument, match="refused the sampling parameters"):
            engine.generate(req)
    finally:
        await engine.shutdown()


def _raise_type_error(**_kw):
    raise TypeError("__init__() got an unexpected keyword argument 'min_p'")


async def test_12_generate_async_runs_on_the_llm_loop(monkeypatch, tokenizer, tiny_model_dir):
    """`generate_async` waits on the worker's answer; it runs on the LLM's own loop thread,
    never on the core's loop (and never in a loop-less thread, `executor/result.py`)."""
    fake = fake_llm.install(monkeypatch)
    seen = []
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm") as (_server, stub):
        llm = _llm(fake)
        original = llm.generate_async

        def spy(*args, **kwargs):
            seen.append(threading.current_thread().name)
            return original(*args, **kwargs)

        llm.generate_async = spy
        msgs = await collect(stub, request(stopping={"max_new_tokens": 3}))
        assert len(tokens_of(msgs)) == 3
    assert seen == ["trtllm-llm-loop"]


async def test_12_context_logits_arrive_on_every_result(monkeypatch, tmp_path, tiny_model_dir, tokenizer):
    """`LlmRequest::createResponse` sets `result.contextLogits` whenever asked, on every
    response; the engine uses the first and ignores the rest."""
    tl = trtllm_executor.install(monkeypatch, "1.0")
    out = make_engine_output(tmp_path / "e", tiny_model_dir, gather_context_logits=True)
    async with serve_engine(trtllm.build, out, tokenizer, engine="trtllm") as (_server, stub):
        msgs = await collect(stub, request(stopping={"max_new_tokens": 3}, output={"prompt_logprobs": 1}))
        assert sum(1 for m in msgs if m.prompt_tokens) == 1
    assert tl.fake_instances


# --------------------------------------------------------------------------------- 13


def _full_logprob(context: list[int], token: int) -> float:
    return float(MODEL.logits(context).log_softmax(-1)[token])


@pytest.mark.parametrize("era", ["0.11", "0.15", "1.0", "1.3"])
async def test_13_logprobs_are_the_models_on_every_executor_release(
    monkeypatch, tokenizer, tmp_path, tiny_model_dir, era
):
    """`ExecutorConfig.normalize_log_probs` (`cpp/tensorrt_llm/executor/executorConfig.cpp`,
    0.11 to 1.3.0rc20) defaults to True until PR #12366 (March 2026, "Do not normalize log
    probs by default"); normalized, a greedy token's logprob is 0.0
    (triton-inference-server/tensorrtllm_backend issue #276; issue #2406 on 0.14) and a sampled
    token's is taken in the truncated top-k distribution. The engine turns it off wherever the
    release has it: greedy and sampled tokens both report their logprob in the model's
    distribution."""
    trtllm_executor.install(monkeypatch, era)
    out = make_engine_output(tmp_path / "e", tiny_model_dir)
    async with serve_engine(trtllm.build, out, tokenizer, engine="trtllm") as (server, stub):
        prompt = tokenizer.encode("hello")
        greedy, lps = MODEL.greedy(prompt, 4)
        toks = await _logprob_tokens(stub, 4)
        assert [t.id for t in toks] == greedy
        assert [t.logprob for t in toks] == pytest.approx(lps, abs=1e-4) and all(t.logprob < 0 for t in toks)
        toks = await _logprob_tokens(stub, 4, do_sample=True, top_k=3, seed=5)
        ids, lps = [t.id for t in toks], [t.logprob for t in toks]
        assert lps == pytest.approx([_full_logprob(prompt + ids[:i], t) for i, t in enumerate(ids)], abs=1e-4)
        assert server.engine._executor.config.normalize_log_probs is False


# --------------------------------------------------------------------------------- 14


@pytest.mark.parametrize(
    "version, sampler, seed_reported",
    [("1.0.0", "trtllm", True), ("1.1.0rc0", "trtllm", True), ("1.2.0", "trtllm", True), ("1.4.0", "torch", False)],
)
async def test_14_the_sampler_is_the_one_the_release_has(
    monkeypatch, tokenizer, tiny_model_dir, version, sampler, seed_reported
):
    """`enable_trtllm_sampler` (1.0), `use_torch_sampler` with TRTLLMSampler the default (the
    1.1 pre-releases between PR #6216 and PR #6831), `sampler_type` (PR #6831 on, deprecated by
    PR #11938), and no switch at all once PR #18232 (2026-08-26; 1.3.0rc26, 1.4.0rc4) removed
    TRTLLMSampler and `sampler_type` -- where passing it is refused and TorchSampler has
    penalties (PR #16485), min_p (PR #16590) and per-request seeds (PR #17172). Each release
    builds and takes penalties, min_p and a seed; TorchSampler's seeds do not reproduce across
    batches (PR #17172: FlashInfer reads the first row's seed), so no seed is reported there."""
    fake = fake_llm.install(monkeypatch, version=version)
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm") as (server, stub):
        body = request(
            sampling={"do_sample": True, "seed": 11, "repetition_penalty": 1.2, "min_p": 0.05},
            stopping={"max_new_tokens": 4},
        )
        msgs = await collect(stub, body)
        assert len(tokens_of(msgs)) == 4 and msgs[-1].HasField("seed") is seed_reported
        assert server.engine.sampler == sampler and _llm(fake).fake_sampler == sampler
        sent = _llm(fake).fake_executor.fake_requests
        sc = sent[max(sent)].sampling_config
        assert (sc.repetition_penalty, sc.min_p, sc.seed) == (pytest.approx(1.2), pytest.approx(0.05), 11)


# --------------------------------------------------------------------------------- 15


@pytest.fixture
def bad_for_xgrammar():
    """A guide llguidance compiles and XGrammar refuses (its regex converter has no Unicode
    classes: "Regex parsing error at position 1"); needs xgrammar, which TensorRT-LLM brings."""
    pytest.importorskip("xgrammar", reason="xgrammar is not installed (TensorRT-LLM brings it)")
    return pb.GuidedDecoding(regex=r"\p{L}+")


def test_15_the_double_fails_the_whole_batch_on_a_guide_that_does_not_compile(tmp_path, tokenizer):
    """`GuidedDecoder::build` (`batch_manager/guidedDecoder.cpp`, 0.16 to 1.3.0rc20) compiles
    a request's grammar inside `forwardAsync`; its exception reaches `terminateActiveRequests`,
    which errors every active request, not only the guided one."""
    from core.engine.trtllm.mapping import xgrammar_tokenizer_info

    tl = trtllm_executor.make_module("1.0")
    engine = trtllm_executor.write_engine_dir(tmp_path / "e")
    guided = tl.GuidedDecodingConfig(
        tl.GuidedDecodingConfig.GuidedDecodingBackend.XGRAMMAR, **xgrammar_tokenizer_info(tokenizer, 2)
    )
    with tl.Executor(engine, tl.ModelType.DECODER_ONLY, tl.ExecutorConfig(guided_decoding_config=guided)) as ex:
        running = ex.enqueue_request(tl.Request([1, 300], 200, streaming=True, end_id=2))
        while not ex.await_responses(running, timeout=1.0):
            pass
        bad = tl.GuidedDecodingParams(tl.GuidedDecodingParams.GuideType.REGEX, "a(?=b)")  # no compiler takes it
        guided_id = ex.enqueue_request(tl.Request([1, 301], 4, end_id=2, guided_decoding_params=bad))
        for rid in (running, guided_id):
            last = None
            while last is None or not (last.has_error() or last.result.is_final):
                got = ex.await_responses(rid, timeout=1.0)
                last = got[-1] if got else last
            assert last.has_error() and "Encountered an error in forwardAsync function" in last.error_msg
    plain = trtllm_executor.make_module("1.0")
    with plain.Executor(engine, plain.ModelType.DECODER_ONLY, plain.ExecutorConfig()) as ex:
        params = plain.GuidedDecodingParams(plain.GuidedDecodingParams.GuideType.REGEX, "[0-9]")
        rid = ex.enqueue_request(plain.Request([1, 300], 4, end_id=2, guided_decoding_params=params))
        got = []
        while not got:
            got = ex.await_responses(rid, timeout=1.0)
        assert got[0].has_error() and "no GuidedDecodingConfig" in got[0].error_msg


@pytest.mark.parametrize("kind", ["trtllm", "trtllm-llm"])
async def test_15_a_guide_xgrammar_refuses_fails_alone_before_the_batch(
    monkeypatch, tokenizer, tmp_path, tiny_model_dir, bad_for_xgrammar, kind
):
    """The core checks guides with llguidance, the runtime compiles them with XGrammar
    (`guidedDecoder.cpp`: `Grammar::FromRegex`); each guide is compiled with XGrammar before it
    is sent, so one it refuses fails with INVALID_ARGUMENT naming its field and the request
    already running finishes."""
    if kind == "trtllm":
        trtllm_executor.install(monkeypatch, "1.0")
        build, model = trtllm.build, make_engine_output(tmp_path / "e", tiny_model_dir)
    else:
        fake_llm.install(monkeypatch)
        build, model = trtllm_llm.build, tiny_model_dir
    async with serve_engine(build, model, tokenizer, engine=kind) as (server, stub):
        running = stub.Generate(request(stopping={"max_new_tokens": 120}))
        while not (await running.read()).outputs:
            pass
        guided = spb.GenerateRequest(text="hi", stopping=pb.StoppingParams(max_new_tokens=4))
        guided.guided_decoding.CopyFrom(bad_for_xgrammar)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, guided)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert GatewayError.from_rpc_error(e.value).param == "guided_decoding.regex"
        assert "XGrammar" in e.value.details()
        rest = []
        while (message := await running.read()) is not grpc.aio.EOF:
            rest.append(message)
        assert finish_of(rest).finish_reason == pb.FINISH_REASON_LENGTH
        assert server.engine.alive


# --------------------------------------------------------------------------------- 16


def _ids_request(n: int, max_new_tokens: int) -> spb.GenerateRequest:
    """A prompt of exactly `n` token ids (not EOS)."""
    return spb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[100 + i for i in range(n)]),
        stopping=pb.StoppingParams(max_new_tokens=max_new_tokens),
    )


@pytest.mark.parametrize("case", ["chunked", "opted-out", "not-in-release"])
async def test_16_a_prompt_longer_than_max_num_tokens(monkeypatch, caplog, tokenizer, tiny_model_dir, case):
    """`llmapi/llm.py` `_check_arguments` (PyTorch backend, 1.x) refuses a prompt over
    `max_num_tokens` unless `enable_chunked_prefill` is on. The engine turns it on where the
    LLM takes it, so such a prompt is served; where it does not, or with
    `--no-trt-enable-chunked-prefill`, the engine's limit is `max_num_tokens`, GetModelInfo
    reports it as max_input_tokens, and a longer prompt is CONTEXT_LENGTH_EXCEEDED before the
    LLM sees it; the start log says why."""
    caplog.set_level(logging.WARNING, logger="core.engine.trtllm.llm")
    fake = fake_llm.install(monkeypatch)
    if case == "not-in-release":
        del sys.modules["tensorrt_llm.llmapi"].TorchLlmArgs.model_fields["enable_chunked_prefill"]
    async with serve_engine(
        trtllm_llm.build,
        tiny_model_dir,
        tokenizer,
        engine="trtllm-llm",
        trt_max_num_tokens=8,
        trt_enable_chunked_prefill=case != "opted-out",
    ) as (server, stub):
        assert _llm(fake).args.enable_chunked_prefill is (case == "chunked")
        why = {"chunked": None, "opted-out": "--no-trt-enable-chunked-prefill", "not-in-release": "cannot chunk"}[case]
        limits = [
            r.getMessage() for r in caplog.records if "prompts are limited to max_num_tokens (8" in r.getMessage()
        ]
        assert [why in m for m in limits] == ([] if why is None else [True])
        info = await stub.GetModelInfo(spb.GetModelInfoRequest())
        if case == "chunked":
            msgs = await collect(stub, _ids_request(9, 3))
            assert len(tokens_of(msgs)) == 3
            assert server.engine.info.max_input_length is None
            assert info.max_input_tokens == info.max_context_length - 1 == 1023
        else:
            assert server.engine.info.max_input_length == info.max_input_tokens == 8
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(stub, _ids_request(9, 3))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert GatewayError.from_rpc_error(e.value).reason == "CONTEXT_LENGTH_EXCEEDED"
            assert "more than the 8 this engine accepts" in e.value.details()
            assert _llm(fake).fake_executor.fake_requests == {}
        assert len(tokens_of(await collect(stub, _ids_request(8, 2)))) == 2


# --------------------------------------------------------------------------------- 17


async def test_17_binding_errors_are_invalid_argument_naming_the_field(
    monkeypatch, tokenizer, tmp_path, tiny_model_dir
):
    """The executor checks `embedding_bias` against the model's vocabulary
    (`createNewDecoderRequests.cpp`), which can be smaller than the tokenizer's: a logit_bias
    id below `len(tokenizer)` but at or above the engine's `vocab_size` is the client's error,
    INVALID_ARGUMENT on `sampling.logit_bias`, as is anything the bindings refuse while the
    request is built (pybind11 TypeError, TLLM_CHECK RuntimeError)."""
    tl = trtllm_executor.install(monkeypatch, "1.0")
    out = make_engine_output(tmp_path / "e", tiny_model_dir, vocab_size=4000)
    assert tokenizer.vocab_size == 4096
    async with serve_engine(trtllm.build, out, tokenizer, engine="trtllm", trt_guided_decoding_backend="none") as (
        server,
        stub,
    ):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, request(bias={4050: 1.0}, stopping={"max_new_tokens": 2}))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert GatewayError.from_rpc_error(e.value).param == "sampling.logit_bias"
        real = tl.SamplingConfig

        def refusing(**kwargs):
            raise RuntimeError("[TensorRT-LLM][ERROR] Assertion failed: topK >= 0")

        monkeypatch.setattr(tl, "SamplingConfig", refusing)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, request(stopping={"max_new_tokens": 2}))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert GatewayError.from_rpc_error(e.value).param == "sampling" and "topK" in e.value.details()
        monkeypatch.setattr(tl, "SamplingConfig", real)
        msgs = await collect(stub, request(bias={3999: 1.0}, stopping={"max_new_tokens": 2}))
        assert len(tokens_of(msgs)) == 2 and server.engine.alive


# --------------------------------------------------------------------------------- 18


def test_18_sampling_params_post_init_and_greedy_n(monkeypatch):
    """`sampling_params.py` `__post_init__` (0.19 to 1.x): `pad_id = end_id` where unset,
    `best_of = best_of or n`; `_validate` allows greedy best_of > 1 when
    TLLM_ALLOW_N_GREEDY_DECODING holds any non-empty value
    (`os.environ.get('TLLM_ALLOW_N_GREEDY_DECODING', None)`)."""
    params = fake_llm.SamplingParams(end_id=2, n=3, top_k=5)
    assert (params.pad_id, params.best_of) == (2, 3)
    monkeypatch.delenv("TLLM_ALLOW_N_GREEDY_DECODING", raising=False)
    with pytest.raises(ValueError, match="Greedy decoding"):
        fake_llm.SamplingParams(end_id=2, n=2)
    monkeypatch.setenv("TLLM_ALLOW_N_GREEDY_DECODING", "true")
    assert fake_llm.SamplingParams(end_id=2, n=2).best_of == 2


@pytest.mark.parametrize("version, sampler, eos_in_ids", [("1.2.0", "trtllm", False), ("1.4.0", "torch", True)])
async def test_18_the_llm_double_follows_each_sampler(monkeypatch, tmp_path, version, sampler, eos_in_ids):
    """TRTLLMSampler is the C++ decoder: the end token stays out of `token_ids`; TorchSampler
    appends it (`_torch/pyexecutor/sampler.py`), and the 2026 TorchSampler's logprobs hold the
    sampled token first, then the top-k (`_torch/pyexecutor/sampler/sampler.py`). A guided
    request without a guided decoding backend is refused."""
    import json

    import torch

    top = fake_llm.install(monkeypatch, version=version)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 4096, "max_position_embeddings": 64}))
    switch = {"sampler_type": "TRTLLMSampler"} if version == "1.2.0" else {}
    llm = top.LLM(tmp_path, skip_tokenizer_init=True, **switch)
    try:
        assert llm.fake_sampler == sampler
        bias = torch.zeros(4096)
        bias[2] = 100.0
        params = top.SamplingParams(end_id=2, max_tokens=5, embedding_bias=bias, logprobs=1)
        ro = await llm.generate_async([5, 6, 7], params).aresult()
        assert (ro.outputs[0].token_ids[-1:] == [2]) is eos_in_ids and ro.outputs[0].finish_reason == "stop"
        ro = await llm.generate_async([5, 6, 7], top.SamplingParams(end_id=2, max_tokens=4, logprobs=1)).aresult()
        out = ro.outputs[0]
        assert all(next(iter(entry)) == token for entry, token in zip(out.logprobs, out.token_ids, strict=True))
        guide = fake_llm.GuidedDecodingParams(regex="[0-9]")
        with pytest.raises(fake_llm.RequestError, match="no GuidedDecodingConfig"):
            await llm.generate_async([5], top.SamplingParams(end_id=2, guided_decoding=guide)).aresult()
        if version == "1.4.0":
            with pytest.raises(ValueError):
                top.LLM(tmp_path, skip_tokenizer_init=True, sampler_type="TRTLLMSampler")
    finally:
        llm.shutdown()


@pytest.mark.parametrize("error", [ValueError, fake_llm.RequestError])
async def test_18_the_prompt_length_check_is_context_length_exceeded_either_way(
    monkeypatch, tokenizer, tiny_model_dir, error
):
    """`_check_arguments` raises a plain ValueError for a prompt over max_num_tokens in the
    1.x releases before its `RequestError` (1.2's `llm.py`: "raise ValueError(f'The sum of
    prompt length ...')"); both are CONTEXT_LENGTH_EXCEEDED, and the engine stays up."""
    fake = fake_llm.install(monkeypatch)
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm") as (server, stub):
        _llm(fake).fake_fail_submit(error(LENGTH_MESSAGE))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await collect(stub, request(stopping={"max_new_tokens": 2}))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert GatewayError.from_rpc_error(e.value).reason == "CONTEXT_LENGTH_EXCEEDED"
        assert server.engine.alive and len(tokens_of(await collect(stub, request(stopping={"max_new_tokens": 2})))) == 2
