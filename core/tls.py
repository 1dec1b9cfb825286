"""TLS for the core's gRPC server, mTLS when asked, with certificates reloaded without a restart.

`server_credentials(config)` builds `grpc.dynamic_ssl_server_credentials` (grpcio
`grpc/__init__.py`, "dynamic_ssl_server_credentials" and "ssl_server_certificate_configuration"):
gRPC asks the fetcher for a new certificate configuration before each TLS handshake, and
`CertificateFiles.fetch` answers with the files read again when one of them changed (mtime or
size), else None (keep the current one). A certificate renewed in place (cert-manager rewrites
the Secret's files) is therefore served from the next connection on; established connections
keep theirs. Replace the files by renaming new ones into place, so a handshake never reads a new
certificate with the old key.

Client certificates (`--ssl-cert-reqs`, the values of Python's `ssl.CERT_*`, as vLLM's flag):
0 asks for none; 1 asks for one signed by `--ssl-ca-certs` but serves clients without one; 2
requires one (mTLS: `require_client_authentication`). The flags and the combinations refused
are the gateways' too (envflags.tls).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import grpc

from envflags.tls import CERT_REQUIRED, check_server_tls

log = logging.getLogger(__name__)


class CertificateFiles:
    """The server's certificate chain, key and (for client certificates) CA bundle, as files.

    Args:
        certfile: PEM certificate chain.
        keyfile: PEM private key.
        ca_certs: PEM CA certificates that sign client certificates; None: none asked for.
    """

    def __init__(self, certfile: str, keyfile: str, ca_certs: str | None):
        self.certfile = certfile
        self.keyfile = keyfile
        self.ca_certs = ca_certs
        self._stamp = self._stat()

    @property
    def _paths(self) -> Sequence[str]:
        return [p for p in (self.certfile, self.keyfile, self.ca_certs) if p]

    def _stat(self) -> tuple[tuple[int, int], ...]:
        stats = [os.stat(p) for p in self._paths]
        return tuple((s.st_mtime_ns, s.st_size) for s in stats)

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        """The files' current contents as a certificate configuration.

        Raises:
            OSError: a file cannot be read.
        """
        with open(self.certfile, "rb") as f:
            chain = f.read()
        with open(self.keyfile, "rb") as f:
            key = f.read()
        roots = None
        if self.ca_certs:
            with open(self.ca_certs, "rb") as f:
                roots = f.read()
        return grpc.ssl_server_certificate_configuration([(key, chain)], root_certificates=roots)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's certificate configuration fetcher: the files read again when they changed since
        the last read, else None. A file that cannot be read keeps the current configuration
        (logged), so a renewal caught half-way never stops the server."""
        try:
            stamp = self._stat()
            if stamp == self._stamp:
                return None
            config = self.configuration()
        except OSError as e:
            log.warning("TLS certificate files cannot be read again (%s); serving the previous ones", e)
            return None
        self._stamp = stamp
        log.info("TLS certificate files changed; new connections get the new certificate")
        return config


def server_credentials(
    certfile: str | None, keyfile: str | None, ca_certs: str | None, cert_reqs: int
) -> grpc.ServerCredentials | None:
    """The gRPC server's credentials: None without `certfile` (plaintext), else dynamic TLS.

    Raises:
        ValueError: flags envflags.tls.check_server_tls refuses (a key without a certificate or
            the reverse, client certificates asked for without a CA bundle, `cert_reqs` outside
            0-2).
        OSError: a file cannot be read.
    """
    pair = check_server_tls(certfile, keyfile, ca_certs, cert_reqs, label="TLS")
    if pair is None:
        return None
    files = CertificateFiles(*pair, ca_certs if cert_reqs else None)
    # types-grpcio types the fetcher without its None ("no change"), which grpcio documents.
    return grpc.dynamic_ssl_server_credentials(
        files.configuration(),
        files.fetch,  # type: ignore[arg-type]
        require_client_authentication=cert_reqs == CERT_REQUIRED,
    )
