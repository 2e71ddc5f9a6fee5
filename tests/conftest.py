"""Suite-wide settings: tests use tiny models, where one intra-op thread is fastest and immune to the
OpenMP stalls that a loaded 2-core machine causes; and the engines the tests build in this process leave its
malloc and garbage collector as they were (see :func:`no_serving_tuning_in_the_test_process`)."""

from collections.abc import Iterator

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
