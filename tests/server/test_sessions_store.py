"""The session store on its own: file format, checks, atomic writes, limits, leases and the LRU."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import multiprocessing
import os
import random
import re
import struct
import threading
import time
import tracemalloc
import weakref
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from rnnserve.engine.models.base import StateSpec
from rnnserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from rnnserve.engine.state_snapshot import StateSnapshot
from rnnserve.server.errors import APIError
from rnnserve.server.metrics import ServerMetrics, SessionMetrics
from rnnserve.server.sessions import (
    LISTED_TOKEN_ID_BYTES,
    SessionCodec,
    SessionInfo,
    SessionStore,
    SessionTurn,
    StoredSession,
    check_session_id,
    default_session_dir,
    new_session_id,
    remove_temporary_files,
    safetensors_bytes,
)

SPECS = [StateSpec("h", (2, 3), torch.float32), StateSpec("conv", (4,), torch.float64)]
FINGERPRINT = "ab" * 32
VOCAB = 100


def snapshot(seed: int = 0, tokens: int = 5) -> StateSnapshot:
    gen = torch.Generator().manual_seed(seed)
    tensors = {spec.name: torch.randn(spec.shape, generator=gen, dtype=spec.dtype) for spec in SPECS}
    return StateSnapshot(tensors, list(range(seed, seed + tokens)), [seed + tokens])


def open_store(directory: Path, **options: Any) -> SessionStore:
    """A store with small limits; ``options``: other limits, ``shared``, ``idle_ttl``, ``metrics``, ``clock``."""
    options = {"max_sessions": 100, "max_bytes": 1 << 20, "cache_bytes": 1 << 20, **options}
    return SessionStore(directory, SessionCodec(FINGERPRINT, SPECS, VOCAB), **options)


def error_of(call, *args) -> APIError:  # type: ignore[no-untyped-def]
    with pytest.raises(APIError) as info:
        call(*args)
    return info.value


def assert_same(a: StateSnapshot, b: StateSnapshot) -> None:
    assert a.token_ids == b.token_ids and a.pending_token_ids == b.pending_token_ids
    assert set(a.tensors) == set(b.tensors)
    for name, tensor in a.tensors.items():
        assert b.tensors[name].dtype == tensor.dtype and torch.equal(b.tensors[name], tensor)


def test_ids_are_unguessable_and_checked_before_any_path_is_built(tmp_path: Path) -> None:
    ids = {new_session_id() for _ in range(100)}
    assert len(ids) == 100 and all(check_session_id(i) == i for i in ids)
    store = open_store(tmp_path)
    for bad in ["../../etc/passwd", "sess-../../x", "sess-short", "sess-" + "a" * 200, "sess-abc/defghijklmnopq", ""]:
        assert error_of(store.path, bad).status == 400
        assert error_of(store.load, bad).code == "invalid_session_id"
    assert sorted(os.listdir(tmp_path)) == []


def test_file_format_round_trip(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    empty = store.create()
    assert empty.num_tokens == 0 and store.load(empty.id).snapshot is None
    state = snapshot(3)
    info = store.save(empty.id, state, empty.created)
    assert info.num_tokens == 6 and info.created == empty.created and info.updated >= empty.created
    path = store.path(empty.id)
    assert path.name == f"{empty.id}.safetensors" and info.nbytes == path.stat().st_size
    with safetensors.safe_open(path, "pt") as file:
        metadata = file.metadata()
        assert sorted(file.keys()) == ["pending_token_ids", "state.conv", "state.h", "token_ids"]
        assert file.get_tensor("token_ids").dtype == torch.int64
    assert metadata["format"] == "rnnserve-session" and metadata["format_version"] == "1"
    assert metadata["model_fingerprint"] == FINGERPRINT and metadata["num_tokens"] == "6"
    assert json.loads(metadata["state_layout"]) == [["h", [2, 3], "float32"], ["conv", [4], "float64"]]
    fresh = open_store(tmp_path)  # a restarted server: nothing cached, found on disk
    assert fresh.num_sessions == 1 and fresh.stored_bytes == info.nbytes
    assert_same(state, fresh.load(empty.id).snapshot)  # type: ignore[arg-type]
    assert fresh.info(empty.id) == info


def test_encoding_a_history_of_a_new_length_keeps_nothing_behind() -> None:
    """``safetensors.torch.save`` made a ctypes array type (and its pointer type) per byte length of a tensor,
    which ctypes keeps for good: one more per new history length for as long as the server ran. The files are
    still what safetensors reads, in every dtype a state may have."""
    codec = SessionCodec(FINGERPRINT, SPECS, VOCAB)
    codec.encode(snapshot(0, tokens=3), 1, 1)  # whatever a first call sets up
    types_before = len(ctypes._pointer_type_cache)  # type: ignore[attr-defined]
    for tokens in range(40_000, 40_020):
        codec.encode(snapshot(0, tokens=tokens), 1, 1)
    assert len(ctypes._pointer_type_cache) == types_before  # type: ignore[attr-defined]
    tensors = {"f": torch.randn(2, 3), "b": torch.randn(5).bfloat16(), "d": torch.randn(1).double(),
               "i": torch.arange(3), "empty": torch.zeros(0, dtype=torch.int64), "s": torch.tensor(True)}
    data = safetensors_bytes(tensors, {"k": "v", "a": "é"})
    loaded = safetensors.torch.load(data)
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], t) for k, t in tensors.items())
    assert all(loaded[k].dtype == t.dtype for k, t in tensors.items())


def test_writes_are_atomic_and_leave_no_temporary_files(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    info = store.create()
    for seed in range(3):
        store.save(info.id, snapshot(seed), info.created)
    assert os.listdir(tmp_path) == [f"{info.id}.safetensors"]
    (tmp_path / ".tmp-left-by-a-killed-server").write_bytes(b"partial")
    open_store(tmp_path)
    assert os.listdir(tmp_path) == [f"{info.id}.safetensors"]


def test_a_write_that_fails_leaves_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store(tmp_path)
    info = store.create()
    store.save(info.id, snapshot(1), info.created)
    before = store.path(info.id).read_bytes()

    def no_space(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    err = error_of(store.save, info.id, snapshot(2), info.created)
    assert err.status == 500 and err.code == "session_write_failed"
    monkeypatch.undo()
    assert store.path(info.id).read_bytes() == before and os.listdir(tmp_path) == [f"{info.id}.safetensors"]
    assert_same(snapshot(1), open_store(tmp_path).load(info.id).snapshot)  # type: ignore[arg-type]


def damaged_files(good: bytes) -> dict[str, bytes]:
    (length,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8 : 8 + length])

    def with_metadata(**values: str) -> bytes:
        """``good`` with these metadata values (the header's length rewritten)."""
        text = json.dumps(dict(header, __metadata__={**header["__metadata__"], **values})).encode()
        return struct.pack("<Q", len(text)) + text + good[8 + length :]

    wrong_count = dict(header, __metadata__={**header["__metadata__"], "num_tokens": "99"})
    text = json.dumps(wrong_count).encode()
    return {
        # str.isdigit takes these, int() does not (a 500 once): a superscript, and more than 4300 digits.
        "unicode digit time": with_metadata(created="\u00b2"),
        "huge time": with_metadata(updated="9" * 5000),
        "unicode digit count": with_metadata(num_tokens="\u00b2"),
        "empty": b"",
        "short": good[:5],
        "truncated": good[:-3],
        "garbage": os.urandom(len(good)),
        "huge header length": struct.pack("<Q", 1 << 40) + good[8:],
        "not json": good[:8] + b"x" * length + good[8 + length :],
        "plain safetensors": safetensors.torch.save({"h": torch.zeros(2)}),
        "wrong token count": struct.pack("<Q", len(text)) + text + good[8 + length :],
        "other format version": good.replace(b'"format_version":"1"', b'"format_version":"9"'),
    }


DAMAGES = [
    "empty", "short", "truncated", "garbage", "huge header length", "not json", "plain safetensors",
    "wrong token count", "other format version", "unicode digit time", "huge time", "unicode digit count",
]  # fmt: skip


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_file_is_a_422_for_that_session_alone(tmp_path: Path, damage: str) -> None:
    store = open_store(tmp_path)
    broken, intact = store.create(), store.create()
    for info in (broken, intact):
        store.save(info.id, snapshot(4), info.created)
    store.path(broken.id).write_bytes(damaged_files(store.path(broken.id).read_bytes())[damage])
    restarted = open_store(tmp_path)
    calls = [restarted.load, restarted.export, restarted.fork]
    if damage != "wrong token count":  # the header alone looks fine: only reading the tensors finds it
        calls.append(restarted.info)
    for call in calls:
        err = error_of(call, broken.id)
        assert err.status == 422 and err.code == "session_corrupted", (damage, call.__name__, err.message)
    assert_same(snapshot(4), restarted.load(intact.id).snapshot)  # type: ignore[arg-type]
    assert restarted.fork(intact.id).num_tokens == 6


def test_a_foreign_file_is_a_422_naming_what_differs(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    data = store.codec.encode(snapshot(0), 1, 2)
    other_model = SessionCodec("cd" * 32, SPECS, VOCAB).encode(snapshot(0), 1, 2)
    other_specs = [StateSpec("h", (2, 4), torch.float32), SPECS[1]]
    other_layout = SessionCodec("cd" * 32, other_specs, VOCAB).encode(
        StateSnapshot({"h": torch.zeros(2, 4), "conv": torch.zeros(4, dtype=torch.float64)}, [1], []), 1, 2
    )
    err = error_of(store.import_state, "sess-" + "a" * 20, other_model)
    assert (err.status, err.code) == (422, "session_model_mismatch") and "another model" in err.message
    err = error_of(store.import_state, "sess-" + "a" * 20, other_layout)
    assert (err.status, err.code) == (422, "session_model_mismatch") and "another state layout" in err.message
    tampered = data.replace(b'\\"float32\\"', b'\\"float16\\"')  # this model claimed, another layout recorded
    assert tampered != data
    assert error_of(store.codec.decode, "sess-" + "b" * 20, tampered).code == "session_layout_mismatch"
    out_of_vocab = SessionCodec(FINGERPRINT, SPECS, 1000).encode(StateSnapshot(snapshot(0).tensors, [500], []), 1, 2)
    assert error_of(store.codec.decode, "sess-" + "c" * 20, out_of_vocab).code == "session_corrupted"
    assert os.listdir(tmp_path) == []


def test_import_creates_or_replaces(tmp_path: Path) -> None:
    source, target = open_store(tmp_path / "a"), open_store(tmp_path / "b")
    info = source.create()
    source.save(info.id, snapshot(7), info.created)
    imported, created = target.import_state(info.id, source.export(info.id))
    assert created and imported.num_tokens == 6 and imported.created == info.created
    assert_same(snapshot(7), target.load(info.id).snapshot)  # type: ignore[arg-type]
    source.save(info.id, snapshot(8), info.created)
    _, created = target.import_state(info.id, source.export(info.id))
    assert not created and target.num_sessions == 1
    assert_same(snapshot(8), open_store(tmp_path / "b").load(info.id).snapshot)  # type: ignore[arg-type]


def test_import_refuses_a_history_longer_than_the_servers_limit(tmp_path: Path) -> None:
    """A history beyond the server's max_model_len is a 422 and nothing is written. One that reaches it exactly,
    as a turn whose max_tokens was cut to the room left may leave it, is taken: a server refused to import its
    own export of such a session (its next turn is refused for its length, on any replica)."""
    source = open_store(tmp_path / "a")
    info = source.create()
    source.save(info.id, snapshot(0, tokens=9), info.created)  # 10 tokens with the pending one
    limits = {"max_sessions": 100, "max_bytes": 1 << 20, "cache_bytes": 1 << 20}
    target = SessionStore(tmp_path / "b", SessionCodec(FINGERPRINT, SPECS, VOCAB, max_model_len=9), **limits)
    err = error_of(target.import_state, info.id, source.export(info.id))
    assert (err.status, err.code) == (422, "session_too_long") and "max_model_len 9" in err.message
    assert not target.path(info.id).exists()
    full = SessionStore(tmp_path / "c", SessionCodec(FINGERPRINT, SPECS, VOCAB, max_model_len=10), **limits)
    assert full.import_state(info.id, source.export(info.id))[0].num_tokens == 10


def test_fork_copies_the_state_under_a_new_id(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    info = store.create()
    store.save(info.id, snapshot(2), info.created)
    fork = store.fork(info.id)
    assert fork.id != info.id and fork.num_tokens == 6
    store.save(info.id, snapshot(9), info.created)
    assert_same(snapshot(2), open_store(tmp_path).load(fork.id).snapshot)  # type: ignore[arg-type]


def test_count_and_byte_limits(tmp_path: Path) -> None:
    store = open_store(tmp_path, max_sessions=2)
    first = store.create()
    store.create()
    err = error_of(store.create)
    assert (err.status, err.code, err.type) == (429, "session_limit_reached", "insufficient_quota")
    assert "--max-sessions" in err.message and error_of(store.fork, first.id).status == 429
    assert error_of(store.import_state, new_session_id(), store.export(first.id)).status == 429
    store.delete(first.id)
    store.create()
    now = int(time.time())
    one_file, empty_file = (len(store.codec.encode(state, now, now)) for state in (snapshot(0), None))
    small = open_store(tmp_path / "small", max_bytes=one_file + empty_file - 1)
    info = small.create()
    small.save(info.id, snapshot(0), info.created)
    assert error_of(small.create).status == 429 and "--max-session-bytes" in error_of(small.create).message
    small.save(info.id, snapshot(1), info.created)  # replacing counts the new size instead of the old one
    assert small.num_sessions == 1 and small.stored_bytes == one_file


def test_files_removed_behind_the_servers_back_stop_counting_when_a_limit_is_reached(tmp_path: Path) -> None:
    """Without a listing or expiry route an operator expires sessions by removing their files; a single server
    counted them until restarted, and refused every new session on an empty folder."""
    store = open_store(tmp_path, max_sessions=2)
    infos = [store.create(), store.create()]
    assert error_of(store.create).status == 429
    for info in infos:
        store.path(info.id).unlink()
    store.create()
    assert store.num_sessions == 1


def test_a_path_that_is_no_regular_file_or_cannot_be_read_is_a_422(tmp_path: Path) -> None:
    """A directory in a session's place was a 500 with a traceback on every route, and a FIFO hung the read."""
    store = open_store(tmp_path)
    intact = store.create()
    for kind in ("directory", "fifo", "unreadable"):
        session_id = new_session_id()
        path = store.path(session_id)
        if kind == "directory":
            path.mkdir()
        elif kind == "fifo":
            os.mkfifo(path)
        else:
            session_id = store.create().id
            store.save(session_id, snapshot(1), int(time.time()))
            path = store.path(session_id)
            path.chmod(0)
            if os.access(path, os.R_OK):  # root reads it anyway
                continue
        for call in (store.load, store.info, store.export, store.fork):
            err = error_of(call, session_id)
            assert (err.status, err.code) == (422, "session_corrupted"), (kind, call.__name__, err.message)
    directory = new_session_id()
    store.path(directory).mkdir()
    assert error_of(store.delete, directory).code == "session_write_failed"
    assert store.load(intact.id).snapshot is None


def test_a_state_with_nan_or_infinite_values_is_refused(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    bad = snapshot(2)
    bad.tensors["h"][0, 1] = float("nan")
    data = store.codec.encode(bad, 1, 1)
    err = error_of(store.import_state, new_session_id(), data)
    assert (err.status, err.code) == (422, "session_corrupted") and "NaN or infinite" in err.message


def test_one_request_at_a_time(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    info = store.create()
    lease = store.acquire(info.id)
    err = error_of(store.acquire, info.id)
    assert (err.status, err.code) == (409, "session_busy")
    assert error_of(store.delete, info.id).status == 409
    assert error_of(store.import_state, info.id, store.export(info.id)).status == 409
    for garbage in (b"", b"not a session file", store.export(info.id)[:-1]):  # busy first, as any write
        err = error_of(store.import_state, info.id, garbage)
        assert (err.status, err.code) == (409, "session_busy"), err.message
    store.fork(info.id)  # reading the stored state needs no lease
    lease.release()
    second = store.acquire(info.id)
    lease.release()  # a stale lease cannot free the session for a third request
    assert error_of(store.acquire, info.id).status == 409
    second.release()
    store.delete(info.id)
    assert error_of(store.load, info.id).status == 404 and error_of(store.delete, info.id).status == 404


def test_the_lru_counts_what_a_decoded_history_holds() -> None:
    """A history is a Python list of ints: counted at 8 bytes a token, it took about 5 times what the LRU counted
    (a small state under a long history, with a large vocabulary)."""
    tracemalloc.start()
    history = [1000 + i for i in range(20_000)]  # ints past the interpreter's shared small ones
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    info = SessionInfo("sess-" + "a" * 16, 1, 1, len(history) + 1, 0)
    short = StoredSession(info, StateSnapshot(snapshot(0).tensors, [], [99]))
    long = StoredSession(info, StateSnapshot(snapshot(0).tensors, history, [99]))
    assert 0.8 * held <= long.host_bytes - short.host_bytes <= 1.6 * held


def test_lru_keeps_recent_states_and_notices_replaced_files(tmp_path: Path) -> None:
    per_session = snapshot(0).tensors["h"].nbytes + snapshot(0).tensors["conv"].nbytes + LISTED_TOKEN_ID_BYTES * 6
    store = open_store(tmp_path, cache_bytes=2 * per_session)
    ids = [store.create().id for _ in range(3)]
    for seed, session_id in enumerate(ids):
        store.save(session_id, snapshot(seed), 0)
    assert list(store._cache) == ids[1:]  # the least recently used went first
    assert store.load(ids[1]) is store.load(ids[1])
    outside = SessionCodec(FINGERPRINT, SPECS, VOCAB).encode(snapshot(5, tokens=9), 0, 1)
    store.path(ids[1]).write_bytes(outside)  # replaced behind the server's back
    assert_same(snapshot(5, tokens=9), store.load(ids[1]).snapshot)  # type: ignore[arg-type]
    store.path(ids[2]).write_bytes(b"broken")
    assert error_of(store.load, ids[2]).status == 422


def test_session_files_of_other_processes_are_found_by_id(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    other = open_store(tmp_path)
    info = other.create()
    other.save(info.id, snapshot(1), info.created)
    assert store.num_sessions == 0 and store.info(info.id).num_tokens == 6 and store.num_sessions == 1


def test_a_shared_folders_lru_drops_the_sessions_another_server_deleted(tmp_path: Path) -> None:
    """With ``--api-servers`` a session one server deleted or expired stayed decoded in the others' LRUs, counted
    in ``rnnserve_session_cache_memory_used_bytes``, until evicted: up to ``--session-cache-bytes`` of each server
    held states of sessions that no longer exist (a soak's gauge climbed while the sessions stayed flat)."""
    store = open_store(tmp_path, shared=True, metrics=SessionMetrics.unregistered())
    other = open_store(tmp_path, shared=True)
    gone, kept = store.create(), store.create()
    for seed, info in enumerate((gone, kept)):
        store.save(info.id, snapshot(seed), info.created)
    used = store.metrics.cache_memory_used_bytes._value.get
    assert list(store._cache) == [gone.id, kept.id] and used() == store._cache_used > 0
    other.delete(gone.id)
    store.refresh()  # the shared folder's recount (the sweep's, every REFRESH_INTERVAL seconds)
    assert list(store._cache) == [kept.id] and used() == store._cache_used == store._cache[kept.id][0].host_bytes
    other.delete(kept.id)
    store.sweep()  # so does the sweep, also with an expiry (a write moves the folder's count, reading no folder)
    assert list(store._cache) == [] and used() == 0


def test_default_folder_is_per_model_under_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_session_dir(FINGERPRINT) == tmp_path / "rnnserve" / "sessions" / FINGERPRINT[:16]
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert (
        default_session_dir(FINGERPRINT) == tmp_path / "home" / ".cache" / "rnnserve" / "sessions" / "abababababababab"
    )


def test_the_folder_is_made_by_the_first_write_and_an_unusable_one_is_a_clear_error(tmp_path: Path) -> None:
    store = open_store(tmp_path / "sessions")
    assert not (tmp_path / "sessions").exists()
    store.create()
    assert (tmp_path / "sessions").stat().st_mode & 0o777 == 0o700
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ValueError, match="cannot use the session folder"):
        open_store(tmp_path / "file")
    # a folder that no write could make is refused at start-up: the server started, said it was ready, and
    # answered every session with a 500
    with pytest.raises(ValueError, match=r"file is not a directory"):
        open_store(tmp_path / "file" / "deeper" / "sessions")
    open_store(tmp_path / "not" / "yet" / "sessions")  # a folder that can be made is made by the first write
    assert not (tmp_path / "not").exists()


def test_any_damage_to_a_file_is_a_422_never_another_error(tmp_path: Path) -> None:
    """Seeded random damage: byte flips in the header and the data, cuts, and crafted headers."""
    store = open_store(tmp_path)
    good = store.codec.encode(snapshot(1), 1, 2)
    (length,) = struct.unpack("<Q", good[:8])
    rng = random.Random(0)
    damaged = []
    for _ in range(300):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(8 + length if rng.random() < 0.8 else len(data))] = rng.randrange(256)
        damaged.append(bytes(data))
    damaged += [good[:cut] for cut in rng.sample(range(len(good)), 50)]
    for header in ['{"__metadata__": {"format": "rnnserve-session", "format_version": 1}}', "[" * 100_000, '"x"']:
        damaged.append(struct.pack("<Q", len(header)) + header.encode())
    for field, value in [("token_ids", {"dtype": "I64", "shape": [5], "data_offsets": "x"}), ("__metadata__", None)]:
        crafted = json.loads(good[8 : 8 + length])
        crafted[field] = value if value is not None else {**crafted[field], "created": 1}
        text = json.dumps(crafted).encode()
        damaged.append(struct.pack("<Q", len(text)) + text + good[8 + length :])
    session_id = "sess-" + "d" * 20
    for data in damaged:
        if data == good:
            continue
        try:
            stored = store.codec.decode(session_id, data)
        except APIError as err:
            assert err.status == 422, err.message
        else:  # a flip inside a float's bytes is a different but well-formed state
            assert stored.snapshot is not None and len(stored.snapshot.history_token_ids) == 6
        store.path(session_id).write_bytes(data)
        try:
            store.info(session_id)  # reads the header alone: it may miss damage to the data, never fail otherwise
        except APIError as err:
            assert err.status == 422, err.message


def test_a_turn_keeps_the_session_until_its_write_is_done(tmp_path: Path) -> None:
    """A client that leaves while the state is being written: the write completes and only then is the session
    free again, so a next request never reads the state from before that write."""
    store = open_store(tmp_path)
    info = store.create()
    writing, may_finish = threading.Event(), threading.Event()
    real_save = store.save

    def slow_save(*args: object) -> SessionInfo:
        writing.set()
        may_finish.wait(10)
        return real_save(*args)  # type: ignore[arg-type]

    store.save = slow_save  # type: ignore[method-assign]
    output = RequestOutput("req", None, [1], [], True, RequestMetrics(0.0), final_state=snapshot(3))

    async def client_leaves_during_the_write() -> None:
        turn = SessionTurn(store, store.acquire(info.id), store.load(info.id))
        task = asyncio.ensure_future(turn.store_state(output))
        await asyncio.to_thread(writing.wait, 10)
        task.cancel()
        turn.release()
        assert error_of(store.acquire, info.id).status == 409  # still writing
        may_finish.set()
        for _ in range(200):
            await asyncio.sleep(0.01)
            if info.id not in store._leases:
                break
        store.acquire(info.id).release()

    asyncio.run(client_leaves_during_the_write())
    assert_same(snapshot(3), open_store(tmp_path).load(info.id).snapshot)  # type: ignore[arg-type]


class Cyclic:
    """A response's submission that only the garbage collector frees (it refers to itself)."""

    def __init__(self) -> None:
        self.itself = self


def test_a_turn_given_back_by_a_finalizer_on_another_thread_is_released_on_the_loop(tmp_path: Path) -> None:
    """The route gives a session back when the submission of a response that never ran is collected. The
    collector runs that finalizer on whichever thread it runs on; the release, which touches the loop's future of
    a write in flight, must run on the loop."""
    store = open_store(tmp_path)
    info = store.create()
    released_on: list[int] = []
    real_release = store.release

    def recording_release(lease: object) -> None:
        released_on.append(threading.get_ident())
        real_release(lease)  # type: ignore[arg-type]

    store.release = recording_release  # type: ignore[method-assign]

    def collect_in_a_thread(release_by: str) -> None:
        turn = SessionTurn(store, store.acquire(info.id), store.load(info.id))
        submission = Cyclic()
        weakref.finalize(submission, getattr(turn, release_by))
        dropped = [submission]
        del submission

        def collect() -> None:
            dropped.clear()
            gc.collect()

        worker = threading.Thread(target=collect)
        worker.start()
        worker.join(10)
        assert not dropped and released_on == []  # finalized on the thread, released on the loop

    async def finalized_off_the_loop() -> None:
        for release_by in ("release", "release_soon"):
            collect_in_a_thread(release_by)
            for _ in range(100):
                await asyncio.sleep(0)
            assert released_on == [threading.get_ident()]
            store.acquire(info.id).release()
            released_on.clear()

    asyncio.run(finalized_off_the_loop(), debug=True)


def test_an_aborted_turn_is_a_503_and_keeps_the_stored_state(tmp_path: Path) -> None:
    """A session request the engine ended as aborted (a shutdown's drain) carries no state: the client gets a 503,
    as other requests cut by a shutdown, and the session keeps its state."""
    store = open_store(tmp_path)
    info = store.create()
    store.save(info.id, snapshot(1), info.created)
    before = store.export(info.id)
    sample = CompletionOutput(0, "", [], "abort", None, 0.0)
    aborted = RequestOutput("req", None, [1], [sample], True, RequestMetrics(0.0))

    async def aborted_turn() -> APIError:
        turn = SessionTurn(store, store.acquire(info.id), store.load(info.id))
        try:
            with pytest.raises(APIError) as raised:
                await turn.store_state(aborted)
        finally:
            turn.release()
        return raised.value

    err = asyncio.run(aborted_turn())
    assert (err.status, err.type) == (503, "service_unavailable"), err.message
    assert open_store(tmp_path).export(info.id) == before
    store.acquire(info.id).release()


def hold_lease(directory: str, session_id: str, held: EventType) -> None:
    """Another server process of a shared folder: lease ``session_id`` and keep it until killed."""
    open_store(Path(directory), shared=True).acquire(session_id)
    held.set()
    time.sleep(120)


def test_a_shared_folder_leases_a_session_to_one_process_at_a_time(tmp_path: Path) -> None:
    store = open_store(tmp_path, shared=True)
    info, other = store.create(), store.create()
    context = multiprocessing.get_context("spawn")
    held = context.Event()
    process = context.Process(target=hold_lease, args=(str(tmp_path), info.id, held), daemon=True)
    process.start()
    try:
        assert held.wait(60)
        assert error_of(store.acquire, info.id).code == "session_busy"
        assert error_of(store.delete, info.id).status == 409
        store.acquire(other.id).release()  # the others are free
    finally:
        process.kill()  # a process that dies lets go of its leases
        process.join(30)
    lease = store.acquire(info.id)
    lease.release()
    store.acquire(info.id).release()


def test_a_shared_folder_counts_every_process_sessions_against_the_limits(tmp_path: Path) -> None:
    first, second = (open_store(tmp_path, shared=True, max_sessions=3) for _ in range(2))
    first.create()
    first.create()
    second.create()  # second counted first's two when it wrote
    assert error_of(first.create).status == 429 and error_of(second.create).status == 429
    (tmp_path / ".tmp-being-written").write_bytes(b"partial")
    open_store(tmp_path, shared=True)  # a server starting beside running ones leaves their writes alone
    assert (tmp_path / ".tmp-being-written").exists()
    remove_temporary_files(tmp_path)  # what the supervisor does before it starts them
    assert not (tmp_path / ".tmp-being-written").exists()


class Clock:
    """Unix time that a test moves forward (file times stay the kernel's)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


def expiring_store(directory: Path, ttl: float = 100.0, **options: Any) -> tuple[SessionStore, Clock]:
    clock = Clock()
    return open_store(directory, idle_ttl=ttl, clock=clock, metrics=SessionMetrics.unregistered(), **options), clock


def test_a_session_unused_for_the_ttl_is_gone_when_next_named(tmp_path: Path) -> None:
    store, clock = expiring_store(tmp_path)
    idle, used = store.create(), store.create()
    store.save(used.id, snapshot(1), used.created)
    clock.offset = 60
    store.load(used.id)  # a read is a use: its idle time starts again
    clock.offset = 120
    for call in (store.load, store.info, store.export, store.fork, store.delete):
        fresh = store.create()
        clock.offset += 100
        err = error_of(call, fresh.id)
        assert (err.status, err.code) == (404, "session_not_found"), call
        assert not store.path(fresh.id).exists()
    assert error_of(store.info, idle.id).status == 404 and not store.path(idle.id).exists()
    assert store.expire_idle() == 1 and not store.path(used.id).exists()
    assert store.num_sessions == 0 and store.metrics.expired._value.get() == 7


def test_the_sweep_expires_idle_sessions_but_never_one_in_use(tmp_path: Path) -> None:
    store, clock = expiring_store(tmp_path)
    idle, busy, recent = store.create(), store.create(), store.create()
    store.save(busy.id, snapshot(2), busy.created)
    lease = store.acquire(busy.id)  # a request runs on it, longer than the ttl
    clock.offset = 60
    store.info(recent.id)
    clock.offset = 150
    assert store.expire_idle() == 1  # the idle one; the busy one is in use, the recent one was read 90 s ago
    assert not store.path(idle.id).exists() and store.path(busy.id).exists() and store.path(recent.id).exists()
    assert store.info(busy.id).num_tokens == 6  # in use: never expired, also when named meanwhile
    fork = store.fork(busy.id)
    lease.release()
    store.save(busy.id, snapshot(3), busy.created)  # the turn's write: a use
    clock.offset = 240
    assert store.expire_idle() == 1 and not store.path(recent.id).exists()  # busy and the fork: 90 s
    clock.offset = 400
    assert store.expire_idle() == 2 and not store.path(fork.id).exists() and store.num_sessions == 0
    assert open_store(tmp_path).num_sessions == 0


def test_a_turn_on_an_expired_session_is_a_404_and_an_import_makes_it_anew(tmp_path: Path) -> None:
    store, clock = expiring_store(tmp_path)
    info = store.create()
    store.save(info.id, snapshot(4), info.created)
    exported = store.export(info.id)
    clock.offset = 100
    lease = store.acquire(info.id)  # the turn holds the lease as it loads
    assert error_of(store.load, info.id, True).status == 404
    lease.release()
    assert store.import_state(info.id, exported)[1]  # created: the expired one is gone
    clock.offset = 200
    assert store.import_state(info.id, exported)[1]
    assert store.metrics.operation("import")._value.get() == 2


def test_expired_sessions_make_room_at_the_limits(tmp_path: Path) -> None:
    store, clock = expiring_store(tmp_path, max_sessions=2)
    first, second = store.create(), store.create()
    assert error_of(store.create).status == 429
    clock.offset = 100
    lease = store.acquire(first.id)
    third = store.create()  # the idle second one made room; the leased first one stays
    assert store.path(first.id).exists() and not store.path(second.id).exists() and store.path(third.id).exists()
    lease.release()
    assert (store.metrics.rejected._value.get(), store.metrics.expired._value.get()) == (1, 1)


def test_without_a_ttl_nothing_expires(tmp_path: Path) -> None:
    clock = Clock()
    store = open_store(tmp_path, clock=clock)
    info = store.create()
    clock.offset = 10**9
    assert store.expire_idle() == 0 and store.info(info.id).id == info.id


def stored_gauges(metrics: ServerMetrics) -> tuple[float, float]:
    """``rnnserve_sessions`` and ``rnnserve_session_bytes`` of a scrape."""
    text = metrics.render().decode()
    samples = re.finditer(r'^(rnnserve_\w+)\{model_name="m"\} (\S+)$', text, re.M)
    found = {m.group(1): float(m.group(2)) for m in samples}
    return found["rnnserve_sessions"], found["rnnserve_session_bytes"]


def on_disk(directory: Path) -> tuple[float, float]:
    files = list(directory.glob("sess-*.safetensors"))
    return float(len(files)), float(sum(path.stat().st_size for path in files))


@pytest.mark.parametrize("shared", [False, True])
def test_the_stored_session_gauges_follow_every_change_and_a_restart(tmp_path: Path, shared: bool) -> None:
    """The gauges are set as the sessions change (a scrape counts nothing): create, a turn's update, fork,
    import, delete, expiry (named and swept), a session another server of a shared folder stored (both servers'
    gauges are one value in multiprocess mode: one ``SessionMetrics`` here), and a restart."""
    metrics = ServerMetrics("m", 64)
    clock = Clock()
    store = open_store(tmp_path, shared=shared, idle_ttl=100.0, clock=clock, metrics=metrics.sessions)
    assert stored_gauges(metrics) == on_disk(tmp_path) == (0, 0)
    first, second = store.create(), store.create()
    assert stored_gauges(metrics) == on_disk(tmp_path)
    store.save(first.id, snapshot(1), first.created)
    grown = stored_gauges(metrics)
    assert grown == on_disk(tmp_path) and grown[0] == 2
    fork = store.fork(first.id)
    store.import_state("sess-imported-0123456789", store.export(first.id))
    assert stored_gauges(metrics) == on_disk(tmp_path) and on_disk(tmp_path)[0] == 4
    store.delete(second.id)
    assert stored_gauges(metrics) == on_disk(tmp_path) and on_disk(tmp_path)[0] == 3
    if shared:
        other = open_store(tmp_path, shared=True, metrics=metrics.sessions)
        other.save(other.create().id, snapshot(2), first.created)
        assert stored_gauges(metrics) == on_disk(tmp_path) and on_disk(tmp_path)[0] == 4
    clock.offset = 60
    store.info(fork.id)  # used: not idle at 100 s
    clock.offset = 120
    assert error_of(store.info, first.id).status == 404  # named: expired
    assert stored_gauges(metrics) == on_disk(tmp_path)
    assert store.expire_idle() >= 1 and on_disk(tmp_path)[0] == 1  # the sweep: all but the fork
    assert stored_gauges(metrics) == on_disk(tmp_path)
    restarted = ServerMetrics("m", 64)
    open_store(tmp_path, shared=shared, metrics=restarted.sessions)
    assert stored_gauges(restarted) == on_disk(tmp_path) and on_disk(tmp_path)[0] == 1


@pytest.mark.parametrize("shared", [False, True])
def test_a_scrape_reads_no_session_folder(tmp_path: Path, shared: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scrape ran on the event loop and, with a shared folder (``--api-servers``), listed and stat'ed every
    session file: ~10 ms a scrape at 10k sessions, every stream of the server stalled meanwhile (the dashboard's
    sampler scraped too, once a second)."""
    metrics = ServerMetrics("m", 64)
    store = open_store(tmp_path, shared=shared, metrics=metrics.sessions)
    store.create()
    expected = on_disk(tmp_path)

    def no_scan(*args: object) -> None:
        raise AssertionError("a scrape listed a folder")

    monkeypatch.setattr(os, "scandir", no_scan)
    assert stored_gauges(metrics) == expected
