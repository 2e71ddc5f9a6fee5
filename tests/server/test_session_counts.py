"""The session store's count of stored sessions and their bytes (the limits and the ``rnnserve_sessions`` /
``rnnserve_session_bytes`` gauges read it): equal to a fresh count of the folder after any sequence of changes,
also from two servers of one shared folder, and when a read, a write, a delete and an expiry interleave."""

from __future__ import annotations

import asyncio
import os
import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from rnnserve.server import sessions as sessions_module
from rnnserve.server.errors import APIError
from rnnserve.server.metrics import ServerMetrics
from rnnserve.server.sessions import SessionStore, new_session_id, sweep_sessions
from tests.server.test_sessions_store import Clock, on_disk, open_store, snapshot, stored_gauges


def counted(store: SessionStore) -> tuple[float, float]:
    return float(store.num_sessions), float(store.stored_bytes)


def run_in_thread(call: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """``call`` started on a thread of its own; the list gets its result or the exception it raised."""
    outcome: list[object] = []

    def target() -> None:
        try:
            outcome.append(call())
        except Exception as err:  # noqa: BLE001  # the test looks at it
            outcome.append(err)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


@contextmanager
def held_write(store: SessionStore, monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The store's next file write waits, once its data is about to be written, until the yielded event is set
    (the context waits until a write is held before it yields)."""
    writing, may_write = threading.Event(), threading.Event()
    real_write = store._write

    def held(path: Path, data: bytes) -> Any:
        if not writing.is_set():
            writing.set()
            assert may_write.wait(30)
        return real_write(path, data)

    monkeypatch.setattr(store, "_write", held)
    yield may_write
    may_write.set()


def test_a_write_in_flight_keeps_its_place_when_another_reaches_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that reached a limit re-counted the folder and kept the sessions in use, but not a new session
    being written (on no one's lease, its file not there yet): its place was given away, a third session was stored
    under a limit of two, and the count stayed one short of the folder for good."""
    store = open_store(tmp_path, max_sessions=2)
    store.create()
    with held_write(store, monkeypatch) as may_write:
        writer, outcome = run_in_thread(store.create)
        while store.num_sessions < 2:  # the held create has reserved its place
            writer.join(0.01)
        with pytest.raises(APIError) as refused:
            store.create()
        may_write.set()
        writer.join(30)
    assert refused.value.status == 429 and isinstance(outcome[0], sessions_module.SessionInfo)
    assert on_disk(tmp_path)[0] == 2 and counted(store) == on_disk(tmp_path)


def test_a_read_of_a_session_being_created_does_not_uncount_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that found no file dropped the session from the count, also one whose import was being written:
    once written it was on disk but not counted."""
    store = open_store(tmp_path)
    source = store.create()
    exported = store.export(source.id)
    imported = new_session_id()
    with held_write(store, monkeypatch) as may_write:
        writer, outcome = run_in_thread(lambda: store.import_state(imported, exported))
        while store.num_sessions < 2:
            writer.join(0.01)
        with pytest.raises(APIError) as missing:
            store.info(imported)  # no file yet
        may_write.set()
        writer.join(30)
    assert missing.value.status == 404 and outcome[0][1] is True  # type: ignore[index]
    assert on_disk(tmp_path)[0] == 2 and counted(store) == on_disk(tmp_path)


class FileRacedBy:
    """A session file whose first read runs ``change`` (on another thread, to its end) once the data is read."""

    def __init__(self, file: BinaryIO, change: Callable[[], object]) -> None:
        self._file = file
        self._change: Callable[[], object] | None = change

    def read(self, *size: int) -> bytes:
        data = self._file.read(*size)
        if self._change is None:
            return data
        change, self._change = self._change, None
        thread, outcome = run_in_thread(change)
        thread.join(30)
        assert outcome and not isinstance(outcome[0], Exception), outcome
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


def race_reads(store: SessionStore, monkeypatch: pytest.MonkeyPatch, change: Callable[[], object]) -> None:
    """The store's next file read runs ``change`` after it read the file and before it returns."""
    real_open = store._open
    raced = threading.Event()

    @contextmanager
    def racing_open(session_id: str) -> Iterator[Any]:
        with real_open(session_id) as file:
            if raced.is_set():
                yield file
                return
            raced.set()
            yield FileRacedBy(file, change)

    monkeypatch.setattr(store, "_open", racing_open)


@pytest.mark.parametrize("read", ["load", "info", "export"])
def test_a_read_racing_a_delete_does_not_count_the_deleted_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read: str
) -> None:
    """A read counted the file it had read once it was done: a session deleted meanwhile was counted again, for good
    (a store of one server counts its folder only at start-up and at a limit)."""
    store = open_store(tmp_path, cache_bytes=0)  # every read reads the file
    info = store.create()
    store.save(info.id, snapshot(1), info.created)
    race_reads(store, monkeypatch, lambda: store.delete(info.id))
    getattr(store, read)(info.id)
    assert on_disk(tmp_path) == (0, 0) and counted(store) == on_disk(tmp_path)


def test_a_read_racing_a_write_counts_the_new_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """... and a session replaced meanwhile was counted at its old file's size."""
    store = open_store(tmp_path, cache_bytes=0)
    info = store.create()
    store.save(info.id, snapshot(1), info.created)
    race_reads(store, monkeypatch, lambda: store.save(info.id, snapshot(1, tokens=50), info.created))
    store.load(info.id)
    assert on_disk(tmp_path)[0] == 1 and counted(store) == on_disk(tmp_path)


def test_the_sweep_goes_on_after_an_unexpected_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Only an ``OSError`` was caught: any other error ended the sweep's task for good, silently (no one awaits it),
    and the server never expired a session or recounted its shared folder again."""
    store = open_store(tmp_path, shared=True)
    calls = 0

    def sweep() -> int:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug")
        return 0

    monkeypatch.setattr(store, "expire_idle", sweep)
    monkeypatch.setattr(store, "refresh", sweep)
    if hasattr(store, "sweep"):
        monkeypatch.setattr(store, "sweep", sweep)

    async def run() -> None:
        task = asyncio.create_task(sweep_sessions(store, 0.0))
        for _ in range(100):
            if calls >= 3 or task.done():
                break
            await asyncio.sleep(0.01)
        assert not task.done(), task.exception()
        task.cancel()

    asyncio.run(run())
    assert calls >= 3


def no_space(*_: object) -> None:
    raise OSError(28, "No space left on device")


# operation: how often it comes (creates outweigh deletes and expiries, so the limits are reached)
OPERATIONS = {"create": 4, "save": 3, "fork": 2, "import": 2, "delete": 1, "load": 1, "info": 1, "expire": 1,
              "sweep": 1, "fail": 1, "behind": 1}  # fmt: skip


def random_operation(rng: random.Random, stores: list[SessionStore], clock: Clock, tmp_path: Path,
                     monkeypatch: pytest.MonkeyPatch, operations: dict[str, int] = OPERATIONS) -> str:  # fmt: skip
    """One random change or read of the folder by one of ``stores`` (or by someone behind their back, which only a
    recount notices)."""
    store = rng.choice(stores)
    ids = sorted(path.name.removesuffix(".safetensors") for path in tmp_path.glob("sess-*.safetensors"))
    known = ids + [new_session_id()]  # now and then one that does not exist
    session_id = rng.choice(known)
    operation = rng.choices(list(operations), list(operations.values()))[0]
    try:
        if operation == "create":
            store.create()
        elif operation in ("save", "fail"):  # a turn: its session leased and read, then its state written
            lease = store.acquire(session_id)
            try:
                created = store.load(session_id, True).info.created
                with monkeypatch.context() as patch:
                    if operation == "fail":  # a write that fails on the disk
                        patch.setattr(os, "fsync", no_space)
                    store.save(session_id, snapshot(rng.randrange(9), tokens=rng.randrange(1, 40)), created)
            finally:
                lease.release()
        elif operation == "fork":
            store.fork(session_id)
        elif operation == "import":
            target = rng.choice(known)
            store.import_state(target, stores[0].codec.encode(snapshot(2, tokens=rng.randrange(1, 40)), 1, 1))
        elif operation == "delete":
            store.delete(session_id)
        elif operation in ("load", "info"):
            getattr(store, operation)(session_id)
        elif operation == "expire":  # time passes: the sessions not used since are expired when named or swept
            clock.offset += rng.choice((10.0, 60.0))
            if rng.random() < 0.5:
                store.expire_idle()
        elif operation == "sweep":
            store.sweep()
        elif operation == "behind" and ids:  # someone removes a file behind the servers' back
            (tmp_path / f"{rng.choice(ids)}.safetensors").unlink()
            for each in stores:
                each.refresh()
    except APIError as err:
        assert err.status in (404, 409, 422, 429, 500), err
        assert err.status != 500 or operation == "fail", err
    return operation


@pytest.mark.parametrize("seed", range(3))
def test_two_servers_of_a_shared_folder_keep_the_count_of_a_random_workload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Random creates, turns, forks, imports (new and replacing), deletes, reads, expiries (named and swept),
    failing writes and files removed behind the servers' back, from two stores of one shared folder: after each,
    the gauges (one value for both in multiprocess mode: one ``SessionMetrics`` here) and both stores' limits see
    the folder as a fresh count finds it."""
    rng = random.Random(seed)
    metrics = ServerMetrics("m", 64)
    clock = Clock()
    stores = [open_store(tmp_path, shared=True, idle_ttl=100.0, clock=clock, metrics=metrics.sessions,
                         max_sessions=12, max_bytes=20_000) for _ in range(2)]  # fmt: skip
    done = []
    for _ in range(150):
        done.append(random_operation(rng, stores, clock, tmp_path, monkeypatch))
        truth = on_disk(tmp_path)
        assert stored_gauges(metrics) == truth, done[-5:]
        assert truth[0] <= 12 and truth[1] <= 20_000
    assert {"create", "save", "delete", "expire"} <= set(done)


@pytest.mark.parametrize("seed", range(2))
def test_one_server_keeps_the_count_of_a_random_workload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """The same workload on a folder of one server, but for files removed behind its back (noticed at a limit)."""
    rng = random.Random(seed)
    metrics = ServerMetrics("m", 64)
    clock = Clock()
    without_behind = {operation: weight for operation, weight in OPERATIONS.items() if operation != "behind"}
    store = open_store(tmp_path, idle_ttl=100.0, clock=clock, metrics=metrics.sessions, max_sessions=12,
                       max_bytes=20_000)  # fmt: skip
    for _ in range(150):
        operation = random_operation(rng, [store], clock, tmp_path, monkeypatch, without_behind)
        truth = on_disk(tmp_path)
        assert stored_gauges(metrics) == counted(store) == truth, operation
        assert truth[0] <= 12 and truth[1] <= 20_000


def test_a_shared_folders_writes_move_its_count_without_listing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every write, delete and expiry of a shared folder listed and stat'ed the whole folder under its write lock,
    to count it (10k sessions: milliseconds each, every server's writes waiting): a change now moves the count the
    folder's servers keep, by what it changed."""
    clock = Clock()
    metrics = ServerMetrics("m", 64)
    first, second = (open_store(tmp_path, shared=True, idle_ttl=100.0, clock=clock, metrics=metrics.sessions)
                     for _ in range(2))  # fmt: skip
    kept, replaced = first.create(), first.create()

    def no_listing(*args: object) -> None:
        raise AssertionError("a change listed the folder")

    with monkeypatch.context() as patch:
        patch.setattr(os, "scandir", no_listing)
        second.save(replaced.id, snapshot(1, tokens=30), replaced.created)
        fork = second.fork(replaced.id)
        first.import_state(new_session_id(), first.export(fork.id))
        first.import_state(fork.id, first.export(kept.id))  # replaces it, smaller
        second.delete(kept.id)
        clock.offset = 200
        with pytest.raises(APIError):
            first.info(replaced.id)  # expired when named
    truth = on_disk(tmp_path)
    assert truth[0] == 2 and stored_gauges(metrics) == counted(first) == truth  # first changed it last


def test_a_shared_folders_count_that_cannot_be_kept_is_recounted_by_the_next_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A count the lease file holds is every server's: one that could not be written is emptied, so that the next
    change, by any server, counts the folder afresh; one wrong (a server killed between a write and its count, a
    file removed behind the servers' back) is right again after a sweep, and a server starting counts afresh."""
    metrics = ServerMetrics("m", 64)
    first, second = (open_store(tmp_path, shared=True, metrics=metrics.sessions) for _ in range(2))
    first.create()
    with monkeypatch.context() as patch:
        patch.setattr(os, "pwrite", no_space)
        info = first.create()  # stored: only its count could not be kept
    assert first.path(info.id).exists() and (tmp_path / ".leases").stat().st_size == 0
    second.create()
    assert stored_gauges(metrics) == counted(second) == on_disk(tmp_path) and on_disk(tmp_path)[0] == 3
    first.path(info.id).unlink()  # behind the servers' back
    second.delete(second.create().id)  # counted as it was
    assert counted(second)[0] == 3
    first.sweep()
    assert stored_gauges(metrics) == counted(first) == on_disk(tmp_path) and on_disk(tmp_path)[0] == 2
    with open(tmp_path / ".leases", "r+b") as lease_file:  # a count gone wrong
        lease_file.write(sessions_module.FOLDER_COUNT.pack(40, 1))
    restarted = ServerMetrics("m", 64)
    third = open_store(tmp_path, shared=True, metrics=restarted.sessions)
    assert stored_gauges(restarted) == counted(third) == on_disk(tmp_path)


def test_a_shared_folder_that_cannot_be_counted_keeps_its_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A change that must count the folder afresh and cannot list it changes nothing, also not the count the
    other servers read."""
    store, other = (open_store(tmp_path, shared=True) for _ in range(2))
    store.create()
    other.create()  # the count store last saw is one short now
    kept = (tmp_path / ".leases").read_bytes()

    def unreadable(*args: object) -> None:
        raise PermissionError(13, "Permission denied")

    with monkeypatch.context() as patch:
        patch.setattr(os, "scandir", unreadable)
        with pytest.raises(PermissionError):
            store.refresh()
    assert (tmp_path / ".leases").read_bytes() == kept
    store.create()  # the write lock was given back
    assert counted(store) == on_disk(tmp_path) and on_disk(tmp_path)[0] == 3
