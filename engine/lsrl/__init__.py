"""LSRL: a language whose programs compile into stacks of linear-RNN layers (Petrov et al., Sec. 3).

Write a program with the primitives and helpers, run it with :func:`run_program`, compile it with
:func:`compile_program` and serve the result as an ``architecture: "lsrl"`` model.
"""

from rnnserve.engine.lsrl.compiler import Path, compile_program, debranch, fold
from rnnserve.engine.lsrl.helpers import (
    f_and,
    f_bump,
    f_constant,
    f_ifelse,
    f_larger,
    f_modulo_counter,
    f_mul,
    f_not,
    f_or,
    f_relu_identity,
    f_smaller,
    f_step,
)
from rnnserve.engine.lsrl.interpreter import Interpreter, run_program
from rnnserve.engine.lsrl.program import Concat, Input, Lin, LinState, Multi, Node, ReLU

__all__ = [
    "Concat",
    "Input",
    "Interpreter",
    "Lin",
    "LinState",
    "Multi",
    "Node",
    "Path",
    "ReLU",
    "compile_program",
    "debranch",
    "f_and",
    "f_bump",
    "f_constant",
    "f_ifelse",
    "f_larger",
    "f_modulo_counter",
    "f_mul",
    "f_not",
    "f_or",
    "f_relu_identity",
    "f_smaller",
    "f_step",
    "fold",
    "run_program",
]
