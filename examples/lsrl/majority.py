"""More ones than zeros so far (the paper's Fig. 1).

    rnnserve lsrl compile examples/lsrl/majority.py -o majority
"""

from rnnserve.engine.lsrl import Input, LinState, Node, f_larger, f_not

ALPHABET = "01"


def build() -> Node:
    x = Input(1)
    ones = LinState(x, A=[[1]], B=[[1]], init_state=[0])
    zeros = LinState(f_not(x), A=[[1]], B=[[1]], init_state=[0])
    return f_larger(ones, zeros, mu=10)
