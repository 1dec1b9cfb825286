"""Core configuration: command-line flags, each with an environment fallback.

Every flag `--some-flag` can also be given as `TRELLIS_CORE_SOME_FLAG`; the command line wins
(envflags.EnvArgumentParser, shared with the gateways; booleans read as envflags.parse_bool).
`load()` is the only place that reads the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from core.engine.hf_config import parse_cpus
from core.engine.registry import ENGINES
from core.lora import MAX_LORA_RANK, MAX_LORAS, parse_lora_module
from core.scheduling import POLICIES
from envflags import EnvArgumentParser, ListAction, comma_list
from envflags.tls import add_server_tls_arguments
from oteltrace import add_tracing_arguments, resolve_tracing

ENV_PREFIX = "TRELLIS_CORE_"


def _non_negative(raw: str) -> float:
    """argparse type: a finite float >= 0."""
    value = _float(raw)
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {raw!r}")
    return value


def _probability(raw: str) -> float:
    """argparse type: a float in [0, 1]."""
    value = _float(raw)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {raw!r}")
    return value


def _count(minimum: int) -> Callable[[str], int]:
    """argparse type: an integer >= minimum."""

    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {raw!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {raw!r}")
        return value

    return parse


def _cpus(raw: str) -> str:
    """argparse type of --engine-cpus (core.engine.hf_config.parse_cpus)."""
    try:
        return parse_cpus(raw)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _lora_modules(raw: str) -> list[tuple[str, str]]:
    """argparse type of --lora-modules: comma-separated NAME=PATH items (core.lora)."""
    try:
        return [parse_lora_module(item) for item in comma_list(raw)]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _float(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {raw!r}") from None


def _tenant_weight(raw: str) -> list[tuple[str, float]]:
    """argparse type of --tenant-weight: `name=weight` items, comma-separated; weight > 0."""
    out = []
    for item in comma_list(raw):
        name, sep, value = item.rpartition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = float("nan")
        if not sep or not name or not 0.0 < weight < float("inf"):
            raise argparse.ArgumentTypeError(f"expected NAME=WEIGHT with a weight > 0, got {item!r}")
        out.append((name, weight))
    return out


@dataclass(frozen=True)
class CoreConfig:
    """Effective configuration of one core process (see `build_parser` for each field's meaning)."""

    model: str
    engine: str = "hf"
    model_name: str = ""
    served_model_name_list: tuple[str, ...] = ()
    model_version: str = "1"
    tokenizer: str | None = None
    host: str = "127.0.0.1"
    port: int = 50051
    max_batch_size: int = 32
    max_queue_size: int = 256
    max_total_tokens: int = 131072
    max_prefill_tokens: int = 4096
    default_max_new_tokens: int = 30
    max_new_tokens: int = 0
    max_stop_sequences: int = 16
    max_stop_sequence_chars: int = 4096
    max_logit_bias: int = 1024
    max_n: int = 16
    dtype: str = "auto"
    device: str = "cpu"
    threads: int = 0
    engine_process: bool = True
    engine_cpus: str = "auto"
    engine_stall_seconds: float = 30.0
    engine_max_restarts: int = 3
    hf_step_trace: str = ""
    prefix_cache: bool = True
    prefix_cache_mib: float = 1024
    prefix_cache_block_size: int = 16
    drain_seconds: float = 30.0
    session_max_tokens: int = 1_000_000
    session_ttl_seconds: float = 3600.0
    session_max_bytes: int = 256 * 1024 * 1024
    max_message_bytes: int = 16 * 1024 * 1024
    allow_special_tokens_in_content: bool = False
    max_queued_messages_per_stream: int = 65536
    slow_reader_timeout: float = 30.0
    max_connection_age_seconds: float = 300.0
    max_connection_age_grace_seconds: float = 3600.0
    log_level: str = "INFO"
    # Prometheus metrics (core.metrics): None serves none.
    metrics_port: int | None = None
    metrics_require_key: bool = False
    # API keys (core.auth): none accepts every call.
    api_key: tuple[str, ...] = ()
    # Scheduling (core.scheduling) and per-tenant limits (core.tenants): 0 is no limit.
    scheduling_policy: str = "fcfs"
    tenant_weight: tuple[tuple[str, float], ...] = ()
    tenant_max_running: int = 0
    tenant_tokens_per_minute: int = 0
    preemption: bool = True
    # TLS (core.tls; flags and their rules: envflags.tls): no certificate serves plaintext.
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    guide_cache_size: int = 256
    # LoRA adapters (core.lora): (name, path) registered at start besides <model>/adapters/.
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = MAX_LORAS
    max_lora_rank: int = MAX_LORA_RANK
    enable_lora_management: bool = False
    # OpenTelemetry traces (core.tracing; flags, variables and rules: oteltrace): "" exports none.
    otlp_traces_endpoint: str = ""
    otlp_traces_sample_ratio: float | None = None
    # TensorRT-LLM executor options (ignored by other engines).
    trt_max_num_tokens: int = 0
    trt_kv_cache_free_gpu_memory_fraction: float = 0.9
    trt_enable_block_reuse: bool = True
    trt_scheduler_policy: str = "guaranteed_no_evict"
    trt_enable_chunked_context: bool = False
    trt_enable_chunked_prefill: bool = True
    trt_iter_stats_max_iterations: int = 1000
    trt_request_stats_max_iterations: int = 0
    trt_await_timeout_ms: int = 5
    trt_tensor_parallel_size: int = 1
    trt_pipeline_parallel_size: int = 1
    trt_guided_decoding_backend: str = "xgrammar"
    # Mock engine options (ignored by other engines).
    mock_step_ms: float = 10.0
    mock_prefill_ms_per_token: float = 0.0
    mock_eos_probability: float = 0.0
    mock_context_length: int = 0
    mock_script: str = ""

    @property
    def served_model_name(self) -> str:
        """The name the core reports: the first --served-model-name, else --model-name, else
        the model directory's name."""
        if self.served_model_name_list:
            return self.served_model_name_list[0]
        return self.model_name or Path(self.model.rstrip("/")).name

    @property
    def model_aliases(self) -> tuple[str, ...]:
        """Other names requests may use for the model: the further --served-model-name values
        (vLLM's flag: the first is reported, all are accepted)."""
        return tuple(dict.fromkeys(n for n in self.served_model_name_list[1:] if n != self.served_model_name))

    def redacted(self) -> dict[str, object]:
        """The configuration as a dict for the start-up log, API keys replaced by their count."""
        out = dataclasses.asdict(self)
        out["api_key"] = f"<{len(self.api_key)} keys>"
        return out


def build_parser(environ: Mapping[str, str]) -> EnvArgumentParser:
    """The core's command-line parser (flags documented in README.md)."""
    p = EnvArgumentParser(
        prog="trellis-core",
        description="Trellis core: serve one model over the gRPC Generate API.",
        env_prefix=ENV_PREFIX,
        environ=environ,
    )
    d = CoreConfig(model="")
    p.add_argument("--model", required=True, help="HF checkpoint directory, or TensorRT-LLM engine directory")
    p.add_argument("--engine", default=d.engine, choices=list(ENGINES), help="engine kind")
    p.add_argument("--model-name", default=d.model_name, help="served model name (default: directory name)")
    p.add_argument(
        "--served-model-name",
        dest="served_model_name_list",
        action=ListAction,
        type=comma_list,
        default=[],
        help="names requests may use for the model (repeatable, or comma-separated; vLLM's flag): the first is "
        "reported and replaces --model-name, the others are aliases",
    )
    p.add_argument("--model-version", default=d.model_version, help="version label reported by GetModelInfo")
    p.add_argument("--tokenizer", default=d.tokenizer, help="tokenizer directory (default: from the model)")
    p.add_argument("--host", default=d.host, help="address to listen on (0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=int, default=d.port, help="gRPC port (0: pick a free one)")
    p.add_argument("--max-batch-size", type=int, default=d.max_batch_size, help="sequences in the running batch")
    p.add_argument(
        "--max-queue-size", type=int, default=d.max_queue_size, help="waiting requests before RESOURCE_EXHAUSTED"
    )
    p.add_argument(
        "--max-total-tokens",
        type=int,
        default=d.max_total_tokens,
        help="token budget of the running batch (sum of prompt + max_new_tokens over sequences)",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=d.max_prefill_tokens,
        help="prompt tokens computed together in one prefill step (a cached prefix does not count)",
    )
    p.add_argument(
        "--default-max-new-tokens",
        type=int,
        default=d.default_max_new_tokens,
        help="max_new_tokens of a request that leaves it unset",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=d.max_new_tokens,
        help="upper bound of max_new_tokens (0: the context length)",
    )
    p.add_argument("--max-stop-sequences", type=int, default=d.max_stop_sequences, help="stop strings per request")
    p.add_argument(
        "--max-stop-sequence-chars",
        type=int,
        default=d.max_stop_sequence_chars,
        help="longest stop string or bad word, in characters",
    )
    p.add_argument("--max-logit-bias", type=int, default=d.max_logit_bias, help="logit_bias entries per request")
    p.add_argument("--max-n", type=int, default=d.max_n, help="largest n / best_of per request")
    p.add_argument(
        "--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"], help="HF engine dtype"
    )
    p.add_argument("--device", default=d.device, help="HF engine device (cpu, cuda, cuda:1, ...)")
    p.add_argument(
        "--threads",
        type=int,
        default=d.threads,
        help="HF engine: torch intra-op threads (0: one per core, less one left to the serving threads)",
    )
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=d.engine_process,
        help="HF engine: run the batching loop in a process of its own, so model steps never wait on serving work",
    )
    p.add_argument(
        "--engine-cpus",
        type=_cpus,
        default=d.engine_cpus,
        metavar="auto|none|LIST",
        help="HF engine process: the CPUs it runs on, the serving threads taking the others (auto: the last "
        "--threads CPUs when there are more CPUs than threads; none: no pinning; or a list such as 1,3-4)",
    )
    p.add_argument(
        "--engine-stall-seconds",
        type=_non_negative,
        default=d.engine_stall_seconds,
        help="HF engine process: seconds without an engine step, while requests are pending, after which "
        "health reports NOT_SERVING until it steps again (longer than the longest prefill; 0: no watchdog)",
    )
    p.add_argument(
        "--engine-max-restarts",
        type=_count(0),
        default=d.engine_max_restarts,
        help="HF engine process: times a process that died is restarted within 10 minutes; beyond, the core "
        "stays without an engine and health reports NOT_SERVING (0: never restart)",
    )
    p.add_argument(
        "--hf-step-trace",
        default=d.hf_step_trace,
        metavar="PATH",
        help="HF engine: append one line per engine step to PATH (kind, rows, tokens, forward and step seconds; "
        "summed up by scripts/bench/hf_steps.py --trace)",
    )
    p.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=d.prefix_cache,
        help="reuse the KV of prompts already seen, on every engine that can: the HF engine keeps prompts' keys "
        "and values in blocks, so a prompt starting with a cached prefix computes only the rest (prompts asking for "
        "prompt logprobs are computed whole); off also turns TensorRT-LLM's KV-cache block reuse off",
    )
    p.add_argument(
        "--prefix-cache-mib",
        type=_non_negative,
        default=d.prefix_cache_mib,
        help="HF engine: memory of the prefix cache's keys and values in MiB (a fraction allowed, e.g. 2.5), "
        "least recently used blocks evicted beyond it (0: no prefix cache)",
    )
    p.add_argument(
        "--prefix-cache-block-size",
        type=_count(1),
        default=d.prefix_cache_block_size,
        help="HF engine: tokens per prefix cache block (only full blocks are cached)",
    )
    p.add_argument(
        "--drain-seconds", type=float, default=d.drain_seconds, help="on SIGTERM, how long in-flight streams may finish"
    )
    p.add_argument(
        "--session-max-tokens",
        type=int,
        default=d.session_max_tokens,
        help="tokens held by all continue-generation sessions together (LRU eviction)",
    )
    p.add_argument(
        "--session-max-bytes",
        type=_count(1),
        default=d.session_max_bytes,
        help="bytes held by all continue-generation sessions together: their keys, 4 per token and 200 per "
        "session (LRU eviction)",
    )
    p.add_argument(
        "--session-ttl-seconds",
        type=float,
        default=d.session_ttl_seconds,
        help="idle time after which a session expires",
    )
    p.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes, help="gRPC message size limit")
    p.add_argument(
        "--allow-special-tokens-in-content",
        action=argparse.BooleanOptionalAction,
        default=d.allow_special_tokens_in_content,
        help="tokenize the text of special tokens (<|end|>, EOS, ...) in prompts and chat messages as those tokens, "
        "as vLLM and TGI do (default: as ordinary text; a chat template's own markers stay special)",
    )
    p.add_argument(
        "--max-queued-messages-per-stream",
        type=_count(1),
        default=d.max_queued_messages_per_stream,
        help="responses (and MultiplexGenerate step entries) a stream may hold for a client that reads slower "
        "than they come; one more cancels the stream's requests with RESOURCE_EXHAUSTED (SLOW_READER)",
    )
    p.add_argument(
        "--slow-reader-timeout",
        type=_non_negative,
        default=d.slow_reader_timeout,
        help="seconds a stream's write may wait for a client that takes nothing while news waits; then its "
        "requests are cancelled the same way (0: no limit)",
    )
    p.add_argument(
        "--max-connection-age-seconds",
        type=float,
        default=d.max_connection_age_seconds,
        help="age after which a client connection is asked to go away (GOAWAY), so balancing clients "
        "reconnect and spread over new replicas (0: never)",
    )
    p.add_argument(
        "--max-connection-age-grace-seconds",
        type=float,
        default=d.max_connection_age_grace_seconds,
        help="how long the streams of an aged connection may still run before it is closed; longer than "
        "the longest stream (a gateway's --core-stream-max-age plus its longest request)",
    )
    p.add_argument("--log-level", default=d.log_level, choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument(
        "--metrics-port",
        type=int,
        default=d.metrics_port,
        help="serve Prometheus metrics on http://HOST:PORT/metrics (--host's address; 0: pick a free port; "
        "unset: no metrics server)",
    )
    p.add_argument(
        "--metrics-require-key",
        action=argparse.BooleanOptionalAction,
        default=d.metrics_require_key,
        help="the metrics port needs one of the --api-key keys too (default: open)",
    )
    p.add_argument(
        "--api-key",
        action=ListAction,
        type=comma_list,
        default=[],
        help="accept only calls with the metadata 'authorization: Bearer KEY' (repeatable, or comma-separated; "
        "grpc.health.v1 stays open)",
    )
    p.add_argument(
        "--scheduling-policy",
        default=d.scheduling_policy,
        choices=POLICIES,
        help="order of waiting requests: fcfs (arrival) or priority (the request's priority, lower first, then "
        "arrival); both share the engine between tenants by weight (HF and mock engines; docs/fleet.md)",
    )
    p.add_argument(
        "--tenant-weight",
        action=ListAction,
        type=_tenant_weight,
        default=[],
        metavar="NAME=WEIGHT",
        help="a tenant's share of the engine's tokens relative to others (repeatable or comma-separated; "
        "tenants not named weigh 1)",
    )
    p.add_argument(
        "--tenant-max-running",
        type=_count(0),
        default=d.tenant_max_running,
        help="requests one tenant may have queued or running at once; more are refused with RESOURCE_EXHAUSTED "
        "(0: no limit)",
    )
    p.add_argument(
        "--tenant-tokens-per-minute",
        type=_count(0),
        default=d.tenant_tokens_per_minute,
        help="tokens (prompt and generated) one tenant may use per minute; a tenant over it is refused with "
        "RESOURCE_EXHAUSTED and a retry delay until it is under again (0: no limit)",
    )
    p.add_argument(
        "--preemption",
        action=argparse.BooleanOptionalAction,
        default=d.preemption,
        help="mock engine: preempt a running request, which resumes later where it stopped, for a waiting one of "
        "a higher priority or of a tenant under its share of the batch (never with one tenant and fcfs; "
        "docs/fleet.md)",
    )
    add_server_tls_arguments(p, serves="gRPC over TLS", label="TLS")
    add_tracing_arguments(p)
    p.add_argument(
        "--guide-cache-size",
        type=int,
        default=d.guide_cache_size,
        help="HF engine: compiled guided-decoding guides (schemas, regexes, grammars) kept",
    )
    p.add_argument(
        "--lora-modules",
        action=ListAction,
        type=_lora_modules,
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) to serve from the start, besides the model directory's adapters/ "
        "subdirectories (repeatable, or comma-separated)",
    )
    p.add_argument(
        "--max-loras",
        type=_count(0),
        default=d.max_loras,
        help="HF and mock engines: LoRA adapters resident at once, each in a slot of its own (the least recently "
        "used idle one is evicted for another; 0: no adapters)",
    )
    p.add_argument(
        "--max-lora-rank", type=_count(1), default=d.max_lora_rank, help="largest LoRA rank an adapter may have"
    )
    p.add_argument(
        "--enable-lora-management",
        action=argparse.BooleanOptionalAction,
        default=d.enable_lora_management,
        help="allow the LoadAdapter and UnloadAdapter RPCs (registering adapters at run time)",
    )
    p.add_argument(
        "--trt-max-num-tokens",
        type=int,
        default=d.trt_max_num_tokens,
        help="TensorRT-LLM: batched tokens per step (0: engine value)",
    )
    p.add_argument(
        "--trt-kv-cache-free-gpu-memory-fraction",
        type=float,
        default=d.trt_kv_cache_free_gpu_memory_fraction,
        help="TensorRT-LLM: KV-cache share of free memory",
    )
    p.add_argument(
        "--trt-enable-block-reuse",
        action=argparse.BooleanOptionalAction,
        default=d.trt_enable_block_reuse,
        help="TensorRT-LLM: KV-cache block reuse across requests (on only when --prefix-cache is on too)",
    )
    p.add_argument(
        "--trt-scheduler-policy",
        default=d.trt_scheduler_policy,
        choices=["guaranteed_no_evict", "max_utilization", "static_batch"],
        help="TensorRT-LLM: capacity scheduler policy",
    )
    p.add_argument(
        "--trt-enable-chunked-context",
        action=argparse.BooleanOptionalAction,
        default=d.trt_enable_chunked_context,
        help="TensorRT-LLM executor (--engine trtllm): chunked prefill",
    )
    p.add_argument(
        "--trt-enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=d.trt_enable_chunked_prefill,
        help="TensorRT-LLM LLM API (--engine trtllm-llm): chunked prefill where the release has it (off: prompts "
        "are limited to max_num_tokens)",
    )
    p.add_argument(
        "--trt-iter-stats-max-iterations",
        type=int,
        default=d.trt_iter_stats_max_iterations,
        help="TensorRT-LLM: iteration stats kept",
    )
    p.add_argument(
        "--trt-request-stats-max-iterations",
        type=int,
        default=d.trt_request_stats_max_iterations,
        help="TensorRT-LLM: request stats kept (> 0 gives exact SCHEDULED/PREFILLED markers)",
    )
    p.add_argument(
        "--trt-await-timeout-ms",
        type=int,
        default=d.trt_await_timeout_ms,
        help="TensorRT-LLM: await_responses timeout of the awaiter thread",
    )
    p.add_argument(
        "--trt-tensor-parallel-size",
        type=int,
        default=d.trt_tensor_parallel_size,
        help="TensorRT-LLM LLM API (--engine trtllm-llm): GPUs per tensor-parallel group (engines built by "
        "scripts/build_trtllm_engine.py carry their own)",
    )
    p.add_argument(
        "--trt-pipeline-parallel-size",
        type=int,
        default=d.trt_pipeline_parallel_size,
        help="TensorRT-LLM LLM API (--engine trtllm-llm): pipeline-parallel stages",
    )
    p.add_argument(
        "--trt-guided-decoding-backend",
        default=d.trt_guided_decoding_backend,
        choices=["xgrammar", "llguidance", "none"],
        help="TensorRT-LLM: grammar backend of guided decoding (llguidance: LLM API only; none: off)",
    )
    p.add_argument(
        "--mock-step-ms",
        type=_non_negative,
        default=d.mock_step_ms,
        help="mock engine (--engine mock): duration of one decode step in ms (0: back to back)",
    )
    p.add_argument(
        "--mock-prefill-ms-per-token",
        type=_non_negative,
        default=d.mock_prefill_ms_per_token,
        help="mock engine: extra step time per prompt token admitted in the step, in ms",
    )
    p.add_argument(
        "--mock-eos-probability",
        type=_probability,
        default=d.mock_eos_probability,
        help="mock engine: probability of drawing EOS at each generated token, in [0, 1]",
    )
    p.add_argument(
        "--mock-context-length",
        type=int,
        default=d.mock_context_length,
        help="mock engine: context length in tokens (0: the model's config.json, else 4096)",
    )
    p.add_argument(
        "--mock-script",
        default=d.mock_script,
        help='mock engine: a JSON file of scripted replies, [{"when": "prompt text", "reply": "text"}] '
        "(core.engine.mock); empty: none",
    )
    return p


def load(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> CoreConfig:
    """Parse flags (argv) with environment fallbacks (environ, default os.environ).

    Raises:
        SystemExit: on a usage error (argparse prints the message).
    """
    environ = os.environ if environ is None else environ
    parser = build_parser(environ)
    ns = vars(parser.parse_args(argv))
    try:
        resolve_tracing(ns["otlp_traces_endpoint"], ns["otlp_traces_sample_ratio"], environ)
    except ValueError as e:
        parser.error(str(e))
    ns["api_key"] = tuple(ns["api_key"])
    ns["tenant_weight"] = tuple(ns["tenant_weight"])
    ns["lora_modules"] = tuple(ns["lora_modules"])
    ns["served_model_name_list"] = tuple(ns["served_model_name_list"])
    return CoreConfig(**ns)
