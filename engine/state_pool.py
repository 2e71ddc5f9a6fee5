"""Preallocated constant-size recurrent state, one slot per running sequence.

Every state tensor of the model is allocated once as ``[num_slots + 1, *shape]``. The extra last row is
a scratch slot that padded batch rows (CUDA-graph buckets) may read and write without touching a real
sequence. Allocation is a free-list pop; nothing grows while requests run.
"""

from __future__ import annotations

import torch

from rnnserve.engine.models.base import StateSpec, long_tensor


class OutOfSlotsError(RuntimeError):
    """Raised when more slots are requested than are free."""


class StatePool:
    """Owns the per-slot state tensors of one model."""

    def __init__(self, specs: list[StateSpec], num_slots: int, device: torch.device | str = "cpu") -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate state names in spec: {names}")
        self.specs = list(specs)
        self.bytes_per_slot = sum(s.nbytes for s in self.specs)  # the engine reports it with every step's load
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.scratch_slot = num_slots
        self.tensors: dict[str, torch.Tensor] = {}
        self._initial: dict[str, torch.Tensor] = {}
        for spec in self.specs:
            self.tensors[spec.name] = torch.empty((num_slots + 1, *spec.shape), dtype=spec.dtype, device=self.device)
            init = spec.initial
            if isinstance(init, torch.Tensor):
                if tuple(init.shape) != spec.shape:
                    raise ValueError(f"state {spec.name}: initial shape {tuple(init.shape)} != {spec.shape}")
                self._initial[spec.name] = init.to(device=self.device, dtype=spec.dtype)
            else:
                self._initial[spec.name] = torch.full(spec.shape, float(init), dtype=spec.dtype, device=self.device)
        self.reset(torch.arange(num_slots + 1))
        self._free = list(range(num_slots - 1, -1, -1))
        self._allocated = [False] * num_slots
        self._copy_stream: torch.cuda.Stream | None = None  # read_slot's transfers to the host (CUDA)

    @classmethod
    def from_budget(
        cls,
        specs: list[StateSpec],
        *,
        max_num_seqs: int | None = None,
        state_memory: int | None = None,
        device: torch.device | str = "cpu",
    ) -> StatePool:
        """Size the pool from ``max_num_seqs``, a state-memory budget in bytes, or the smaller of both. The budget
        holds the pool's scratch slot too: it is all the pool allocates."""
        per_slot = sum(s.nbytes for s in specs)
        candidates = []
        if max_num_seqs is not None:
            candidates.append(max_num_seqs)
        if state_memory is not None:
            if 2 * per_slot > state_memory:
                raise ValueError(
                    f"state memory budget {state_memory} B is below one slot and the pool's scratch slot "
                    f"({per_slot} B per sequence)"
                )
            candidates.append(state_memory // max(per_slot, 1) - 1)
        if not candidates:
            raise ValueError("give max_num_seqs or state_memory")
        return cls(specs, min(candidates), device)

    @property
    def total_bytes(self) -> int:
        """Bytes of the real slots (the scratch slot is not counted)."""
        return self.bytes_per_slot * self.num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self, count: int = 1) -> list[int]:
        """Take ``count`` free slots, each reset to the initial state."""
        return self.allocate_many([count])[0]

    def allocate_many(self, counts: list[int]) -> list[list[int]]:
        """Take ``counts[i]`` free slots for each ``i``, all reset to the initial state by one write per state
        tensor; all or none (``OutOfSlotsError``)."""
        if sum(counts) > len(self._free):
            raise OutOfSlotsError(f"asked for {sum(counts)} slots, {len(self._free)} free")
        taken = [[self._free.pop() for _ in range(count)] for count in counts]
        for slots in taken:
            for slot in slots:
                self._allocated[slot] = True
        self.reset(long_tensor([slot for slots in taken for slot in slots], self.device))
        return taken

    def free(self, slots: list[int]) -> None:
        """Return slots to the pool. Freeing a slot that is already free is an error."""
        for slot in slots:
            if not 0 <= slot < self.num_slots or not self._allocated[slot]:
                raise ValueError(f"slot {slot} is not allocated")
            self._allocated[slot] = False
            self._free.append(slot)

    def reset(self, slots: torch.Tensor) -> None:
        """Write the initial state into ``slots``."""
        slots = slots.to(self.device)
        for name, tensor in self.tensors.items():
            tensor[slots] = self._initial[name]

    def read_slot(self, slot: int) -> tuple[dict[str, torch.Tensor], torch.cuda.Event | None]:
        """A CPU copy of one slot's state (contiguous; one copy per state tensor) and, on CUDA, the event after
        which it holds the state; ``None`` elsewhere (the copy is done).

        On CUDA nothing waits for the device: the slot is cloned on the current stream (behind the work queued
        so far, ahead of whatever reuses the slot later), and the clone is copied into pinned host memory on a
        stream of the pool's own, so neither the host nor the next steps wait for the transfer. Read the
        tensors only after the event has completed."""
        if self.device.type != "cuda":
            return {name: tensor[slot].to("cpu", copy=True) for name, tensor in self.tensors.items()}, None
        clones = {name: tensor[slot].clone() for name, tensor in self.tensors.items()}
        cloned = torch.cuda.Event()
        cloned.record()
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        stream = self._copy_stream
        host = {}
        with torch.cuda.stream(stream):
            stream.wait_event(cloned)
            for name, clone in clones.items():
                host[name] = torch.empty(clone.shape, dtype=clone.dtype, pin_memory=True)
                host[name].copy_(clone, non_blocking=True)
                clone.record_stream(stream)  # its memory is not reused before the copy has read it
            copied = torch.cuda.Event()
            copied.record(stream)
        return host, copied

    def write_slot(self, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        """Overwrite one slot's state with ``tensors`` (one per state name, the spec's shape, any device).

        On CUDA a host state is copied from pinned memory behind the work queued so far: the host does not wait
        for the device (a pageable tensor is first copied into pinned memory, whose reuse waits for the copy)."""
        for name, tensor in self.tensors.items():
            source = tensors[name]
            if self.device.type == "cuda" and source.device.type == "cpu":
                tensor[slot].copy_(source.to(tensor.dtype).pin_memory(), non_blocking=True)
            else:
                tensor[slot].copy_(source)

    def copy(self, src: int, dst: list[int]) -> None:
        """Fork: copy slot ``src``'s state into every slot of ``dst``."""
        index = long_tensor(dst, self.device)
        for tensor in self.tensors.values():
            tensor[index] = tensor[src].clone()
