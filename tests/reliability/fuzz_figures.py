"""schemathesis against each gateway's own `/openapi.json`, on loopback.

`fuzz_gateway(base_url, ...)` runs schemathesis (4.32.5) over every operation of one running
gateway's document: positive cases (bodies the schema allows) and negative ones (bodies it
refuses) per operation, each answer checked for no 5xx, a documented status, content type and
headers, a body that matches the response schema, and, for negative cases, a 4xx. It blocks (it
uses requests), so an in-process gateway must run on another thread's loop (the tests call it
through `asyncio.to_thread`).

`fuzz_figures(model_dir, ...)` is the long, self-contained run for `make soak`: it starts a
mock-engine core and the four gateways as processes on 127.0.0.1, port 0, fuzzes each gateway,
stops them, and returns per gateway `{"cases", "4xx", "5xx", "failures", "deaths",
"tracebacks"}`: `deaths` counts gateway processes (and the core) that were not running at the
end, `tracebacks` the Python tracebacks in each gateway's output.

Streams: a streamed answer is read whole by requests; the mock core's steps are back to back
(--mock-step-ms 0) and every generation is bounded by max_tokens or the context, so no body is
endless. The items of a stream are checked by tests/integration/test_openapi.py; schemathesis
checks the stream's status, content type and headers.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis import GenerationMode
from schemathesis import checks as st_checks

GATEWAYS = ("openai", "lmi", "triton", "ws")

#: The checks run on every answer (schemathesis.checks).
CHECKS = [
    st_checks.not_a_server_error,
    st_checks.status_code_conformance,
    st_checks.content_type_conformance,
    st_checks.response_headers_conformance,
    st_checks.response_schema_conformance,
]
#: Added for negative cases: a body the schema refuses must be refused (4xx).
NEGATIVE_CHECKS = [*CHECKS, st_checks.negative_data_rejection]

#: The statuses that count as refusing a schema-violating request: schemathesis' defaults plus
#: 413 (too large), 424 (LMI's malformed payload, as DJL answers it) and 426 (the WebSocket
#: routes answer a plain HTTP request so).
CONFIG = {
    "checks": {
        "negative_data_rejection": {
            "expected-statuses": [
                *("400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "424", "426"),
                *("428", "429", "5xx"),
            ]
        }
    }
}


@dataclass
class FuzzCounts:
    """What one schemathesis pass over a gateway gave.

    Attributes:
        cases: requests sent.
        client_errors: answers with a 4xx status.
        server_errors: answers with a 5xx status.
        failures: one line per distinct failed check ("METHOD path: check message").
    """

    cases: int = 0
    client_errors: int = 0
    server_errors: int = 0
    failures: list[str] = field(default_factory=list)

    def add(self, other: FuzzCounts) -> None:
        """Add another pass's counts to these."""
        self.cases += other.cases
        self.client_errors += other.client_errors
        self.server_errors += other.server_errors
        self.failures += [f for f in other.failures if f not in self.failures]


def fuzz_gateway(
    base_url: str,
    *,
    model: str = "mock",
    max_examples: int = 50,
    seed: int = 0,
    modes: Iterable[GenerationMode] = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE),
    request_timeout_s: float = 30.0,
) -> FuzzCounts:
    """Run schemathesis over every operation of the gateway at `base_url` (its `/openapi.json`).

    Args:
        base_url: "http://127.0.0.1:PORT".
        model: the served model's name. Positive cases name it (in the path's model parameter
            and a body's `model`), so they reach generation instead of stopping at 404; negative
            cases name anything.
        max_examples: hypothesis examples per operation and generation mode.
        seed: hypothesis seed (the same seed gives the same cases).
        modes: generation modes; negative cases apply only to operations with inputs.
        request_timeout_s: per request.

    Returns:
        FuzzCounts; a failed check does not stop the pass, it is counted in `failures`.
    """
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json", config=schemathesis.Config.from_dict(CONFIG))
    counts = FuzzCounts()
    with requests.Session() as session:
        for result in schema.get_all_operations():
            operation = result.ok()
            has_inputs = bool(operation.body) or bool(operation.path_parameters)
            for mode in modes:
                if mode is GenerationMode.NEGATIVE and not has_inputs:
                    continue
                checks = NEGATIVE_CHECKS if mode is GenerationMode.NEGATIVE else CHECKS
                strategy = operation.as_strategy(generation_mode=mode)
                if mode is GenerationMode.POSITIVE:
                    strategy = _served(operation, strategy, model)
                _fuzz_operation(
                    operation, mode, strategy, checks, session, base_url, max_examples, seed, request_timeout_s, counts
                )
        _unsupported_methods(schema.raw_schema, session, base_url, model, request_timeout_s, counts)
    return counts


METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH")


def _unsupported_methods(
    doc: dict[str, Any], session: requests.Session, base_url: str, model: str, timeout: float, counts: FuzzCounts
) -> None:
    """Every documented path with each method it does not document: 405 with an `Allow` header
    (RFC 9110 section 15.5.6), as schemathesis' unsupported_method check asks in its coverage
    phase, which this pass does not run. Behind an API key, 401 with `WWW-Authenticate` is right
    too (the key is checked before the route), as that check allows."""
    for template, item in doc["paths"].items():
        path = re.sub(r"\{([^}]+)\}", lambda m: PATH_VALUES.get(m.group(1)) or model, template)
        keyed = "security" in doc and all(op.get("security") != [] for op in item.values())
        for method in METHODS:
            if method.lower() in item:
                continue
            response = session.request(method, base_url + path, timeout=timeout)
            counts.cases += 1
            counts.client_errors += 400 <= response.status_code < 500
            counts.server_errors += response.status_code >= 500
            if keyed and response.status_code == 401 and response.headers.get("WWW-Authenticate"):
                continue
            if response.status_code != 405 or not response.headers.get("Allow"):
                line = f"{method} {template}: {response.status_code}, Allow {response.headers.get('Allow')!r}"
                counts.failures.append(f"{line} (expected 405 with Allow)")


#: Path parameters of a served model: its name, and the version the Triton gateway answers to.
PATH_VALUES = {"model": None, "model_name": None, "version": "1"}


def _served(operation: Any, strategy: Any, model: str) -> Any:
    """Positive cases for the served model: its name in the path and in a body's `model`."""

    def name(case: Any) -> Any:
        for param in case.path_parameters or {}:
            if param in PATH_VALUES:
                case.path_parameters[param] = PATH_VALUES[param] or model
        if isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = model
        return case

    return strategy.map(name)


def _fuzz_operation(
    operation: Any,
    mode: GenerationMode,
    strategy: Any,
    checks: list[Any],
    session: requests.Session,
    base_url: str,
    max_examples: int,
    seed: int,
    timeout: float,
    counts: FuzzCounts,
) -> None:
    @hypothesis.seed(seed)
    @hypothesis.settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    @hypothesis.given(strategy)
    def run(case: Any) -> None:
        response = case.call(base_url=base_url, session=session, timeout=timeout)
        counts.cases += 1
        status = response.status_code
        counts.client_errors += 400 <= status < 500
        counts.server_errors += status >= 500
        try:
            case.validate_response(response, checks=checks)
        except (Exception, BaseExceptionGroup) as e:  # a Failure or a FailureGroup: counted, the pass goes on
            fail(e)

    def fail(e: BaseException) -> None:
        line = f"{operation.method.upper()} {operation.path} ({mode.value}): {_first_line(e)}"
        if line not in counts.failures:
            counts.failures.append(line)

    try:
        run()
    except hypothesis.errors.Unsatisfiable:
        pass  # nothing to generate in this mode (e.g. no negative value for a path parameter)
    except (Exception, BaseExceptionGroup) as e:  # a check schemathesis runs after the case
        fail(e)


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return " ".join(text.split())[:300]


# ----------------------------------------------------------------------------- make soak


class _Process:
    """A process whose output is read into `lines` by a thread; `ready` matches its start line."""

    def __init__(self, name: str, args: list[str], ready: str):
        self.name = name
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.match: re.Match[str] | None = None
        pattern = re.compile(ready)
        threading.Thread(target=self._read, args=(pattern,), daemon=True).start()
        if not self._ready.wait(120) or self.match is None:
            self.stop()
            raise RuntimeError(f"{name} did not start:\n{''.join(self.lines[-40:])}")

    def _read(self, pattern: re.Pattern[str]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.match is None and (m := pattern.search(line)):
                self.match = m
                self._ready.set()
        self._ready.set()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def tracebacks(self) -> int:
        return sum(line.startswith("Traceback") for line in self.lines)

    def stop(self) -> None:
        if self.alive:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


LOOPBACK = ("--host", "127.0.0.1", "--port", "0")
#: The mock core of the pass: steps back to back, served as "mock" (fuzz_gateway's default model).
MOCK_CORE = ("--mock-step-ms", "0", "--model-name", "mock")


@contextmanager
def _stack(model_dir: Path) -> Iterator[tuple[_Process, dict[str, tuple[_Process, str]]]]:
    py = sys.executable
    core = _Process(
        "core",
        [py, "-m", "core", "--model", str(model_dir), "--engine", "mock", *MOCK_CORE, *LOOPBACK],
        r"trellis-core serving .* on (\S+)",
    )
    gateways: dict[str, tuple[_Process, str]] = {}
    try:
        assert core.match is not None
        address = core.match.group(1)
        for name in GATEWAYS:
            gw = _Process(
                name,
                [py, "-m", "gateways", name, "--core", address, *LOOPBACK, "--log-level", "WARNING"],
                rf"trellis-gateway {name} on (http://\S+)",
            )
            assert gw.match is not None
            gateways[name] = (gw, gw.match.group(1))
        yield core, gateways
    finally:
        for gw, _ in gateways.values():
            gw.stop()
        core.stop()


def fuzz_figures(
    model_dir: str | Path, *, max_examples: int = 200, seed: int = 0, log: Any = print
) -> dict[str, dict[str, Any]]:
    """The long schemathesis pass over all four gateways, each a process on a mock-engine core
    process (module docstring).

    Args:
        model_dir: a model or tokenizer directory for the mock engine (models/demo).
        max_examples: hypothesis examples per operation and generation mode.
        seed: hypothesis seed.
        log: progress lines go here.

    Returns:
        `{gateway: {"cases", "4xx", "5xx", "failures", "deaths", "tracebacks"}}`, failures as a
        count, plus "failure_lines" (the distinct failed checks).
    """
    figures: dict[str, dict[str, Any]] = {}
    with _stack(Path(model_dir)) as (core, gateways):
        for name, (gw, base) in gateways.items():
            log(f"schemathesis: {name} gateway at {base}, {max_examples} examples per operation and mode")
            counts = fuzz_gateway(base, max_examples=max_examples, seed=seed)
            figures[name] = {
                "cases": counts.cases,
                "4xx": counts.client_errors,
                "5xx": counts.server_errors,
                "failures": len(counts.failures),
                "failure_lines": counts.failures,
                "deaths": int(not gw.alive) + int(not core.alive),
                "tracebacks": gw.tracebacks,
            }
            log(f"schemathesis: {name}: {figures[name]}")
    return figures


if __name__ == "__main__":
    import json

    print(json.dumps(fuzz_figures(sys.argv[1] if len(sys.argv) > 1 else "models/demo", max_examples=20), indent=2))
