"""Tokenizers (byte-level, fixed alphabet, Hugging Face ``tokenizer.json``) and streaming detokenization."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


class Tokenizer:
    """Minimal tokenizer interface the engine and server rely on."""

    eos_token_id: int | None = None
    bos_token_id: int | None = None
    chat_template: str | None = None

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def first_undecodable(self, ids: Sequence[int]) -> int | None:
        """The first id that is not one of this tokenizer's tokens (text or special), or ``None``; ids are
        ``0 .. vocab_size - 1`` unless a tokenizer says otherwise. A model's vocabulary may be padded beyond
        its tokenizer's: such ids decode to nothing and are no valid input."""
        size = self.vocab_size
        return next((t for t in ids if not 0 <= t < size), None)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes 0..255 plus special tokens from 256 on (``<|endoftext|>`` = 256 is EOS)."""

    SPECIALS = ("<|endoftext|>",)

    def __init__(self) -> None:
        self.eos_token_id = 256
        self._special_text = {256 + i: s for i, s in enumerate(self.SPECIALS)}

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.SPECIALS)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # Special and out-of-vocabulary ids carry no text.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class CharTokenizer(Tokenizer):
    """A fixed alphabet: token ``i`` is ``alphabet[i]`` (used by compiled LSRL models)."""

    def __init__(self, alphabet: Sequence[str], eos_token_id: int | None = None) -> None:
        self.alphabet = list(alphabet)
        self._index = {ch: i for i, ch in enumerate(self.alphabet)}
        self._longest_first = sorted(self._index, key=len, reverse=True)
        self.eos_token_id = eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> list[int]:
        ids = []
        i = 0
        while i < len(text):
            for sym in self._longest_first:
                if text.startswith(sym, i):
                    ids.append(self._index[sym])
                    i += len(sym)
                    break
            else:
                raise ValueError(f"character {text[i]!r} is not in this model's alphabet {''.join(self.alphabet)!r}")
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
        self.chat_template = config.get("chat_template") if isinstance(config.get("chat_template"), str) else None
        self.add_bos = bool(config.get("add_bos_token", False))
        self.eos_token_id = self._special_id(config.get("eos_token"))
        self.bos_token_id = self._special_id(config.get("bos_token"))

    def _special_id(self, token: str | dict | None) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        return self._tok.token_to_id(token) if token else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def first_undecodable(self, ids: Sequence[int]) -> int | None:
        """The first id with no token (a ``tokenizer.json`` may leave gaps between its ids), or ``None``."""
        return next((t for t in dict.fromkeys(ids) if not 0 <= t < 2**32 or self._tok.id_to_token(t) is None), None)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never end inside a UTF-8 sequence.

    Keeps a short window of tokens: ``[prefix, read)`` was emitted already and gives context (tokenizers
    that merge across tokens, such as leading spaces), ``[read, end)`` is pending. A delta is emitted once
    the pending tokens no longer decode to an incomplete character (U+FFFD); after ``max_pending`` held
    tokens it stops waiting (the model really produced invalid bytes) and emits the replacement character.
    """

    def __init__(self, tokenizer: Tokenizer, max_pending: int = 6) -> None:
        self.tokenizer = tokenizer
        self.max_pending = max_pending
        self._window: list[int] = []
        self._read = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        self._window.append(token_id)
        return self._emit(force=False)

    def flush(self) -> str:
        """Emit whatever is still held (at the end of a sequence)."""
        return self._emit(force=True)

    def _emit(self, force: bool) -> str:
        if self._read == len(self._window):
            return ""
        text = self.tokenizer.decode(self._window)
        pending = len(self._window) - self._read
        if not force and text.endswith("\ufffd") and pending < self.max_pending:
            return ""
        delta = text[len(self.tokenizer.decode(self._window[: self._read])) :]
        self._window = self._window[self._read :]
        self._read = len(self._window)
        return delta
