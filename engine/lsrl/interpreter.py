"""Reference semantics: run an uncompiled LSRL program token by token, node by node."""

from __future__ import annotations

import torch

from rnnserve.engine.lsrl import sparse
from rnnserve.engine.lsrl.program import (
    Concat,
    Input,
    Lin,
    LinState,
    Multi,
    Node,
    ReLU,
    program_input,
    topological_order,
)


class Interpreter:
    """Evaluates the program DAG once per token in ``dtype``; LinState states persist between ``step``s."""

    def __init__(self, output: Node, dtype: torch.dtype = torch.float64) -> None:
        self.output = output
        self.order = topological_order(output)
        self.input = program_input(self.order)
        self.dtype = dtype
        self._matrices = {
            (node.id, name): getattr(node, name).to(dtype)
            for node in self.order
            for name in ("A", "B")
            if hasattr(node, name)
        }
        self.states: dict[int, torch.Tensor] = {}
        self.reset()

    def reset(self) -> None:
        """Forget all state: the next token is the first of a new sequence."""
        self.states = {n.id: n.init_state.to(self.dtype) for n in self.order if isinstance(n, LinState)}

    def _mv(self, node: Node, name: str, v: torch.Tensor) -> torch.Tensor:
        return sparse.matvec(self._matrices[(node.id, name)], v)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        """Process one token ``x`` (``[input.dim]``) and return the program's output for it."""
        values: dict[int, torch.Tensor] = {}
        for node in self.order:
            if isinstance(node, Input):
                value = torch.as_tensor(x, dtype=self.dtype).reshape(node.dim)
            elif isinstance(node, Lin):
                value = self._mv(node, "A", values[node.inputs[0].id]) + node.b.to(self.dtype)
            elif isinstance(node, ReLU):
                value = torch.relu(values[node.inputs[0].id])
            elif isinstance(node, LinState):
                value = (
                    self._mv(node, "A", self.states[node.id])
                    + self._mv(node, "B", values[node.inputs[0].id])
                    + node.b.to(self.dtype)
                )
                self.states[node.id] = value
            elif isinstance(node, Concat):
                value = torch.cat([values[i.id] for i in node.inputs])
            elif isinstance(node, Multi):
                inner = values[node.inputs[0].id]
                value = inner[: node.dim] * inner[node.dim :]
            else:
                raise TypeError(f"unknown LSRL node {node!r}")
            values[node.id] = value
        return values[self.output.id]

    def run(self, inputs: torch.Tensor) -> torch.Tensor:
        """Run a whole sequence ``[T, input.dim]`` from the initial state; returns ``[T, output.dim]``."""
        self.reset()
        inputs = torch.as_tensor(inputs, dtype=self.dtype).reshape(-1, self.input.dim)
        return torch.stack([self.step(x) for x in inputs]) if len(inputs) else inputs.new_zeros(0, self.output.dim)


def run_program(output: Node, inputs: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Outputs ``[T, output.dim]`` of the uncompiled program on one sequence ``inputs`` (``[T, in_dim]``)."""
    return Interpreter(output, dtype).run(inputs)
