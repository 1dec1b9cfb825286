"""One test per defect of issue 12, each against the double of the era where it lives.

Every docstring names the upstream source (NVIDIA/TensorRT-LLM) the behaviour was read in.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import types

import grpc
import pytest
from grpc_health.v1 import health_pb2
from trellis.generate.v1 import generate_pb2 as pb

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


def _llm(fake):
    return fake.fake_instances[-1]


# --------------------------------------------------------------------------------- 1


async def test_1_request_error_at_submit_fails_the_request_not_the_engine(monkeypatch, tokenizer, tiny_model_dir):
    """`RequestError` (a RuntimeError, `tensorrt_llm/executor/utils.py`) is one request's
    failure; `tests/unittest/llmapi/test_llm.py::test_max_num_token_check` expects it from
    `llm.generate` for a prompt over max_num_tokens ("should not exceed max_num_tokens")."""
    fake_llm.install(monkeypatch)
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm", trt_max_num_tokens=4) as (
        server,
        stub,
    ):
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
        toks = [t for m in msgs for o in m.outputs for t in o.tokens]
        assert [t.id for t in toks] == tokens_of(msgs) and 2 not in tokens_of(msgs) and len(toks) == 1
        assert msgs[-1].usage.completion_tokens == 1


# --------------------------------------------------------------------------------- 5


async def test_5_a_logprob_the_llm_did_not_give_is_left_unset(monkeypatch, tokenizer, tiny_model_dir):
    """From 1.1 TorchSampler keys logprobs by the top-k tokens (`handle_logprobs`,
    `py_topk_logprobs_*`); a sampled token outside them has none. Never report 0.0; with
    top-k sampling ask for top_k alternatives, which always hold the sampled token."""
    fake_llm.install(monkeypatch, sampler_switch=False)  # TorchSampler only
    async with serve_engine(trtllm_llm.build, tiny_model_dir, tokenizer, engine="trtllm-llm") as (_server, stub):
        msgs = await collect(
            stub,
            request(
                sampling={"do_sample": True, "top_k": 0, "top_p": 1.0},
                stopping={"max_new_tokens": 24},
                output={"logprobs": True},
            ),
        )
        toks = [t for m in msgs for o in m.outputs for t in o.tokens]
        assert toks and all(not t.HasField("logprob") or t.logprob < 0 for t in toks)
        assert any(not t.HasField("logprob") for t in toks)  # full-vocabulary sampling left some out
        msgs = await collect(
            stub,
            request(
                sampling={"do_sample": True, "top_k": 5}, stopping={"max_new_tokens": 12}, output={"logprobs": True}
            ),
        )
        toks = [t for m in msgs for o in m.outputs for t in o.tokens]
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
        assert server.engine.sampler == "torch"


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

    top = fake_llm.install(monkeypatch, sampler_switch=False)
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
