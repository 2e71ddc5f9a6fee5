"""Suite-wide settings: tests use tiny models, where one intra-op thread is fastest and immune to the
OpenMP stalls that a loaded 2-core machine causes; and the engines the tests build in this process leave its
malloc and garbage collector as they were (see :func:`no_serving_tuning_in_the_test_process`), their garbage
cycles collected before their address space piles up (see :func:`pytest_runtest_teardown`)."""

import gc
import os
from collections.abc import Generator, Iterator

import pytest
import torch

from rnnserve.engine import llm

torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def no_serving_tuning_in_the_test_process() -> Iterator[None]:
    """``LLM(...)`` tunes the process it is built in for serving, which suits one engine per process, not the
    hundreds that this process builds one after another:

    - ``retain_freed_memory`` (no mmap of large blocks, no trimming of the heap): each engine's prefix-cache tier
      (1 GiB on the CPU, allocated but mostly never touched) came out of the brk heap, and the holes that freed
      tiers left below longer-lived blocks were never given back, so the heap, a single mapping, only grew: 30 GiB
      of address space for 1 GiB resident after ``tests/engine`` alone. Forking this process (``subprocess`` with
      a ``preexec_fn``) then failed with ENOMEM: the kernel's overcommit check refuses to copy a private mapping
      larger than the machine's RAM and swap.
    - ``freeze_startup_heap`` (every live object out of the collector's reach): an engine still alive when a later
      one was built (a test comparing two) was frozen, and one in a reference cycle (a test's wrapper around its
      model's methods) was never freed, with its prefix-cache tier.

    ``tests/engine/test_retain_freed_memory.py`` and ``test_startup_heap.py`` check both in fresh interpreters."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llm, "retain_freed_memory", lambda: False)
        patch.setattr(llm, "freeze_startup_heap", lambda: None)
        yield


# Garbage cycles that may hold this much more address space than after the last collection before one runs.
UNCOLLECTED_BYTES = 2 * 2**30
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def data_bytes() -> int | None:
    """This process's data address space (heap and private mappings), ``None`` where ``/proc`` has no statm."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[5]) * _PAGE_BYTES
    except OSError:
        return None


_collected_at = data_bytes()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    """After a test's fixtures are gone, a full collection when the address space grew by
    :data:`UNCOLLECTED_BYTES` since the last one. Tests that wrap an engine's own methods on it (a counter around
    ``engine.scheduler._steady_appended``) leave the engine in a reference cycle, freed by a full collection only,
    which this process, with millions of objects, runs rarely; meanwhile each held its prefix-cache tier, 1 GiB of
    address space. Their mappings lay side by side and merged: one of 11 GiB in tests/engine in a full run (see
    :func:`no_serving_tuning_in_the_test_process` for why that size matters)."""
    global _collected_at
    result = yield
    data = data_bytes()
    if data is not None and _collected_at is not None and data > _collected_at + UNCOLLECTED_BYTES:
        gc.collect()
        _collected_at = data_bytes()
    return result
