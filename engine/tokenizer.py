"""Tokenizers (byte-level, fixed alphabet, Hugging Face ``tokenizer.json``) and streaming detokenization."""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ASCII = [chr(i) for i in range(128)]  # the text of each ASCII byte, built once
PLAIN_BYTES: list[str | None] = [*ASCII, *[None] * 128]  # a byte token's plain text: ASCII bytes only
MISSING = object()


class Tokenizer:
    """Minimal tokenizer interface the engine and server rely on."""

    eos_token_id: int | None = None
    extra_eos_token_ids: tuple[int, ...] = ()  # more ids that end generation as EOS does (a config's list)
    bos_token_id: int | None = None
    chat_template: str | None = None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation unless ``ignore_eos``: ``eos_token_id`` and ``extra_eos_token_ids``."""
        first = () if self.eos_token_id is None else (self.eos_token_id,)
        return frozenset((*first, *self.extra_eos_token_ids))

    @property
    def vocab_size(self) -> int:
        """The size of the id range, ``0 .. vocab_size - 1`` (a model's vocabulary may be padded beyond it)."""
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_plain(self, text: str) -> list[int]:
        """The text's ids without a BOS token the tokenizer adds on its own (``add_special_tokens: false``)."""
        return self.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def has_token(self, token_id: int) -> bool:
        """Whether ``token_id`` is one of the tokenizer's (a model's embedding may be larger)."""
        return 0 <= token_id < self.vocab_size

    def first_undecodable(self, ids: Sequence[int]) -> int | None:
        """The first id that is not one of this tokenizer's tokens (text or special), or ``None``; ids are
        ``0 .. vocab_size - 1`` unless a tokenizer says otherwise. A model's vocabulary may be padded beyond
        its tokenizer's: such ids decode to nothing and are no valid input."""
        size = self.vocab_size
        return next((t for t in ids if not 0 <= t < size), None)

    def char_offsets(self, text: str, ids: Sequence[int]) -> list[int] | None:
        """Where each of ``ids`` (the tokens of ``text``) starts in ``text``, for tokenizers that align tokens with
        the text they came from; ``None`` here: the tokens' own bytes place them."""
        return None

    def special_text(self, token_id: int) -> str | None:
        """A special token's own text (``<|im_end|>``), which decoding leaves out; ``None`` for other tokens."""
        return None

    def decode_with_specials(self, ids: Sequence[int]) -> str:
        """:meth:`decode` with special tokens' own text kept, as ``/detokenize`` and an echoed token-id prompt give
        it (vLLM's, ``transformers``' default)."""
        return self.decode(ids)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (empty for special tokens and ids past the tokenizer's); this
        default encodes its decoded text, right for tokenizers whose tokens are whole strings."""
        return self.decode([token_id]).encode()

    def stream_decoder(self, context: Sequence[int] = (), skip_special_tokens: bool = True) -> StreamDecoder:
        """A decoder for one generated sequence whose tokens follow ``context`` (the prompt), leaving special
        tokens' text out unless ``skip_special_tokens`` is false. This default decodes each token alone, right for
        tokenizers whose tokens are whole strings and have no special text; tokenizers whose tokens merge or
        split characters override it."""
        return StreamDecoder(self)

    def plain_texts(self, token_ids: list[int]) -> list[str | None] | None:
        """Each token's plain text, ``None`` where it has none: what a stream decoder that :attr:`takes_plain
        <StreamDecoder.takes_plain>` gives for it, whatever the tokens before it were, so that a whole batch of
        streams' texts come from one look-up each, not one push each. ``None`` from tokenizers whose decoders are
        always pushed (this default)."""
        return None


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes 0..255 plus special tokens from 256 on (``<|endoftext|>`` = 256 is EOS)."""

    SPECIALS = ("<|endoftext|>",)

    def __init__(self) -> None:
        self.eos_token_id = 256

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.SPECIALS)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # Special and out-of-vocabulary ids carry no text.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if 0 <= token_id < 256 else b""

    def stream_decoder(self, context: Sequence[int] = (), skip_special_tokens: bool = True) -> StreamDecoder:
        return Utf8StreamDecoder(self)

    def plain_texts(self, token_ids: list[int]) -> list[str | None]:
        """ASCII bytes are their characters (after whole characters); other ids have no plain text."""
        try:
            return list(map(PLAIN_BYTES.__getitem__, token_ids))
        except IndexError:  # ids beyond the bytes (specials, a padded vocabulary)
            return [PLAIN_BYTES[t] if 0 <= t < 256 else None for t in token_ids]


class TokenIdTokenizer(Tokenizer):
    """For models shipped without a tokenizer: the text of a token is its id in decimal after a space, so
    ``"12 7 345"`` encodes to ``[12, 7, 345]`` and generated ids come back as ``" 51 9"``. No EOS."""

    def __init__(self, vocab_size: int) -> None:
        self._vocab_size = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        words = text.split()
        if not all(w.isascii() and w.isdecimal() for w in words):  # "²" and "١٢" are digits to str.isdigit
            raise ValueError("this model has no tokenizer: send token ids (a list of ints, or decimal ids separated "
                             "by spaces)")
        return [int(w) for w in words]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(f" {i}" for i in ids if 0 <= i < self._vocab_size)


class CharTokenizer(Tokenizer):
    """A fixed alphabet: token ``i`` is ``alphabet[i]`` (used by compiled LSRL models)."""

    def __init__(self, alphabet: Sequence[str], eos_token_id: int | None = None) -> None:
        self.alphabet = list(alphabet)
        self._index = {ch: i for i, ch in enumerate(self.alphabet)}
        self._lengths = sorted({len(sym) for sym in self._index if sym}, reverse=True)  # longest match first
        self.eos_token_id = eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> list[int]:
        """The longest symbol at each place, in one dictionary look-up per symbol length (trying every symbol
        at every character took 13 s for a 1 MB prompt, on the server's event loop)."""
        ids = []
        i = 0
        index = self._index
        while i < len(text):
            for length in self._lengths:
                token = index.get(text[i : i + length])
                if token is not None:
                    ids.append(token)
                    i += length
                    break
            else:
                shown = "".join(self.alphabet)
                shown = shown if len(shown) <= 80 else shown[:80] + "..."
                raise ValueError(f"no symbol of this model's alphabet starts at {text[i : i + 12]!r} (character "
                                 f"{i}); its {len(self.alphabet)} symbols: {shown!r}")  # fmt: skip
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.alphabet[i] for i in ids if 0 <= i < len(self.alphabet))


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer loaded from ``tokenizer.json``."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(path)
        self._tok = _Tokenizer.from_file(str(path))
        config_path = path.with_name("tokenizer_config.json")
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.chat_template = _default_chat_template(config.get("chat_template"))
        self.eos_token_id = self._special_id(config.get("eos_token"))
        self.bos_token_id = self._special_id(config.get("bos_token"))
        if "add_bos_token" in config:
            self.prefix_ids = [self.bos_token_id] if config["add_bos_token"] and self.bos_token_id is not None else []
        else:
            self.prefix_ids = self._post_processor_prefix()
        decoder = json.loads(self._tok.to_str()).get("decoder")
        self._decoders = _decoder_types(decoder)
        self._special_ids = {i for i, token in self._tok.get_added_tokens_decoder().items() if token.special}
        self._anchor = self.encode_plain("a") if _appends_token_by_token(decoder) else []
        self._anchor_text = self._tok.decode(self._anchor)
        self._plain_texts: dict[int, str | None] = {}

    def _special_id(self, token: str | dict | None) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        return self._tok.token_to_id(token) if token else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def _post_processor_prefix(self) -> list[int]:
        """The special tokens ``tokenizer.json``'s post-processor puts before a text (Llama 3's
        ``<|begin_of_text|>``), which ``transformers``' ``tokenizer(text)`` adds; any it puts after one (an EOS)
        would end a prompt that is to be continued, and are left out."""
        for text in ("a", "0", " "):
            plain = self._tok.encode(text, add_special_tokens=False).ids
            full = self._tok.encode(text, add_special_tokens=True).ids
            starts = [i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain]
            if plain and starts:
                return full[: starts[0]]
        return []

    def encode(self, text: str) -> list[int]:
        """The text's ids after the tokens the tokenizer puts before every text (BOS where
        ``tokenizer_config.json``'s ``add_bos_token`` asks for it, else what ``tokenizer.json``'s post-processor
        adds before a text), unless the text begins with their own text already, as a chat template's
        ``{{ bos_token }}`` writes it."""
        ids = self.encode_plain(text)
        prefix = self.prefix_ids
        if prefix and ids[: len(prefix)] != prefix:
            ids = [*prefix, *ids]
        return ids

    def encode_plain(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def special_text(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id) if token_id in self._special_ids else None

    def decode_with_specials(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def char_offsets(self, text: str, ids: Sequence[int]) -> list[int] | None:
        """Where each of ``ids`` starts in ``text``, from the tokenizer's alignment of ``text`` (a Metaspace
        ``▁`` added before the first word counts no character, a special token typed in the text counts its own);
        tokens before the text's own (BOS) start at 0. ``None`` when ``ids`` does not end with the text's tokens."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        head = len(ids) - len(encoding.ids)
        if head < 0 or list(ids[head:]) != encoding.ids:
            return None
        return [0] * head + [start for start, _ in encoding.offsets]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes the token stands for, also where it holds part of a character (whose text alone is U+FFFD):
        a byte-level BPE token's characters mapped back to bytes (GPT-2's table), a byte-fallback ``<0xNN>``
        token's byte, a Metaspace token with ``▁`` as a space; empty for special tokens."""
        token = self._tok.id_to_token(token_id) if self.has_token(token_id) else None
        if token is None or token_id in self._special_ids:
            return b""
        if "ByteLevel" in self._decoders and all(c in BYTE_LEVEL_BYTES for c in token):
            return bytes(BYTE_LEVEL_BYTES[c] for c in token)
        if "ByteFallback" in self._decoders and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
            return bytes([int(token[3:5], 16)])
        if "Metaspace" in self._decoders or "▁" in self._decoders:
            return token.replace("▁", " ").encode()
        return self.decode([token_id]).encode()

    def plain_text(self, token_id: int) -> str | None:
        """The text ``token_id`` adds to any text that ends with a whole character and does not start the decode,
        where the tokenizer's decoder appends each token's text to the text before it (byte-level BPE, Metaspace,
        byte fallback) and that text is whole characters: what a stream decoder gives for it without decoding.
        ``None`` for other tokens (part of a character, special or empty) and other decoders. Computed once per
        token, as the decode of an anchor token and it past the anchor's own decode."""
        text = self._plain_texts.get(token_id, MISSING)
        if text is MISSING:
            text = None
            if self._anchor_text and token_id not in self._special_ids and self.has_token(token_id):
                full = self._tok.decode([*self._anchor, token_id], skip_special_tokens=False)
                added = full[len(self._anchor_text) :]
                if full.startswith(self._anchor_text) and added and "\ufffd" not in added:
                    text = added
            self._plain_texts[token_id] = text
        return text

    def plain_texts(self, token_ids: list[int]) -> list[str | None] | None:
        """:meth:`plain_text` of each token, from its cache in one pass; ``None`` where the decoder does not append
        token by token."""
        if not self._anchor_text:
            return None
        texts = list(map(self._plain_texts.get, token_ids))
        if None in texts:  # not cached yet, or no plain text
            for index, text in enumerate(texts):
                if text is None:
                    texts[index] = self.plain_text(token_ids[index])
        return texts

    def to_json(self) -> str:
        """The tokenizer serialised as ``tokenizer.json``."""
        return self._tok.to_str()

    def stream_decoder(self, context: Sequence[int] = (), skip_special_tokens: bool = True) -> StreamDecoder:
        return HFStreamDecoder(self, context, skip_special_tokens)

    def has_token(self, token_id: int) -> bool:
        """Whether ``token_id`` is one of the tokenizer's (a model's embedding may be larger)."""
        return 0 <= token_id < 2**32 and self._tok.id_to_token(token_id) is not None

    def first_undecodable(self, ids: Sequence[int]) -> int | None:
        """The first id with no token (a ``tokenizer.json`` may leave gaps between its ids), or ``None``."""
        return next((t for t in dict.fromkeys(ids) if not self.has_token(t)), None)


def _default_chat_template(value: object) -> str | None:
    """``tokenizer_config.json``'s ``chat_template``: a template, or a list of named ones (``{"name",
    "template"}``) of which ``transformers`` renders ``default`` unless told otherwise."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character standing for each byte (printable Latin-1 bytes for
    themselves, the others shifted past 255), inverted."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    shifted = [b for b in range(256) if b not in kept]
    table = {chr(b): b for b in kept}
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


BYTE_LEVEL_BYTES = _byte_level_table()


# Decoders that turn each token into its own text (or bytes) and join them: a token adds the same text after any
# text that ends with a whole character, except as the decode's first token (Metaspace drops its space there, a
# Strip after Fuse the whole text's). Replace qualifies with a one-character string pattern (Llama's "▁" -> " "),
# which cannot match across tokens; Strip when it strips nothing from the end.
APPENDING_DECODERS = {"ByteLevel", "Metaspace", "ByteFallback", "Fuse", "Replace", "Strip", "Sequence"}


def _appends_token_by_token(decoder: dict | None) -> bool:
    """Whether a ``tokenizer.json`` decoder appends each token's text to the text before it (see
    :data:`APPENDING_DECODERS`): a stream decoder then gives a token's :meth:`HFTokenizer.plain_text` as is."""
    if not isinstance(decoder, dict) or decoder.get("type") not in APPENDING_DECODERS:
        return False
    if decoder["type"] == "Replace":
        pattern = decoder.get("pattern")
        if not (isinstance(pattern, dict) and isinstance(pattern.get("String"), str) and len(pattern["String"]) == 1):
            return False
    if decoder["type"] == "Strip" and decoder.get("stop", 0) != 0:
        return False
    return all(_appends_token_by_token(inner) for inner in decoder.get("decoders") or [])


def _decoder_types(decoder: dict | None) -> set[str]:
    """The types of a ``tokenizer.json`` decoder and of those in its sequence, plus ``"▁"`` where one replaces
    that character (Llama's Metaspace written as a Replace)."""
    if not isinstance(decoder, dict):
        return set()
    found = {str(decoder.get("type"))}
    pattern = decoder.get("pattern")
    if decoder.get("type") == "Replace" and isinstance(pattern, dict) and pattern.get("String") == "▁":
        found.add("▁")
    for inner in decoder.get("decoders") or []:
        found |= _decoder_types(inner)
    return found


class StreamDecoder:
    """Text of a token stream, one token at a time, for tokenizers whose tokens are whole strings (alphabets,
    token ids): each token's text is its own decode."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        return self.tokenizer.decode([token_id])

    def push_many(self, token_ids: list[int]) -> str:
        """Add tokens in order; the text :meth:`push` would have returned for each, joined."""
        return "".join(map(self.push, token_ids))

    def flush(self) -> str:
        """Whatever is still held, at the end of a sequence."""
        return ""

    @property
    def takes_plain(self) -> bool:
        """Whether :meth:`push` would give the next token's plain text (``Tokenizer.plain_texts``), where it has
        one: a caller may then take that text instead of pushing, and the decoder needs no word of it. A plain text
        is what the token adds after any text that ends with a whole character, so the decoder gives the tokens
        pushed after it the same texts whether it saw it or not (it decodes them after the text it holds, which ends
        with a whole character too)."""
        return False


class Utf8StreamDecoder(StreamDecoder):
    """Byte tokens through Python's incremental UTF-8 decoder: a character split across tokens comes out whole,
    an invalid byte at once as U+FFFD; ids beyond the bytes carry no text."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if 0 <= token_id < 128 and not self._utf8.buffer:  # ASCII outside a character: the codec's Python skipped
            return ASCII[token_id]
        return self._utf8.decode(bytes([token_id])) if 0 <= token_id < 256 else ""

    def push_many(self, token_ids: list[int]) -> str:
        try:  # the codec's incremental output does not depend on how the bytes are split
            data = bytes(token_ids)
        except ValueError:  # ids beyond the bytes carry no text
            data = bytes(t for t in token_ids if 0 <= t < 256)
        return self._utf8.decode(data)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)

    @property
    def takes_plain(self) -> bool:
        return not self._utf8.buffer  # outside a character (pushing ASCII bytes then changes nothing)


class HFStreamDecoder(StreamDecoder):
    """``tokenizers``' ``DecodeStream``: it holds tokens while their text ends inside a character and decodes
    with the preceding tokens as context (merged leading spaces, byte fallback). It has no end-of-stream call,
    so :meth:`flush` decodes what it still holds, after the tokens of the last delta as context.

    The stream starts after the last :data:`CONTEXT_TOKENS` tokens of ``context`` (the prompt; from a character's
    start, to the end of its last whole character), as vLLM's detokenizer starts after the prompt: alone, a first
    token ``▁word`` of a Metaspace (sentencepiece) tokenizer lost its space, which ``decode(prompt + output)``
    keeps."""

    CONTEXT_TOKENS = 4

    def __init__(self, tokenizer: HFTokenizer, context: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        super().__init__(tokenizer)
        self._tok = tokenizer._tok
        self._skip = skip_special_tokens
        self._stream = self._new_stream()
        tail = [t for t in context[len(context) - self.CONTEXT_TOKENS :] if tokenizer.has_token(t)]
        while tail and self._decode(tail).startswith("\ufffd"):
            tail = tail[1:]  # the window starts inside a character: from its next token
        while tail and self._decode(tail).endswith("\ufffd"):
            tail = tail[:-1]  # the prompt ends inside a character: its bytes are the prompt's, not the output's
        self._context = tail
        for token_id in self._context:
            self._stream.step(self._tok, token_id)
        self._held: list[int] = []
        # Whether a token's plain text (HFTokenizer.plain_text) is what the stream gives for it: once nothing is
        # held and the stream has text before it (else a Metaspace token decoded first drops its space).
        # ``_stale``: plain tokens went past the stream, which continues from ``_context`` when one does not.
        self._anchored = bool(tail) and bool(self._decode(tail))
        self._stale = False

    def push(self, token_id: int) -> str:
        if self._anchored and not self._held:
            text = self.tokenizer.plain_text(token_id)  # type: ignore[attr-defined]
            if text is not None:
                self._context = [token_id]
                self._stale = True
                return text
        if self._stale:
            self._stream = self._new_stream()
            for context_id in self._context:
                self._stream.step(self._tok, context_id)
            self._stale = False
        self._held.append(token_id)
        try:
            delta = self._stream.step(self._tok, token_id)
        except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception ("Invalid prefix encountered")
            delta = self._restart()
        if delta is None:
            return ""
        self._context, self._held = self._held, []
        self._anchored = True
        return delta

    @property
    def takes_plain(self) -> bool:
        return self._anchored and not self._held

    def _restart(self) -> str | None:
        """A new stream from the held tokens alone, when a token changed text already given out: a byte-fallback
        decoder turns a run of byte tokens that is not UTF-8 (``<0xC3><0xA9>`` then a stray ``<0xA9>``) into one
        U+FFFD per byte, so the decode with context no longer starts with what was emitted. What was emitted
        stays; the held tokens' text comes from a stream of their own (vLLM's detokenizer recovers so)."""
        self._stream = self._new_stream()
        pieces = []
        try:
            for token_id in self._held:
                piece = self._stream.step(self._tok, token_id)
                if piece is not None:
                    pieces.append(piece)
        except Exception:  # noqa: BLE001 - the held tokens alone fail too: their plain decode, and a new stream
            self._stream = self._new_stream()
            return self._decode(self._held)
        return "".join(pieces) if pieces else None

    def _new_stream(self) -> Any:
        from tokenizers.decoders import DecodeStream

        return DecodeStream(skip_special_tokens=self._skip)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def flush(self) -> str:
        if not self._held:
            return ""
        context = self._decode(self._context)
        text = self._decode(self._context + self._held)
        self._context, self._held = self._held, []
        return text[len(context) :]
