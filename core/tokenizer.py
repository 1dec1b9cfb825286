"""The served model's tokenizer, wrapped for the request pipeline.

Wraps a transformers tokenizer (any backend) and adds what serving needs on top: chat
rendering with the model's own template, per-token text and raw bytes (cached), special-token
detection, the model's EOS set, and decoding with `spaces_between_special_tokens`.

Special tokens in a client's text. Tokenizers turn the text of a special token (`<|end|>`,
`<|system|>`, EOS) into that token wherever it appears, so a user who writes it in a message
or a prompt can end a turn and forge another role's. vLLM and TGI tokenize a rendered chat
that way (vLLM's fix, PR #31735, closed unmerged; transformers issue #29279 is open). With
`split_special=True`, `encode` tokenizes such text as ordinary text (transformers'
`split_special_tokens`, the Rust tokenizer's `encode_special_tokens`), and `render_chat`
keeps the template's own markers special while every special-token text that came from the
client (message contents, names, tool calls and tool definitions) is tokenized as ordinary
text: before rendering, each such occurrence is replaced by a sentinel that no client can
guess (a random nonce per render, in private-use characters); the rendered text is tokenized
piece by piece between the sentinels, each sentinel as its original text in split mode, and the
rendered text handed back has the original text again.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import secrets
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from core.errors import InvalidArgument
from core.types import DEFAULT_TEMPLATE, ChatMessage, ChatTemplateOptions, Tool

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted (ByteLevel pre-tokenizer alphabet -> byte)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class Tokenizer:
    """Serving-side tokenizer.

    Attributes:
        byte_exact: decoding is exactly "concatenate the tokens' bytes, then UTF-8 with
            replacement": the Rust tokenizer's only decoder is ByteLevel (GPT-2 style byte-level
            BPE; tokenizers' ByteLevel decoder maps each token back to its bytes and decodes the
            whole with `String::from_utf8_lossy`) and no clean-up pass runs after it. Streaming
            then needs no decode call per token (core.detokenize.ByteDetokenizer).

    Args:
        hf_tokenizer: a loaded transformers tokenizer.
        eos_token_ids: the model's EOS ids (generation config and tokenizer together).
    """

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, eos_token_ids: Iterable[int | None]):
        self.hf = hf_tokenizer
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids if i is not None)
        self.special_ids = frozenset(int(i) for i in hf_tokenizer.all_special_ids)
        added = getattr(hf_tokenizer, "added_tokens_decoder", {}) or {}
        self.special_ids |= {int(i) for i, t in added.items() if getattr(t, "special", False)}
        self.vocab_size = len(hf_tokenizer)
        self.pad_token_id = hf_tokenizer.pad_token_id
        self._byte_level = _is_byte_level(hf_tokenizer)
        # The Rust tokenizer decodes exactly like transformers' decode when no clean-up pass runs
        # after it, at a fraction of the cost; decoding runs twice per streamed token.
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        self._rust = (
            backend if backend is not None and not getattr(hf_tokenizer, "clean_up_tokenization_spaces", True) else None
        )
        # transformers' fast tokenizers encode one text by setting the Rust tokenizer to no
        # truncation, no padding and their split_special_tokens, then calling its encode_batch
        # (TokenizersBackend._encode_plus, transformers 5.23): with the Rust tokenizer in that
        # state already, calling its encode directly gives the same ids for half the time.
        # Classes that change that path encode through transformers.
        self._rust_encoder = backend if backend is not None and _plain_fast_encode(hf_tokenizer) else None
        # The same Rust tokenizer with special-token text split as ordinary text (encode with
        # split_special): a copy, since the flag is the tokenizer's state and encode runs on two
        # threads (core.pipeline's tokenizer thread and the event loop).
        self._rust_splitter = None
        if self._rust_encoder is not None:
            from tokenizers import Tokenizer as RustTokenizer

            self._rust_splitter = RustTokenizer.from_str(self._rust_encoder.to_str())
            self._rust_splitter.encode_special_tokens = True
        # One id gives one token string (transformers types convert_ids_to_tokens for lists too).
        pieces = (cast("str | None", hf_tokenizer.convert_ids_to_tokens(i)) for i in self.special_ids)
        texts = sorted({t for t in pieces if t}, key=len)
        #: Matches the text of any special token (longest first).
        self._special_text = re.compile("|".join(re.escape(t) for t in reversed(texts))) if texts else None
        self._bytes_cache: dict[int, bytes] = {}
        self._text_cache: dict[int, str] = {}
        self.byte_exact = self._rust is not None and _decoder_kinds(hf_tokenizer) == ["ByteLevel"]

    @classmethod
    def load(cls, path: str | Path, extra_eos: Iterable[int] = ()) -> Tokenizer:
        """Load the tokenizer in `path`; EOS ids come from the tokenizer, `generation_config.json`
        and `config.json` there, plus `extra_eos`."""
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(path))
        eos: set[int] = set(extra_eos)
        if hf.eos_token_id is not None:
            eos.add(hf.eos_token_id)
        for name in ("generation_config.json", "config.json"):
            f = Path(path) / name
            if f.is_file():
                value = json.loads(f.read_text()).get("eos_token_id")
                eos.update(value if isinstance(value, list) else [value] if value is not None else [])
        return cls(hf, eos)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of input one token can stand for: the length of the longest
        vocabulary entry (byte-level vocabularies spell each byte as one character, SentencePiece
        a space as one "▁"), at least 1. Bounds a prompt's length by its token count
        (core.validation.prompt_chars_bound)."""
        return max((len(piece) for piece in self.hf.get_vocab()), default=1) or 1

    @property
    def has_chat_template(self) -> bool:
        """Whether the model ships a chat template."""
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True, *, split_special: bool = False) -> list[int]:
        """Token ids of `text`; special tokens (such as BOS) are added unless told otherwise.
        `split_special`: the text of a special token in `text` is tokenized as ordinary text
        (see the module docstring), not as that token."""
        backend = self._rust_encoder
        if (
            backend is not None
            and backend.truncation is None
            and backend.padding is None
            and backend.encode_special_tokens == self.hf.split_special_tokens
        ):
            if split_special and self._rust_splitter is not None:
                backend = self._rust_splitter
            return cast("list[int]", backend.encode(text, add_special_tokens=add_special_tokens).ids)
        if split_special:
            return list(self.hf(text, add_special_tokens=add_special_tokens, split_special_tokens=True)["input_ids"])
        return list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    def spans(self, text: str, ids: Sequence[int], *, split_special: bool = False) -> list[tuple[int, int]]:
        """Where each token of `ids` (what `encode(text, split_special=split_special)` gave)
        came from in `text`, as UTF-8 byte offsets (start, stop), a special token the tokenizer
        added having an empty span; [] when the tokenizer has no offset mapping (a slow
        tokenizer) or maps a different number of tokens."""
        if not getattr(self.hf, "is_fast", False):
            return []
        offsets = self.hf(text, return_offsets_mapping=True, split_special_tokens=split_special)["offset_mapping"]
        if len(offsets) != len(ids):
            return []
        # Character offsets (the Python bindings') -> byte offsets (TGI's, the Rust crate's).
        byte_at = [0]
        for ch in text:
            byte_at.append(byte_at[-1] + len(ch.encode("utf-8", "surrogatepass")))
        return [(byte_at[start], byte_at[stop]) for start, stop in offsets]

    def render_chat(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[Tool] = (),
        template: ChatTemplateOptions = DEFAULT_TEMPLATE,
        *,
        split_special: bool = False,
    ) -> tuple[str, list[int]]:
        """Render a chat with the model's template and (unless `template` says otherwise) a
        generation prompt.

        Messages are passed in the shape Hugging Face chat templates take (transformers' chat
        templating docs, "Tool use"): `{"role", "content"[, "name"][, "tool_calls"][,
        "tool_call_id"]}`, where each tool call is `{"id", "type": "function", "function":
        {"name", "arguments"}}` with the arguments as a JSON object (the templates apply
        `tojson` to them; text that is not a JSON object is passed as it is, as vLLM does). A
        message without content parts has content "". `tools` go to the template as OpenAI's
        function tools; templates that do not use them ignore them. `template` sets
        add_generation_prompt and continue_final_message (transformers' apply_chat_template
        arguments) and extra template variables (a JSON object's text, checked by
        core.validation).

        Returns the rendered text and its token ids (the template supplies any special
        tokens, so none are added). `split_special`: special-token text in the client's strings
        is tokenized as ordinary text, the template's own markers stay special (see the module
        docstring).

        Raises:
            InvalidArgument: the model has no chat template, or the template rejects the
                conversation (e.g. roles out of order).
        """
        if not self.has_chat_template:
            raise InvalidArgument(
                "This model has no chat template, so chat messages cannot be used; send a text prompt instead.",
                field="messages",
            )
        masker = _Masker(self._special_text) if split_special and self._special_text is not None else None
        mask = masker.mask if masker is not None else _unchanged
        # Messages and tools are JSON-like dicts, wider than transformers' annotations say.
        convo: Any = [_template_message(m, mask) for m in messages]
        template_tools: Any = [_template_tool(t, mask) for t in tools] or None
        extra: dict[str, Any] = json.loads(template.kwargs) if template.kwargs else {}
        extra = {k: mask(v) if isinstance(v, str) else v for k, v in extra.items()}
        try:
            text = cast(
                str,
                self.hf.apply_chat_template(
                    convo,
                    tools=template_tools,
                    tokenize=False,
                    add_generation_prompt=template.add_generation_prompt,
                    continue_final_message=template.continue_final_message,
                    **extra,
                ),
            )
        except Exception as e:  # jinja raises TemplateError (or anything raise_exception() throws)
            raise InvalidArgument(f"The model's chat template rejected the messages: {e}", field="messages") from e
        if masker is None or not masker.originals:
            return text, self.encode(text, add_special_tokens=False)
        return self._encode_masked(text, masker)

    def _encode_masked(self, text: str, masker: _Masker) -> tuple[str, list[int]]:
        """The rendered text with the client's special-token text back in place, and its ids:
        the template's text with its markers special, the client's special-token text as
        ordinary text."""
        ids: list[int] = []
        parts: list[str] = []
        at = 0
        for m in masker.sentinels().finditer(text):
            if m.start() > at:
                parts.append(text[at : m.start()])
                ids += self.encode(parts[-1], add_special_tokens=False)
            original = masker.originals[int(m.group(1))]
            parts.append(original)
            ids += self.encode(original, add_special_tokens=False, split_special=True)
            at = m.end()
        if at < len(text):
            parts.append(text[at:])
            ids += self.encode(parts[-1], add_special_tokens=False)
        return "".join(parts), ids

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> str:
        """Text of `ids`. When special tokens are kept and `spaces_between_special_tokens` is
        true, two adjacent special tokens are separated by a space."""
        if skip_special_tokens or not spaces_between_special_tokens or len(ids) < 2:
            if self._rust is not None:
                return cast(str, self._rust.decode(list(ids), skip_special_tokens=skip_special_tokens))
            return self._decode(ids, skip_special_tokens)
        cuts = [i for i in range(1, len(ids)) if ids[i - 1] in self.special_ids and ids[i] in self.special_ids]
        if not cuts:
            return self._decode(ids, False)
        bounds = [0, *cuts, len(ids)]
        return " ".join(self._decode(ids[a:b], False) for a, b in itertools.pairwise(bounds))

    def _decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        # One sequence of ids decodes to one string (transformers types decode for batches too).
        return cast(str, self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is a special token (EOS, BOS, chat markers, ...)."""
        return token_id in self.special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (a UTF-8 fragment for byte tokens)."""
        b = self._bytes_cache.get(token_id)
        if b is None:
            b = self._compute_bytes(token_id)
            self._bytes_cache[token_id] = b
        return b

    def token_text(self, token_id: int) -> str:
        """A token's text on its own; a partial UTF-8 sequence shows as U+FFFD."""
        t = self._text_cache.get(token_id)
        if t is None:
            t = self.token_bytes(token_id).decode("utf-8", errors="replace")
            self._text_cache[token_id] = t
        return t

    def _compute_bytes(self, token_id: int) -> bytes:
        # One id gives one token string, or None for an id the vocabulary does not have.
        piece = cast("str | None", self.hf.convert_ids_to_tokens(token_id))
        if piece is None:
            return b""
        if token_id in self.special_ids:
            return piece.encode("utf-8")
        if self._byte_level:
            table = _byte_level_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        m = _HEX_BYTE.match(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        if "▁" in piece:  # SentencePiece marks a leading space with U+2581
            return piece.replace("▁", " ").encode("utf-8")
        return self._decode([token_id], False).encode("utf-8")


def _plain_fast_encode(hf_tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether `hf_tokenizer` encodes text with transformers' own fast-tokenizer path
    (TokenizersBackend._encode_plus under PreTrainedTokenizerBase.__call__), unchanged."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return False
    cls = type(hf_tokenizer)
    return (
        isinstance(hf_tokenizer, TokenizersBackend)
        and cls._encode_plus is TokenizersBackend._encode_plus
        and cls.__call__ is PreTrainedTokenizerBase.__call__
        and not hasattr(hf_tokenizer, "_switch_to_input_mode")
    )


class _Masker:
    """Replaces special-token text in a client's strings by sentinels for one render (see the
    module docstring): `\\ue000<nonce>:<n>\\ue001`, n indexing `originals`."""

    def __init__(self, special_text: re.Pattern[str]):
        self._special_text = special_text
        self._nonce = secrets.token_hex(8)
        self._format = "\ue000" + self._nonce + ":{}\ue001"
        self.originals: list[str] = []

    def sentinels(self) -> re.Pattern[str]:
        """The pattern of this render's sentinels, group 1 the index into `originals`.

        Compiled only for a render that masked something: a pattern made for every render
        would cost a regex compile per chat request and push other patterns out of `re`'s
        cache.
        """
        return re.compile("\ue000" + self._nonce + ":([0-9]+)\ue001")

    def mask(self, text: str) -> str:
        """`text` with each special-token text replaced by a sentinel."""
        return self._special_text.sub(self._replace, text)

    def _replace(self, m: re.Match[str]) -> str:
        self.originals.append(m.group(0))
        return self._format.format(len(self.originals) - 1)


def _unchanged(text: str) -> str:
    return text


def _template_message(m: ChatMessage, mask: Callable[[str], str] = _unchanged) -> dict[str, object]:
    entry: dict[str, object] = {"role": m.role, "content": mask("\n".join(p.text or "" for p in m.content))}
    if m.name is not None:
        entry["name"] = mask(m.name)
    if m.tool_calls:
        entry["tool_calls"] = [
            {
                "id": mask(c.id),
                "type": "function",
                "function": {"name": mask(c.name), "arguments": _json_object(mask(c.arguments))},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        entry["tool_call_id"] = mask(m.tool_call_id)
    return entry


def _template_tool(t: Tool, mask: Callable[[str], str] = _unchanged) -> dict[str, object]:
    params = _json_object(mask(t.parameters)) if t.parameters else {"type": "object", "properties": {}}
    function: dict[str, object] = {"name": mask(t.name), "parameters": params}
    if t.description:
        function["description"] = mask(t.description)
    return {"type": "function", "function": function}


def _json_object(text: str) -> object:
    """`text` parsed when it is a JSON object, else `text` itself."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _decoder_kinds(hf_tokenizer: PreTrainedTokenizerBase) -> list[str | None]:
    """The types of the Rust tokenizer's decoder and of the decoders it chains ([] without one)."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        return []
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except Exception:
        return []
    if not decoder:
        return []
    return [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", []) or []]


def _is_byte_level(hf_tokenizer: PreTrainedTokenizerBase) -> bool:
    return "ByteLevel" in _decoder_kinds(hf_tokenizer)
