"""TLS on a gateway's two sides: HTTPS/WSS to its clients, and its gRPC channel to the core.

Clients (vLLM's flag names): `--ssl-certfile` and `--ssl-keyfile` serve HTTPS (and WSS on the
WebSocket gateway); `--ssl-ca-certs` with `--ssl-cert-reqs` (Python's `ssl.CERT_*`: 0 none, 1
optional, 2 required) asks clients for certificates signed by that CA. `server_ssl_context`
builds the `ssl.SSLContext` aiohttp serves with; the flags and the combinations refused are the
core's too (envflags.tls).

Core: `--core-ssl-ca-certs` (the CA that signs the core's certificate) or `--core-tls` (the
system's CAs) makes the channel TLS; `--core-ssl-certfile` and `--core-ssl-keyfile` add the
gateway's client certificate for a core that requires one (mTLS). The core's certificate must
name the host the gateway dials (`--core`), as a DNS name or an IP address.
`channel_credentials(config)` builds the `grpc.ChannelCredentials` (None: plaintext); any
client of the core can use it.
"""

from __future__ import annotations

import ssl

import grpc

from envflags.tls import check_server_tls
from gateways.common.config import GatewayConfig


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def channel_credentials(config: GatewayConfig) -> grpc.ChannelCredentials | None:
    """TLS credentials for the channel to the core, or None for plaintext.

    Raises:
        ValueError: a client key without its certificate or the reverse.
        OSError: a file cannot be read.
    """
    cert, key = config.core_ssl_certfile, config.core_ssl_keyfile
    if bool(cert) != bool(key):
        raise ValueError("--core-ssl-certfile and --core-ssl-keyfile go together")
    if not (config.core_tls or config.core_ssl_ca_certs or cert):
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(config.core_ssl_ca_certs) if config.core_ssl_ca_certs else None,
        private_key=_read(key) if key else None,
        certificate_chain=_read(cert) if cert else None,
    )


def server_ssl_context(config: GatewayConfig) -> ssl.SSLContext | None:
    """The SSLContext the gateway serves HTTPS with, or None for plain HTTP.

    Raises:
        ValueError: flags envflags.tls.check_server_tls refuses (a key without a certificate or
            the reverse, client certificates asked for without a CA bundle, `ssl_cert_reqs`
            outside 0-2).
        OSError / ssl.SSLError: a file cannot be read or is not PEM.
    """
    ca, reqs = config.ssl_ca_certs, config.ssl_cert_reqs
    pair = check_server_tls(config.ssl_certfile, config.ssl_keyfile, ca, reqs, label="HTTPS")
    if pair is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*pair)
    if ca:
        context.load_verify_locations(ca)
    context.verify_mode = ssl.VerifyMode(reqs)
    return context
