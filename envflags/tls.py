"""The TLS flags a serving process offers its clients, and the rules that check them, as both
islands have them: the core serves gRPC over TLS (core.tls builds grpc's credentials), a
gateway HTTPS and WSS (gateways.common.tls builds the `ssl.SSLContext`).

The four flags are vLLM's (`vllm serve`, vllm/entrypoints/openai/cli_args.py):
`--ssl-certfile` and `--ssl-keyfile` (PEM certificate chain and private key) turn TLS on;
`--ssl-ca-certs` (PEM CA certificates) with `--ssl-cert-reqs` asks clients for certificates
signed by that CA, the values being Python's `ssl.CERT_*`: 0 none, 1 optional (checked when
sent), 2 required (mutual TLS).

`check_server_tls` refuses, with a ValueError naming the flags:
- `--ssl-cert-reqs` other than 0, 1 or 2;
- `--ssl-ca-certs` or a non-zero `--ssl-cert-reqs` without a certificate and a key;
- a certificate without its key, or a key without its certificate;
- `--ssl-cert-reqs` 1 or 2 without `--ssl-ca-certs`.
The files themselves are read by each island when it builds its credentials (a missing or
unreadable file is an OSError there). Standard library only, like the rest of envflags, so
both islands can import it.
"""

from __future__ import annotations

import argparse

__all__ = ["CERT_NONE", "CERT_OPTIONAL", "CERT_REQUIRED", "add_server_tls_arguments", "check_server_tls"]

#: `--ssl-cert-reqs` values, those of Python's ssl.CERT_NONE, CERT_OPTIONAL and CERT_REQUIRED.
CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED = 0, 1, 2


def add_server_tls_arguments(parser: argparse.ArgumentParser, *, serves: str, label: str) -> None:
    """Add `--ssl-certfile`, `--ssl-keyfile`, `--ssl-ca-certs` and `--ssl-cert-reqs` (default:
    no TLS, no client certificates).

    Args:
        parser: the island's parser (an envflags.EnvArgumentParser gives each its variable).
        serves: what the certificate serves, for the help ("gRPC over TLS", "HTTPS (and WSS)").
        label: the protocol's name, for the help ("TLS", "HTTPS").
    """
    parser.add_argument("--ssl-certfile", default=None, help=f"serve {serves} with this PEM certificate chain")
    parser.add_argument("--ssl-keyfile", default=None, help=f"the {label} certificate's PEM private key")
    parser.add_argument(
        "--ssl-ca-certs", default=None, help="PEM CA certificates that sign accepted client certificates"
    )
    parser.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=CERT_NONE,
        choices=[CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED],
        help="client certificates: 0 none, 1 optional, 2 required (mTLS); as Python's ssl.CERT_*",
    )


def check_server_tls(
    certfile: str | None, keyfile: str | None, ca_certs: str | None, cert_reqs: int, *, label: str
) -> tuple[str, str] | None:
    """The certificate and key to serve TLS with, `(certfile, keyfile)`; None without either
    (plaintext). Any other combination is refused (see the module docstring).

    Args:
        certfile, keyfile, ca_certs: the `--ssl-*` paths (None or "": not given).
        cert_reqs: `--ssl-cert-reqs`.
        label: the protocol's name, in the message of a certificate without its key ("TLS",
            "HTTPS").

    Raises:
        ValueError: a refused combination; the message names the flags to give.
    """
    if cert_reqs not in (CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED):
        raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2, got {cert_reqs}")
    if not certfile and not keyfile:
        if ca_certs or cert_reqs:
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile and --ssl-keyfile")
        return None
    if not (certfile and keyfile):
        raise ValueError(f"{label} needs both --ssl-certfile and --ssl-keyfile")
    if cert_reqs and not ca_certs:
        raise ValueError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs (the CA that signs client certificates)")
    return certfile, keyfile
