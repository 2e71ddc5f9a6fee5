"""Every sampling parameter has a test that fails if the parameter is ignored."""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable
from collections.abc import Sequence as Seq

import pytest
import torch

from rnnserve.engine import sampler as sampler_module
from rnnserve.engine import sequence as sequence_module
from rnnserve.engine.sampler import filter_logits, sample
from rnnserve.engine.sampling_params import InvalidParameterError, OutputKind, SamplingParams
from rnnserve.engine.sequence import Sequence, SequenceGroup
from rnnserve.engine.tokenizer import ByteTokenizer, Tokenizer
from rnnserve.kernels.row_argmax.naive import row_argmax_ref
from tests.engine.conftest import make_engine, run_to_completion

VOCAB = 8
INT64_MAX = 2**63 - 1
PROBS = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0, 0.0, 0.0, 0.0])
LOGITS = torch.log(PROBS.clamp_min(1e-30))


def _seq(params: SamplingParams, prompt: list[int] | None = None, eos: int | None = None) -> Sequence:
    """A sample of ``params``; ``eos`` (inside ``VOCAB``) replaces the byte tokenizer's EOS."""
    group = SequenceGroup("r", None, prompt or [7], params)
    tokenizer = ByteTokenizer()
    if eos is not None:
        tokenizer.eos_token_id = eos
    seq = Sequence(group, 0, tokenizer)
    seq.init_sampling_state(VOCAB, torch.device("cpu"))
    return seq


def _draws(params: SamplingParams, logits: torch.Tensor = LOGITS, rows: int = 400) -> set[int]:
    seqs = [_seq(params) for _ in range(rows)]
    return set(sample(logits.expand(rows, -1).clone(), seqs).token_ids)


def test_greedy_takes_the_argmax_and_temperature_spreads() -> None:
    assert _draws(SamplingParams(temperature=0)) == {0}
    assert _draws(SamplingParams(temperature=1.0)) == {0, 1, 2, 3}


def test_temperature_sharpens_and_flattens() -> None:
    cold = sample(LOGITS.expand(400, -1).clone(), [_seq(SamplingParams(temperature=0.05)) for _ in range(400)])
    hot = sample(LOGITS.expand(400, -1).clone(), [_seq(SamplingParams(temperature=5.0)) for _ in range(400)])
    assert cold.token_ids.count(0) > 390
    assert hot.token_ids.count(3) > 60  # p(3) rises from 0.1 to ~0.2


def test_a_temperature_below_vllms_epsilon_is_greedy() -> None:
    """As in vLLM, a temperature below 1e-5 is greedy: clients that may not send 0 send 1e-6 for greedy output,
    and dividing by it would pick at random between tokens whose logits differ by less than about 1e-5."""
    near_tie = torch.tensor([0.0, 1e-7, -5.0, -5.0, -5.0, -5.0, -5.0, -5.0])
    for temperature in (1e-6, 1e-30):
        assert _draws(SamplingParams(temperature=temperature), near_tie) == {1}
        assert SamplingParams(temperature=temperature).greedy
    assert not SamplingParams(temperature=1e-5).greedy


def test_top_k_top_p_min_p_restrict_the_support() -> None:
    assert _draws(SamplingParams(top_k=2)) == {0, 1}
    assert _draws(SamplingParams(top_p=0.5)) == {0, 1}
    assert _draws(SamplingParams(top_p=0.75)) == {0, 1, 2}
    assert _draws(SamplingParams(min_p=0.6)) == {0, 1}
    assert _draws(SamplingParams(min_p=0.45)) == {0, 1, 2}


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(top_k=2, logit_bias={0: -100}), 1),
        (SamplingParams(allowed_token_ids=[2]), 2),
        (SamplingParams(top_p=0.5), 0),
    ],
)
def test_a_draw_of_zero_takes_the_first_token_with_mass(
    monkeypatch: pytest.MonkeyPatch, params: SamplingParams, expected: int
) -> None:
    """``torch.rand`` returns exactly 0 once in 2^24 draws; the inverse CDF must still skip tokens that the
    filters and masks removed (it took token 0 whatever its probability, a grammar's 500 with structured outputs)."""
    monkeypatch.setattr(sampler_module, "draw_uniform", lambda seqs, device: torch.zeros(len(seqs), device=device))
    assert _draws(params, LOGITS, rows=4) == {expected}


def test_rows_without_filters_keep_every_token_alone_and_beside_rows_with_them() -> None:
    """top_p = 1 keeps the whole vocabulary even where the rounded mass reaches 1 before the tail, and a row's
    logits do not depend on whether a row beside it filters (a batch where none does skips the sort)."""
    logits = torch.full((1, VOCAB), -60.0)
    logits[0, 0] = 60.0  # in fp32 the first token's probability is 1: the mass before every other token is 1
    plain = SamplingParams(temperature=2.0)
    alone = filter_logits(logits.clone(), [_seq(plain)])
    mixed = filter_logits(logits.expand(2, -1).clone(), [_seq(plain), _seq(SamplingParams(top_p=0.5))])
    assert torch.equal(alone[0], logits[0] / 2.0)
    assert torch.equal(mixed[0], alone[0])
    assert mixed[1].isinf().sum().item() == VOCAB - 1


def test_repetition_penalty_covers_prompt_tokens() -> None:
    logits = torch.tensor([[3.0, 2.9, 0, 0, 0, 0, 0, 0]])
    plain = sample(logits.clone(), [_seq(SamplingParams(temperature=0), prompt=[0])])
    penalised = sample(logits.clone(), [_seq(SamplingParams(temperature=0, repetition_penalty=1.2), prompt=[0])])
    assert plain.token_ids == [0] and penalised.token_ids == [1]


def test_presence_and_frequency_penalties_use_generated_counts() -> None:
    logits = torch.tensor([[3.0, 2.0, 0, 0, 0, 0, 0, 0]])
    presence = _seq(SamplingParams(temperature=0, presence_penalty=1.5))
    frequency = _seq(SamplingParams(temperature=0, frequency_penalty=0.4))
    weak_frequency = _seq(SamplingParams(temperature=0, frequency_penalty=0.4))
    certain_zero = torch.tensor([[9.0, 0, 0, 0, 0, 0, 0, 0]])  # each sampled token counts, before it is read
    for _ in range(3):
        sample(certain_zero.expand(2, -1).clone(), [presence, frequency])
    sample(certain_zero.clone(), [weak_frequency])
    assert presence.token_counts is not None and presence.token_counts[0] == 3
    assert sample(logits.clone(), [presence]).token_ids == [1]
    assert sample(logits.clone(), [frequency]).token_ids == [1]  # 3 * 0.4 > 1
    assert sample(logits.clone(), [weak_frequency]).token_ids == [0]  # 1 * 0.4 < 1


def test_min_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 9.0, 8.0, 0.0]])
    early = _seq(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[6]), eos=5)
    assert sample(logits.clone(), [early]).token_ids == [0]
    late = _seq(SamplingParams(temperature=0, min_tokens=1, stop_token_ids=[6]), eos=5)
    late.append_token(1, None)
    assert sample(logits.clone(), [late]).token_ids == [5]


def test_a_constraint_that_allows_only_stop_tokens_wins_over_min_tokens() -> None:
    """A grammar can leave only a stop token (a choice whose next character is one of ``stop_token_ids``, or its
    end); min_tokens' ban would then forbid every token, and a row of -inf took token 0 and failed the request
    (a 500). The constraint wins for that row alone; its neighbour keeps the ban."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 9.0, 8.0, 0.0]]).expand(2, -1).clone()
    forced = _seq(SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[6], allowed_token_ids=[6]), eos=5)
    free = _seq(SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[6]), eos=5)
    assert sample(logits, [forced, free]).token_ids == [6, 0]


def test_seed_gives_reproducible_draws_independent_of_the_batch() -> None:
    params = SamplingParams(temperature=1.0, seed=1234)
    alone = [sample(LOGITS[None].clone(), [s]).token_ids[0] for s in [_seq(params)] for _ in range(30)]
    seeded = _seq(params)
    batch = []
    for _ in range(30):
        others = [_seq(SamplingParams(temperature=1.0)) for _ in range(5)]
        batch.append(sample(LOGITS.expand(6, -1).clone(), [*others[:2], seeded, *others[2:]]).token_ids[2])
    assert alone == batch
    other_seed = _seq(SamplingParams(temperature=1.0, seed=99))
    assert [sample(LOGITS[None].clone(), [other_seed]).token_ids[0] for _ in range(30)] != alone


def test_logprobs_report_the_sampled_token_and_top_n() -> None:
    seq = _seq(SamplingParams(temperature=0, logprobs=3))
    result = sample(LOGITS[None].clone(), [seq])
    entry = result.logprobs[0]
    assert entry is not None and entry.token_id == 0
    assert entry.logprob == pytest.approx(math.log(0.4), abs=1e-5)
    assert [t for t, _ in entry.top] == [0, 1, 2]
    assert [lp for _, lp in entry.top] == pytest.approx([math.log(p) for p in (0.4, 0.3, 0.2)], abs=1e-5)
    assert sample(LOGITS[None].clone(), [_seq(SamplingParams(temperature=0))]).logprobs == [None]


def test_logit_bias_moves_the_greedy_token_and_the_draws() -> None:
    assert _draws(SamplingParams(temperature=0, logit_bias={3: 1.5})) == {3}  # log 0.1 + 1.5 > log 0.4
    assert _draws(SamplingParams(temperature=0, logit_bias={0: -100, 1: -0.5})) == {2}
    assert _draws(SamplingParams(temperature=1.0, logit_bias={0: -100, 1: -100})) == {2, 3}
    assert _draws(SamplingParams(temperature=1.0, logit_bias={5: 100})) == {5}  # from probability 0


def test_logit_bias_beyond_100_is_clamped_as_vllm_does() -> None:
    """vLLM's server clamps each bias into [-100, 100] (OpenAI's range): a client that bans a token with -1e9 or
    forces one with 1000 gets what -100 and 100 do, not a 400; a bias that is no finite number stays an error."""
    params = SamplingParams(temperature=0, logit_bias={5: 1000, 0: -1e9, 1: 2.5})
    assert params.logit_bias == {5: 100.0, 0: -100.0, 1: 2.5}
    assert _draws(params) == {5}
    with pytest.raises(InvalidParameterError):
        SamplingParams(logit_bias={1: math.inf})


def test_allowed_token_ids_restrict_sampling_and_logprobs() -> None:
    assert _draws(SamplingParams(temperature=0, allowed_token_ids=[2, 3])) == {2}
    assert _draws(SamplingParams(temperature=1.0, allowed_token_ids=[1, 3, 6])) == {1, 3}
    assert _draws(SamplingParams(temperature=0, allowed_token_ids=[6])) == {6}
    restricted = _seq(SamplingParams(temperature=0, allowed_token_ids=[1, 2], logprobs=3))
    top = sample(LOGITS[None].clone(), [restricted]).logprobs[0].top  # type: ignore[union-attr]
    assert [t for t, _ in top[:2]] == [1, 2] and math.isinf(top[2][1])
    assert [lp for _, lp in top[:2]] == pytest.approx([math.log(0.6), math.log(0.4)], abs=1e-5)
    both = _seq(SamplingParams(temperature=0, allowed_token_ids=[1, 2], logit_bias={2: 1.0, 5: 50}))
    assert sample(LOGITS[None].clone(), [both]).token_ids == [2]  # the bias cannot reopen token 5


def test_biased_rows_leave_their_neighbours_alone() -> None:
    """Rows with and without a bias in one batch: each row samples what it samples alone, and the ``n`` samples
    of a request share one bias row."""
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0, logit_bias={int(logits[i].argmin()): 100}) if i % 2 else
              SamplingParams(temperature=0) for i in range(6)]  # fmt: skip
    alone = [sample(logits[i : i + 1].clone(), [_seq(p)]).token_ids[0] for i, p in enumerate(params)]
    batch = sample(logits.clone(), [_seq(p) for p in params]).token_ids
    assert batch == alone
    assert batch[1::2] == [int(logits[i].argmin()) for i in (1, 3, 5)]
    assert batch[0::2] == [int(logits[i].argmax()) for i in (0, 2, 4)]
    group = SequenceGroup("r", None, [7], SamplingParams(n=2, logit_bias={1: 1.0}))
    samples = [Sequence(group, i, ByteTokenizer()) for i in range(2)]
    for seq in samples:
        seq.init_sampling_state(VOCAB, torch.device("cpu"))
    assert samples[0].logit_bias is samples[1].logit_bias
    assert samples[0].logit_bias.tolist() == [0, 1, 0, 0, 0, 0, 0, 0]  # type: ignore[union-attr]


def test_logit_bias_and_allowed_tokens_in_the_engine() -> None:
    """Through the engine (prefill's first token and decode steps): the biased token is every token; the
    allowed tokens are the only ones; token ids past the vocabulary are a 400 naming the field."""
    engine = make_engine()
    plain, _, _ = _greedy(engine, "bias", max_tokens=8)
    forced = next(t for t in range(40, 120) if t not in plain)
    biased, _, _ = _greedy(engine, "bias", max_tokens=8, logit_bias={forced: 100})
    assert biased == [forced] * 8
    allowed = [plain[3], forced]
    rid = engine.add_request("bias", SamplingParams(temperature=1.0, seed=3, max_tokens=30, allowed_token_ids=allowed))
    assert set(run_to_completion(engine)[rid].outputs[0].token_ids) <= set(allowed)
    vocab = engine.model.vocab_size
    for field, value in (("logit_bias", {vocab: 1.0}), ("allowed_token_ids", [0, vocab])):
        with pytest.raises(InvalidParameterError) as err:
            engine.add_request("bias", SamplingParams(**{field: value}))
        assert err.value.param == field
    assert engine.pool.num_used == 0 and not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -1.0), ("top_p", 0.0), ("max_tokens", 0), ("n", 0), ("logprobs", 50), ("min_p", 2.0),
     ("presence_penalty", 3.0), ("repetition_penalty", 0.0), ("top_k", -2), ("temperature", math.nan),
     ("top_p", math.inf), ("frequency_penalty", -math.inf), ("n", 10**30), ("temperature", 10**400)],
)
def test_invalid_values_name_the_parameter(field: str, value: float) -> None:
    with pytest.raises(InvalidParameterError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field


@pytest.mark.parametrize(
    ("field", "value"),
    [("top_k", 10**400), ("top_k", INT64_MAX + 1), ("max_tokens", 2**63), ("max_tokens", 1e300),
     ("max_tokens", True), ("n", True), ("n", 2.0), ("min_tokens", 1.5), ("logprobs", True), ("seed", 2**64),
     ("seed", INT64_MAX), ("seed", -(2**63) - 1), ("seed", 1.5), ("stop_token_ids", [2**64]),
     ("stop_token_ids", [True]), ("temperature", "1"), ("temperature", True), ("top_p", None),
     ("repetition_penalty", 1e-320), ("stop", ["ok", 3]), ("logit_bias", {-1: 1.0}),
     ("logit_bias", {"1": 1.0}), ("logit_bias", {1: math.nan}), ("logit_bias", {1: True}), ("allowed_token_ids", []),
     ("allowed_token_ids", [-1]), ("allowed_token_ids", [1.0])],
    ids=lambda value: str(value)[:24],
)  # fmt: skip
def test_hostile_values_are_rejected_up_front(field: str, value: object) -> None:
    """Wrong types, bools, floats for integers, ints beyond int64 or a seed + index beyond it: an
    InvalidParameterError (a 400) naming the field, never a value that reaches the sampler."""
    with pytest.raises(InvalidParameterError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field


def test_extreme_valid_values_sample_and_numbers_are_normalised() -> None:
    params = SamplingParams(temperature=1, top_k=INT64_MAX)
    assert isinstance(params.temperature, float) and params.temperature == 1.0
    assert _draws(params) == {0, 1, 2, 3}  # top_k beyond the vocabulary keeps every token
    last = SamplingParams(n=SamplingParams.MAX_N, seed=SamplingParams.SEED_RANGE[1])
    group = SequenceGroup("r", None, [7], last)
    Sequence(group, last.n - 1, ByteTokenizer()).init_sampling_state(VOCAB, torch.device("cpu"))  # seed + 127
    seq = _seq(SamplingParams(temperature=1.0, top_k=2))
    seq.params.top_k = 10**400  # past validation (e.g. set after construction): the sampler still copes
    assert sample(LOGITS[None].clone(), [seq]).token_ids[0] in {0, 1, 2, 3}


# Engine-level behaviour of the stopping parameters.


def _greedy(engine, prompt: str, **kw) -> tuple[list[int], str, str]:
    rid = engine.add_request(prompt, SamplingParams(temperature=0, **kw))
    out = run_to_completion(engine)[rid].outputs[0]
    return out.token_ids, out.text, out.finish_reason


def test_max_tokens_and_stop_token_ids() -> None:
    engine = make_engine()
    tokens, _, reason = _greedy(engine, "stop ids", max_tokens=20)
    assert len(tokens) == 20 and reason == "length"
    stop_at = tokens[5]
    first = tokens.index(stop_at)
    stopped, _, reason = _greedy(engine, "stop ids", max_tokens=20, stop_token_ids=[stop_at])
    assert stopped == tokens[: first + 1] and reason == "stop"
    held, _, _ = _greedy(engine, "stop ids", max_tokens=20, stop_token_ids=[stop_at], min_tokens=first + 2)
    assert len(held) > first + 1 and stop_at not in held[: first + 2]


def test_eos_stops_unless_ignored() -> None:
    engine = make_engine()
    tokens, _, _ = _greedy(engine, "eos", max_tokens=10)
    engine.tokenizer.eos_token_id = tokens[2]
    eos_at = tokens.index(tokens[2])
    stopped, _, reason = _greedy(engine, "eos", max_tokens=10)
    assert stopped == tokens[: eos_at + 1] and reason == "stop"
    ignored, _, reason = _greedy(engine, "eos", max_tokens=10, ignore_eos=True)
    assert ignored == tokens and reason == "length"


def test_stop_strings_truncate_and_are_never_streamed() -> None:
    engine = make_engine(architecture="minlstm")
    _, text, _ = _greedy(engine, "stop strings", max_tokens=40)
    printable = [i for i in range(4, len(text) - 2) if text[i : i + 2].isprintable()]
    assert printable, f"need a printable substring in {text!r}"
    cut = printable[0]
    stop = text[cut : cut + 2]
    cut = text.index(stop)
    rid = engine.add_request("stop strings", SamplingParams(temperature=0, max_tokens=40, stop=[stop]))
    streamed = ""
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.outputs[0].text_delta
            final = out
    assert final is not None and final.request_id == rid
    assert final.outputs[0].text == text[:cut] == streamed
    assert final.outputs[0].finish_reason == "stop"


def test_n_samples_prefill_the_prompt_once() -> None:
    engine = make_engine()
    prompt = "shared prompt for four samples"
    rid = engine.add_request(prompt, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=12))
    out = run_to_completion(engine)[rid]
    assert engine.total_prefill_tokens == len(prompt)
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in out.outputs}) == 4
    assert engine.pool.num_used == 0
    greedy = make_engine()
    rid = greedy.add_request(prompt, SamplingParams(n=3, temperature=0, max_tokens=12))
    outs = run_to_completion(greedy)[rid].outputs
    single, _, _ = _greedy(make_engine(), prompt, max_tokens=12)
    assert all(o.token_ids == single for o in outs)


# Stop strings: exact semantics against a brute-force reference, and a per-token cost that is bounded.


class WordTokenizer(Tokenizer):
    """Token ``i`` is ``words[i]``: tokens of several characters, so one token can complete a stop string and
    start another."""

    def __init__(self, words: Seq[str]) -> None:
        self.words = list(words)

    @property
    def vocab_size(self) -> int:
        return len(self.words)

    def decode(self, ids: Seq[int]) -> str:
        return "".join(self.words[i] for i in ids)


def _reference_stream(
    pieces: list[str], stops: list[str], min_tokens: int = 0, include: bool = False
) -> tuple[list[str], str, bool]:
    """Brute force: the streamable text after each piece, the final text (cut at the earliest stop string, after
    it with ``include``) and whether a stop string ended it. Up to ``min_tokens`` pieces no stop string counts
    (vLLM); after, one counts when it ends in the new piece's text."""
    text, streamed = "", []
    for count, piece in enumerate(pieces, 1):
        old_len = len(text)
        text += piece
        ends_in_piece = [
            (i, i + len(s))
            for s in stops
            for i in range(len(text) - len(s) + 1)
            if text.startswith(s, i) and i + len(s) > old_len
        ]
        hits = ends_in_piece if count > min_tokens else []
        if hits:
            start, end = min(hits)
            text = text[: end if include else start]
            streamed.append(text)
            return streamed, text, True
        hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        streamed.append(text[: len(text) - hold])
    return streamed, text, False


@pytest.mark.parametrize("tail", [4096, 1, 5])
def test_stop_strings_match_a_brute_force_reference(monkeypatch: pytest.MonkeyPatch, tail: int) -> None:
    """Also with the text's head frozen every few characters (``TEXT_TAIL_CHARS``): a match in progress and
    what a stream holds back stay reachable, and outputs read across the frozen pieces; with ``min_tokens``,
    which holds stop strings back until that many tokens are out, and with ``include_stop_str_in_output``."""
    monkeypatch.setattr(sequence_module, "TEXT_TAIL_CHARS", tail)
    rng = random.Random(0)
    words = ["a", "b", "ab", "ba", "aab", "bba", "abab", "c"]
    for _ in range(400):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        ids = [rng.randrange(len(words)) for _ in range(30)]
        min_tokens = rng.choice([0, 0, 2, 5, 12])
        include = rng.random() < 0.3
        samples = []
        for kind, limit in ((OutputKind.CUMULATIVE, 100), (OutputKind.DELTA, len(ids))):  # the stream ends
            params = SamplingParams(max_tokens=limit, stop=stops, output_kind=kind, min_tokens=min_tokens,
                                    include_stop_str_in_output=include)  # fmt: skip
            group = SequenceGroup("r", None, [0], params)
            seq = Sequence(group, 0, WordTokenizer(words))
            group.seqs = [seq]
            samples.append(seq)
        cumulative, delta = samples
        streamed: list[str] = []
        deltas: list[str] = []
        for step, token in enumerate(ids):
            cumulative.append_token(token, None)
            streamed.append(cumulative.take_output(OutputKind.CUMULATIVE).text)
            delta.append_token(token, None)
            if step % 3 == 0 or delta.finished:  # a stream read every third step
                deltas.append(delta.take_output(OutputKind.DELTA).text)
            if cumulative.finished:
                break
        expected = _reference_stream([words[i] for i in ids], stops, min_tokens, include)
        assert (streamed, cumulative.text, cumulative.finish_reason == "stop") == expected, (stops, ids, min_tokens)
        assert "".join(deltas) == delta.text == expected[1] and (delta.finish_reason == "stop") == expected[2]


@pytest.mark.parametrize("include", [True, False])
def test_a_kept_stop_tokens_text_is_checked_for_stop_strings(include: bool) -> None:
    """A stop token id whose text the output keeps (``include_stop_str_in_output``) ended the sample before the
    stop strings saw that text: ``ab<t>`` with the stop string ``b<t`` came out whole (vLLM: ``ab<t``)."""
    params = SamplingParams(max_tokens=10, stop=["b<t"], stop_token_ids=[2], include_stop_str_in_output=include)
    group = SequenceGroup("r", None, [0], params)
    seq = Sequence(group, 0, WordTokenizer(["a", "b", "<t>", "c"]))
    group.seqs = [seq]
    for token in (0, 1, 2):
        seq.append_token(token, None)
    assert seq.finish_reason == "stop"
    assert (seq.text, seq.stop_reason) == (("ab<t", "b<t") if include else ("ab", 2))


def test_text_decoded_at_each_read_is_the_token_by_token_text() -> None:
    """A FINAL_ONLY sample without stop strings decodes its tokens only when its text is read. Read at random
    steps (as ``DELTA`` takes, to see each read), its deltas add up to the bytes' decode: a stop token (EOS, or
    " " here) left out, a character cut off by the end replaced, and, when it is aborted, the bytes of an
    unfinished character held back, as when each token was decoded at once."""
    rng = random.Random(2)
    tokenizer = ByteTokenizer()
    eos = tokenizer.eos_token_id
    alphabet = [*b"ab ", 0x80, 0xC3, 0xA9, 0xE2, 0xF0, 0x9F, 0x98, 0x80, 0xFF, 300, eos]
    for _ in range(300):
        params = SamplingParams(max_tokens=rng.randint(1, 20), stop_token_ids=[ord(" ")],
                                output_kind=OutputKind.FINAL_ONLY)  # fmt: skip
        group = SequenceGroup("r", None, [0], params)
        seq = Sequence(group, 0, tokenizer)
        group.seqs = [seq]
        abort_at = rng.choice([None, rng.randint(1, 20)])
        deltas, fed = [], []
        while not seq.finished:
            token = rng.choice(alphabet)
            seq.append_token(token, None)
            fed.append(token)
            if len(fed) == abort_at and not seq.finished:
                seq.finish_reason = "abort"
            if rng.random() < 0.3 or seq.finished:
                deltas.append(seq.take_output(OutputKind.DELTA).text)
        data = bytes(t for t in fed if t < 256)
        if seq.finish_reason == "abort":  # not flushed: what the token-by-token decoder had emitted
            expected = "".join(map(tokenizer.stream_decoder().push, fed))
        else:
            expected = bytes(t for t in fed[:-1] if t < 256).decode("utf-8", errors="replace")
            if seq.finish_reason == "length":
                expected = data.decode("utf-8", errors="replace")
        assert seq.text == "".join(deltas) == expected, (fed, seq.finish_reason)
        assert seq.output_token_ids == fed


def _line_events(call: Callable[[], object]) -> int:
    """Python lines executed by ``call`` (a deterministic measure of interpreted work)."""
    count = 0

    def tracer(frame: object, event: str, arg: object) -> Callable:
        nonlocal count
        count += event == "line"
        return tracer

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return count


def _per_token_work(stops: list[str], num_tokens: int) -> list[int]:
    """Lines executed per streamed token of a sample that emits "abab..." and never completes a stop."""
    group = SequenceGroup("r", None, [0], SamplingParams(max_tokens=num_tokens + 1, stop=stops))
    seq = Sequence(group, 0, ByteTokenizer())
    group.seqs = [seq]
    work = []
    for i in range(num_tokens):
        step = lambda i=i: (seq.append_token(ord("ab"[i % 2]), None), seq.take_output(OutputKind.DELTA))  # noqa: E731
        work.append(_line_events(step))
    assert not seq.finished
    return work


def test_stop_string_cost_per_token_does_not_grow_with_the_output_or_the_stop_length() -> None:
    """A stop string that never completes ("Q" + ...), one whose prefix keeps matching the text and one
    that keeps failing: each token costs the same whether it is the 50th or the 1500th, and whether the stop
    strings are 20 or 2000 characters long."""
    def stops(length: int) -> list[str]:
        return ["Q" + "ab" * (length // 2), "ba" * (length // 2) + "Q", "abc" * (length // 3)]

    long_work = _per_token_work(stops(2000), 1500)
    short_work = _per_token_work(stops(20), 1500)
    early, late = max(long_work[40:100]), max(long_work[-100:])
    assert late <= early
    assert max(long_work[40:]) <= max(short_work[40:])



def _generate_with_a_nan_logit(token: int) -> tuple[list[int], list[int]]:
    """Greedy and seeded-draw tokens of the tiny minGRU whose tied embedding row ``token`` is NaN: that token's logit
    is NaN, and once it is fed back every logit is. Checks that no request failed and every slot was freed."""
    engine = make_engine()
    with torch.no_grad():
        engine.model.embed.weight[token] = math.nan
    greedy = engine.add_request("nan", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    drawn = engine.add_request(
        "nan", SamplingParams(temperature=1.0, seed=1, max_tokens=4, ignore_eos=True, logprobs=2)
    )  # fmt: skip
    final = run_to_completion(engine)
    assert final[greedy].error is None and final[drawn].error is None
    assert engine.pool.num_used == 0 and not engine.has_unfinished_requests()
    return final[greedy].outputs[0].token_ids, final[drawn].outputs[0].token_ids


def test_nan_logits_sample_as_torch_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy sampling takes a NaN logit as the maximum, as torch.argmax does (the fused CPU kernel skipped it:
    token 123 lost to a number), and the whole generation equals the one with torch's argmax."""
    fused = _generate_with_a_nan_logit(123)
    monkeypatch.setattr(sampler_module, "row_argmax", row_argmax_ref)
    assert fused == _generate_with_a_nan_logit(123)
    assert fused[0][0] == 123


@pytest.mark.parametrize(
    ("params", "special", "expected"),
    [(SamplingParams(temperature=1.0), {5: math.inf}, 5),
     (SamplingParams(temperature=1.0, top_p=0.9, seed=1), {2: math.inf, 6: math.inf}, 2),
     (SamplingParams(temperature=0.5, top_k=4), {3: 3e38}, 3),
     (SamplingParams(temperature=1.0, logprobs=2), {4: math.nan, 6: math.inf}, 4),
     (SamplingParams(temperature=1.0, min_p=0.1), dict.fromkeys(range(VOCAB), math.nan), 0)],
)  # fmt: skip
def test_a_row_without_a_distribution_takes_its_greedy_token(
    params: SamplingParams, special: dict[int, float], expected: int
) -> None:
    """A row whose softmax is NaN (a +inf or NaN logit, or a finite one that overflowed when divided by the
    temperature) takes the argmax, as a greedy row does; the draw found the vocabulary's last token there. The
    other rows of the batch draw as before."""
    row = LOGITS.clone()
    for token, value in special.items():
        row[token] = value
    seqs = [_seq(params), _seq(SamplingParams(temperature=1.0, seed=7))]
    alone = sample(LOGITS[None].clone(), [_seq(SamplingParams(temperature=1.0, seed=7))]).token_ids[0]
    assert sample(torch.stack([row, LOGITS]), seqs).token_ids == [expected, alone]
