"""Structured outputs: every sample follows its JSON schema, regex, choice or grammar, with the byte tokenizer and
a Hugging Face BPE tokenizer, alone and beside unconstrained rows, with synchronous and async scheduling."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest
import torch
from llguidance import LLMatcher

from rnnserve.engine.config import EngineConfig
from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.loader import load_model
from rnnserve.engine.sampler import sample
from rnnserve.engine.sampling_params import InvalidParameterError, SamplingParams
from rnnserve.engine.sampling_params import StructuredOutputParams as Constraint
from rnnserve.engine.sequence import Sequence, SequenceGroup
from rnnserve.engine.structured_output import GrammarCompiler, allowed_tokens
from rnnserve.engine.tokenizer import ByteTokenizer, TokenIdTokenizer
from tests.engine.conftest import make_engine, run_to_completion, tiny_model
from tests.server.tiny_checkpoint import write_tiny_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["color", "ok", "name", "tags"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe so"]
LARK = 'start: "(" NUM ("," NUM)? ")"\nNUM: /[0-9]{1,3}/'


def follows(constraint: Constraint, text: str) -> bool:
    """Whether ``text`` satisfies ``constraint`` (checked without llguidance)."""
    if constraint.json is not None:
        jsonschema.validate(json.loads(text), constraint.json)  # type: ignore[arg-type]
        return text == json.dumps(json.loads(text), ensure_ascii=False)  # compact: json.dumps' separators only
    if constraint.regex is not None:
        return re.fullmatch(constraint.regex, text) is not None
    if constraint.choice is not None:
        return text in constraint.choice
    return re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})?\)", text) is not None


CONSTRAINTS = [Constraint(json=SCHEMA), Constraint(regex=REGEX), Constraint(choice=CHOICES), Constraint(grammar=LARK)]


def generate(engine: LLMEngine, constraint: Constraint | None, n: int = 1, **sampling: object) -> list:
    sampling = {"max_tokens": 200, **sampling}
    params = SamplingParams(n=n, structured_outputs=constraint, **sampling)  # type: ignore[arg-type]
    rid = engine.add_request("Once upon a time", params)
    return run_to_completion(engine)[rid].outputs


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=["json", "regex", "choice", "grammar"])
@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_every_sample_follows_its_constraint(constraint: Constraint, async_scheduling: str) -> None:
    """Random weights, temperature 1: whatever the model prefers, each of 6 samples is complete and valid, ends with
    ``stop`` at its last token (the byte tokenizer's EOS is never needed), and ``allowed_token_ids``-style masks
    leave the other samples' tokens alone."""
    engine = make_engine(async_scheduling=async_scheduling)
    outputs = generate(engine, constraint, n=6, temperature=1.0, seed=11)
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        assert follows(constraint, out.text), out.text
        assert engine.tokenizer.eos_token_id not in out.token_ids
    assert len({o.text for o in outputs}) > 1 or constraint.choice is not None
    assert engine.pool.num_used == 0


def test_greedy_takes_the_best_allowed_token_and_neighbours_are_untouched() -> None:
    """Greedy under a choice picks the choice whose tokens the model ranks highest step by step (checked against
    the masked argmax computed here from the model's own logits), and rows without a constraint in the same
    batch generate what they generate alone, with synchronous and async scheduling."""
    for async_scheduling in ("off", "on"):
        engine = make_engine(async_scheduling=async_scheduling)
        plain = SamplingParams(temperature=0, max_tokens=12)
        rid_plain = engine.add_request("Once upon a time", plain)
        expected = run_to_completion(engine)[rid_plain].outputs[0].token_ids
        rids = [engine.add_request("Once upon a time", plain)]
        constrained = SamplingParams(temperature=0, max_tokens=12, structured_outputs=Constraint(choice=CHOICES))
        rids.append(engine.add_request("Once upon a time", constrained))
        rids.append(engine.add_request("Once upon a time", plain))
        done = run_to_completion(engine)
        assert done[rids[0]].outputs[0].token_ids == expected == done[rids[2]].outputs[0].token_ids
        assert done[rids[1]].outputs[0].text in CHOICES


def test_greedy_choice_matches_the_masked_argmax() -> None:
    """The engine's greedy constrained tokens are, at every step, the model's greedy token among those the grammar
    allows: computed here token by token with a fresh matcher, each step a new request for one token over the
    tokens so far, restricted with ``allowed_token_ids``."""
    engine = make_engine()
    constraint = Constraint(grammar=LARK)
    out = generate(engine, constraint, temperature=0)[0]
    matcher = engine.grammars.compile(constraint).start()
    vocab = engine.model.vocab_size
    prompt = list(b"Once upon a time")
    tokens: list[int] = []
    while matcher.end is None:
        mask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
        matcher.fill_mask(mask, 0)
        allowed = allowed_tokens(mask, vocab)[0].nonzero().flatten().tolist()
        params = SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=allowed)
        rid = engine.add_request(prompt + tokens, params)
        tokens += run_to_completion(engine)[rid].outputs[0].token_ids
        matcher.advance(tokens[-1], len(tokens))
    assert matcher.error is None and tokens == out.token_ids and len(tokens) > 3


def test_length_limit_bias_and_logprobs_with_a_constraint() -> None:
    """``max_tokens`` cuts a constrained sample with ``length``; the returned logprobs are those of the masked
    distribution (every alternative an allowed token); ``logit_bias`` acts among the allowed tokens."""
    engine = make_engine()
    out = generate(engine, Constraint(regex="[a-c]{20}"), temperature=1.0, seed=3, max_tokens=5, logprobs=5)[0]
    assert out.finish_reason == "length" and re.fullmatch("[a-c]{5}", out.text)
    for entry in out.logprobs:
        finite = [t for t, lp in entry.top if lp > float("-inf")]
        assert finite and set(finite) <= set(b"abc")
    biased = generate(engine, Constraint(regex="[a-c]{4}"), temperature=0, logit_bias={ord("b"): 100})[0]
    assert biased.text == "bbbb" and biased.finish_reason == "stop"


def test_hugging_face_tokenizer(tmp_path: Path) -> None:
    """A byte-level BPE tokenizer with merges: the constraint holds on the decoded text."""
    model, tokenizer = load_model(str(write_tiny_checkpoint(tmp_path / "ckpt")), device="cpu")
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=8))
    for constraint in (Constraint(json=SCHEMA), Constraint(choice=["The quick", "brown fox", "lazy dog"])):
        rid = engine.add_request("The quick", SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=200,
                                                             structured_outputs=constraint))  # fmt: skip
        for out in run_to_completion(engine)[rid].outputs:
            assert out.finish_reason == "stop" and follows(constraint, out.text), out.text


def test_invalid_constraints_are_rejected_before_anything_runs() -> None:
    engine = make_engine()
    bad = [Constraint(regex="(a"), Constraint(grammar="start: nowhere"), Constraint(json={"type": "nonsense"}),
           Constraint(json="{not json", param="response_format"),
           # valid, but past llguidance's lexer and parser limits at the first token
           Constraint(regex="a{1000000}"),
           Constraint(choice=[f"w{i}" for i in range(2001)], param="tools")]  # fmt: skip
    for constraint in bad:
        with pytest.raises(InvalidParameterError) as err:
            engine.add_request("x", SamplingParams(structured_outputs=constraint))
        assert err.value.param == constraint.param
    for fields in ({}, {"regex": "a", "choice": ["b"]}, {"choice": []}, {"choice": ["", "a"]}, {"choice": "abc"},
                   {"regex": ""}):  # fmt: skip
        with pytest.raises(InvalidParameterError):
            Constraint(**fields)
    assert not engine.has_unfinished_requests() and engine.pool.num_used == 0
    no_eos = LLMEngine(tiny_model("mingru"), TokenIdTokenizer(300), EngineConfig(max_num_seqs=2))
    with pytest.raises(InvalidParameterError, match="end-of-text"):
        no_eos.add_request([1, 2], SamplingParams(structured_outputs=Constraint(regex="1")))


def test_sampler_masks_only_rows_whose_grammar_goes_on() -> None:
    """The sampler alone: a constrained row can only take allowed tokens whatever its logits; a row whose grammar
    ended (its token is dropped under async scheduling) is not masked, so an all-forbidden row never happens."""
    compiler = GrammarCompiler(ByteTokenizer(), 300)
    grammar = compiler.compile(Constraint(regex="x"))
    group = SequenceGroup("r", None, [7], SamplingParams(temperature=0), grammar=grammar)
    seq = Sequence(group, 0, ByteTokenizer())
    seq.init_sampling_state(300, torch.device("cpu"))
    logits = torch.zeros(1, 300)
    logits[0, ord("y")] = 50.0
    assert sample(logits.clone(), [seq]).token_ids == [ord("x")]
    assert seq.grammar is not None and seq.grammar.end == 1  # the regex is complete after one token
    assert sample(logits.clone(), [seq]).token_ids == [ord("y")]  # not masked, and dropped
    seq.append_token(ord("x"), None)
    assert seq.finish_reason == "stop" and seq.text == "x"
    assert LLMatcher.validate_grammar(group.grammar.grammar) == ""  # type: ignore[union-attr]


def test_structured_outputs_may_be_given_as_a_dict() -> None:
    """vLLM users write ``structured_outputs={"choice": [...]}``: it was refused ("must be StructuredOutputParams",
    a class the README did not name)."""
    from rnnserve import StructuredOutputParams

    params = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    assert params.structured_outputs == StructuredOutputParams(choice=["yes", "no"])
    with pytest.raises(InvalidParameterError, match="structural_tag"):
        SamplingParams(structured_outputs={"structural_tag": "x"})
    with pytest.raises(InvalidParameterError, match="give exactly one"):
        SamplingParams(structured_outputs={"choice": ["a"], "regex": "a"})


def test_the_prompts_of_a_request_share_one_compiled_grammar(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's prompts are added one by one with the same parameters: each compiled the grammar again on the
    engine thread (a 20-prompt request with a large enum stalled every stream 11.6 s)."""
    engine = make_engine()
    compiled: list[Constraint] = []
    real = GrammarCompiler._compile

    def counting(self: GrammarCompiler, params: Constraint):  # type: ignore[no-untyped-def]
        compiled.append(params)
        return real(self, params)

    monkeypatch.setattr(GrammarCompiler, "_compile", counting)
    params = SamplingParams(max_tokens=4, structured_outputs=Constraint(choice=["yes", "no"]))
    for prompt in ("a", "b", "c"):
        engine.add_request(prompt, params)
    assert len(compiled) == 1
    engine.add_request("d", SamplingParams(max_tokens=4, structured_outputs=Constraint(choice=["yes", "no"])))
    assert len(compiled) == 2
    outputs = run_to_completion(engine)
    assert len(outputs) == 4 and all(o.outputs[0].text in ("yes", "no") for o in outputs.values())


def wide_schema(num_properties: int) -> dict:
    """An object of ``num_properties`` optional objects: its grammar grows by ~20 symbols a property."""
    inner = {"type": "object", "properties": {"v": {"type": "integer"}}}
    return {"type": "object", "properties": {f"k{i}": inner for i in range(num_properties)}}


def test_a_request_compiles_its_grammar_once_and_its_samples_copy_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiling checked the grammar, built a matcher to try its first token, then each sample built one more,
    on the engine's thread: a schema that took 1 s to compile cost 2 + n s. One matcher is built; samples copy it."""
    import llguidance

    real = llguidance.LLMatcher
    built: list[str] = []

    class CountingMatcher:
        def __new__(cls, tokenizer: object, grammar: str, **options: object) -> object:
            built.append(grammar)
            return real(tokenizer, grammar, **options)

    for name in ("grammar_from_json_schema", "grammar_from_regex", "grammar_from_lark", "validate_grammar"):
        setattr(CountingMatcher, name, staticmethod(getattr(real, name)))
    monkeypatch.setattr(llguidance, "LLMatcher", CountingMatcher)
    engine = make_engine()
    constraint = Constraint(json=SCHEMA)
    outputs = generate(engine, constraint, n=3, temperature=1.0, seed=5)
    assert len(built) == 1
    assert all(out.finish_reason == "stop" and follows(constraint, out.text) for out in outputs)


def test_a_grammar_too_large_is_refused_quickly_and_clearly() -> None:
    """A schema of 8000 objects (567 KB) compiled for 3 s and more, then llguidance panicked (a 400 whose message
    was a backtrace). Past the size limit it is refused at once; one under it that still meets llguidance's
    symbol limit is refused with a message, not the backtrace."""
    compiler = GrammarCompiler(ByteTokenizer(), 300)
    with pytest.raises(InvalidParameterError, match="too big") as err:  # the size limit, met before compiling
        compiler.compile(Constraint(json=wide_schema(8000), param="response_format"))
    assert err.value.param == "response_format"
    with pytest.raises(InvalidParameterError, match="too large for llguidance") as err:
        compiler.compile(Constraint(json=wide_schema(4800)))
    assert "backtrace" not in str(err.value) and "\n" not in str(err.value)


def right_recursive(rules: int) -> str:
    """A Lark grammar whose ``rules`` right-recursive rules all match ``a+``: each ``a`` adds as many items to the
    parser's row, so with 40 of them llguidance's limit of 2000 items a row is met after ~45 tokens, not at the
    first token, which admission tries."""
    return "start: " + " | ".join(f"s{i}" for i in range(rules)) + "\n" + "\n".join(
        f's{i}: "a" s{i} | "a"' for i in range(rules))


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_a_grammar_that_meets_the_parser_limit_midway_fails_its_request_alone(async_scheduling: str) -> None:
    """The grammar is accepted, then its parser meets llguidance's per-step limit while the request generates
    (``min_tokens`` keeps it from ending first): the request failed with a ValueError, a 500. It now fails as the
    request's own error, naming its parameter (a 400), with llguidance's reason; its slot is freed and the
    request beside it, and the next one, run as if nothing happened."""
    engine = make_engine(async_scheduling=async_scheduling)
    beside = engine.add_request("Once upon", SamplingParams(max_tokens=80, ignore_eos=True, temperature=1.0, seed=3))
    constraint = Constraint(grammar=right_recursive(40), param="response_format")
    failing = engine.add_request("x", SamplingParams(max_tokens=200, min_tokens=100, structured_outputs=constraint))
    outputs = run_to_completion(engine)
    failed = outputs[failing]
    assert failed.error_param == "response_format" and failed.outputs[0].finish_reason == "error"
    assert re.match(r"the structured output failed after \d+ tokens: Parser Error: .*max is 2000", failed.error)
    assert outputs[beside].error is None and len(outputs[beside].outputs[0].token_ids) == 80
    assert engine.pool.num_used == 0
    after = generate(engine, Constraint(regex=REGEX), temperature=1.0, seed=2)
    assert after[0].finish_reason == "stop" and follows(Constraint(regex=REGEX), after[0].text)


def test_compiling_on_a_thread_of_its_own_starts_no_openmp_team() -> None:
    """The server compiles grammars on a thread of its own. Reading the first step's mask with torch ops over the
    vocabulary there started a second OpenMP team (one more OS thread per extra torch thread), which makes every
    CPU decode step ~17% slower (see ``EngineThread``): the compile's only threads are now its own."""
    compiler = GrammarCompiler(ByteTokenizer(), 1 << 16)  # a vocabulary past torch's grain for parallel ops
    suite_threads = torch.get_num_threads()
    torch.set_num_threads(2)  # as a server runs (the suite runs torch on one thread, where no team ever starts)
    try:
        torch.ones(1 << 16).mul(2).sum()  # this thread's team
        threads_before = len(os.listdir("/proc/self/task"))
        with ThreadPoolExecutor(1) as grammar_thread:
            grammar = grammar_thread.submit(compiler.compile, Constraint(json=SCHEMA)).result()
            assert len(os.listdir("/proc/self/task")) == threads_before + 1  # the grammar thread itself
    finally:
        torch.set_num_threads(suite_threads)
    assert grammar.allows_first([ord("{")]) and not grammar.allows_first([ord("x"), 1 << 15, (1 << 16) + 5])
