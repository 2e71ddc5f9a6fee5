"""Built-in LSRL models, loadable as ``lsrl:<name>``: the paper's programs compiled with their tokenizers.

- ``lsrl:majority`` (Fig. 1): tokens ``0`` and ``1``; outputs 1 while ones outnumber zeros.
- ``lsrl:dictionary`` (Listing 2, n = 3): token 0 is ``.``, 1..26 are ``A``..``Z``; prompt = query, then
  key/value pairs, e.g. ``CANAUSVIEBULSOFCANOTTDENCOPENGLON`` continues greedily with ``TOTTOTT``.
- ``lsrl:approximator`` (Listing 1, d_in = 2, d_out = 1, delta = 0.5): prompt = query then cells, e.g.
  ``(0.7,0.2)[0,0]=1[0,0.5]=2[0.5,0]=3[0.5,0.5]=4`` continues with ``3`` (see :mod:`rnnserve.engine.lsrl.tokens`).
"""

from __future__ import annotations

import functools
import string
from collections.abc import Callable

import torch

from rnnserve.engine.lsrl import programs
from rnnserve.engine.lsrl.compiler import Path, compile_program
from rnnserve.engine.lsrl.program import Node
from rnnserve.engine.lsrl.tokens import TokenInterface, approximator_tokens
from rnnserve.engine.model_sources import ModelLoadError
from rnnserve.engine.models.lsrl import LSRLModel
from rnnserve.engine.tokenizer import CharTokenizer

BUILTINS: dict[str, tuple[Callable[[], Node], Callable[[], TokenInterface]]] = {
    "majority": (programs.majority, lambda: TokenInterface.scalar("01")),
    "dictionary": (programs.dictionary, lambda: TokenInterface.scalar([".", *string.ascii_uppercase])),
    "approximator": (programs.approximator, approximator_tokens),
}


@functools.cache
def compiled(name: str) -> Path:
    """The compiled path of built-in ``name`` (compiled once per process)."""
    return compile_program(BUILTINS[name][0]())


def build_builtin(name: str) -> tuple[LSRLModel, CharTokenizer]:
    """A fresh fp64 model of built-in ``name`` and its tokenizer."""
    tokens = BUILTINS[name][1]()
    return LSRLModel.from_path(compiled(name), tokens), CharTokenizer(tokens.alphabet)


def load_builtin(name: str, device: torch.device, dtype: torch.dtype | None) -> tuple[LSRLModel, CharTokenizer]:
    """Model source for ``lsrl:<name>`` (fp64 unless ``dtype`` says otherwise)."""
    if name not in BUILTINS:
        raise ModelLoadError(f"unknown built-in LSRL model 'lsrl:{name}'; known: {', '.join(sorted(BUILTINS))}")
    model, tokenizer = build_builtin(name)
    return model.to(device=device, dtype=dtype or torch.float64).requires_grad_(False), tokenizer
