"""The Redis response store (gateways/openai/responses_store.py, `--response-store redis://...`)
against a real redis-server on loopback: records round-trip and expire, two gateways share
stored responses (a chain started on one continues on the other, directly and behind haproxy),
and an unreachable store is 503 `store_unavailable` before anything is generated (a PING only
before the first stored request and while the store is down). Skipped where
redis-server or redis-py is absent (`make system-deps` installs redis-server and haproxy)."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from gateways.openai.responses_store import RedisStore, StoredResponse, make_store
from tests.integration.test_haproxy import CONFIG, HAPROXY

pytest.importorskip("redis")
REDIS = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (make system-deps)")

MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(port: int, workdir: Path) -> subprocess.Popen[bytes]:
    """A redis-server on loopback `port`, persisting nothing, once it listens."""
    args = [str(REDIS), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([*args, "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    for _ in range(200):  # up to 10 s for it to listen
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"redis-server exited with {proc.returncode}")
            time.sleep(0.05)
    proc.terminate()
    pytest.fail("redis-server did not listen within 10 s")


def stop_redis(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory) -> Iterator[str]:
    """A redis-server of this module."""
    port = free_port()
    proc = start_redis(port, tmp_path_factory.mktemp("redis"))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_redis(proc)


def record(rid: str) -> StoredResponse:
    return StoredResponse(response={"id": rid, "output": []}, input_items=[{"id": "i"}], context=[{"role": "user"}])


async def test_records_round_trip_and_expire(redis_url):
    store = make_store(redis_url, 10, ttl_seconds=1)
    assert isinstance(store, RedisStore)
    try:
        await store.put(record("resp_a"))
        assert await store.get("resp_a") == record("resp_a")
        assert await store.get("resp_b") is None
        assert await store.delete("resp_a") and not await store.delete("resp_a")
        await store.put(record("resp_c"))
        assert 0 < await store._redis.ttl(RedisStore.PREFIX + "resp_c") <= 1
        for _ in range(40):  # expires after its TTL (1 s)
            if await store.get("resp_c") is None:
                break
            await asyncio.sleep(0.1)
        assert await store.get("resp_c") is None
    finally:
        await store.close()


async def test_two_gateways_share_a_chain(redis_url, start_gateway):
    one = await start_gateway("openai", response_store=redis_url)
    two = await start_gateway("openai", response_store=redis_url)
    a = openai.AsyncOpenAI(base_url=f"{one}/v1", api_key="unused", max_retries=0)
    b = openai.AsyncOpenAI(base_url=f"{two}/v1", api_key="unused", max_retries=0)
    try:
        first = await a.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=3)
        assert (await b.responses.retrieve(first.id)).output_text == first.output_text
        second = await b.responses.create(
            model=MODEL, previous_response_id=first.id, input="Another?", max_output_tokens=3
        )
        assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
        items = await a.responses.input_items.list(second.id)
        assert [i.content[0].text for i in items.data] == ["Another?"]
        await a.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await b.responses.retrieve(first.id)
    finally:
        await a.close()
        await b.close()


@pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (make system-deps installs it)")
async def test_a_chain_continues_through_the_other_gateway_behind_haproxy(redis_url, start_gateway, tmp_path):
    """haproxy balances two gateways round robin and names the one that answered
    (`x-served-by`); a response created through one is continued through the other."""
    urls = [await start_gateway("openai", response_store=redis_url) for _ in range(2)]
    front = free_port()
    backend = "    http-response set-header x-served-by %s\n" + "\n".join(
        f"    server g{i} {url.removeprefix('http://')}" for i, url in enumerate(urls)
    )
    (tmp_path / "haproxy.cfg").write_text(CONFIG.format(port=front, servers=backend))
    haproxy = await asyncio.create_subprocess_exec(
        str(HAPROXY), "-db", "-f", str(tmp_path / "haproxy.cfg"), stdout=asyncio.subprocess.DEVNULL
    )
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{front}/v1", api_key="unused", max_retries=0)
    try:
        for _ in range(200):  # up to 10 s for haproxy to listen
            try:
                await client.models.list()
                break
            except openai.APIConnectionError:
                await asyncio.sleep(0.05)
        raw = await client.responses.with_raw_response.create(model=MODEL, input="Name a colour.", max_output_tokens=3)
        first, first_gateway = raw.parse(), raw.headers["x-served-by"]
        served = set()
        for stream in (False, True):  # round robin: one of each pair goes to the other gateway
            for _ in range(2):
                raw = await client.responses.with_raw_response.create(
                    model=MODEL, previous_response_id=first.id, input="Another?", max_output_tokens=3, stream=stream
                )
                served.add(raw.headers["x-served-by"])
                if stream:
                    events = [event async for event in raw.parse()]
                    second = events[-1].response
                else:
                    second = raw.parse()
                assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
                assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
        assert served == {"g0", "g1"} and first_gateway in served
    finally:
        await client.close()
        haproxy.terminate()
        await haproxy.wait()


async def pings(url: str) -> int:
    """How many PINGs the redis-server at `url` answered since its statistics were reset."""
    redis = pytest.importorskip("redis.asyncio").Redis.from_url(url)
    try:
        stats = await redis.info("commandstats")
    finally:
        await redis.aclose()
    return int(stats.get("cmdstat_ping", {}).get("calls", 0))


async def test_stored_requests_do_not_ping_a_store_that_answers(redis_url, start_gateway):
    """Only the first stored request, before the store has answered anything, checks it."""
    url = await start_gateway("openai", response_store=redis_url)
    redis = pytest.importorskip("redis.asyncio").Redis.from_url(redis_url)
    await redis.config_resetstat()
    await redis.aclose()
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        for stream in (False, True, False, True):
            resp = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, stream=stream)
            if stream:
                resp = [event async for event in resp][-1].response
            assert (await client.responses.retrieve(resp.id)).id == resp.id
    assert await pings(redis_url) == 1


async def test_a_store_that_goes_away_is_503_before_generating_until_it_is_back(
    start_gateway, start_mock_core, tmp_path
):
    """The command that meets a stopped Redis fails (503); the stored requests after it are
    refused before the core is asked, until a PING gets through again."""
    port = free_port()
    redis = start_redis(port, tmp_path)
    core = await start_mock_core()
    url = await start_gateway("openai", core=core.address, response_store=f"redis://127.0.0.1:{port}/0")
    try:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
            first = await client.responses.create(model="mock", input="Hi", max_output_tokens=1)
            stop_redis(redis)
            with pytest.raises(openai.InternalServerError) as err:
                await client.responses.create(model="mock", input="Hi", max_output_tokens=1)
            assert err.value.status_code == 503 and err.value.code == "store_unavailable"
            generated = ended_requests(core)
            for stream in (False, True):
                with pytest.raises(openai.InternalServerError) as err:
                    await client.responses.create(model="mock", input="Hi", max_output_tokens=1, stream=stream)
                assert err.value.status_code == 503 and err.value.code == "store_unavailable"
            assert ended_requests(core) == generated
            redis = start_redis(port, tmp_path)
            again = await client.responses.create(model="mock", input="Hi", max_output_tokens=1)
            assert (await client.responses.retrieve(again.id)).id == again.id
            with pytest.raises(openai.NotFoundError):  # that Redis kept nothing
                await client.responses.retrieve(first.id)
    finally:
        stop_redis(redis)


def ended_requests(core) -> int:
    """How many requests the core has seen end (finished, failed or cancelled)."""
    return sum(core.servicer.pipeline.metrics.requests.values())


async def test_an_unreachable_store_is_503_before_anything_is_generated(start_gateway, start_mock_core):
    core = await start_mock_core()
    url = await start_gateway("openai", core=core.address, response_store=f"redis://127.0.0.1:{free_port()}/0")
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        for call in (
            client.responses.retrieve("resp_x"),
            client.responses.delete("resp_x"),
            client.responses.input_items.list("resp_x"),
            client.responses.create(model="mock", input="Hi", max_output_tokens=50),
            client.responses.create(model="mock", input="Hi", max_output_tokens=50, stream=True),
            client.responses.create(model="mock", input="Hi", previous_response_id="resp_x"),
        ):
            with pytest.raises(openai.InternalServerError) as err:
                await call
            assert err.value.status_code == 503 and err.value.code == "store_unavailable"
        # The store was asked first: the core generated nothing.
        assert ended_requests(core) == 0 and core.servicer.pipeline.metrics.generation_tokens == 0
        # Without storing, nothing needs the store.
        resp = await client.responses.create(model="mock", input="Hi", max_output_tokens=1, store=False)
        assert resp.status in ("completed", "incomplete") and resp.store is False
        assert ended_requests(core) == 1


def test_a_bad_ttl_is_refused():
    with pytest.raises(ValueError):
        RedisStore("redis://127.0.0.1:1/0", 0)
