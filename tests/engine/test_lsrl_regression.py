"""Engine-wide regression with known answers: any bug in state slots, prefill/decode, chunking or batching
turns into a wrong letter of a dictionary lookup served by the compiled ``lsrl:dictionary`` model."""

from __future__ import annotations

import random
import string

from rnnserve.engine import LLM, SamplingParams
from tests.lsrl.conftest import rotated


def random_word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(3))


def make_request(rng: random.Random) -> tuple[str, str]:
    """A prompt (query + 1..8 key/value pairs) and its exact greedy 7-token continuation."""
    pairs: dict[str, str] = {}
    num_pairs = rng.randint(1, 8)
    while len(pairs) < num_pairs:
        pairs[random_word(rng)] = random_word(rng)
    if rng.random() < 0.25:
        query = random_word(rng)
        while query in pairs:
            query = random_word(rng)
        expected = "." * 7  # no key matches: the registers stay 0
    else:
        query = rng.choice(list(pairs))
        value = pairs[query]
        if value[2] + value[:2] == query:  # the fed-back continuation would itself match as a key
            return make_request(rng)
        expected = None
    prompt = query + "".join(k + v for k, v in pairs.items())
    return prompt, expected or rotated(pairs[query], len(prompt))


def test_64_concurrent_dictionary_lookups_are_exact() -> None:
    rng = random.Random(7)
    requests = [make_request(rng) for _ in range(64)]
    assert len({len(p) for p, _ in requests}) >= 6  # mixed prompt lengths
    # 8 slots for 64 requests (slot reuse) and at most 5 prompt tokens per step (tiny prefill chunks).
    llm = LLM("lsrl:dictionary", device="cpu", max_num_seqs=8, max_num_batched_tokens=5)
    outputs = llm.generate([p for p, _ in requests], SamplingParams(temperature=0, max_tokens=7))
    assert [o.outputs[0].text for o in outputs] == [expected for _, expected in requests]
    assert llm.engine.pool.num_free == 8
