"""Every sampling parameter has a test that fails if the parameter is ignored."""

from __future__ import annotations

import math

import pytest
import torch

from rnnserve.engine.sampler import sample
from rnnserve.engine.sampling_params import InvalidParameterError, SamplingParams
from rnnserve.engine.sequence import Sequence, SequenceGroup
from rnnserve.engine.tokenizer import ByteTokenizer
from tests.engine.conftest import make_engine, run_to_completion

VOCAB = 8
PROBS = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0, 0.0, 0.0, 0.0])
LOGITS = torch.log(PROBS.clamp_min(1e-30))


def _seq(params: SamplingParams, prompt: list[int] | None = None) -> Sequence:
    group = SequenceGroup("r", None, prompt or [7], params)
    seq = Sequence(group, 0, ByteTokenizer())
    seq.init_sampling_state(VOCAB, torch.device("cpu"))
    return seq


def _draws(params: SamplingParams, logits: torch.Tensor = LOGITS, rows: int = 400) -> set[int]:
    seqs = [_seq(params) for _ in range(rows)]
    return set(sample(logits.expand(rows, -1).clone(), seqs, eos_token_id=None).token_ids)


def test_greedy_takes_the_argmax_and_temperature_spreads() -> None:
    assert _draws(SamplingParams(temperature=0)) == {0}
    assert _draws(SamplingParams(temperature=1.0)) == {0, 1, 2, 3}


def test_temperature_sharpens_and_flattens() -> None:
    cold = sample(LOGITS.expand(400, -1).clone(), [_seq(SamplingParams(temperature=0.05)) for _ in range(400)], None)
    hot = sample(LOGITS.expand(400, -1).clone(), [_seq(SamplingParams(temperature=5.0)) for _ in range(400)], None)
    assert cold.token_ids.count(0) > 390
    assert hot.token_ids.count(3) > 60  # p(3) rises from 0.1 to ~0.2


def test_top_k_top_p_min_p_restrict_the_support() -> None:
    assert _draws(SamplingParams(top_k=2)) == {0, 1}
    assert _draws(SamplingParams(top_p=0.5)) == {0, 1}
    assert _draws(SamplingParams(top_p=0.75)) == {0, 1, 2}
    assert _draws(SamplingParams(min_p=0.6)) == {0, 1}
    assert _draws(SamplingParams(min_p=0.45)) == {0, 1, 2}


def test_repetition_penalty_covers_prompt_tokens() -> None:
    logits = torch.tensor([[3.0, 2.9, 0, 0, 0, 0, 0, 0]])
    plain = sample(logits.clone(), [_seq(SamplingParams(temperature=0), prompt=[0])], None)
    penalised = sample(logits.clone(), [_seq(SamplingParams(temperature=0, repetition_penalty=1.2), prompt=[0])], None)
    assert plain.token_ids == [0] and penalised.token_ids == [1]


def test_presence_and_frequency_penalties_use_generated_counts() -> None:
    logits = torch.tensor([[3.0, 2.0, 0, 0, 0, 0, 0, 0]])
    presence = _seq(SamplingParams(temperature=0, presence_penalty=1.5))
    frequency = _seq(SamplingParams(temperature=0, frequency_penalty=0.4))
    weak_frequency = _seq(SamplingParams(temperature=0, frequency_penalty=0.4))
    for _ in range(3):
        presence.append_token(0, None, None)
        frequency.append_token(0, None, None)
    weak_frequency.append_token(0, None, None)
    assert sample(logits.clone(), [presence], None).token_ids == [1]
    assert sample(logits.clone(), [frequency], None).token_ids == [1]  # 3 * 0.4 > 1
    assert sample(logits.clone(), [weak_frequency], None).token_ids == [0]  # 1 * 0.4 < 1


def test_min_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 9.0, 8.0, 0.0]])
    early = _seq(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[6]))
    assert sample(logits.clone(), [early], eos_token_id=5).token_ids == [0]
    late = _seq(SamplingParams(temperature=0, min_tokens=1, stop_token_ids=[6]))
    late.append_token(1, None, None)
    assert sample(logits.clone(), [late], eos_token_id=5).token_ids == [5]


def test_seed_gives_reproducible_draws_independent_of_the_batch() -> None:
    params = SamplingParams(temperature=1.0, seed=1234)
    alone = [sample(LOGITS[None].clone(), [s], None).token_ids[0] for s in [_seq(params)] for _ in range(30)]
    seeded = _seq(params)
    batch = []
    for _ in range(30):
        others = [_seq(SamplingParams(temperature=1.0)) for _ in range(5)]
        batch.append(sample(LOGITS.expand(6, -1).clone(), [*others[:2], seeded, *others[2:]], None).token_ids[2])
    assert alone == batch
    other_seed = _seq(SamplingParams(temperature=1.0, seed=99))
    assert [sample(LOGITS[None].clone(), [other_seed], None).token_ids[0] for _ in range(30)] != alone


def test_logprobs_report_the_sampled_token_and_top_n() -> None:
    seq = _seq(SamplingParams(temperature=0, logprobs=3))
    result = sample(LOGITS[None].clone(), [seq], None)
    entry = result.logprobs[0]
    assert entry is not None and entry.token_id == 0
    assert entry.logprob == pytest.approx(math.log(0.4), abs=1e-5)
    assert [t for t, _ in entry.top] == [0, 1, 2]
    assert [lp for _, lp in entry.top] == pytest.approx([math.log(p) for p in (0.4, 0.3, 0.2)], abs=1e-5)
    assert sample(LOGITS[None].clone(), [_seq(SamplingParams(temperature=0))], None).logprobs == [None]


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -1.0), ("top_p", 0.0), ("max_tokens", 0), ("n", 0), ("logprobs", 50), ("min_p", 2.0),
     ("presence_penalty", 3.0), ("repetition_penalty", 0.0), ("top_k", -2)],
)
def test_invalid_values_name_the_parameter(field: str, value: float) -> None:
    with pytest.raises(InvalidParameterError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field


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
    engine.eos_token_id = tokens[2]
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
