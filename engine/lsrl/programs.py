"""The paper's LSRL programs (Fig. 1, Listings 1 and 2), written with the multiplicative ``f_ifelse``.

Each function builds a fresh program and returns its output node. With the ReLU form of ``f_ifelse``
(Eq. 7) the compiled dictionary gives wrong answers even in fp64, so the built-ins use Eq. 10.
"""

from __future__ import annotations

import torch

from rnnserve.engine.lsrl import sparse
from rnnserve.engine.lsrl.helpers import (
    IfElseForm,
    f_and,
    f_bump,
    f_constant,
    f_ifelse,
    f_larger,
    f_modulo_counter,
    f_not,
    f_smaller,
)
from rnnserve.engine.lsrl.program import Concat, Input, Lin, LinState, Node


def _counter(x: Node, start: float) -> Node:
    """A LinState counting tokens: ``start + 1`` at the first token, then ``+1`` per token."""
    return LinState(f_constant(x, 1.0), A=[[1.0]], B=[[1.0]], init_state=[start])


def _accumulator(x: Node) -> Node:
    """A LinState holding the running sum of ``x``."""
    eye = sparse.identity(x.dim)
    return LinState(x, A=eye, B=eye)


def majority() -> Node:
    """Fig. 1: 1 while the tokens so far hold more ones than zeros, else 0 (input tokens 0/1)."""
    x = Input(1)
    ones = _accumulator(x)
    zeros = _accumulator(f_not(x))
    return f_larger(ones, zeros, mu=10.0)


POSITION_BOUND = 1e9  # lam of an f_ifelse that passes a token position (exact in fp64: integers below 2^53)


def dictionary(n: int = 3, form: IfElseForm = "multiplicative") -> Node:
    """Listing 2: dictionary lookup over token sequences (tokens are positive integers).

    Input: ``n`` query tokens, then key/value pairs of ``n`` tokens each. At position ``t`` the output is
    register ``t mod n`` of the value whose key matched the query (0 until a key matches), so the last
    ``n`` outputs of the prompt spell the value (rotated by the prompt length).
    """
    x = Input(1)
    position = _counter(x, -1.0)  # 0 at the first token
    mod_n = f_modulo_counter(x, n)
    mod_2n = f_modulo_counter(x, 2 * n)

    is_prompt = f_larger(position, n - 0.5)
    is_compare = f_larger(mod_2n, n - 0.5)
    is_copy = f_and(is_prompt, f_not(is_compare))
    is_first_copy = f_and(is_copy, f_smaller(mod_n, 0.5))
    mod_n_is = [f_and(f_larger(mod_n, i - 0.5), f_smaller(mod_n, i + 0.5)) for i in range(n)]

    # Store the query: token i of the first n goes to query[i].
    query_token = f_ifelse(f_smaller(is_prompt, 0.5), x, form=form)
    query = _accumulator(Concat([f_ifelse(mod_n_is[i], query_token, form=form) for i in range(n)]))

    # In a key, compare each token with the query token at the same offset.
    query_here = Lin(Concat([f_ifelse(mod_n_is[i], query[i], form=form) for i in range(n)]), [[1.0] * n])
    matching = f_and(f_and(f_larger(x, query_here - 0.5), f_smaller(x, query_here + 0.5)), is_compare)

    # Last n+1 match flags (shift register); the key matched if the n before this token all did.
    shift = torch.diag(torch.ones(n, dtype=sparse.DTYPE), 1)
    buffer = LinState(matching, A=shift, B=[[0.0]] * n + [[1.0]])
    all_matching = f_larger(Lin(buffer, [[1.0] * n + [0.0]]), n - 0.5)

    # Remember where the matching value starts, and copy its n tokens into the output registers.
    starts_here = f_and(all_matching, is_first_copy)
    # the position is unbounded: the ReLU forms need their bound lam above any prompt's length
    started_on = _accumulator(f_ifelse(starts_here, position, form=form, lam=POSITION_BOUND))
    copying = f_and(is_copy, f_smaller(position, started_on + float(n)))
    registers = [_accumulator(f_ifelse(f_and(copying, mod_n_is[i]), x, form=form)) for i in range(n)]

    # Output register t mod n.
    return Lin(Concat([f_ifelse(mod_n_is[i], registers[i], form=form) for i in range(n)]), [[1.0] * n])


def approximator(d_in: int = 2, d_out: int = 1, form: IfElseForm = "multiplicative") -> Node:
    """Listing 1: piecewise-constant approximation of a function given in context.

    Token 0 is the query ``[q, 0, ..., 0]`` (``q`` in ``[0, 1]^d_in``); each later token describes one
    cell ``[delta, l_1 .. l_d_in, y_1 .. y_d_out]`` (the cell is ``l < q <= l + delta``). The output is
    the sum of the ``y`` of the cells seen so far that contain ``q``.
    """
    x = Input(1 + d_in + d_out)
    position = _counter(x, 0.0)  # 1 at the first token
    is_query = f_smaller(position, 1.5)
    q = _accumulator(f_ifelse(is_query, x[:d_in], form=form))

    step = Lin(x[0], torch.ones(d_in, 1, dtype=sparse.DTYPE))
    lower = x[1 : 1 + d_in]
    inside = f_bump(q, lower, lower + step)
    in_cell = f_larger(Lin(inside, [[1.0] * d_in]), d_in - 0.5)
    update = f_ifelse(f_and(in_cell, f_not(is_query)), x[1 + d_in :], form=form)
    return _accumulator(update)
