"""Fixtures: an in-process app (TestClient) and a live server on 127.0.0.1, both over random:mingru-tiny; and a
guard that no engine built in a module outlives it (:func:`pytest_runtest_teardown`)."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Generator, Iterator

import pytest
from fastapi.testclient import TestClient

from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.sampling_params import StructuredOutputParams
from rnnserve.engine.structured_output import CompiledGrammar
from rnnserve.server.app import ServerConfig, create_app
from rnnserve.server.background import serve_in_thread

TINY = "random:mingru-tiny"
API_KEY = "test-secret-key"


def tiny_config(**overrides: object) -> ServerConfig:
    base: dict[str, object] = {
        "model": TINY,
        "max_num_seqs": 4,
        "max_prompt_tokens": 64,
        "max_body_bytes": 8192,
        "api_key": None,  # not $RNNSERVE_API_KEY from the developer's shell
    }
    return ServerConfig.build(**{**base, **overrides})


def hold_grammar_compiles(monkeypatch: pytest.MonkeyPatch, engine: LLMEngine, timeout: float) -> threading.Semaphore:
    """Make each of ``engine``'s grammar compiles wait for a release of the returned semaphore (at most
    ``timeout`` seconds, then the compile fails the test)."""
    may_finish = threading.Semaphore(0)
    real_compile = engine.grammars.compile

    def held_compile(constraint: StructuredOutputParams) -> CompiledGrammar:
        assert may_finish.acquire(timeout=timeout)
        return real_compile(constraint)

    monkeypatch.setattr(engine.grammars, "compile", held_compile)
    return may_finish


def live_engines() -> list[LLMEngine]:
    """Every :class:`LLMEngine` alive in this process."""
    return [obj for obj in gc.get_objects() if issubclass(type(obj), LLMEngine)]  # type(): no lazy __class__


# per module: the engines alive before its first test, and the session's failures then
ENGINES_BEFORE = pytest.StashKey[tuple["weakref.WeakSet[LLMEngine]", int]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    """Before a module's first test (and its fixtures): note the engines alive (see :func:`pytest_runtest_teardown`)."""
    module = item.getparent(pytest.Module)
    if module is not None and ENGINES_BEFORE not in module.stash:
        module.stash[ENGINES_BEFORE] = (weakref.WeakSet(live_engines()), item.session.testsfailed)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    """After a module's last test and its fixtures: an engine built in the module that is still alive fails that
    test's teardown. Each holds ~1 GiB of address space (its prefix-cache tier); FastAPI's process-wide caches of
    endpoint callables keep every app's routes, and while a stopped app held its engine that kept one engine
    alive per module, 24 GiB over this folder. Not checked after a failure: a failed test's traceback keeps its
    frames, and the engines in them."""
    result = yield
    module = item.getparent(pytest.Module)
    if module is None or (nextitem is not None and nextitem.getparent(pytest.Module) is module):
        return result
    before, failed = module.stash[ENGINES_BEFORE]
    if item.session.testsfailed == failed:
        item.funcargs = {}  # the fixtures' values, torn down already (pytest drops them after this hook)
        left = sum(1 for engine in live_engines() if engine not in before)
        if left:  # perhaps garbage in a cycle: a full collection costs ~0.5 s in this process, so only then
            gc.collect()
            left = sum(1 for engine in live_engines() if engine not in before)
        assert not left, f"{left} engine(s) built in this module outlive it (gc.get_referrers finds what holds them)"
    return result


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(create_app(tiny_config())) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def live_url() -> Iterator[str]:
    """A real server (uvicorn, random free port) requiring API_KEY; stopped after the module."""
    with serve_in_thread(create_app(tiny_config(api_key=API_KEY, max_num_seqs=2))) as url:
        yield url
