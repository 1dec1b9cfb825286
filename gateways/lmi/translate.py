"""LMI <-> gRPC translation: pure functions, no I/O, no clocks, no random ids
(docs/architecture.md, "Principles").

Request side: `render_options` decides what the response will show, `to_generate_request` maps
`inputs` + GenerationParameters (seed "GenerationParameters") onto one `GenerateRequest`
through the schema's field table `FIELDS`, which also names the LMI parameter when the core
refuses a value (`client_names`).
Response side: `StreamRenderer` turns Generate messages into jsonlines/SSE records as they
arrive (seed "Response Schema", streaming), `collect_messages` + `render_response` build the
non-streaming body, and the `dynamic_*` helpers render the dynamic-batch schema. They take the
messages of a complete stream (gateways.common.core_call.CoreCall checks that the final
message came). A sequence the core cancelled or failed is an error here: LMI's finish reasons
(`FINISH_REASONS`, also used for chat completions on `/invocations`) have no word for it.

Token texts. A record's `text` is the part of the sequence's text that arrived with that token:
the core sends UTF-8-safe text deltas per message (holding back partial characters and possible
stop-string starts), so the delta of a message goes on its last token and earlier tokens of the
same message get "". Concatenating the `text` of all token records therefore gives exactly
`generated_text` (what the `text-generation` client's users do), which per-token decoding would
not (SentencePiece spaces, split UTF-8 characters, stop strings left out of the output).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.fields import Field, FieldTable, Transform, by_rule, same_names, true_or_unset
from gateways.common.guided import tgi_grammar_guide
from gateways.common.status import GatewayError
from gateways.common.streaming import finish_word
from gateways.lmi.schema import GenerationParameters

#: The schema's max_new_tokens default (seed "GenerationParameters": default = 30), set
#: explicitly so the answer does not depend on the core's configured default.
DEFAULT_MAX_NEW_TOKENS = 30

#: Core finish reasons -> LMI's `finish_reason` words, the seeds' enum "length", "eos_token",
#: "stop_sequence" (`lmi-input-output-schema.md` "Details", `lmi-chat-completions-schema.md`;
#: TGI's FinishReason, which the `text-generation` client validates). TIME_LIMIT cannot happen
#: through this gateway (it never sets a time limit); it reads as a length limit if it does.
#: CANCELLED and ERROR have no word: they are errors (UNAVAILABLE, so the client retries, and
#: INTERNAL; gateways.common.streaming.sequence_error), on every LMI path, chat included.
FINISH_REASONS: dict[int, str] = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_EOS: "eos_token",
    pb.FINISH_REASON_STOP_SEQUENCE: "stop_sequence",
    pb.FINISH_REASON_TIME_LIMIT: "length",
}


def _unset_if(neutral: object) -> Transform:
    """A transform that leaves the contract field unset for the schema's "disabled" value."""
    return lambda value: None if value == neutral else value


#: The request fields (seed "GenerationParameters", with the LMI-Dist/vLLM, TensorRT-LLM and
#: TGI additions) and the GenerateRequest paths they set. `by_rule` rows are set by
#: `to_generate_request` itself (rules across fields: n and best_of, the two stop fields, the
#: logprob counts) and only name the path in errors. Where two rows set one path, the later one
#: the client gave names it.
FIELDS = FieldTable(
    (
        *by_rule("inputs", "text"),
        *same_names("parameters.", "sampling", ("do_sample", "temperature")),
        Field("parameters.top_k", "sampling.top_k", _unset_if(-1)),  # vLLM/LMI-Dist: -1 disables
        Field("parameters.top_p", "sampling.top_p", _unset_if(0)),  # TensorRT-LLM table: 0 when greedy
        *same_names("parameters.", "sampling", ("min_p", "typical_p", "repetition_penalty", "presence_penalty")),
        *same_names("parameters.", "sampling", ("frequency_penalty", "length_penalty", "early_stopping")),
        *same_names("parameters.", "sampling", ("seed", "num_beams")),
        Field("parameters.priority", "priority"),
        *by_rule("parameters.best_of", "sampling.n"),
        *by_rule("parameters.n", "sampling.n", "sampling.best_of"),
        *by_rule("parameters.best_of", "sampling.best_of"),
        Field("parameters.bad_sequences", "sampling.bad_words"),
        *same_names("parameters.", "stopping", ("max_new_tokens",)),
        Field("parameters.min_length", "stopping.min_new_tokens"),
        *by_rule("parameters.stop_sequences", "stopping.stop"),
        *same_names("parameters.", "stopping", ("stop_token_ids",)),
        Field("parameters.ignore_eos_token", "stopping.ignore_eos"),
        *same_names("parameters.", "stopping", ("include_stop_str_in_output",)),
        Field("parameters.truncate", "stopping.truncate_input_tokens"),
        *by_rule("parameters.logprobs", "output.logprobs", "output.top_logprobs"),
        *by_rule("parameters.top_n_tokens", "output.logprobs", "output.top_logprobs"),
        *by_rule("parameters.decoder_input_details", "output.prompt_logprobs"),
        *by_rule("parameters.prompt_logprobs", "output.prompt_logprobs"),
        Field("parameters.return_full_text", "output.echo", true_or_unset),
        *same_names("parameters.", "output", ("skip_special_tokens", "spaces_between_special_tokens")),
        *by_rule("parameters.grammar", "guided_decoding.json_object", "guided_decoding.json_schema"),
        *by_rule("parameters.grammar", "guided_decoding.regex"),
    )
)

# Parameters whose output the dynamic-batch schema ({generated_text} only) cannot carry.
_ROLLING_ONLY = ("details", "decoder_input_details", "prompt_logprobs", "logprobs", "top_n_tokens")


@dataclass(frozen=True, slots=True)
class RenderOptions:
    """What a response shows, decided from the request once.

    Attributes:
        inputs: the prompt as the client sent it (`details.inputs`).
        stream: token-by-token response.
        tgi_compat: TGI shapes (token `logprob`/`special`, `details.seed`, `prefill` always
            present, non-streaming body wrapped in an array).
        tgi_router: the shapes of TGI's own routes (`/generate`, `/generate_stream`; TGI's
            router/src/lib.rs `GenerateResponse`, `StreamResponse`): as tgi_compat, but the
            body is not wrapped, `details` has no `inputs`, every stream record carries `index`
            (1-based), `generated_text` and `details` (null until the last), and the last
            record's `details` is TGI's StreamDetails (`input_length`, no `prefill`).
        array: on TGI's routes, the whole body is wrapped in a one-element array (TGI's
            `POST /`, router/src/server.rs `compat_generate`).
        details: `details` is rendered (asked for, implied by prefill or best-of output, or
            TGI compatibility's default).
        prefill: `details.prefill` carries the prompt tokens (decoder_input_details or
            prompt_logprobs).
        prefill_top: alternatives per prompt token (prompt_logprobs > 0).
        top_tokens: alternatives per generated token (logprobs or top_n_tokens > 0).
        num_sequences: sequences asked from the core (max of n and best_of); above 1 the best
            one is `generated_text` and the others go to `details.best_of_sequences`.
        full_text: `generated_text` starts with the prompt (return_full_text).
    """

    inputs: str
    stream: bool = False
    tgi_compat: bool = False
    tgi_router: bool = False
    array: bool = False
    details: bool = False
    prefill: bool = False
    prefill_top: bool = False
    top_tokens: bool = False
    num_sequences: int = 1
    full_text: bool = False


def render_options(
    inputs: str,
    p: GenerationParameters,
    *,
    stream: bool,
    tgi_compat: bool,
    tgi_router: bool = False,
    array: bool = False,
) -> RenderOptions:
    """Decide what the response shows (see RenderOptions). On TGI's routes `details` is shown
    when `details` or `decoder_input_details` asks for it, as TGI's `generate` does."""
    num_sequences = max(p.n or 1, p.best_of or 1)
    prefill = bool(p.decoder_input_details) or p.prompt_logprobs is not None
    if tgi_router:
        details = bool(p.details) or prefill
    else:
        details = (p.details if p.details is not None else tgi_compat) or prefill or num_sequences > 1
    top = [v for v in (p.logprobs, p.top_n_tokens) if v is not None]
    return RenderOptions(
        inputs=inputs,
        stream=stream,
        tgi_compat=tgi_compat or tgi_router,
        tgi_router=tgi_router,
        array=array,
        details=details,
        prefill=prefill,
        prefill_top=bool(p.prompt_logprobs),
        top_tokens=bool(top) and max(top) > 0,
        num_sequences=num_sequences,
        full_text=bool(p.return_full_text),
    )


def refuse_unsupported(
    p: GenerationParameters, *, stream: bool, dynamic: bool = False, tgi_router: bool = False
) -> None:
    """Refuse schema features this server cannot honour (never drop them silently).

    Raises:
        GatewayError: INVALID_ARGUMENT naming the LMI parameter:
            - `stop: true` (TensorRT-LLM's flag, without a defined meaning on other engines);
            - `watermark: true` (a TGI feature the core does not implement);
            - n or best_of > 1 with streaming (seed: "only works with non-streaming case");
            - on TGI's `/generate_stream` (`tgi_router`), `decoder_input_details: true`, whose
              prompt tokens TGI's StreamDetails cannot carry (TGI refuses it the same way,
              router/src/server.rs `generate_stream_internal`);
            - with dynamic batching, parameters whose output that schema cannot carry
              (details, decoder_input_details, prompt_logprobs, logprobs, top_n_tokens,
              n/best_of > 1).
    """
    if p.stop is True:
        raise _refuse(
            "stop",
            "the TensorRT-LLM 'stop' flag has no defined meaning on this server; use stop_sequences "
            "or stop_token_ids to end generation.",
        )
    if p.watermark:
        raise _refuse("watermark", "watermarking is not supported by this server.")
    if tgi_router and stream and p.decoder_input_details:
        raise _refuse(
            "decoder_input_details",
            "the prompt's tokens are not part of a stream; ask for them without streaming (/generate).",
        )
    many = max(p.n or 1, p.best_of or 1) > 1
    name = "n" if (p.n or 1) > 1 else "best_of"
    if dynamic:
        for field_name in _ROLLING_ONLY:
            value = getattr(p, field_name)
            if value is not None and value is not False:
                raise _refuse(field_name, "this parameter is only available with rolling batching.")
        if many:
            raise _refuse(name, "values above 1 are only available with rolling batching.")
    elif many and stream:
        raise _refuse(name, "values above 1 only work without streaming; set stream to false.")


def _refuse(name: str, why: str) -> GatewayError:
    return GatewayError.invalid(f"parameters.{name}: {why}", param=f"parameters.{name}")


def to_generate_request(
    inputs: str,
    p: GenerationParameters,
    opts: RenderOptions,
    *,
    request_id: str,
    model: str | None = None,
    dynamic: bool = False,
    adapter: str = "",
) -> spb.GenerateRequest:
    """One GenerateRequest for `inputs` with LMI parameters `p`.

    Mapping (seed "GenerationParameters"; docs/architecture.md, "Sampling defaults are the engine's"):
    sampling fields pass through when given (unset ones take the core engine's defaults, so
    TensorRT-LLM's distinct defaults apply on that engine); `do_sample` only when given (the
    core infers it), except that TGI compatibility reads `do_sample: false` as "not forced",
    as TGI does; `top_k: -1` (vLLM/LMI-Dist "disabled") and `top_p: 0` (the seed's TensorRT-LLM
    table: "0 when greedy") -> unset; n/best_of -> `sampling.n` =
    max of both (the gateway ranks the sequences); max_new_tokens defaults to 30 (on TGI's
    routes an absent one is left to the core's default, as TGI fills it from its own limits);
    min_length -> min_new_tokens; stop_sequences (and TGI's list-valued `stop`) -> stopping.stop;
    ignore_eos_token -> ignore_eos; truncate -> truncate_input_tokens; bad_sequences ->
    bad_words; return_full_text -> echo; logprobs/top_n_tokens -> top_logprobs;
    decoder_input_details -> prompt_logprobs 0, prompt_logprobs k -> k; TGI's grammar
    (`{"type": "json" | "regex", "value"}`) -> guided_decoding (gateways.common.guided). Logprobs
    are asked whenever token records show `log_prob` (streaming, details) or sequences are ranked.

    Args:
        inputs: the prompt text.
        p: the request's parameters.
        opts: from `render_options` (decides which logprobs are asked).
        request_id: the id for the core and its logs.
        model: the model named by `/predictions/{model}` (None: the served one).
        dynamic: the request is one input of a dynamic batch (stricter refusals).
        adapter: the LoRA adapter named by the body's `adapters` ("": the base model; TGI's
            `parameters.adapter_id` names one too).

    Raises:
        GatewayError: see `refuse_unsupported`; a `grammar` of another shape (INVALID_ARGUMENT).
    """
    refuse_unsupported(p, stream=opts.stream, dynamic=dynamic, tgi_router=opts.tgi_router)
    if p.adapter_id is not None and adapter and p.adapter_id != adapter:
        raise _refuse("adapter_id", f"adapter_id '{p.adapter_id}' contradicts adapters '{adapter}'; give one of them.")
    req = spb.GenerateRequest(request_id=request_id, text=inputs, adapter=adapter or p.adapter_id or "")
    if model:
        req.model = model
    FIELDS.apply(vars(p), req)
    s, st, o = req.sampling, req.stopping, req.output
    if opts.tgi_compat and p.do_sample is False:
        s.ClearField("do_sample")
    if (p.n is not None and p.n < 1) or (p.best_of is not None and p.best_of < 1):
        # Out of range: pass both as given so the core's check names the offending one.
        if p.n is not None:
            s.n = p.n
        if p.best_of is not None:
            s.best_of = p.best_of
    elif p.n is not None or p.best_of is not None:
        s.n = opts.num_sequences
    if p.max_new_tokens is None and not opts.tgi_router:
        st.max_new_tokens = DEFAULT_MAX_NEW_TOKENS
    st.stop.extend(stop_sequences(p))
    top = [v for v in (p.logprobs, p.top_n_tokens) if v is not None]
    o.logprobs = opts.stream or opts.details or opts.num_sequences > 1 or bool(top)
    if top:
        o.top_logprobs = _merge(top)
    prompt = [v for v in (0 if p.decoder_input_details else None, p.prompt_logprobs) if v is not None]
    if prompt:
        o.prompt_logprobs = _merge(prompt)
    if p.grammar is not None:
        req.guided_decoding.CopyFrom(tgi_grammar_guide(p.grammar, "parameters.grammar"))
    return req


def _merge(values: list[int]) -> int:
    """The largest of two counts that ask for the same output, or a negative one as given, so
    the core's range check still sees (and names) it."""
    return min(values) if min(values) < 0 else max(values)


def stop_sequences(p: GenerationParameters) -> list[str]:
    """stop_sequences (a list, or one string) followed by TGI's list-valued `stop`, without
    duplicates, in order."""
    given = p.stop_sequences
    seqs = [given] if isinstance(given, str) else list(given or [])
    if isinstance(p.stop, list):
        seqs += p.stop
    return list(dict.fromkeys(seqs))


def client_names(p: GenerationParameters) -> dict[str, str]:
    """The LMI field for each GenerateRequest path the core may name in an error, for the
    parameters the client set: "sampling.n" is "parameters.n" or "parameters.best_of",
    "output.top_logprobs" "parameters.logprobs" or "parameters.top_n_tokens", and so on."""
    return FIELDS.names([name for name, value in p if value is not None])


# ---------------------------------------------------------------------------------- tokens


def _logprob(tok: pb.Token | pb.TopLogprob) -> float | None:
    if isinstance(tok, pb.TopLogprob):
        return tok.logprob
    return tok.logprob if tok.HasField("logprob") else None


def token_record(tok: pb.Token, text: str, *, tgi_compat: bool) -> dict[str, Any]:
    """A generated token: LMI `{id, text, log_prob[, special_token: true]}` (seed "Token";
    DJL adds `special_token` only for special tokens) or TGI `{id, text, logprob, special}`."""
    return token_fields(tok.id, text, _logprob(tok), tok.special, tgi_compat=tgi_compat)


def token_fields(token_id: Any, text: str, logprob: Any, special: bool, *, tgi_compat: bool) -> dict[str, Any]:
    """`token_record` from its values (a Template renders it with stand-ins for them)."""
    if tgi_compat:
        return {"id": token_id, "text": text, "logprob": logprob, "special": special}
    rec: dict[str, Any] = {"id": token_id, "text": text, "log_prob": logprob}
    if special:
        rec["special_token"] = True
    return rec


def alternative_records(tok: pb.Token, *, tgi_compat: bool) -> list[dict[str, Any]]:
    """The alternatives of one position (`top_tokens`), most likely first."""
    if tgi_compat:
        return [{"id": a.id, "text": a.text, "logprob": a.logprob, "special": a.special} for a in tok.top_logprobs]
    return [{"id": a.id, "text": a.text, "log_prob": a.logprob} for a in tok.top_logprobs]


def prefill_records(tokens: Iterable[pb.Token], opts: RenderOptions) -> list[dict[str, Any]]:
    """Prompt tokens for `details.prefill` (TGI's InputToken: the first has no logprob, null);
    with prompt_logprobs > 0 each also carries its `top_tokens`."""
    key = "logprob" if opts.tgi_compat else "log_prob"
    out = []
    for tok in tokens:
        rec: dict[str, Any] = {"id": tok.id, "text": tok.text, key: _logprob(tok)}
        if opts.prefill_top:
            rec["top_tokens"] = alternative_records(tok, tgi_compat=opts.tgi_compat)
        out.append(rec)
    return out


def aligned(out: pb.SequenceOutput, carry: str = "") -> list[tuple[pb.Token, str]]:
    """The tokens of one message with their share of the text (module docstring): all of
    `carry + out.text` on the last token, "" on the others. Empty when the message has no
    tokens (the caller carries the text to the next token)."""
    if not out.tokens:
        return []
    last = len(out.tokens) - 1
    return [(tok, carry + out.text if i == last else "") for i, tok in enumerate(out.tokens)]


def _seed(msg: spb.GenerateResponse) -> int | None:
    """TGI reports the seed only when the request sampled."""
    if msg.HasField("seed") and msg.effective_sampling.do_sample:
        return msg.seed
    return None


# ---------------------------------------------------------------------------------- streaming


class StreamRenderer:
    """Turns the Generate messages of one streaming rolling-batch request into records.

    Each generated token becomes one `{"token": {...}}` record (plus `top_tokens` when asked);
    the record of the last token also carries `generated_text` and, when details are on,
    `details` without `tokens` (seed "Response Schema", streaming). The caller frames each
    record as a jsonlines line or an SSE event and writes a message's records at once.
    """

    def __init__(self, opts: RenderOptions):
        self.opts = opts
        self._parts: list[str] = []
        self._carry = ""
        self._generated = 0
        self._finish = "length"  # the word, once the sequence finished
        self._prompt_text = ""
        self._prefill: list[dict[str, Any]] = []

    def feed(self, msg: spb.GenerateResponse) -> list[dict[str, Any]]:
        """Records for one message (often none: lifecycle-only messages).

        Raises:
            GatewayError: the sequence was cancelled by the core or failed (FINISH_REASONS has
                no word for it).
        """
        opts = self.opts
        if msg.HasField("prompt_text"):
            self._prompt_text = msg.prompt_text
        if msg.prompt_tokens:
            self._prefill = prefill_records(msg.prompt_tokens, opts)
        records: list[dict[str, Any]] = []
        for out in msg.outputs:
            if out.index != 0:
                continue
            if out.finish_reason:
                self._finish = finish_word(out.finish_reason, FINISH_REASONS) or self._finish
            self._parts.append(out.text)
            tokens = out.tokens
            if not tokens:
                self._carry += out.text
                continue
            last = len(tokens) - 1
            for i, tok in enumerate(tokens):
                self._generated += 1
                text = self._carry + out.text if i == last else ""
                rec = self._record(token_record(tok, text, tgi_compat=opts.tgi_compat))
                if opts.top_tokens:
                    rec["top_tokens"] = alternative_records(tok, tgi_compat=opts.tgi_compat)
                records.append(rec)
            self._carry = ""
        if msg.HasField("usage"):
            if not records:
                # A sequence that ends without a token of its own (not produced by length, EOS or
                # stop endings) still needs a last record to carry generated_text and details.
                records.append(self._record(_terminal_token(self._carry, opts.tgi_compat)))
            last_record = records[-1]
            last_record["generated_text"] = self.generated_text
            if opts.details:
                last_record["details"] = self._details(msg)
        return records

    def _record(self, token: dict[str, Any]) -> dict[str, Any]:
        """The record of one token; on TGI's routes with `index` (the token's 1-based position)
        and null `generated_text` and `details`, which the last record fills."""
        if self.opts.tgi_router:
            return {"index": self._generated, "token": token, "generated_text": None, "details": None}
        return {"token": token}

    def step_text(self, text: str) -> str:
        """The text of the record of a plain decode step (core_call.Step: new `text` of
        sequence 0 with one ordinary token, whose id and logprob the record takes as they
        are), with the state update `feed` makes for the message it stands for. For a stream
        without top_tokens, whose records carry nothing else of a token."""
        self._parts.append(text)
        self._generated += 1
        if self._carry:
            text, self._carry = self._carry + text, ""
        return text

    @property
    def index(self) -> int:
        """The 1-based position of the last token rendered (TGI's stream `index`)."""
        return self._generated

    def plain_record(self, token_id: Any, text: Any, logprob: Any, index: Any = None) -> dict[str, Any]:
        """The record of a plain decode step (see `step_text`); `index` (the `index` property
        after `step_text`) is rendered on TGI's routes only."""
        token = token_fields(token_id, text, logprob, False, tgi_compat=self.opts.tgi_compat)
        if self.opts.tgi_router:
            return {"index": index, "token": token, "generated_text": None, "details": None}
        return {"token": token}

    @property
    def generated_text(self) -> str:
        """The text so far (with the prompt first under return_full_text)."""
        return (self._prompt_text if self.opts.full_text else "") + "".join(self._parts)

    def _details(self, msg: spb.GenerateResponse) -> dict[str, Any]:
        opts = self.opts
        if opts.tgi_router:
            # TGI's StreamDetails (router/src/lib.rs).
            return {
                "finish_reason": self._finish,
                "generated_tokens": self._generated,
                "seed": _seed(msg),
                "input_length": msg.usage.prompt_tokens,
            }
        details: dict[str, Any] = {
            "finish_reason": self._finish,
            "generated_tokens": self._generated,
            "inputs": opts.inputs,
        }
        if opts.tgi_compat:
            details["seed"] = _seed(msg)
        if opts.prefill:
            details["prefill"] = self._prefill
        return details


def _terminal_token(text: str, tgi_compat: bool) -> dict[str, Any]:
    if tgi_compat:
        return {"id": -1, "text": text, "logprob": None, "special": True}
    return {"id": -1, "text": text, "log_prob": None, "special_token": True}


# ---------------------------------------------------------------------------------- non-streaming


@dataclass(slots=True)
class SequenceResult:
    """Everything one sequence produced."""

    index: int
    text: str = ""
    tokens: list[tuple[pb.Token, str]] = field(default_factory=list)
    finish_reason: str = "length"
    cumulative_logprob: float | None = None


@dataclass(slots=True)
class Collected:
    """A whole Generate stream folded together (see `collect_messages`)."""

    sequences: dict[int, SequenceResult] = field(default_factory=dict)
    prompt_text: str = ""
    prompt_tokens: list[pb.Token] = field(default_factory=list)
    seed: int | None = None


def collect_messages(messages: Iterable[spb.GenerateResponse]) -> Collected:
    """Fold a complete Generate stream per sequence: text, tokens with their text share,
    finish reason, cumulative logprob; plus prompt text/tokens and the (TGI-reported) seed.

    Raises:
        GatewayError: a sequence was cancelled by the core or failed (FINISH_REASONS has no
            word for it).
    """
    c = Collected()
    carry: dict[int, str] = {}
    for msg in messages:
        if msg.HasField("prompt_text"):
            c.prompt_text = msg.prompt_text
        if msg.prompt_tokens:
            c.prompt_tokens = list(msg.prompt_tokens)
        for out in msg.outputs:
            word = finish_word(out.finish_reason, FINISH_REASONS)
            seq = c.sequences.setdefault(out.index, SequenceResult(out.index))
            seq.text += out.text
            pairs = aligned(out, carry.pop(out.index, ""))
            if pairs:
                seq.tokens += pairs
            elif out.text and seq.tokens:
                tok, text = seq.tokens[-1]
                seq.tokens[-1] = (tok, text + out.text)
            elif out.text:
                carry[out.index] = carry.get(out.index, "") + out.text
            if word is not None:
                seq.finish_reason = word
            if out.HasField("cumulative_logprob"):
                seq.cumulative_logprob = out.cumulative_logprob
        if msg.HasField("usage"):
            c.seed = _seed(msg)
    if 0 not in c.sequences:
        c.sequences[0] = SequenceResult(0)
    return c


def ranked(c: Collected) -> list[SequenceResult]:
    """Sequences by cumulative logprob, best first (ties: lower index first); the best is the
    answer and the rest are `best_of_sequences` (seed "BestOfSequence")."""
    return sorted(
        c.sequences.values(),
        key=lambda s: (-(s.cumulative_logprob if s.cumulative_logprob is not None else float("-inf")), s.index),
    )


def render_response(c: Collected, opts: RenderOptions) -> dict[str, Any] | list[dict[str, Any]]:
    """The non-streaming rolling-batch body: `{generated_text, details?}` (seed "Response
    Schema"), wrapped in a one-element array under TGI compatibility ("Response with TGI
    compatibility"); TGI's `GenerateResponse` on TGI's routes (no `details.inputs`, wrapped
    only with `array`)."""
    seqs = ranked(c) if opts.num_sequences > 1 else [c.sequences[0]]
    best = seqs[0]
    result: dict[str, Any] = {"generated_text": _full_text(c, best, opts)}
    if opts.details:
        details: dict[str, Any] = {"finish_reason": best.finish_reason, "generated_tokens": len(best.tokens)}
        if not opts.tgi_router:
            details["inputs"] = opts.inputs
        details.update(_sequence_details(c, best, opts))
        if opts.num_sequences > 1:
            details["best_of_sequences"] = [
                {
                    "generated_text": _full_text(c, s, opts),
                    "finish_reason": s.finish_reason,
                    "generated_tokens": len(s.tokens),
                    **_sequence_details(c, s, opts),
                }
                for s in seqs[1:]
            ]
        result["details"] = details
    return [result] if (opts.array if opts.tgi_router else opts.tgi_compat) else result


def _full_text(c: Collected, seq: SequenceResult, opts: RenderOptions) -> str:
    return (c.prompt_text if opts.full_text else "") + seq.text


def _sequence_details(c: Collected, seq: SequenceResult, opts: RenderOptions) -> dict[str, Any]:
    out: dict[str, Any] = {"tokens": [token_record(t, text, tgi_compat=opts.tgi_compat) for t, text in seq.tokens]}
    if opts.prefill or opts.tgi_compat:
        out["prefill"] = prefill_records(c.prompt_tokens, opts)
    if opts.tgi_compat:
        out["seed"] = c.seed
    if opts.top_tokens:
        out["top_tokens"] = [alternative_records(t, tgi_compat=opts.tgi_compat) for t, _ in seq.tokens]
    return out


# ---------------------------------------------------------------------------------- dynamic batch


def dynamic_delta(msg: spb.GenerateResponse) -> str:
    """The new text of one input's message in a dynamic-batch stream (the echoed prompt first
    under return_full_text).

    Raises:
        GatewayError: the sequence was cancelled by the core or failed (FINISH_REASONS has no
            word for it).
    """
    text = msg.prompt_text if msg.HasField("prompt_text") else ""
    for out in msg.outputs:
        finish_word(out.finish_reason, FINISH_REASONS)
        if out.index == 0:
            text += out.text
    return text


def dynamic_line(texts: list[str]) -> dict[str, Any]:
    """One dynamic-batch stream record: `{"outputs": [...]}`, one entry per input in input
    order ("" for inputs without news in this step)."""
    return {"outputs": texts}


def render_dynamic(results: list[Collected], *, full_text: bool) -> list[dict[str, str]]:
    """The non-streaming dynamic-batch body: `[{generated_text}, ...]` in input order."""
    return [{"generated_text": (c.prompt_text if full_text else "") + c.sequences[0].text} for c in results]


# ---------------------------------------------------------------------------------- TGI's /info


def tgi_info(info: spb.GetModelInfoResponse, version: str) -> dict[str, Any]:
    """TGI's `GET /info` object (text-generation-inference router/src/lib.rs `Info`, 3.x) from
    the core's GetModelInfo: model_id is the served name; max_total_tokens the context length,
    max_input_tokens one less (a prompt leaves room for one generated token); max_best_of the
    largest `n`; max_stop_sequences the core's `--max-stop-sequences`. What the core does not
    report is null: model_sha, the concurrency limits (the core's batch and queue sizes), the
    validation workers and client batch size (TGI router settings with no counterpart here);
    router and version name this gateway, docker_label and sha are null."""
    return {
        "model_id": info.model_name,
        "model_sha": None,
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": None,
        "max_best_of": info.max_n,
        "max_stop_sequences": info.max_stop_sequences,
        "max_input_tokens": max(info.max_context_length - 1, 0),
        "max_total_tokens": info.max_context_length,
        "validation_workers": None,
        "max_client_batch_size": None,
        "router": "trellis-gateway-lmi",
        "version": version,
        "sha": None,
        "docker_label": None,
    }


def tgi_tokens(text: str, resp: spb.TokenizeResponse, truncate: int | None = None) -> list[dict[str, Any]]:
    """TGI's `POST /tokenize` answer: one `{id, text, start, stop}` per token (router/src/lib.rs
    `SimpleToken`; server.rs `encoding_to_tokens`): `start`/`stop` are UTF-8 byte offsets into
    `text` and `text` is those bytes (invalid UTF-8 replaced); a special token the tokenizer
    added has an empty span. Without spans (the core's tokenizer has no offsets) every token has
    text "" and span 0..0, as TGI answers then. `truncate` keeps the last tokens, as TGI's
    validation truncates the prompt from the left."""
    data = text.encode("utf-8", "surrogatepass")
    ids = list(resp.token_ids)
    spans = [(s.start, s.stop) for s in resp.spans] if len(resp.spans) == len(ids) else [(0, 0)] * len(ids)
    tokens = [
        {"id": token_id, "text": data[start:stop].decode("utf-8", "replace"), "start": start, "stop": stop}
        for token_id, (start, stop) in zip(ids, spans, strict=True)
    ]
    if truncate:
        tokens = tokens[-truncate:]
    return tokens
