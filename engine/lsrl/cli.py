"""``rnnserve lsrl``: compile LSRL program files into checkpoints and run them.

A program file is Python that defines ``build()``, returning the program's output node, and optionally:

- ``ALPHABET``: token strings, token ``i`` is ``ALPHABET[i]`` (a string of characters or a list of
  strings); default ``"0123456789"``.
- ``EMBEDDING``: one input vector per token, for programs whose ``Input`` has several dimensions
  (default ``E[v] = [v]``).
- ``VALUES``: each token's output value (``None``: never generated); default ``v`` for token ``v``.

The file is executed as ordinary Python: compile only programs you trust.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path as FilePath
from types import ModuleType

import torch

from rnnserve.engine.lsrl.compiler import LinStateOp, Path, compile_program
from rnnserve.engine.lsrl.interpreter import run_program
from rnnserve.engine.lsrl.program import Node, program_input, topological_order
from rnnserve.engine.lsrl.tokens import TokenInterface
from rnnserve.engine.models.lsrl import LSRLModel
from rnnserve.engine.tokenizer import CharTokenizer

DEFAULT_ALPHABET = "0123456789"


class ProgramFileError(ValueError):
    """A program file does not define what ``rnnserve lsrl`` needs."""


def _import(path: FilePath) -> ModuleType:
    if not path.is_file():
        raise ProgramFileError(f"{path}: no such file")
    name = f"lsrl_program_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ProgramFileError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    # as `python program.py` runs it: registered (a @dataclass needs its module) and its folder importable
    sys.modules[name] = module
    sys.path.insert(0, str(path.resolve().parent))
    try:
        with _program_errors(path, "importing it"):
            spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module


@contextlib.contextmanager
def _program_errors(path: FilePath, doing: str) -> Iterator[None]:
    """A :class:`ProgramFileError` naming the file for whatever the program's own code raises while ``doing``
    (a syntax error, an LSRL call with wrong arguments): one line, not a traceback through the CLI."""
    try:
        yield
    except ProgramFileError:
        raise
    except SyntaxError as err:
        raise ProgramFileError(f"{path}, line {err.lineno}: syntax error: {err.msg}") from err
    except Exception as err:  # noqa: BLE001 - anything the user's program raises
        raise ProgramFileError(f"{path}: {doing} raised {type(err).__name__}: {err}") from err


def load_program_file(path: str | FilePath) -> tuple[Node, TokenInterface]:
    """The output node built by a program file and its token interface (see the module docstring)."""
    path = FilePath(path)
    module = _import(path)
    build = getattr(module, "build", None)
    if not callable(build):
        raise ProgramFileError(f"{path}: define build() returning the program's output node")
    with _program_errors(path, "build()"):
        output = build()
    if not isinstance(output, Node):
        raise ProgramFileError(f"{path}: build() returned {type(output).__name__}, not an LSRL node")
    try:
        program_input(topological_order(output))
    except ValueError as err:  # a cycle, no Input or two
        raise ProgramFileError(f"{path}: build() returned no valid program: {err}") from err
    alphabet = getattr(module, "ALPHABET", DEFAULT_ALPHABET)
    if not isinstance(alphabet, str | list | tuple) or not alphabet:
        raise ProgramFileError(f"{path}: ALPHABET must be a non-empty string or list of characters")
    embedding = getattr(module, "EMBEDDING", None)
    values = getattr(module, "VALUES", None)
    with _program_errors(path, "its ALPHABET, EMBEDDING or VALUES"):
        scalar = TokenInterface.scalar(list(alphabet))
        if embedding is None and values is None:
            return output, scalar
        return output, TokenInterface.table(
            list(alphabet),
            scalar.embedding.tolist() if embedding is None else embedding,
            scalar.values.tolist() if values is None else values,
        )


def compile_file(program: str | FilePath, out_dir: str | FilePath, force: bool = False) -> tuple[Path, LSRLModel]:
    """Compile a program file and write it as an ``architecture: "lsrl"`` checkpoint to ``out_dir``: a new or
    empty directory, or with ``force`` one whose ``config.json`` and ``model.safetensors`` it replaces."""
    from rnnserve.engine.loader import save_checkpoint

    out = FilePath(out_dir)
    if out.exists() and not out.is_dir():
        raise ProgramFileError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ProgramFileError(f"{out}: exists and is not empty (pass --force to write the checkpoint into it)")
    output, tokens = load_program_file(program)
    with _program_errors(FilePath(program), "compiling it"):  # a node type of its own, weights it cannot take
        path = compile_program(output)
        model = LSRLModel.from_path(path, tokens)
    bad = next((name for name, t in model.state_dict().items()
                if name != "token_values" and t.is_floating_point() and not torch.isfinite(t).all()), None)  # fmt: skip
    if bad is not None:
        raise ProgramFileError(f"{program}: the compiled model's {bad} holds NaN or infinite numbers")
    save_checkpoint(model, out_dir)
    return path, model


def _summary(path: Path, model: LSRLModel) -> str:
    kinds = [type(op).__name__.removesuffix("Op") for op in path.ops]
    layers = sum(isinstance(op, LinStateOp) for op in path.ops)
    state = model.state_spec()[0].numel
    return (
        f"{len(path.ops)} ops ({', '.join(kinds)}), {layers} LinState layer(s), "
        f"{path.num_parameters} stored numbers, {state} state numbers per sequence"
    )


def _run(args: argparse.Namespace) -> int:
    output, tokens = load_program_file(args.program)
    ids = CharTokenizer(tokens.alphabet).encode(args.text)
    inputs = tokens.embedding[ids]
    reference = run_program(output, inputs)
    model = LSRLModel.from_path(compile_program(output), tokens).to(dtype=torch.float64)
    cu_seqlens = torch.tensor([0, len(ids)])
    compiled, _ = model.run_vectors(inputs, cu_seqlens, model.initial_state(1))
    print("token\tinterpreted\tcompiled")
    for token, y_ref, y in zip(ids, reference.tolist(), compiled.tolist(), strict=True):
        print(f"{tokens.alphabet[token]}\t{y_ref}\t{y}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``rnnserve lsrl`` command line: ``compile`` and ``run``."""
    parser = argparse.ArgumentParser(prog="rnnserve lsrl", description="Compile and run LSRL programs.")
    sub = parser.add_subparsers(dest="command", required=True)
    comp = sub.add_parser("compile", help="compile PROGRAM.py into a checkpoint directory")
    comp.add_argument("program", help="Python file defining build() (and optionally ALPHABET/EMBEDDING/VALUES)")
    comp.add_argument("-o", "--output", required=True, help="checkpoint directory to write (new or empty)")
    comp.add_argument("--force", action="store_true", help="write into a non-empty output directory")
    run = sub.add_parser("run", help="print per-token outputs of PROGRAM.py, interpreted and compiled")
    run.add_argument("program", help="Python file defining build()")
    run.add_argument("text", help="input text in the program's alphabet")
    return parser


def main(argv: list[str]) -> int:
    """Entry point of ``rnnserve lsrl``; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        path, model = compile_file(args.program, args.output, args.force)
    except ValueError as err:  # includes ProgramFileError and invalid programs
        print(f"rnnserve lsrl: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # an output path that cannot be written
        print(f"rnnserve lsrl: {err.filename or args.output}: {err.strerror}", file=sys.stderr)
        return 1
    print(f"compiled {args.program} -> {args.output}: {_summary(path, model)}")
    return 0
