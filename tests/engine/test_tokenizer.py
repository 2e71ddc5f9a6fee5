"""Tokenizers and streaming detokenization that never yields a broken character."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rnnserve.engine.tokenizer import ByteTokenizer, CharTokenizer, HFTokenizer

TEXTS = ["plain ascii", "héllo wörld", "emoji 😀🎉 family 👨‍👩‍👧", "中文字符和日本語のテキスト", "mixed: a😀b中c"]


def _stream(tokenizer, ids: list[int]) -> list[str]:
    detok = tokenizer.stream_decoder()
    return [detok.push(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_stream_never_emits_a_partial_character(text: str) -> None:
    tokenizer = ByteTokenizer()
    deltas = _stream(tokenizer, tokenizer.encode(text))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d) > 1  # really incremental


def test_invalid_bytes_are_replaced_not_held_forever() -> None:
    deltas = _stream(ByteTokenizer(), [0xFF, *b"abcdefgh"])
    assert "".join(deltas) == "\ufffdabcdefgh"


def test_byte_stream_equals_the_whole_decode_of_any_bytes() -> None:
    """ASCII bytes inside a broken character (a lead byte, then ``a``) still pass through the UTF-8 decoder."""
    rng = random.Random(0)
    streams = [[0xC3, *b"a"], [0xE2, 0x82, *b"x", 0xAC], [0xF0, 0x9F, 0x98, *b"!"]]
    streams += [[rng.choice([*range(128), 0x80, 0xBF, 0xC3, 0xE2, 0xF0, 0xFF]) for _ in range(40)] for _ in range(200)]
    for ids in streams:
        assert "".join(_stream(ByteTokenizer(), ids)) == bytes(ids).decode("utf-8", errors="replace")


def test_byte_stream_pushed_in_runs_equals_the_token_by_token_stream() -> None:
    """A sample's lazy text decodes the tokens since its last read in one ``push_many``: whatever the runs, the
    text is the token-by-token stream's (broken characters, specials and ids beyond the vocabulary included)."""
    rng = random.Random(1)
    tokenizer = ByteTokenizer()
    alphabet = [*range(128), 0x80, 0xBF, 0xC3, 0xE2, 0xF0, 0xFF, tokenizer.eos_token_id, 300, -1]
    for _ in range(300):
        ids = [rng.choice(alphabet) for _ in range(rng.randrange(1, 40))]
        cuts = sorted(rng.sample(range(1, len(ids)), rng.randrange(len(ids)))) if len(ids) > 1 else []
        detok = tokenizer.stream_decoder()
        runs = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]
        assert "".join(detok.push_many(run) for run in runs) + detok.flush() == "".join(_stream(tokenizer, ids))


def test_special_tokens_carry_no_text() -> None:
    tok = ByteTokenizer()
    assert tok.decode([*b"hi", tok.eos_token_id, 300]) == "hi"
    assert tok.vocab_size == 257


def test_char_tokenizer_round_trip_and_unknown_characters() -> None:
    tok = CharTokenizer([".", *"ABCDEFGHIJKLMNOPQRSTUVWXYZ"])
    assert tok.encode("CAN.") == [3, 1, 14, 0]
    assert tok.decode([20, 15]) == "TO"
    with pytest.raises(ValueError, match="alphabet"):
        tok.encode("cat")


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXTS * 20 + ["the cat sat on the mat"] * 20, trainer)
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text('{"eos_token": "<eos>"}')
    return path


@pytest.mark.parametrize("text", TEXTS)
def test_hf_tokenizer_stream_matches_full_decode(hf_tokenizer_dir: Path, text: str) -> None:
    tokenizer = HFTokenizer(hf_tokenizer_dir / "tokenizer.json")
    ids = tokenizer.encode(text)
    deltas = _stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_hf_tokenizer_reads_eos(hf_tokenizer_dir: Path) -> None:
    tokenizer = HFTokenizer(hf_tokenizer_dir / "tokenizer.json")
    assert tokenizer.eos_token_id == 0
    assert tokenizer.decode([tokenizer.eos_token_id, *tokenizer.encode("cat")]) == "cat"


def test_first_undecodable_id(hf_tokenizer_dir: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    assert ByteTokenizer().first_undecodable([0, 255, 256, 257, 300]) == 257
    assert CharTokenizer("ab").first_undecodable([1, 0, -1]) == -1
    tokenizer = HFTokenizer(hf_tokenizer_dir / "tokenizer.json")
    assert tokenizer.first_undecodable([*tokenizer.encode("the cat"), tokenizer.vocab_size, -3]) == tokenizer.vocab_size
    assert tokenizer.first_undecodable([0, 2**40]) == 2**40
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 5}, unk_token="a")).save(str(tmp_path / "tokenizer.json"))
    gaps = HFTokenizer(tmp_path / "tokenizer.json")
    assert gaps.first_undecodable([0, 1, 5]) is None and gaps.first_undecodable([5, 3]) == 3


def test_char_tokenizer_takes_the_longest_symbol_and_names_where_none_starts() -> None:
    tokenizer = CharTokenizer(["a", "ab", "abc", "b", "(0,1)", "0"])
    assert tokenizer.encode("abcab(0,1)0ba") == [2, 1, 4, 5, 3, 0]
    with pytest.raises(ValueError, match=r"no symbol of this model's alphabet starts at '\(0,2\)' \(character 2\)"):
        tokenizer.encode("ab(0,2)")
    long = CharTokenizer([f"<{i}>" for i in range(5000)])  # the message names a few symbols, not 40 KB of them
    with pytest.raises(ValueError) as err:
        long.encode("<1><x>")
    assert len(str(err.value)) < 200


@pytest.mark.parametrize(
    ("template", "config", "expected_prefix"),
    [
        ("<bos> $A", {}, ["<bos>"]),  # Llama 3: the post-processor adds BOS, tokenizer_config.json says nothing
        ("<bos> $A <eos>", {}, ["<bos>"]),  # a trailing EOS would end the prompt: left out
        ("$A", {}, []),
        ("<bos> $A", {"add_bos_token": False}, []),  # tokenizer_config.json's word wins, as transformers' Llama
        ("$A", {"add_bos_token": True}, ["<bos>"]),
    ],
)
def test_hf_tokenizer_puts_the_tokens_before_a_text_that_transformers_does(
    hf_tokenizer_dir: Path, tmp_path: Path, template: str, config: dict, expected_prefix: list[str]
) -> None:
    """A prompt gets what ``tokenizer(text)`` puts before it: without this, a Llama-3-style tokenizer's
    completions prompts silently lacked their BOS. A text that already begins with BOS does not get a second."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(str(hf_tokenizer_dir / "tokenizer.json"))
    tok.add_special_tokens(["<bos>"])
    bos, eos = tok.token_to_id("<bos>"), tok.token_to_id("<eos>")
    tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<bos>", bos), ("<eos>", eos)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>", **config}))
    tokenizer = HFTokenizer(tmp_path / "tokenizer.json")
    prefix = [tok.token_to_id(t) for t in expected_prefix]
    for text in ("the cat", "", "<bos>the cat"):
        plain = tok.encode(text, add_special_tokens=False).ids
        assert tokenizer.encode(text) == (plain if plain[: len(prefix)] == prefix else prefix + plain), text
    if not config:
        reference = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
        assert reference("the cat").input_ids[: len(prefix) + 1] == tokenizer.encode("the cat")[: len(prefix) + 1]


def test_a_list_of_named_chat_templates_gives_the_default_one(hf_tokenizer_dir: Path, tmp_path: Path) -> None:
    """``tokenizer_config.json`` may name several templates (``[{"name", "template"}]``); ``transformers`` renders
    ``default``. The list was dropped, and chats silently got the generic template."""
    (tmp_path / "tokenizer.json").write_bytes((hf_tokenizer_dir / "tokenizer.json").read_bytes())
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    for value, expected in [(named, "D"), (named[:1], None), ("S", "S"), (7, None)]:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": value}))
        assert HFTokenizer(tmp_path / "tokenizer.json").chat_template == expected
