"""The executor double reproduces the bindings' behaviour as read in upstream source (the
files its module docstring names, per era).

If the double drifts from upstream, the engine tests prove nothing; these tests pin it.
"""

from __future__ import annotations

import datetime
import threading

import pytest
import torch

from tests.fakes import trtllm_executor
from tests.fakes.trtllm_model import FakeModel

MS = datetime.timedelta(milliseconds=20)
MODEL = FakeModel(4096)
PROMPT = [1, 300, 301, 302]


@pytest.fixture
def engine_dir(tmp_path):
    return trtllm_executor.write_engine_dir(tmp_path / "engine", max_input_len=16, max_seq_len=32)


def executor(tl, engine_dir, **config):
    return tl.Executor(engine_dir, tl.ModelType.DECODER_ONLY, tl.ExecutorConfig(max_beam_width=1, **config))


def drain(ex, rid) -> list:
    """Every Response of `rid` until its final one (per-id await_responses)."""
    out = []
    while not out or (not out[-1].has_error() and not out[-1].result.is_final):
        got = ex.await_responses(rid, timeout=datetime.timedelta(seconds=5))
        assert got, "no response in time"
        out += got
    return out


def request(tl, **kw):
    era = tl.fake_era
    length = kw.pop("max_tokens", 4)
    kw.setdefault("end_id", 2)
    if era == "0.11":
        return tl.Request(kw.pop("input_token_ids", PROMPT), length, **kw)
    return tl.Request(input_token_ids=kw.pop("input_token_ids", PROMPT), max_tokens=length, **kw)


# ------------------------------------------------------------------------- names


def test_recent_naming_is_keyword_only():
    tl = trtllm_executor.make_module("1.0")
    assert tl.SamplingConfig(beam_width=1, top_k=5, seed=3, min_tokens=2).seed == 3
    with pytest.raises(TypeError):
        tl.SamplingConfig(1, 5)
    for old in ("random_seed", "min_length"):
        with pytest.raises(TypeError):
            tl.SamplingConfig(**{old: 1})
    assert tl.Request([1], 5).max_tokens == 5
    with pytest.raises(TypeError):
        tl.Request([1], max_new_tokens=5)
    with pytest.raises(TypeError):
        tl.Request([1], 5, True)  # streaming is keyword-only
    assert hasattr(tl, "CapacitySchedulerPolicy") and not hasattr(tl, "SchedulerPolicy")
    assert tl.FinishReason.CANCELLED == 5


def test_mid_naming_accepts_both_and_the_new_one_wins():
    tl = trtllm_executor.make_module("0.15")
    sc = tl.SamplingConfig(seed=1, random_seed=2, min_length=4)
    assert (sc.seed, sc.random_seed, sc.min_tokens, sc.min_length) == (1, 1, 4, 4)
    assert tl.Request([1], max_new_tokens=5).max_new_tokens == 5
    with pytest.raises(TypeError, match="max_tokens"):
        tl.Request([1])
    with pytest.raises(TypeError):
        tl.SamplingConfig(min_p=0.1)  # min_p is later
    with pytest.raises(TypeError):
        tl.SamplingConfig(num_return_sequences=2)  # on the Request in this shape
    assert tl.Request([1], max_tokens=2, num_return_sequences=2).num_return_sequences == 2
    assert not hasattr(tl.FinishReason, "CANCELLED")


def test_early_shape_is_the_0_11_bindings():
    """bindings.cpp at 0.11.0.dev2024062500 (the 0.11 branch point): positional-or-keyword
    Request/SamplingConfig with the old names only; no FinishReason, finish_reasons,
    sequence_index or client_id; ExecutorConfig without max_queue_size/max_num_tokens and
    max_batch_size only in its constructor; no STATIC_BATCH; no module __version__."""
    tl = trtllm_executor.make_module("0.11")
    assert tl.SamplingConfig(1, 5).top_k == 5  # positional-or-keyword
    assert tl.SamplingConfig(random_seed=3).random_seed == 3
    for new in ("seed", "min_tokens", "num_return_sequences", "min_p"):
        with pytest.raises(TypeError):
            tl.SamplingConfig(**{new: 1})
    with pytest.raises(TypeError):
        tl.Request([1], max_tokens=5)
    with pytest.raises(TypeError):
        tl.Request([1], 5, client_id=3)
    assert tl.Request([1], 5, True).streaming is True  # positional streaming
    assert not hasattr(tl, "FinishReason") and not hasattr(tl, "__version__")
    assert not hasattr(tl.CapacitySchedulerPolicy, "STATIC_BATCH")
    cfg = tl.ExecutorConfig(max_batch_size=4)
    assert not hasattr(cfg, "max_batch_size") and not hasattr(cfg, "max_queue_size")
    with pytest.raises(TypeError):
        tl.ExecutorConfig(max_queue_size=3)
    with pytest.raises(TypeError):
        tl.ExecutorConfig(max_num_tokens=3)
    result = tl.Result()
    assert not hasattr(result, "finish_reasons") and not hasattr(result, "sequence_index")
    assert not hasattr(tl.Response(1, result), "client_id")


# ------------------------------------------------------------------------- SamplingConfig validation


@pytest.mark.parametrize(
    "fields",
    [
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"repetition_penalty": 0.0},
        {"temperature": -0.1},
        {"min_tokens": -1},
        {"beam_width": 2, "num_return_sequences": 3},
        {"num_return_sequences": 0},
        {"min_p": 1.5},
        {"beam_width": 0},
    ],
)
def test_sampling_config_validation(fields):
    tl = trtllm_executor.make_module("1.0")
    with pytest.raises(RuntimeError, match="Assertion failed"):
        tl.SamplingConfig(**fields)


def test_sampling_config_unset_reads_none_and_seed_is_unsigned():
    tl = trtllm_executor.make_module("1.0")
    sc = tl.SamplingConfig()
    assert (sc.top_k, sc.top_p, sc.temperature, sc.seed, sc.num_return_sequences) == (None,) * 5
    assert tl.SamplingConfig(num_return_sequences=3).num_return_sequences == 3  # beam_width 1: any n
    with pytest.raises(TypeError):
        tl.SamplingConfig(seed=-1)


# ------------------------------------------------------------------------- enqueue


def test_ids_are_unique_increasing_and_shutdown_refuses(engine_dir):
    tl = trtllm_executor.make_module("1.0", first_request_id=None)
    ex = executor(tl, engine_dir)
    try:
        ids = [ex.enqueue_request(request(tl)) for _ in range(3)]
        assert ids == sorted(set(ids))
        assert ex.enqueue_requests([request(tl), request(tl)]) == [ids[-1] + 1, ids[-1] + 2]
    finally:
        ex.shutdown()
    assert not ex.can_enqueue_requests()
    for call in (
        lambda: ex.enqueue_request(request(tl)),
        lambda: ex.await_responses(timeout=MS),
        lambda: ex.cancel_request(ids[0]),
        lambda: ex.get_num_responses_ready(),
    ):
        with pytest.raises(RuntimeError, match="Shutdown"):
            call()
    ex.shutdown()  # idempotent


def test_queue_full_counts_child_requests(engine_dir):
    tl = trtllm_executor.make_module("1.0")
    ex = executor(tl, engine_dir, max_queue_size=3)
    try:
        ex.fake_pause()
        ex.enqueue_request(request(tl, sampling_config=tl.SamplingConfig(num_return_sequences=2)))
        ex.enqueue_request(request(tl))
        with pytest.raises(RuntimeError, match="Maximum queue size of 3 has been reached"):
            ex.enqueue_request(request(tl))
    finally:
        ex.shutdown()


# ------------------------------------------------------------------------- per-request behaviour


def test_prompt_too_long_is_one_error_response(engine_dir):
    tl = trtllm_executor.make_module("1.0")
    with executor(tl, engine_dir) as ex:
        rid = ex.enqueue_request(request(tl, input_token_ids=[5] * 17))
        [r] = drain(ex, rid)
        assert r.has_error() and "Prompt length (17) exceeds maximum input length (16)" in r.error_msg
        with pytest.raises(RuntimeError):
            r.result  # noqa: B018 (the binding throws)


@pytest.mark.parametrize("era", ["0.11", "0.15", "1.0"])
def test_streaming_greedy_is_deterministic_one_token_per_response(engine_dir, era):
    tl = trtllm_executor.make_module(era)
    with executor(tl, engine_dir) as ex:
        runs = []
        for _ in range(2):
            rid = ex.enqueue_request(request(tl, streaming=True, max_tokens=5))
            responses = drain(ex, rid)
            assert [len(r.result.output_token_ids[0]) for r in responses] == [1] * 5
            assert [r.result.is_final for r in responses] == [False] * 4 + [True]
            if era != "0.11":
                assert [r.result.finish_reasons[0].name for r in responses] == ["NOT_FINISHED"] * 4 + ["LENGTH"]
            runs.append([r.result.output_token_ids[0][0] for r in responses])
        assert runs[0] == runs[1] == MODEL.greedy(PROMPT, 5)[0]


def test_end_id_is_excluded_and_the_final_response_is_empty(engine_dir):
    tl = trtllm_executor.make_module("1.0")
    bias = torch.zeros(4096)
    bias[2] = 100.0
    with executor(tl, engine_dir) as ex:
        rid = ex.enqueue_request(request(tl, streaming=True, max_tokens=8, embedding_bias=bias))
        responses = drain(ex, rid)
        # default min_tokens 1: the end token is banned at the first step
        assert [r.result.output_token_ids[0] for r in responses][-1] == []
        assert len(responses) == 2 and 2 not in responses[0].result.output_token_ids[0]
        assert responses[-1].result.finish_reasons[0] == tl.FinishReason.END_ID
        rid = ex.enqueue_request(
            request(
                tl, streaming=True, max_tokens=8, embedding_bias=bias, sampling_config=tl.SamplingConfig(min_tokens=3)
            )
        )
        assert sum(len(r.result.output_token_ids[0]) for r in drain(ex, rid)) == 3
        rid = ex.enqueue_request(request(tl, streaming=True, max_tokens=3, embedding_bias=bias, end_id=-1))
        assert [t for r in drain(ex, rid) for t in r.result.output_token_ids[0]] == [2, 2, 2]
        rid = ex.enqueue_request(request(tl, embedding_bias=torch.zeros(10)))
        assert "embedding bias shape" in drain(ex, rid)[0].error_msg


def test_stop_words_stay_in_the_output(engine_dir):
    tl = trtllm_executor.make_module("1.0")
    greedy, _ = MODEL.greedy(PROMPT, 6)
    with executor(tl, engine_dir) as ex:
        rid = ex.enqueue_request(request(tl, streaming=True, max_tokens=6, stop_words=[greedy[2:4]]))
        responses = drain(ex, rid)
        assert [t for r in responses for t in r.result.output_token_ids[0]] == greedy[:4]
        assert responses[-1].result.finish_reasons[0] == tl.FinishReason.STOP_WORDS


def test_length_is_clipped_to_max_seq_len(engine_dir):
    tl = trtllm_executor.make_module("1.0")
    with executor(tl, engine_dir) as ex:
        rid = ex.enqueue_request(request(tl, streaming=True, max_tokens=100, input_token_ids=[5] * 10))
        responses = drain(ex, rid)
        assert len(responses) == 32 - 10 and responses[-1].result.finish_reasons[0] == tl.FinishReason.LENGTH


def test_non_streaming_includes_the_prompt_unless_excluded(engine_dir):
    tl = trtllm_executor.make_module("1.0")
    greedy, _ = MODEL.greedy(PROMPT, 3)
    with executor(tl, engine_dir) as ex:
        [r] = drain(ex, ex.enqueue_request(request(tl, max_tokens=3)))
        assert r.result.output_token_ids == [PROMPT + greedy] and r.result.is_final
        oc = tl.OutputConfig(exclude_input_from_output=True, return_log_probs=True)
        [r] = drain(ex, ex.enqueue_request(request(tl, max_tokens=3, output_config=oc)))
        assert r.result.output_token_ids == [greedy] and len(r.result.log_probs[0]) == 3


def test_log_probs_are_cumulative_per_response(engine_dir):
    tl = trtllm_executor.make_module("1.0")
    _, lps = MODEL.greedy(PROMPT, 3)
    oc = tl.OutputConfig(return_log_probs=True)
    with executor(tl, engine_dir, normalize_log_probs=False) as ex:
        responses = drain(ex, ex.enqueue_request(request(tl, streaming=True, max_tokens=3, output_config=oc)))
        assert [len(r.result.log_probs[0]) for r in responses] == [1, 2, 3]
        assert responses[-1].result.log_probs[0] == pytest.approx(lps, abs=1e-5)


@pytest.mark.parametrize("era, normalized", [("0.11", True), ("0.15", True), ("1.0", True), ("1.3", False)])
def test_log_probs_are_normalized_by_default_until_1_3(engine_dir, era, normalized):
    """`ExecutorConfig.normalize_log_probs` defaults to True until PR #12366 (1.3.0rc): greedy
    tokens then read 0.0 (tensorrtllm_backend issue #276), sampled tokens the logprob in the
    truncated, renormalized distribution (above the full distribution's)."""
    tl = trtllm_executor.make_module(era)
    _, lps = MODEL.greedy(PROMPT, 3)
    oc = tl.OutputConfig(return_log_probs=True)
    with executor(tl, engine_dir) as ex:
        assert ex.config.normalize_log_probs is normalized
        greedy = drain(ex, ex.enqueue_request(request(tl, streaming=True, max_tokens=3, output_config=oc)))
        assert greedy[-1].result.log_probs[0] == pytest.approx([0.0] * 3 if normalized else lps, abs=1e-5)
        seed = {"random_seed" if era == "0.11" else "seed": 5}
        sc = tl.SamplingConfig(beam_width=1, top_k=3, **seed)
        sampled = drain(ex, ex.enqueue_request(request(tl, max_tokens=3, output_config=oc, sampling_config=sc)))
        values = sampled[-1].result.log_probs[0]
        assert all(v <= 0 for v in values)
    with executor(tl, engine_dir, normalize_log_probs=False) as ex:
        sc = tl.SamplingConfig(beam_width=1, top_k=3, **seed)
        full = drain(ex, ex.enqueue_request(request(tl, max_tokens=3, output_config=oc, sampling_config=sc)))
        assert full[-1].result.output_token_ids == sampled[-1].result.output_token_ids
        raw = full[-1].result.log_probs[0]
        assert all(n > r for n, r in zip(values, raw, strict=True)) if normalized else values == raw


def test_num_return_sequences_gives_child_responses(engine_dir):
    tl = trtllm_executor.make_module("1.0")
    sc = tl.SamplingConfig(num_return_sequences=2, top_k=5, seed=1)
    with executor(tl, engine_dir) as ex:
        responses = drain(ex, ex.enqueue_request(request(tl, streaming=True, max_tokens=3, sampling_config=sc)))
        assert sorted(r.result.sequence_index for r in responses) == [0, 0, 0, 1, 1, 1]
        assert [r.result.is_final for r in responses].count(True) == 1 and responses[-1].result.is_final
        assert sum(r.result.is_sequence_final for r in responses) == 2


# ------------------------------------------------------------------------- awaiting


def test_await_timeout_and_terminated_ids(engine_dir):
    tl = trtllm_executor.make_module("1.0")
    with executor(tl, engine_dir) as ex:
        assert ex.await_responses(timeout=MS) == []
        ex.fake_pause()
        rid = ex.enqueue_request(request(tl, streaming=True, max_tokens=2))
        assert ex.get_num_responses_ready() == 0
        ex.fake_resume()
        while ex.get_num_responses_ready(rid) < 2:
            pass
        assert ex.get_num_responses_ready() == 2
        assert len(ex.await_responses(timeout=MS)) == 2
        [r] = ex.await_responses(rid, timeout=MS)
        assert r.has_error() and r.error_msg == f"ReqId {rid} has already been processed and was terminated."
        assert ex.await_responses([rid], timeout=MS)[0][0].has_error()
        with pytest.raises(TypeError):
            ex.await_responses(timeout=5)  # pybind11's chrono caster: an int is refused
        assert ex.await_responses(timeout=0.01) == []  # a float is seconds


def test_shutdown_wakes_a_blocked_awaiter(engine_dir):
    tl = trtllm_executor.make_module("1.0")
    ex = executor(tl, engine_dir)
    got = []
    waiter = threading.Thread(target=lambda: got.append(ex.await_responses()))
    waiter.start()
    waiter.join(0.1)
    assert waiter.is_alive()  # no timeout: blocks
    ex.shutdown()
    waiter.join()
    assert got == [[]]


# ------------------------------------------------------------------------- cancellation


@pytest.mark.parametrize("era, reason", [("1.0", "CANCELLED"), ("0.15", "NOT_FINISHED")])
def test_cancel_takes_effect_on_the_next_step_with_no_tokens(engine_dir, era, reason):
    tl = trtllm_executor.make_module(era)
    with executor(tl, engine_dir) as ex:
        ex.fake_pause()
        rid = ex.enqueue_request(request(tl, streaming=True, max_tokens=20, input_token_ids=[5, 6]))
        ex.cancel_request(rid)
        assert ex.get_num_responses_ready(rid) == 0  # asynchronous
        ex.fake_resume()
        responses = drain(ex, rid)
        final = responses[-1].result
        assert final.is_final and final.output_token_ids == [[]] and final.finish_reasons[0].name == reason
        ex.cancel_request(rid)  # already terminated: a logged no-op
        assert ex.get_num_responses_ready(rid) == 0 and ex.fake_live_count == 0


# ------------------------------------------------------------------------- stats


def test_iteration_stats_are_a_bounded_drained_deque(engine_dir):
    tl = trtllm_executor.make_module("1.0")
    with executor(tl, engine_dir, iter_stats_max_iterations=3, request_stats_max_iterations=2) as ex:
        drain(ex, ex.enqueue_request(request(tl, streaming=True, max_tokens=6)))
        stats = ex.get_latest_iteration_stats()
        assert len(stats) == 3
        s = stats[-1]
        for name in (
            "timestamp",
            "iter",
            "iter_latency_ms",
            "num_active_requests",
            "num_queued_requests",
            "num_completed_requests",
            "max_num_active_requests",
            "kv_cache_stats",
            "inflight_batching_stats",
        ):
            assert hasattr(s, name)
        assert '"iter"' in s.to_json_str()
        assert len(ex.get_latest_iteration_stats()) == 0
        assert len(ex.get_latest_request_stats()) <= 2


def test_engine_directory_is_checked(tmp_path):
    tl = trtllm_executor.make_module("1.0")
    with pytest.raises(RuntimeError, match="File does not exist"):
        executor(tl, tmp_path)
