"""Constraints built to break llguidance's compiler: a long chain of rules (a Lark rule naming the next, a JSON
schema's ``$ref`` to the next definition) made it recurse past a thread's stack, a SIGSEGV that took the whole
server down with it (one request of 180 KB). A compile now runs on a stack sized for its constraint, and a
constraint has a size limit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rnnserve.engine.sampling_params import InvalidParameterError
from rnnserve.engine.sampling_params import StructuredOutputParams as Constraint
from rnnserve.engine.structured_output import MAX_CONSTRAINT_BYTES, GrammarCompiler, call_with_stack
from rnnserve.engine.tokenizer import ByteTokenizer

LINKS = 6000  # 3000 overflowed an 8 MiB stack


def lark_rule_chain(links: int) -> Constraint:
    rules = "\n".join(f"r{i}: r{i + 1}" for i in range(links))
    return Constraint(grammar=f'start: r0\n{rules}\nr{links}: "a"')


def schema_ref_chain(links: int) -> Constraint:
    definitions: dict[str, object] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(links)}
    definitions[f"d{links}"] = {"enum": ["a"]}
    return Constraint(json={"$ref": "#/$defs/d0", "$defs": definitions})


def test_rule_chains_compile_on_a_thread_with_an_ordinary_stack() -> None:
    """Compiled (as the server does) from a thread with an 8 MiB stack, in a child process: without the large
    compile stack the child died of SIGSEGV."""
    code = textwrap.dedent(
        f"""
        import threading
        from rnnserve.engine.structured_output import GrammarCompiler
        from rnnserve.engine.tokenizer import ByteTokenizer
        from tests.engine.test_grammar_compile_limits import lark_rule_chain, schema_ref_chain

        compiler = GrammarCompiler(ByteTokenizer(), 257)
        def compile_both():
            for constraint in (lark_rule_chain({LINKS}), schema_ref_chain({LINKS})):
                print(compiler.compile(constraint).start().matcher.is_error(), flush=True)
        threading.stack_size(8 << 20)
        worker = threading.Thread(target=compile_both)
        worker.start()
        worker.join()
        """
    )
    root = Path(__file__).resolve().parents[2]
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split() == ["False", "False"]


def test_a_constraint_past_the_size_limit_is_refused_before_compiling() -> None:
    compiler = GrammarCompiler(ByteTokenizer(), 257)
    choices = [f"choice {i:07d}" for i in range(MAX_CONSTRAINT_BYTES // 16)]
    with pytest.raises(InvalidParameterError, match="too large") as refused:
        compiler.compile(Constraint(choice=choices))
    assert refused.value.param == "structured_outputs"
    compiler.compile(Constraint(choice=choices[:1000]))  # a large one within the limit compiles


def test_call_with_stack_returns_and_raises_in_the_callers_thread() -> None:
    assert call_with_stack(lambda: 42, 1 << 20) == 42
    with pytest.raises(KeyError, match="missing"):
        call_with_stack(lambda: {}["missing"], 1 << 20)


def test_a_schema_nested_past_pythons_stack_is_a_parameter_error() -> None:
    """The offline API takes a schema as a dict: one nested 5000 deep made ``json.dumps`` raise RecursionError
    (the server's JSON parser stops far earlier)."""
    schema: dict[str, object] = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(InvalidParameterError, match="not JSON"):
        Constraint(json=schema)
