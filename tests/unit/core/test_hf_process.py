"""The HF engine in a process of its own (core.engine.hf_process): the same tokens as the engine
on a thread, admission refusals decided in the core process and in the engine process,
cancellation, shutdown, a load failure, an engine process that dies under running requests,
and where the engine process and the serving threads run (--engine-cpus)."""

from __future__ import annotations

import contextlib
import os
import shutil

import pytest

from core.config import load
from core.engine import hf, hf_process
from core.engine.hf_config import engine_cpus
from core.errors import EngineDead, InvalidArgument, NotReady, Overloaded
from core.types import EngineOutput, FinishReason, Guide, PromptTokenInfo, RequestState, SequenceStep
from tests.conftest import core_config
from tests.integration.core_helpers import wait_for, wait_idle
from tests.unit.core.test_hf_engine import guided, last_output, req, until_tokens


async def started(model_dir, tokenizer, **overrides) -> hf_process.HfProcessEngine:
    engine = hf_process.build(core_config(model_dir, **overrides), tokenizer)
    assert isinstance(engine, hf_process.HfProcessEngine)
    await engine.start()
    return engine


@pytest.fixture
async def engine(tiny_model_dir, tokenizer):
    e = await started(tiny_model_dir, tokenizer)
    yield e
    await e.shutdown()


def test_no_engine_process_builds_the_engine_on_a_thread(tiny_model_dir, tokenizer):
    assert isinstance(hf_process.build(core_config(tiny_model_dir, engine_process=False), tokenizer), hf.HfEngine)


def test_outputs_cross_the_pipe_unchanged():
    out = EngineOutput(
        "r",
        state=RequestState.SCHEDULED,
        sequences=[SequenceStep(1, [5, 6], [-0.5, -1.0], [[(5, -0.5)], [(6, -1.0)]], FinishReason.EOS, 6)],
        prompt_logprobs=[PromptTokenInfo(1, None, None), PromptTokenInfo(5, -2.0, [(5, -2.0)])],
        finished=True,
        cached_tokens=3,
        error=None,
        time=12.5,
    )
    assert hf_process.unpack(hf_process.pack(out)) == out


async def test_same_tokens_as_the_engine_on_a_thread(engine, tiny_model_dir, tokenizer):
    local = hf.build(core_config(tiny_model_dir), tokenizer)
    await local.start()
    try:
        prompts = [[1, 5, 9], [1, 7], [1, 3, 3, 8, 2]]
        ours = [[out async for out in engine.generate(req(f"p{i}", p, 12))] for i, p in enumerate(prompts)]
        theirs = [[out async for out in local.generate(req(f"p{i}", p, 12))] for i, p in enumerate(prompts)]
    finally:
        await local.shutdown()

    def tokens(outs: list[EngineOutput]) -> list[int]:
        return [t for out in outs for s in out.sequences for t in s.token_ids]

    assert [tokens(o) for o in ours] == [tokens(o) for o in theirs]
    assert all(o[-1].finished and o[-1].sequences[-1].finish_reason is FinishReason.LENGTH for o in ours)
    await wait_idle(engine)


async def test_a_running_request_id_is_refused_and_a_closed_stream_aborts(engine):
    gen = engine.generate(req("dup", [1, 5], max_new_tokens=900))
    await until_tokens(gen)
    with pytest.raises(InvalidArgument, match="already running") as info:
        engine.generate(req("dup", [1, 5]))
    assert info.value.field == "request_id"
    with pytest.raises(InvalidArgument) as wide:
        engine.generate(req("wide", [1, 5], n=99))
    assert wide.value.field == "sampling.n"
    await gen.aclose()
    await wait_idle(engine)
    out = await last_output(engine.generate(req("dup", [1, 5])))
    assert out.finished and out.error is None


async def test_a_request_the_engine_process_refuses_ends_with_its_error(engine):
    """Only the engine process compiles guides: the core admits a request whose guide does not
    compile, the engine process refuses it, and the refusal ends the stream and frees its place
    in the queue."""
    gen = engine.generate(guided("bad", [1, 5], Guide("lark_grammar", "start: nowhere"), seed=1))
    assert (engine.stats().active, engine.stats().queued) == (0, 1)
    outs = [out async for out in gen]
    assert [o.state for o in outs] == [RequestState.QUEUED, None]
    last = outs[-1]
    assert last.finished and isinstance(last.error, InvalidArgument)
    assert last.error.field == "guided_decoding.lark_grammar" and "does not compile" in str(last.error)
    assert (engine.stats().active, engine.stats().queued) == (0, 0)
    out = await last_output(engine.generate(req("bad", [1, 5])))
    assert out.finished and out.error is None


async def test_a_full_queue_is_refused_and_shutdown_ends_what_is_left(tiny_model_dir, tokenizer):
    engine = await started(tiny_model_dir, tokenizer, max_batch_size=1, max_queue_size=1)
    try:
        running = engine.generate(req("running", [1, 5], max_new_tokens=900))
        await until_tokens(running)
        waiting = engine.generate(req("waiting", [1, 5]))
        with pytest.raises(Overloaded):
            engine.generate(req("refused", [1, 5]))
        assert engine.stats().queued == 1
    finally:
        await engine.shutdown()
    for gen in (running, waiting):
        out = await last_output(gen)
        assert isinstance(out.error, NotReady)
    assert not engine.alive
    with pytest.raises(NotReady):
        engine.generate(req("late", [1, 5]))


async def test_an_engine_process_that_dies_without_restarts_fails_its_requests(tiny_model_dir, tokenizer):
    engine = await started(tiny_model_dir, tokenizer, engine_max_restarts=0)
    try:
        await _dies_for_good(engine)
    finally:
        await engine.shutdown()


async def _dies_for_good(engine: hf_process.HfProcessEngine) -> None:
    deaths: list[Exception] = []
    engine.set_on_dead(deaths.append)
    gen = engine.generate(req("victim", [1, 5], max_new_tokens=900))
    await until_tokens(gen)
    engine._process.kill()
    out = await last_output(gen)
    assert isinstance(out.error, EngineDead) and "exit code -9" in str(out.error)
    await wait_for(lambda: deaths)
    assert len(deaths) == 1 and not engine.alive
    with pytest.raises(EngineDead):
        engine.generate(req("after", [1, 5]))


async def test_a_model_the_engine_process_cannot_load_fails_start(tiny_model_dir, tokenizer, tmp_path):
    broken = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir, broken, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    engine = hf_process.build(core_config(broken), tokenizer)
    with pytest.raises(RuntimeError, match="could not load"):
        await engine.start()
    assert not engine.alive


def test_engine_cpus_give_the_engine_the_last_cpus_and_serving_the_rest():
    two, four = frozenset({0, 1}), frozenset({0, 1, 2, 3})
    assert engine_cpus("auto", 1, two) == ({1}, {0})
    assert engine_cpus("auto", 2, four) == ({2, 3}, {0, 1})
    assert engine_cpus("auto", 2, two) is None  # no CPU would be left to serving: the scheduler decides
    assert engine_cpus("none", 1, four) is None
    assert engine_cpus("1,3", 2, four) == ({1, 3}, {0, 2})
    assert engine_cpus("0-3", 4, four) == (four, four)  # every CPU to the engine: serving shares them
    with pytest.raises(ValueError, match="CPU 7 is not among the CPUs this process may run on"):
        engine_cpus("1,7", 2, four)


@pytest.mark.parametrize(
    ("spec", "message"), [("x", "not a CPU list"), ("3-1", "runs backwards"), ("1,", "not a CPU list")]
)
def test_a_malformed_engine_cpus_flag_is_a_usage_error(spec, message, capsys):
    with pytest.raises(SystemExit) as e:
        load(["--model", "/m", "--engine-cpus", spec], {})
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert load(["--model", "/m"], {"TRELLIS_CORE_ENGINE_CPUS": "0,2-3"}).engine_cpus == "0,2-3"
    assert load(["--model", "/m"], {}).engine_cpus == "auto"


async def test_engine_cpus_naming_a_cpu_out_of_reach_fail_start_before_any_process(tiny_model_dir, tokenizer):
    engine = hf_process.build(core_config(tiny_model_dir, engine_cpus="4095"), tokenizer)
    with pytest.raises(ValueError, match="CPU 4095"):
        await engine.start()
    assert engine._process is None and not engine.alive


def _threads_cpus(pid: int) -> dict[int, set[int]]:
    out = {}
    for name in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            out[int(name)] = os.sched_getaffinity(int(name))
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to separate the engine from serving")
async def test_the_engine_process_runs_on_its_own_cpus_and_serving_on_the_others(tiny_model_dir, tokenizer):
    before = os.sched_getaffinity(0)
    engine_cpu, serving = {max(before)}, before - {max(before)}
    engine = await started(tiny_model_dir, tokenizer, threads=1, engine_cpus="auto")
    try:
        child = _threads_cpus(engine._process.pid)
        assert child.pop(engine._process.pid) == engine_cpu  # the batching loop (and torch's threads)
        assert serving in child.values()  # its receiver thread
        assert set(map(frozenset, child.values())) <= {frozenset(engine_cpu), frozenset(serving)}
        assert all(cpus == serving for cpus in _threads_cpus(os.getpid()).values())
        out = await last_output(engine.generate(req("pinned", [1, 5], max_new_tokens=4)))
        assert out.finished and out.error is None
    finally:
        await engine.shutdown()
    assert all(cpus == before for cpus in _threads_cpus(os.getpid()).values())
