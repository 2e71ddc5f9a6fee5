"""A guard for the GPU tests: parts of an engine step that must never make the host wait for the device."""

from __future__ import annotations

from typing import Any

import torch


def never_waits(owner: object, name: str, ran: list[str]) -> None:
    """Make ``owner.name`` raise on any CUDA call that waits for the device (CUDA's sync-debug error mode while
    it runs); each call appends ``name`` to ``ran``."""
    method = getattr(owner, name)

    def call(*args: Any) -> Any:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return method(*args)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            ran.append(name)

    setattr(owner, name, call)
