"""Streaming detokenization per tokenizer kind: ``tokenizers``' DecodeStream for Hugging Face tokenizers (byte-level
BPE, Metaspace, byte fallback), Python's incremental UTF-8 decoder for bytes, whole tokens for alphabets and ids.
Whatever the split, the deltas add up to the full decode and never end inside a character."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from rnnserve.engine.sampling_params import OutputKind, SamplingParams
from rnnserve.engine.sequence import Sequence, SequenceGroup, SteadyAppend
from rnnserve.engine.tokenizer import (
    BYTE_LEVEL_BYTES,
    ByteTokenizer,
    CharTokenizer,
    HFStreamDecoder,
    HFTokenizer,
    TokenIdTokenizer,
)

CORPUS = ["the cat sat on the mat", "héllo wörld", "emoji 😀🎉 family 👨‍👩‍👧", "中文字符和日本語のテキスト"] * 20


def stream(tokenizer, ids: list[int], context: list[int] | None = None) -> list[str]:  # type: ignore[no-untyped-def]
    detok = tokenizer.stream_decoder(context or [])
    return [detok.push(i) for i in ids] + [detok.flush()]


def save(tok: Tokenizer, path: Path) -> HFTokenizer:
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    return HFTokenizer(path / "tokenizer.json")


@pytest.fixture(scope="module")
def tokenizers_by_kind(tmp_path_factory: pytest.TempPathFactory) -> dict[str, HFTokenizer]:
    root = tmp_path_factory.mktemp("toks")
    byte_level = Tokenizer(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    byte_level.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    metaspace = Tokenizer(models.BPE())
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    metaspace.decoder = decoders.Metaspace()
    metaspace.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300))
    # Llama-style: characters outside the vocabulary become <0xNN> byte tokens.
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    vocab.update({c: 256 + i for i, c in enumerate("▁abcdefghijklmnopqrstuvwxyzé")})
    fallback = Tokenizer(models.BPE(vocab, [], byte_fallback=True))
    fallback.normalizer = normalizers.Replace(" ", "▁")
    fallback.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    # Llama's own: a space prepended to the first word, and the decoder's Strip removing it again.
    llama = Tokenizer(models.BPE(vocab, [], byte_fallback=True))
    llama.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    llama.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return {
        "byte_level": save(byte_level, root / "byte_level"),
        "metaspace": save(metaspace, root / "metaspace"),
        "byte_fallback": save(fallback, root / "byte_fallback"),
        "llama": save(llama, root / "llama"),
    }


@pytest.mark.parametrize("kind", ["byte_level", "metaspace", "byte_fallback"])
@pytest.mark.parametrize("text", ["the cat sat", "a héllo 😀 wörld", "中文 and 日本語", "x 👨‍👩‍👧 y"])
def test_hf_stream_adds_up_to_the_full_decode(tokenizers_by_kind: dict[str, HFTokenizer], kind: str, text: str) -> None:
    tokenizer = tokenizers_by_kind[kind]
    assert isinstance(tokenizer.stream_decoder(), HFStreamDecoder)
    ids = tokenizer.encode(text)
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("kind", ["byte_level", "metaspace", "byte_fallback"])
def test_hf_stream_pushed_in_runs_equals_the_token_by_token_stream(
    tokenizers_by_kind: dict[str, HFTokenizer], kind: str
) -> None:
    tokenizer = tokenizers_by_kind[kind]
    ids = tokenizer.encode("a héllo 😀 wörld 中文 x 👨‍👩‍👧 y")
    for run in (1, 2, 3, 7, len(ids)):
        detok = tokenizer.stream_decoder()
        text = "".join(detok.push_many(ids[i : i + run]) for i in range(0, len(ids), run)) + detok.flush()
        assert text == "".join(stream(tokenizer, ids))


@pytest.mark.parametrize("kind", ["byte_level", "metaspace", "byte_fallback", "llama"])
@pytest.mark.parametrize("text", ["the cat sat on the mat", "a héllo wörld", "x 中文 y"])
def test_a_stream_after_a_prompt_is_the_decode_of_prompt_and_output_past_the_prompt(
    tokenizers_by_kind: dict[str, HFTokenizer], kind: str, text: str
) -> None:
    """Cut anywhere into a prompt and an output, the output's stream is ``decode(prompt + output)`` past
    ``decode(prompt)``, as vLLM and ``transformers`` give it: a Metaspace (sentencepiece) first token ``▁sat``
    keeps its space (decoded alone it lost it)."""
    tokenizer = tokenizers_by_kind[kind]
    ids = tokenizer.encode(text)
    cuts = [c for c in range(1, len(ids)) if tokenizer.decode(ids).startswith(tokenizer.decode(ids[:c]))]
    assert len(cuts) >= 3  # not inside a character (there the prompt's own text ends in U+FFFD)
    for cut in cuts:
        prompt, output = ids[:cut], ids[cut:]
        expected = tokenizer.decode(prompt + output)[len(tokenizer.decode(prompt)) :]
        assert "".join(stream(tokenizer, output, prompt)) == expected, (kind, cut)


@pytest.mark.parametrize("kind", ["byte_level", "metaspace", "byte_fallback", "llama"])
def test_token_bytes_are_the_tokens_own_bytes(
    tokenizers_by_kind: dict[str, HFTokenizer], kind: str, tmp_path: Path
) -> None:
    """Chat logprobs' ``bytes`` (OpenAI: the token's UTF-8 bytes, so that split characters can be rebuilt): a token
    holding part of a character gives that part, not the U+FFFD its text alone decodes to, and a Metaspace token's
    ``▁`` is a space; a special token gives none."""
    tokenizer = tokenizers_by_kind[kind]
    text = "a héllo 😀 wörld 中文"
    ids = tokenizer.encode(text)
    joined = b"".join(tokenizer.token_bytes(i) for i in ids)
    assert joined.decode() in (text, " " + text)
    if kind != "metaspace":  # its BPE learnt whole characters
        assert any(0 < len(tokenizer.token_bytes(i)) < len(tokenizer.decode([i]).encode()) for i in ids)
    special = Tokenizer.from_str(tokenizer.to_json())
    special.add_special_tokens(["<eos>"])
    with_special = save(special, tmp_path / "special")
    assert with_special.token_bytes(with_special._tok.token_to_id("<eos>")) == b""


def test_byte_fallback_holds_a_split_character(tokenizers_by_kind: dict[str, HFTokenizer]) -> None:
    tokenizer = tokenizers_by_kind["byte_fallback"]
    ids = tokenizer.encode("a😀")
    assert len(ids) == 5  # "a" and the emoji's four <0xNN> bytes
    assert stream(tokenizer, ids) == ["a", "", "", "", "😀", ""]


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_a_character_cut_off_at_the_end_is_flushed(tokenizers_by_kind: dict[str, HFTokenizer], kind: str) -> None:
    tokenizer = tokenizers_by_kind[kind]
    ids = tokenizer.encode("ab😀")
    cut = ids[:-1]  # the emoji's last byte is missing
    deltas = stream(tokenizer, cut)
    assert "".join(deltas) == tokenizer.decode(cut) and deltas[-1].endswith("\ufffd")


@pytest.mark.parametrize("kind", ["byte_fallback", "llama"])
@pytest.mark.parametrize("stray", [[0xA9], [0xAD, 0x80], [0xFF]])
def test_a_stray_byte_after_a_whole_character_does_not_break_a_byte_fallback_stream(
    tokenizers_by_kind: dict[str, HFTokenizer], kind: str, stray: list[int]
) -> None:
    """``é`` written as ``<0xC3><0xA9>``, then a stray byte token: decoded together, the ByteFallback decoder turns
    the whole run into U+FFFD per byte, so ``DecodeStream`` raised "Invalid prefix encountered" (a request's
    failure, or with lazy text the engine loop's). What was emitted stays, the stray byte comes out as U+FFFD
    and the stream goes on; in a prompt's context and after a character, as the stream's first tokens too."""
    tokenizer = tokenizers_by_kind[kind]
    a = tokenizer.encode_plain("a")[-1]
    ids = [0xC3, 0xA9, *stray, a, 0xE4, 0xB8, 0xAD, a]  # <0xNN> tokens have the byte's id
    for context in ([], [a], [0xC3, 0xA9]):
        deltas = stream(tokenizer, ids, context)
        assert "".join(deltas).lstrip() == "é" + "\ufffd" * len(stray) + "a中a", (context, deltas)
        detok = tokenizer.stream_decoder(context)
        assert detok.push_many(ids) + detok.flush() == "".join(deltas)


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
@pytest.mark.parametrize("cut", [1, 2])
def test_a_prompt_ending_inside_a_character_leaves_its_bytes_out_of_the_output(
    tokenizers_by_kind: dict[str, HFTokenizer], kind: str, cut: int
) -> None:
    """A token-id prompt cut inside a character (a client resending prompt + output after a cut mid-emoji): its
    dangling bytes stayed held in the stream and came out as a U+FFFD at the start of the output, which
    ``decode(prompt + output)`` past ``decode(prompt)`` does not have."""
    tokenizer = tokenizers_by_kind[kind]
    char_of = {b: c for c, b in BYTE_LEVEL_BYTES.items()}
    split = [b if kind == "byte_fallback" else tokenizer._tok.token_to_id(char_of[b]) for b in "中".encode()[:cut]]
    prompt = [*tokenizer.encode_plain("a"), *split]
    assert tokenizer.decode(prompt).endswith("\ufffd")
    output = tokenizer.encode_plain("bc")
    assert "".join(stream(tokenizer, output, prompt)) == "bc"


def test_byte_tokenizer_streams_characters_whole_and_invalid_bytes_at_once() -> None:
    tokenizer = ByteTokenizer()
    assert stream(tokenizer, list("é😀".encode())) == ["", "é", "", "", "", "😀", ""]
    assert stream(tokenizer, [0xFF, *b"ab", tokenizer.eos_token_id]) == ["\ufffd", "a", "b", "", ""]
    assert stream(tokenizer, [*b"a", 0xE4, 0xB8]) == ["a", "", "", "\ufffd"]  # cut off: flushed


def test_whole_token_tokenizers_stream_token_by_token() -> None:
    lsrl = CharTokenizer([".", *"ABC"])
    assert stream(lsrl, [1, 2, 0, 7]) == ["A", "B", ".", "", ""]
    ids = TokenIdTokenizer(vocab_size=100)
    assert stream(ids, [12, 7]) == [" 12", " 7", ""]
    assert ids.stream_decoder().push_many([12, 7]) == " 12 7" and lsrl.stream_decoder().push_many([1, 2]) == "AB"


class CountingStream:
    """A ``DecodeStream`` that counts its steps."""

    steps = 0

    def __init__(self, stream: object) -> None:
        self.stream = stream

    def step(self, tok: object, token_id: int) -> str | None:
        CountingStream.steps += 1
        return self.stream.step(tok, token_id)  # type: ignore[attr-defined]


def decode_stream_deltas(tokenizer: HFTokenizer, ids: list[int], context: list[int], skip: bool = True) -> list[str]:
    """The deltas of a stream decoder that gives every token to ``DecodeStream`` (no plain texts)."""
    plain_texts = tokenizer._plain_texts
    tokenizer._plain_texts = dict.fromkeys(range(tokenizer.vocab_size))  # every token: no plain text
    try:
        detok = tokenizer.stream_decoder(context, skip)
        return [detok.push(i) for i in ids] + [detok.flush()]
    finally:
        tokenizer._plain_texts = plain_texts


@pytest.mark.parametrize("kind", ["byte_level", "metaspace", "byte_fallback", "llama"])
def test_plain_token_texts_give_the_decode_streams_deltas(
    tokenizers_by_kind: dict[str, HFTokenizer], kind: str, tmp_path: Path
) -> None:
    """A token whose text is whole characters skips ``DecodeStream``: its text after the last delta is the same
    whatever came before (its decode alone may differ: a Metaspace ``▁word`` first in a decode loses its space).
    Token by token the deltas are the stream's own: after a prompt (none, a BOS alone, a character cut in two),
    around characters split over byte tokens, stray continuation bytes and special tokens, of random ids too."""
    tokenizer = tokenizers_by_kind[kind]
    special = Tokenizer.from_str(tokenizer.to_json())
    special.add_special_tokens(["<s>"])
    rng = random.Random(0)
    texts = ["the cat sat on the mat", " a héllo 😀 wörld", "中文 and 日本語 x", "emoji 👨‍👩‍👧 family", "é"]
    for text in texts:
        ids = tokenizer.encode(text)
        for cut in range(len(ids)):
            context, output = ids[:cut], ids[cut:]
            assert stream(tokenizer, output, context) == decode_stream_deltas(tokenizer, output, context), (text, cut)
    tokenizer = save(special, tmp_path / "special")  # random ids now include a special token
    vocab = tokenizer.vocab_size
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        context = [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
        for skip in (True, False):
            detok = tokenizer.stream_decoder(context, skip)
            deltas = [detok.push(i) for i in ids] + [detok.flush()]
            assert deltas == decode_stream_deltas(tokenizer, ids, context, skip), (ids, context, skip)


def test_plain_tokens_take_no_decode_stream_step(
    tokenizers_by_kind: dict[str, HFTokenizer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a prompt, a byte-level stream of whole-character tokens steps ``DecodeStream`` for none of them; a
    token that is part of a character is stepped (after the last delta's tokens, to continue from there)."""
    tokenizer = tokenizers_by_kind["byte_level"]
    new_stream = HFStreamDecoder._new_stream
    monkeypatch.setattr(HFStreamDecoder, "_new_stream", lambda self: CountingStream(new_stream(self)))
    prompt = tokenizer.encode("the cat")
    output = tokenizer.encode(" sat on the mat")
    detok = tokenizer.stream_decoder(prompt)
    CountingStream.steps = 0
    assert "".join(detok.push(i) for i in output) == " sat on the mat"
    assert CountingStream.steps == 0
    emoji = tokenizer.encode("😀")
    assert len(emoji) > 1
    assert "".join(detok.push(i) for i in emoji) == "😀"
    assert CountingStream.steps >= len(emoji)


def test_decoders_that_do_not_append_token_by_token_have_no_plain_texts(tmp_path: Path) -> None:
    """WordPiece merges ``##`` pieces into the word before and cleans up spaces: a token's text depends on its
    neighbours, so every token goes through ``DecodeStream``."""
    vocab = {"[UNK]": 0, "the": 1, "cat": 2, "##s": 3, ".": 4}
    wordpiece = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece.decoder = decoders.WordPiece()
    tokenizer = save(wordpiece, tmp_path / "wordpiece")
    assert all(tokenizer.plain_text(i) is None for i in vocab.values())
    ids = tokenizer.encode("the cats.")
    assert "".join(stream(tokenizer, ids, [1])) == tokenizer.decode([1, *ids])[len("the") :]


def streams_deltas(tokenizer: Tokenizer, outputs: list[list[int]], steady: bool, skip: bool = True) -> list[list[str]]:
    """Each stream's deltas (taken every few steps, and at its end) when its tokens are appended one step at a time:
    for a steady batch of streams (``SteadyAppend``: plain texts looked up for the batch, decoders pushed where
    needed) while it can, else token by token (``Sequence.append_token``), as the scheduler does."""
    params = SamplingParams(temperature=0, max_tokens=len(outputs[0]) - 2, ignore_eos=True, skip_special_tokens=skip,
                            output_kind=OutputKind.DELTA)  # fmt: skip
    seqs = []
    for index, output in enumerate(outputs):
        group = SequenceGroup(f"stream-{index}", None, output[:2], params)  # a prompt of two tokens, then the output
        group.seqs.append(Sequence(group, 0, tokenizer))
        seqs.append(group.seqs[0])
    deltas: list[list[str]] = [[] for _ in seqs]
    batch = None
    for step in range(2, len(outputs[0])):
        tokens = [output[step] for output in outputs]
        if batch is None or not batch.append(tokens):
            if batch is not None:
                batch.end()
            for seq, token in zip(seqs, tokens, strict=True):
                seq.append_token(token, None)
            batch = SteadyAppend(seqs) if steady and all(map(SteadyAppend.plain, seqs)) else None
        if step % 5 == 0 or seqs[0].finished:
            for taken, seq in zip(deltas, seqs, strict=True):
                taken.append(seq.take_delta()[0])
    return deltas


@pytest.mark.parametrize("kind", ["bytes", "byte_level", "metaspace", "byte_fallback", "llama"])
def test_a_steady_batch_of_streams_decodes_as_each_stream_token_by_token(
    tokenizers_by_kind: dict[str, HFTokenizer], kind: str, tmp_path: Path
) -> None:
    """A steady batch of streams takes each token's plain text for the batch, and pushes a stream's decoder only
    where its token has none or the decoder holds part of a character (which then catches up with the plain texts
    it did not see): every stream's deltas are those of its tokens pushed one by one, over random ids (pieces of
    characters, special tokens with and without their text) and over text whose characters split into tokens."""
    if kind == "bytes":
        tokenizer: Tokenizer = ByteTokenizer()
        texts = [list("a héllo 😀 wörld".encode()), list("中文 and 日本語 x".encode())]
    else:
        special = Tokenizer.from_str(tokenizers_by_kind[kind].to_json())
        special.add_special_tokens(["<s>"])
        tokenizer = save(special, tmp_path / "special")
        texts = [tokenizer.encode(text) for text in ("the cat sat", " a héllo 😀 wörld", "中文 and 日本語 x")]
    rng = random.Random(0)
    vocab = tokenizer.vocab_size + 3  # a model's padded vocabulary: ids without a token
    for length in (8, 40):
        outputs = [[rng.randrange(vocab) for _ in range(length)] for _ in range(6)]
        outputs += [(text * length)[:length] for text in texts]
        for skip in (True, False):
            assert streams_deltas(tokenizer, outputs, True, skip) == streams_deltas(tokenizer, outputs, False, skip)


@pytest.mark.parametrize("kind", ["bytes", "byte_level"])
def test_a_steady_batch_of_streams_of_whole_characters_pushes_no_decoder(
    tokenizers_by_kind: dict[str, HFTokenizer], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streams of text whose tokens are whole characters get their texts in a steady batch from the look-up of
    each token's plain text: their decoders are pushed the tokens appended one by one only (the batch's first
    step, and its last, at ``max_tokens``)."""
    tokenizer: Tokenizer = ByteTokenizer() if kind == "bytes" else tokenizers_by_kind[kind]
    decoder_class = type(tokenizer.stream_decoder())
    pushes = 0
    push = decoder_class.push

    def counted(self, token_id: int) -> str:  # type: ignore[no-untyped-def]
        nonlocal pushes
        pushes += 1
        return push(self, token_id)

    monkeypatch.setattr(decoder_class, "push", counted)
    ids = tokenizer.encode("the cat sat on the mat " * 10)
    outputs = [ids[start : start + 40] for start in range(8)]
    deltas = streams_deltas(tokenizer, outputs, True)
    assert pushes == 2 * len(outputs)
    assert ["".join(taken) for taken in deltas] == [tokenizer.decode(output[2:]) for output in outputs]
