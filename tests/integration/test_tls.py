"""TLS, every path good and bad, with certificates the tests make (trustme): the core over TLS and
mTLS (a client without a certificate, with one from another CA, a server certificate that
expired, an untrusted server), a certificate renewed on disk and served without a restart, a
gateway reaching an mTLS core, and gateways serving HTTPS and WSS (client certificates
required too), plus the flag errors on both sides."""

from __future__ import annotations

import asyncio
import datetime
import importlib
import os
import re
import shutil
import signal
import ssl
import sys
from pathlib import Path

import aiohttp
import grpc
import pytest
import trustme
import websockets
from trellis.generate.v1 import generate_service_pb2_grpc as spb_grpc

from core.tls import server_credentials
from gateways.common.app import start_app
from gateways.common.config import GatewayConfig
from gateways.common.tls import channel_credentials, server_ssl_context
from tests.conftest import _default_options
from tests.integration.core_helpers import generate, start_core_process

BODY = {"text": "Once upon a time", "stopping": {"maxNewTokens": 3}}


class Pki:
    """A CA and the files of certificates it issued, in one directory."""

    def __init__(self, root: Path, name: str):
        self.root = root
        self.ca = trustme.CA()
        self.ca_file = str(root / f"{name}-ca.pem")
        self.ca.cert_pem.write_to_path(self.ca_file)
        self.name = name

    def issue(self, label: str, *identities: str, **kwargs) -> tuple[str, str]:
        """(certfile, keyfile) of a new leaf certificate."""
        cert = self.ca.issue_cert(*identities, **kwargs)
        certfile, keyfile = self.root / f"{self.name}-{label}.pem", self.root / f"{self.name}-{label}.key"
        certfile.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
        cert.private_key_pem.write_to_path(str(keyfile))
        return str(certfile), str(keyfile)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"), "main")


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki-other"), "other")


def creds(ca: Pki | None = None, client: tuple[str, str] | None = None) -> grpc.ChannelCredentials:
    cert, key = client or (None, None)
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca.ca_file).read_bytes() if ca else None,
        private_key=Path(key).read_bytes() if key else None,
        certificate_chain=Path(cert).read_bytes() if cert else None,
    )


async def call(address: str, credentials: grpc.ChannelCredentials | None) -> int:
    """Completion tokens of one Generate call over a new channel."""
    channel = grpc.aio.secure_channel(address, credentials) if credentials else grpc.aio.insecure_channel(address)
    async with channel:
        msgs = await generate(spb_grpc.GenerateServiceStub(channel), BODY)
    return msgs[-1].usage.completion_tokens


async def refused(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(address, credentials)
    return info.value.code()


# --------------------------------------------------------------------------- the core


@pytest.fixture(scope="module")
async def tls_core(start_mock_core, pki):
    cert, key = pki.issue("server", "127.0.0.1", "localhost")
    return await start_mock_core(ssl_certfile=cert, ssl_keyfile=key)


@pytest.fixture(scope="module")
async def mtls_core(start_mock_core, pki):
    cert, key = pki.issue("mtls-server", "127.0.0.1", "localhost")
    return await start_mock_core(ssl_certfile=cert, ssl_keyfile=key, ssl_ca_certs=pki.ca_file, ssl_cert_reqs=2)


async def test_tls_core_serves_a_client_that_trusts_its_ca(tls_core, pki, other):
    assert await call(tls_core.address, creds(pki)) == 3
    assert await refused(tls_core.address, None) is grpc.StatusCode.UNAVAILABLE  # plaintext
    assert await refused(tls_core.address, creds(other)) is grpc.StatusCode.UNAVAILABLE  # untrusted


async def test_mtls_core_requires_a_client_certificate_from_its_ca(mtls_core, pki, other):
    client = pki.issue("client", "gateway")
    assert await call(mtls_core.address, creds(pki, client)) == 3
    assert await refused(mtls_core.address, creds(pki)) is grpc.StatusCode.UNAVAILABLE  # no client certificate
    stranger = other.issue("client", "gateway")
    assert await refused(mtls_core.address, creds(pki, stranger)) is grpc.StatusCode.UNAVAILABLE


async def test_optional_client_certificates(start_mock_core, pki):
    cert, key = pki.issue("optional", "127.0.0.1")
    core = await start_mock_core(ssl_certfile=cert, ssl_keyfile=key, ssl_ca_certs=pki.ca_file, ssl_cert_reqs=1)
    assert await call(core.address, creds(pki)) == 3
    assert await call(core.address, creds(pki, pki.issue("client-opt", "gateway"))) == 3
    await core.stop(0)


async def test_an_expired_server_certificate_is_refused_by_clients(start_mock_core, pki):
    past = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=1)
    cert, key = pki.issue("expired", "127.0.0.1", not_before=past - datetime.timedelta(days=30), not_after=past)
    core = await start_mock_core(ssl_certfile=cert, ssl_keyfile=key)
    assert await refused(core.address, creds(pki)) is grpc.StatusCode.UNAVAILABLE
    await core.stop(0)


async def test_a_renewed_certificate_is_served_without_a_restart(start_mock_core, pki, other, tmp_path):
    cert, key = pki.issue("renew", "127.0.0.1")
    live_cert, live_key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copyfile(cert, live_cert)
    shutil.copyfile(key, live_key)
    core = await start_mock_core(ssl_certfile=str(live_cert), ssl_keyfile=str(live_key))
    assert await call(core.address, creds(pki)) == 3
    assert await refused(core.address, creds(other)) is grpc.StatusCode.UNAVAILABLE
    # renew from another CA, as cert-manager would: new files renamed into place
    new_cert, new_key = other.issue("renewed", "127.0.0.1")
    os.replace(Path(new_key), live_key)
    os.replace(Path(new_cert), live_cert)
    assert await call(core.address, creds(other)) == 3
    assert await refused(core.address, creds(pki)) is grpc.StatusCode.UNAVAILABLE
    # a renewal caught half-way (a file missing) keeps the certificate being served
    live_key.rename(tmp_path / "aside.key")
    assert await call(core.address, creds(other)) == 3
    await core.stop(0)


@pytest.mark.parametrize(
    "args, error",
    [
        (("cert.pem", None, None, 0), "both --ssl-certfile and --ssl-keyfile"),
        ((None, None, "ca.pem", 0), "need --ssl-certfile"),
        ((None, None, None, 2), "need --ssl-certfile"),
        (("cert.pem", "key.pem", None, 2), "needs --ssl-ca-certs"),
        (("cert.pem", "key.pem", None, 3), "0, 1 or 2"),
    ],
)
def test_core_tls_flag_errors(args, error):
    with pytest.raises(ValueError, match=error):
        server_credentials(*args)


async def test_core_with_a_missing_certificate_file_does_not_start(start_mock_core, tmp_path):
    with pytest.raises(OSError):
        await start_mock_core(ssl_certfile=str(tmp_path / "no.pem"), ssl_keyfile=str(tmp_path / "no.key"))


# --------------------------------------------------------------------------- gateways


def gateway_config(name: str, **fields) -> GatewayConfig:
    module = importlib.import_module(f"gateways.{name}")
    return GatewayConfig(name=name, host="127.0.0.1", port=0, options=_default_options(module), **fields)


@pytest.fixture
async def serve():
    runners = []

    async def start(config: GatewayConfig) -> int:
        module = importlib.import_module(f"gateways.{config.name}")
        runner, port = await start_app(module.make_app(config), "127.0.0.1", 0, server_ssl_context(config))
        runners.append(runner)
        return port

    yield start
    for runner in runners:
        await runner.cleanup()


def client_context(pki: Pki, cert: tuple[str, str] | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=pki.ca_file)
    if cert:
        context.load_cert_chain(*cert)
    return context


async def test_gateway_reaches_an_mtls_core(serve, mtls_core, pki):
    client = pki.issue("gw-client", "gateway")
    body = {"model": "mock", "prompt": "hi", "max_tokens": 2}
    port = await serve(
        gateway_config(
            "openai",
            core=mtls_core.address,
            core_ssl_ca_certs=pki.ca_file,
            core_ssl_certfile=client[0],
            core_ssl_keyfile=client[1],
        )
    )
    async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
        assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 2
    port = await serve(gateway_config("openai", core=mtls_core.address, core_ssl_ca_certs=pki.ca_file))
    async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
        assert r.status == 503  # the core refused the handshake: unavailable


async def test_gateway_serves_https(serve, mock_core, pki):
    cert, key = pki.issue("https", "127.0.0.1")
    port = await serve(gateway_config("openai", core=mock_core.address, ssl_certfile=cert, ssl_keyfile=key))
    async with aiohttp.ClientSession() as s:
        async with s.get(f"https://127.0.0.1:{port}/health", ssl=client_context(pki)) as r:
            assert r.status == 200
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await s.get(f"https://127.0.0.1:{port}/health")  # the system's CAs do not know ours
        with pytest.raises(aiohttp.ClientError):
            await s.get(f"http://127.0.0.1:{port}/health")


async def test_gateway_requires_client_certificates_when_asked(serve, mock_core, pki, other):
    cert, key = pki.issue("https-mtls", "127.0.0.1")
    config = gateway_config(
        "triton", core=mock_core.address, ssl_certfile=cert, ssl_keyfile=key, ssl_ca_certs=pki.ca_file, ssl_cert_reqs=2
    )
    port = await serve(config)
    url = f"https://127.0.0.1:{port}/v2/health/live"
    async with aiohttp.ClientSession() as s:
        async with s.get(url, ssl=client_context(pki, pki.issue("https-client", "someone"))) as r:
            assert r.status == 200
        for context in (client_context(pki), client_context(pki, other.issue("https-client", "someone"))):
            with pytest.raises(aiohttp.ClientError):
                async with s.get(url, ssl=context) as r:
                    await r.read()


async def test_websocket_gateway_serves_wss(serve, mock_core, pki):
    cert, key = pki.issue("wss", "127.0.0.1")
    port = await serve(gateway_config("ws", core=mock_core.address, ssl_certfile=cert, ssl_keyfile=key))
    async with websockets.connect(f"wss://127.0.0.1:{port}/ws", ssl=client_context(pki)) as ws:
        await ws.send('[{"request_id": "a", "prompt": "hi", "generation_config": {"max_new_tokens": 2}}]')
        assert await ws.recv()


@pytest.mark.parametrize(
    "fields, error",
    [
        ({"ssl_certfile": "c.pem"}, "both --ssl-certfile and --ssl-keyfile"),
        ({"ssl_ca_certs": "ca.pem"}, "need --ssl-certfile"),
        ({"ssl_certfile": "c.pem", "ssl_keyfile": "k.pem", "ssl_cert_reqs": 2}, "needs --ssl-ca-certs"),
    ],
)
def test_gateway_https_flag_errors(fields, error):
    with pytest.raises(ValueError, match=error):
        server_ssl_context(GatewayConfig(name="openai", **fields))


def test_gateway_channel_credentials():
    assert channel_credentials(GatewayConfig(name="openai")) is None
    assert channel_credentials(GatewayConfig(name="openai", core_tls=True)) is not None
    with pytest.raises(ValueError, match="go together"):
        channel_credentials(GatewayConfig(name="openai", core_ssl_certfile="c.pem"))
    with pytest.raises(OSError):
        channel_credentials(GatewayConfig(name="openai", core_ssl_ca_certs="/nonexistent/ca.pem"))


def test_tls_flags_parse_on_both_sides():
    from core.config import load as load_core
    from gateways.common.config import load as load_gateway

    core = load_core(["--model", "m", "--ssl-certfile", "c", "--ssl-keyfile", "k", "--ssl-ca-certs", "ca"], {})
    assert (core.ssl_certfile, core.ssl_keyfile, core.ssl_ca_certs, core.ssl_cert_reqs) == ("c", "k", "ca", 0)
    env = {"TRELLIS_GATEWAY_SSL_CERT_REQS": "2", "TRELLIS_GATEWAY_CORE_SSL_CA_CERTS": "core-ca"}
    gw = load_gateway("ws", 8765, lambda p: None, ["--ssl-certfile", "c", "--ssl-keyfile", "k"], env)
    assert (gw.ssl_certfile, gw.ssl_keyfile, gw.ssl_cert_reqs, gw.core_ssl_ca_certs) == ("c", "k", 2, "core-ca")
    with pytest.raises(SystemExit):
        load_gateway("ws", 8765, lambda p: None, ["--ssl-cert-reqs", "5"], {})


# --------------------------------------------------------------------------- the processes


async def _gateway_process(*args: str) -> tuple[asyncio.subprocess.Process, str, list[str]]:
    """`python -m gateways *args`; returns the process, its URL and its output so far."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateways", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    lines: list[str] = []
    while True:
        line = (await proc.stdout.readline()).decode()
        lines.append(line)
        if not line:
            return proc, "", lines
        m = re.search(r" on (https?://127\.0\.0\.1:\d+) ->", line)
        if m:
            return proc, m.group(1), lines


async def test_core_and_gateway_processes_with_keys_and_tls_end_to_end(tokenizer_only_dir, pki):
    core_cert, core_key = pki.issue("proc-core", "127.0.0.1")
    gw_client = pki.issue("proc-gw-client", "gateway")
    gw_cert, gw_key = pki.issue("proc-gw", "127.0.0.1")
    core, address = await start_core_process(
        "--engine", "mock", "--model", str(tokenizer_only_dir), "--model-name", "mock", "--port", "0",
        "--api-key", "secret-core-key",
        "--ssl-certfile", core_cert, "--ssl-keyfile", core_key, "--ssl-ca-certs", pki.ca_file, "--ssl-cert-reqs", "2",
    )  # fmt: skip
    gateway = None
    try:
        gateway, url, lines = await _gateway_process(
            "openai", "--core", address, "--port", "0", "--host", "127.0.0.1",
            "--api-key", "secret-gw-key", "--core-api-key", "secret-core-key",
            "--core-ssl-ca-certs", pki.ca_file, "--core-ssl-certfile", gw_client[0], "--core-ssl-keyfile", gw_client[1],
            "--ssl-certfile", gw_cert, "--ssl-keyfile", gw_key,
        )  # fmt: skip
        assert url.startswith("https://"), "".join(lines)
        assert not any("secret" in line for line in lines)  # keys never reach the log
        body = {"model": "mock", "prompt": "hi", "max_tokens": 3}
        headers = {"Authorization": "Bearer secret-gw-key"}
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v1/completions", json=body, headers=headers, ssl=client_context(pki)) as r:
                assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 3
            async with s.post(f"{url}/v1/completions", json=body, ssl=client_context(pki)) as r:
                assert r.status == 401
        gateway.send_signal(signal.SIGTERM)
        assert await gateway.wait() == 0
    finally:
        for proc in (gateway, core):
            if proc is not None and proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_gateway_process_with_inconsistent_tls_flags_exits_2(tmp_path):
    proc, url, lines = await _gateway_process("openai", "--port", "0", "--ssl-certfile", str(tmp_path / "c.pem"))
    assert url == "" and await proc.wait() == 2
    assert any("--ssl-keyfile" in line for line in lines)
