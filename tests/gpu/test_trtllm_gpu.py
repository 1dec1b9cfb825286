r"""Real TensorRT-LLM on a GPU: the first thing to run on a GPU machine (docs/tensorrt-llm.md).

One smoke test per engine kind. Each builds nothing it need not: `--engine trtllm` builds a
tiny engine from the demo model with scripts/build_trtllm_engine.py and serves it;
`--engine trtllm-llm` serves the demo checkpoint itself. Both compare greedy output with the
HF engine on the same weights (float32 on CPU vs float16 on GPU: the first tokens must agree).

Then, per engine, what the doubles can only model:
  * logprobs of greedy and sampled tokens are the model's (never the 0.0 of a normalized
    greedy candidate, `ExecutorConfig.normalize_log_probs`), close to the HF engine's;
  * a guide that XGrammar refuses and llguidance accepts (`\p{L}+`) fails alone with
    INVALID_ARGUMENT while a request next to it finishes (the runtime would fail the batch,
    `GuidedDecoder::build`);
  * KV-cache block reuse (on by default): a prompt sent twice gives the same greedy tokens, and
    the second time reports cached tokens (at most the prompt length - 1) that the prefix
    cache counters add up, where the release reports reuse (core/engine/trtllm/reuse.py);
  * `--engine trtllm-llm` serves a prompt longer than the LLM's `max_num_tokens` (chunked
    prefill; `llm.py` `_check_arguments`), and refuses it itself, as CONTEXT_LENGTH_EXCEEDED,
    with `--no-trt-enable-chunked-prefill`;
  * LoRA: a PEFT adapter of the demo model gives the HF engine's greedy tokens with that adapter
    (leading tokens), different from the base's, on both engines; the executor engine is built
    with `--lora-dir` (scripts/build_trtllm_engine.py) and the second request of the adapter,
    sent by task id alone (the PEFT cache holds the weights), gives the same tokens.

Skipped unless TensorRT-LLM imports and CUDA is available; the executor test also needs
TRTLLM_EXAMPLES_DIR (TensorRT-LLM's examples directory matching the installed release).
Run: `python -m pytest tests/gpu -q`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import grpc
import pytest
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

pytestmark = pytest.mark.gpu
pytest.importorskip("tensorrt_llm", reason="TensorRT-LLM is not installed")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from core.engine import hf  # noqa: E402
from core.engine.registry import tokenizer_path  # noqa: E402
from core.engine.trtllm import executor as trtllm  # noqa: E402
from core.engine.trtllm import llm as trtllm_llm  # noqa: E402
from core.engine.trtllm.bindings import import_llm_api  # noqa: E402
from core.engine.trtllm.options import release_at_least  # noqa: E402
from core.tokenizer import Tokenizer  # noqa: E402
from gateways.common.status import GatewayError  # noqa: E402
from tests.conftest import core_config  # noqa: E402
from tests.fakes.trtllm_harness import collect, finish_of, serve_engine, tokens_of  # noqa: E402
from tests.lora_helpers import make_adapter  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "demo"
PROMPT = "The license"
AGREE = 4  # leading greedy tokens that must match the HF engine's


def _build_script():
    spec = importlib.util.spec_from_file_location("build_trtllm_engine", ROOT / "scripts" / "build_trtllm_engine.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _has_executor() -> bool:
    try:
        return hasattr(importlib.import_module("tensorrt_llm.bindings.executor"), "Executor")
    except ImportError:
        return False


def _request(max_new_tokens: int = 16) -> spb.GenerateRequest:
    return spb.GenerateRequest(text=PROMPT, stopping=pb.StoppingParams(max_new_tokens=max_new_tokens))


@pytest.fixture(scope="module")
def demo() -> Path:
    if not (DEMO / "config.json").is_file():
        pytest.skip("no demo model: run `make model` first")
    return DEMO


def _with_logprobs(request: spb.GenerateRequest) -> spb.GenerateRequest:
    request.output.logprobs = True
    return request


def _logprobs(messages) -> list[float | None]:
    return [t.logprob if t.HasField("logprob") else None for m in messages for o in m.outputs for t in o.tokens]


@pytest.fixture(scope="module")
async def hf_greedy(demo) -> list[int]:
    tokenizer = Tokenizer.load(demo)
    async with serve_engine(hf.build, demo, tokenizer, engine="hf") as (_server, stub):
        return tokens_of(await collect(stub, _request()))


@pytest.fixture(scope="module")
async def hf_logprobs(demo) -> list[float | None]:
    tokenizer = Tokenizer.load(demo)
    async with serve_engine(hf.build, demo, tokenizer, engine="hf") as (_server, stub):
        return _logprobs(await collect(stub, _with_logprobs(_request())))


async def _check_logprobs(stub, hf_logprobs: list[float | None]) -> None:
    """Greedy logprobs are the model's (close to HF's on the leading tokens, not 0.0); sampled
    tokens have logprobs at or below 0 that are not all 0.0."""
    greedy = _logprobs(await collect(stub, _with_logprobs(_request())))
    assert all(v is not None and v <= 0 for v in greedy) and any(v < -1e-3 for v in greedy)  # type: ignore[operator]
    assert greedy[:AGREE] == pytest.approx(hf_logprobs[:AGREE], abs=0.15)
    sampled_request = _with_logprobs(_request())
    sampled_request.sampling.do_sample = True
    sampled_request.sampling.seed = 7
    sampled = [v for v in _logprobs(await collect(stub, sampled_request)) if v is not None]
    assert sampled and all(v <= 0 for v in sampled) and any(v < -1e-3 for v in sampled)


async def _check_bad_guide_next_to_a_running_request(stub) -> None:
    r"""A guide XGrammar refuses (llguidance takes `\p{L}+`) fails alone, before the runtime."""
    running = stub.Generate(_request(48))
    while not (await running.read()).outputs:
        pass
    bad = _request(4)
    bad.guided_decoding.regex = r"\p{L}+"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await collect(stub, bad)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert GatewayError.from_rpc_error(e.value).param == "guided_decoding.regex"
    rest = []
    while (message := await running.read()) is not grpc.aio.EOF:
        rest.append(message)
    assert finish_of(rest).finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS)


async def _check_block_reuse(server, stub, reported: bool) -> None:
    """The same long prompt twice: identical greedy tokens; the second reports its reused
    prompt tokens (0 < cached < prompt) where `reported`, else 0; the counters agree."""
    text = " ".join(["The license grants every user the right to copy the work."] * 20)
    long = spb.GenerateRequest(text=text, stopping=pb.StoppingParams(max_new_tokens=8))
    first = await collect(stub, long)
    second = await collect(stub, long)
    assert tokens_of(second) == tokens_of(first)
    prompt, cached = second[-1].usage.prompt_tokens, second[-1].usage.cached_tokens
    stats = server.engine.stats().prefix_cache
    assert stats is not None
    if reported:
        assert 0 < cached < prompt and stats.hits >= cached and stats.queries >= 2 * prompt
    else:
        assert cached == 0


@pytest.fixture(scope="module")
def demo_engine(tmp_path_factory, demo) -> Path:
    examples = os.environ.get("TRTLLM_EXAMPLES_DIR")
    if not examples:
        pytest.skip("TRTLLM_EXAMPLES_DIR is not set")
    if not _has_executor():
        pytest.skip("this TensorRT-LLM release has no executor (use --engine trtllm-llm)")
    out = tmp_path_factory.mktemp("trt") / "demo-engine"
    argv = ["--model", str(demo), "--output", str(out), "--trtllm-examples", examples, "--max-batch-size", "8"]
    assert _build_script().main([*argv, "--max-input-len", "512", "--max-seq-len", "1024"]) == 0
    return out


async def test_executor_engine_matches_hf(demo_engine, hf_greedy):
    tokenizer = Tokenizer.load(tokenizer_path(core_config(demo_engine, engine="trtllm")))
    async with serve_engine(trtllm.build, demo_engine, tokenizer, engine="trtllm") as (_server, stub):
        msgs = await collect(stub, _request())
        assert tokens_of(msgs)[:AGREE] == hf_greedy[:AGREE]
        assert finish_of(msgs).finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS)
        assert tokens_of(await collect(stub, _request())) == tokens_of(msgs)  # greedy is deterministic
        biased = _request(8)
        biased.sampling.logit_bias[2] = 100.0
        assert finish_of(await collect(stub, biased)).finish_reason == pb.FINISH_REASON_EOS


async def test_executor_engine_logprobs_and_guides(demo_engine, hf_logprobs):
    tokenizer = Tokenizer.load(tokenizer_path(core_config(demo_engine, engine="trtllm")))
    async with serve_engine(trtllm.build, demo_engine, tokenizer, engine="trtllm") as (server, stub):
        await _check_logprobs(stub, hf_logprobs)
        await _check_bad_guide_next_to_a_running_request(stub)
        await _check_block_reuse(server, stub, server.engine._reuse_reported)


async def test_llm_api_engine_logprobs_and_guides(demo, hf_logprobs):
    tokenizer = Tokenizer.load(demo)
    async with serve_engine(trtllm_llm.build, demo, tokenizer, engine="trtllm-llm") as (server, stub):
        await _check_logprobs(stub, hf_logprobs)
        await _check_bad_guide_next_to_a_running_request(stub)
        # exact cached_tokens from 1.2 (PR #7637); before, perf metrics and the block size
        engine = server.engine
        reported = engine._tokens_per_block is not None or release_at_least(engine._api.version, "1.2.0rc0")
        await _check_block_reuse(server, stub, reported)


@pytest.mark.parametrize("chunked", [True, False])
async def test_llm_api_engine_serves_a_prompt_longer_than_max_num_tokens(demo, chunked):
    """With chunked prefill the prompt is served; with --no-trt-enable-chunked-prefill the
    engine reports max_num_tokens as GetModelInfo.max_input_tokens and refuses the prompt
    itself, and the LLM serves on."""
    tokenizer = Tokenizer.load(demo)
    text = " ".join(["The license grants every user the right to copy the work."] * 40)
    assert 256 < len(tokenizer.encode(text)) < 900  # over max_num_tokens, within the demo's 1024 context
    async with serve_engine(
        trtllm_llm.build,
        demo,
        tokenizer,
        engine="trtllm-llm",
        trt_max_num_tokens=256,
        trt_enable_chunked_prefill=chunked,
    ) as (_server, stub):
        info = await stub.GetModelInfo(spb.GetModelInfoRequest())
        long = spb.GenerateRequest(text=text, stopping=pb.StoppingParams(max_new_tokens=8))
        if chunked:
            assert info.max_input_tokens == info.max_context_length - 1
            msgs = await collect(stub, long)
            assert len(tokens_of(msgs)) >= 1 and msgs[-1].usage.prompt_tokens > 256
        else:
            assert info.max_input_tokens == 256
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(stub, long)
            assert GatewayError.from_rpc_error(e.value).reason == "CONTEXT_LENGTH_EXCEEDED"
            assert len(tokens_of(await collect(stub, _request(4)))) >= 1


async def test_llm_api_engine_matches_hf(demo, hf_greedy):
    tokenizer = Tokenizer.load(demo)
    async with serve_engine(trtllm_llm.build, demo, tokenizer, engine="trtllm-llm") as (_server, stub):
        msgs = await collect(stub, _request())
        assert tokens_of(msgs)[:AGREE] == hf_greedy[:AGREE] and msgs[-1].HasField("usage")
        biased = _request(8)
        biased.sampling.logit_bias[2] = 100.0
        eos = await collect(stub, biased)
        assert finish_of(eos).finish_reason == pb.FINISH_REASON_EOS and 2 not in tokens_of(eos)


# --------------------------------------------------------------------------------- LoRA


@pytest.fixture(scope="module")
def demo_adapter(tmp_path_factory, demo) -> Path:
    """A PEFT adapter of the demo model (q_proj, v_proj, rank 8) strong enough to change greedy
    output."""
    return make_adapter(tmp_path_factory.mktemp("lora") / "gpu", demo, rank=8, seed=21, magnitude=2.0)


@pytest.fixture(scope="module")
async def hf_adapter_greedy(demo, demo_adapter) -> list[int]:
    tokenizer = Tokenizer.load(demo)
    modules = (("gpu", str(demo_adapter)),)
    async with serve_engine(hf.build, demo, tokenizer, engine="hf", lora_modules=modules) as (_server, stub):
        return tokens_of(
            await collect(stub, spb.GenerateRequest(text=PROMPT, adapter="gpu", stopping=_request().stopping))
        )


def _adapter_request() -> spb.GenerateRequest:
    request = _request()
    request.adapter = "gpu"
    return request


async def test_executor_engine_serves_a_lora_adapter(
    tmp_path_factory, demo, demo_adapter, hf_adapter_greedy, hf_greedy
):
    examples = os.environ.get("TRTLLM_EXAMPLES_DIR")
    if not examples or not _has_executor():
        pytest.skip("needs TRTLLM_EXAMPLES_DIR and a release with the executor")
    out = tmp_path_factory.mktemp("trt-lora") / "engine"
    argv = ["--model", str(demo), "--output", str(out), "--trtllm-examples", examples, "--max-batch-size", "8"]
    argv += ["--max-input-len", "512", "--max-seq-len", "1024", "--lora-dir", str(demo_adapter)]
    assert _build_script().main(argv) == 0
    tokenizer = Tokenizer.load(tokenizer_path(core_config(out, engine="trtllm")))
    modules = (("gpu", str(demo_adapter)),)
    async with serve_engine(trtllm.build, out, tokenizer, engine="trtllm", lora_modules=modules) as (server, stub):
        first = tokens_of(await collect(stub, _adapter_request()))
        again = tokens_of(await collect(stub, _adapter_request()))  # task id only: from the PEFT cache
        assert first[:AGREE] == hf_adapter_greedy[:AGREE] and again == first
        assert first != hf_greedy
        assert server.engine._adapters["gpu"].task_id in server.engine._sent_tasks


async def test_llm_api_engine_serves_a_lora_adapter(demo, demo_adapter, hf_adapter_greedy, hf_greedy):
    api = import_llm_api()
    if api.lora_request is None or api.lora_config is None or "lora_config" not in api.llm_args:
        pytest.skip("this TensorRT-LLM release's LLM API takes no LoRA adapters")
    tokenizer = Tokenizer.load(demo)
    modules = (("gpu", str(demo_adapter)),)
    async with serve_engine(trtllm_llm.build, demo, tokenizer, engine="trtllm-llm", lora_modules=modules) as (
        _server,
        stub,
    ):
        first = tokens_of(await collect(stub, _adapter_request()))
        assert first[:AGREE] == hf_adapter_greedy[:AGREE] and first != hf_greedy
        assert tokens_of(await collect(stub, _adapter_request())) == first
