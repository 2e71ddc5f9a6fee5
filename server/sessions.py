"""Persistent sessions: a conversation's recurrent state kept between requests, on disk and in host memory.

A session is one safetensors file, ``<dir>/<id>.safetensors``: the state tensors of one slot (``state.<name>``),
the tokens the state has consumed (``token_ids``) and the history tokens it has not consumed yet
(``pending_token_ids``, e.g. the last sampled token), int64. The header's ``__metadata__`` (strings) holds the
format and its version, the model fingerprint, the state layout (names, shapes, dtypes), the token count and
the created/updated times. A session that has had no turn yet has no state tensors (``has_state`` = ``0``).

Files are written atomically (a temporary file in the same directory, fsync, ``os.replace``, fsync of the
directory), so a file is always a whole old or a whole new state, also after ``kill -9``. Sessions are
counted at start-up and otherwise found on disk by id when asked for. Recently used sessions stay decoded in
an LRU in host memory; an idle session never holds a state slot. A file that cannot be read back (truncated,
bad header) or that belongs to another model or state layout is a 422 for that session alone. One request at a
time may use a session (:meth:`SessionStore.acquire`; a second one gets 409).

With an idle expiry (``--session-ttl``) a session that no request has used for that long is deleted: when it is
next named (it is then a 404, whether or not the sweep got to it first) and by a periodic sweep
(:meth:`SessionStore.expire_idle`). A file's last use is the later of its modification time (the last write) and
its access time, which the store sets whenever a request reads the session. A session in use is never expired:
expiring one takes its lease.

The store is thread-safe: its methods that touch the disk are called with ``asyncio.to_thread``. Several server
processes may share a folder (``--api-servers``; ``shared``): a lease then also holds a lock on one byte of the
folder's ``.leases`` file (``fcntl.lockf``, so a process that dies lets go), and a write, a delete or an expiry
holds the lock of byte 0, the folder's write lock: under it the process reads the folder's count (sessions and
bytes, which the lease file's first 16 bytes hold), checks the limits against it (so that they hold for all
processes together), changes the folder, moves the count by what it changed (a file created or replaced and its
size, one deleted) and sets the stored-session gauges, which all the processes share, to it. What no server counts
(files copied in or removed behind their back, a count a killed server did not update) is found by a recount of the
folder: at start-up, by the sweep (:func:`sweep_sessions`) and by a write that reaches a limit. A store of one
process counts its sessions by id as they change, checking what a read finds on disk. A scrape reads no folder: a
store keeps the gauges as its sessions change.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import stat
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import safetensors.torch
import torch

from rnnserve.engine.models.base import StateSpec
from rnnserve.engine.outputs import RequestOutput
from rnnserve.engine.state_snapshot import StateSnapshot
from rnnserve.server.errors import APIError
from rnnserve.server.metrics import SessionMetrics

if TYPE_CHECKING:
    from rnnserve.server.config import ServerConfig
    from rnnserve.server.engine_core import EngineInfo

logger = logging.getLogger("rnnserve.server")

FORMAT_NAME = "rnnserve-session"
FORMAT_VERSION = "1"
ID_PREFIX = "sess-"
SESSION_ID_PATTERN = re.compile(r"sess-[A-Za-z0-9_-]{16,128}")
FILE_SUFFIX = ".safetensors"
TEMP_PREFIX = ".tmp-"
STATE_PREFIX = "state."
TOKEN_TENSORS = ("token_ids", "pending_token_ids")
HEADER_LENGTH_BYTES = 8
MAX_HEADER_BYTES = 1 << 20
TOKEN_ID_BYTES = 8
LISTED_TOKEN_ID_BYTES = 36  # a token id held in a Python list: its slot (8 B) and the int object (28 B)
LEASE_FILE = ".leases"  # shared folders: byte 0 locks writes, byte 1 + hash(id) a session's lease
FOLDER_COUNT = struct.Struct("<qq")  # shared folders: the lease file's first bytes, sessions and bytes stored
MAX_SWEEP_INTERVAL = 60.0  # seconds between sweeps for expired sessions, at most
REFRESH_INTERVAL = 10.0  # seconds between recounts of a shared folder without an expiry (with one: the sweep's)
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def default_session_dir(fingerprint: str) -> Path:
    """``$XDG_CACHE_HOME/rnnserve/sessions/<fingerprint prefix>`` (else under ``~/.cache``): one folder per
    model, so the sessions of different models never count against each other's limits."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "rnnserve" / "sessions" / fingerprint[:16]


def new_session_id() -> str:
    """An unguessable id: ``sess-`` and 32 URL-safe characters (192 random bits)."""
    return ID_PREFIX + secrets.token_urlsafe(24)


def check_session_id(session_id: str, param: str | None = None) -> str:
    """``session_id`` if it has the shape of an id (so it names a file in the session folder and nothing
    else); a 400 otherwise."""
    if not SESSION_ID_PATTERN.fullmatch(session_id):
        raise APIError(
            400,
            "invalid session id: expected 'sess-' followed by 16 to 128 letters, digits, '-' or '_'",
            param=param,
            code="invalid_session_id",
        )
    return session_id


def not_found(session_id: str) -> APIError:
    return APIError(404, f"session {session_id!r} does not exist", code="session_not_found")


def corrupted(session_id: str, reason: str) -> APIError:
    return APIError(422, f"session {session_id!r} cannot be read: {reason}", code="session_corrupted")


def busy(session_id: str) -> APIError:
    return APIError(
        409,
        f"session {session_id!r} is in use by another request; a session takes one request at a time",
        code="session_busy",
        retryable=True,
    )


def limit_reached(message: str) -> APIError:
    return APIError(429, message, type="insufficient_quota", code="session_limit_reached")


def safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The safetensors file of ``tensors`` and ``metadata``, what ``safetensors.torch.save`` writes up to the order
    of the tensors (here by falling element size, then name, so each tensor's data is aligned to its element; the
    metadata's keys sorted, the header padded to 8 bytes). That function views each tensor's memory through a
    ctypes array type of the tensor's byte length, and ctypes keeps every such type for good (~3.6 KB each): a
    server storing sessions of ever new history lengths kept one more per length."""
    header: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))}
    chunks: list[bytes] = []
    offset = 0
    for name, tensor in sorted(tensors.items(), key=lambda item: (-item[1].element_size(), item[0])):
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}  # fmt: skip
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def state_layout(specs: list[StateSpec]) -> list[list[object]]:
    """The layout recorded in a session file: ``[name, shape, dtype]`` per state tensor."""
    return [[spec.name, list(spec.shape), dtype_name(spec.dtype)] for spec in specs]


@dataclass(frozen=True)
class FileVersion:
    """Which version of a file the LRU holds: inode, size and modification time."""

    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, stat: os.stat_result) -> FileVersion:
        return cls(stat.st_ino, stat.st_size, stat.st_mtime_ns)


@dataclass
class SessionInfo:
    """What ``GET /v1/sessions/{id}`` reports, and the file's size."""

    id: str
    created: int
    updated: int
    num_tokens: int
    nbytes: int

    def to_json(self, model: str) -> dict[str, object]:
        return {
            "id": self.id,
            "object": "session",
            "created": self.created,
            "updated": self.updated,
            "num_tokens": self.num_tokens,
            "model": model,
        }


@dataclass
class StoredSession:
    """A decoded session: its info and its state (``None`` before its first turn)."""

    info: SessionInfo
    snapshot: StateSnapshot | None

    @property
    def host_bytes(self) -> int:
        """Host memory the decoded session holds (what the LRU counts)."""
        if self.snapshot is None:
            return 0
        tensors = sum(t.numel() * t.element_size() for t in self.snapshot.tensors.values())
        tokens = len(self.snapshot.token_ids) + len(self.snapshot.pending_token_ids)
        return tensors + LISTED_TOKEN_ID_BYTES * tokens

    @property
    def last_token_id(self) -> int | None:
        """The last token of the session's history, or ``None`` when it has none."""
        if self.snapshot is None:
            return None
        history = self.snapshot.pending_token_ids or self.snapshot.token_ids
        return history[-1] if history else None


def data_end(entry: object) -> int | None:
    """Where a header entry's tensor data ends, or ``None`` when the entry does not describe a tensor's data."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets):
        return offsets[1]
    return None


class SessionCodec:
    """Encodes sessions to the file format and decodes (and checks) them, for one model."""

    def __init__(
        self, fingerprint: str, specs: list[StateSpec], vocab_size: int, max_model_len: int | None = None
    ) -> None:
        self.fingerprint = fingerprint
        self.specs = {spec.name: spec for spec in specs}
        self.layout = state_layout(specs)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def encode(self, snapshot: StateSnapshot | None, created: int, updated: int) -> bytes:
        token_ids = snapshot.token_ids if snapshot is not None else []
        pending = snapshot.pending_token_ids if snapshot is not None else []
        tensors = {
            "token_ids": torch.tensor(token_ids, dtype=torch.int64),
            "pending_token_ids": torch.tensor(pending, dtype=torch.int64),
        }
        if snapshot is not None:
            for name, spec in self.specs.items():
                tensors[STATE_PREFIX + name] = snapshot.tensors[name].detach().to("cpu", spec.dtype).contiguous()
        metadata = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "model_fingerprint": self.fingerprint,
            "state_layout": json.dumps(self.layout),
            "has_state": "1" if snapshot is not None else "0",
            "num_tokens": str(len(token_ids) + len(pending)),
            "created": str(created),
            "updated": str(updated),
        }
        return safetensors_bytes(tensors, metadata)

    def read_header(self, session_id: str, header: bytes, size: int) -> tuple[dict[str, str], int]:
        """The checked metadata of a file of ``size`` bytes whose first bytes are ``header`` (at least the
        length prefix and the JSON header), and the header's total length."""
        if size < HEADER_LENGTH_BYTES:
            raise corrupted(session_id, f"the file has {size} bytes, too short for a safetensors header")
        (length,) = struct.unpack("<Q", header[:HEADER_LENGTH_BYTES])
        if length > MAX_HEADER_BYTES or HEADER_LENGTH_BYTES + length > size:
            raise corrupted(session_id, "the safetensors header length is out of bounds (truncated or not a session)")
        try:
            parsed = json.loads(header[HEADER_LENGTH_BYTES : HEADER_LENGTH_BYTES + length])
        except (ValueError, RecursionError) as err:  # not UTF-8, not JSON, or nested beyond the parser's depth
            raise corrupted(session_id, f"the safetensors header is not valid JSON ({type(err).__name__})") from err
        if not isinstance(parsed, dict):
            raise corrupted(session_id, "the safetensors header is not a JSON object")
        metadata = parsed.pop("__metadata__", None)
        if not isinstance(metadata, dict) or metadata.get("format") != FORMAT_NAME:
            raise corrupted(session_id, f"not an rnnserve session file (no '{FORMAT_NAME}' metadata)")
        if not all(isinstance(value, str) for value in metadata.values()):
            raise corrupted(session_id, "the metadata holds values that are not strings")
        if metadata.get("format_version") != FORMAT_VERSION:
            raise corrupted(
                session_id,
                f"session format version {metadata.get('format_version')!r}, this server reads {FORMAT_VERSION!r}",
            )
        self.check_model(session_id, metadata)
        ends = [data_end(entry) for entry in parsed.values()]
        if None in ends:
            raise corrupted(session_id, "a tensor entry of the header has no valid data_offsets")
        expected = HEADER_LENGTH_BYTES + length + max(ends, default=0)  # type: ignore[type-var]
        if expected != size:
            raise corrupted(session_id, f"the file has {size} bytes, its header describes {expected} (truncated?)")
        return metadata, HEADER_LENGTH_BYTES + length

    def check_model(self, session_id: str, metadata: dict[str, str]) -> None:
        """422 for a session of another model or state layout."""
        if metadata.get("model_fingerprint") != self.fingerprint:
            layout = "" if metadata.get("state_layout") == json.dumps(self.layout) else " with another state layout"
            raise APIError(
                422,
                f"session {session_id!r} belongs to another model{layout} (model fingerprint "
                f"{str(metadata.get('model_fingerprint'))[:16]}..., this server's {self.fingerprint[:16]}...)",
                code="session_model_mismatch",
            )
        if metadata.get("state_layout") != json.dumps(self.layout):
            raise APIError(
                422,
                f"session {session_id!r} has another state layout ({metadata.get('state_layout')}; this server's "
                f"{json.dumps(self.layout)})",
                code="session_layout_mismatch",
            )

    def decode(self, session_id: str, data: bytes) -> StoredSession:
        """A whole file, checked: format, model, layout, tensors and token ids; 422 for anything wrong."""
        metadata, _ = self.read_header(session_id, data[: HEADER_LENGTH_BYTES + MAX_HEADER_BYTES], len(data))
        try:
            tensors = safetensors.torch.load(data)
        except Exception as err:  # safetensors raises its own error type (and others) for broken files
            raise corrupted(session_id, f"the tensors cannot be read ({err})") from err
        has_state = metadata.get("has_state") == "1"
        expected = set(TOKEN_TENSORS) | ({STATE_PREFIX + name for name in self.specs} if has_state else set())
        if set(tensors) != expected:
            raise APIError(
                422,
                f"session {session_id!r} holds tensors {sorted(tensors)}, expected {sorted(expected)}",
                code="session_layout_mismatch",
            )
        state: dict[str, torch.Tensor] = {}
        for name, spec in self.specs.items():
            tensor = tensors.get(STATE_PREFIX + name)
            if tensor is None:
                continue
            if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                raise APIError(
                    422,
                    f"session {session_id!r}: state {name!r} is {dtype_name(tensor.dtype)}{list(tensor.shape)}, this "
                    f"model's is {dtype_name(spec.dtype)}{list(spec.shape)}",
                    code="session_layout_mismatch",
                )
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise corrupted(session_id, f"state {name!r} holds NaN or infinite values")
            state[name] = tensor
        token_ids, pending = (self.token_list(session_id, name, tensors[name]) for name in TOKEN_TENSORS)
        if metadata.get("num_tokens") != str(len(token_ids) + len(pending)):
            raise corrupted(session_id, "the token count in the metadata does not match the token ids")
        if has_state and not token_ids and not pending:
            raise corrupted(session_id, "a session with a state has no history tokens")
        info = SessionInfo(
            session_id,
            self.timestamp(session_id, metadata, "created"),
            self.timestamp(session_id, metadata, "updated"),
            len(token_ids) + len(pending),
            len(data),
        )
        return StoredSession(info, StateSnapshot(state, token_ids, pending) if has_state else None)

    def token_list(self, session_id: str, name: str, tensor: torch.Tensor) -> list[int]:
        if tensor.dtype != torch.int64 or tensor.dim() != 1:
            raise corrupted(session_id, f"{name} must be a 1-D int64 tensor")
        if tensor.numel() and not (0 <= int(tensor.min()) and int(tensor.max()) < self.vocab_size):
            raise corrupted(session_id, f"{name} holds ids outside the vocabulary [0, {self.vocab_size})")
        return tensor.tolist()

    @staticmethod
    def timestamp(session_id: str, metadata: dict[str, str], key: str) -> int:
        return metadata_int(session_id, metadata, key, f"the metadata's {key!r} time")

    def check_continuable(self, session_id: str, num_tokens: int) -> None:
        """422 for an imported history longer than the model's length limit: no turn of this server could have
        made it, nor follow it. One that reaches the limit exactly, as a turn may leave it, moves between
        replicas like any other (its next turn is refused for its length)."""
        if self.max_model_len is not None and num_tokens > self.max_model_len:
            raise APIError(
                422,
                f"session {session_id!r} holds {num_tokens} tokens, more than this server's max_model_len "
                f"{self.max_model_len}",
                code="session_too_long",
            )


def metadata_int(session_id: str, metadata: dict[str, str], key: str, what: str) -> int:
    """A non-negative integer of at most 19 ASCII digits from the metadata; 422 for anything else (``str.isdigit``
    takes digits such as ``'²'`` that ``int`` refuses, and ``int`` refuses more than 4300 digits)."""
    value = metadata.get(key, "")
    if not re.fullmatch(r"[0-9]{1,19}", value):
        raise corrupted(session_id, f"{what} is not an integer")
    return int(value)


class SessionSizes:
    """The stored sessions' file sizes by id, with their total kept as they change: the limits and the gauges read
    it per write, and summing 10k sizes each time is what a counter avoids."""

    def __init__(self, sizes: dict[str, int] | None = None) -> None:
        self._sizes = dict(sizes or {})
        self.total = sum(self._sizes.values())

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sizes

    def get(self, session_id: str) -> int | None:
        return self._sizes.get(session_id)

    def items(self) -> list[tuple[str, int]]:
        return list(self._sizes.items())

    def set(self, session_id: str, size: int) -> None:
        self.total += size - self._sizes.get(session_id, 0)
        self._sizes[session_id] = size

    def pop(self, session_id: str) -> None:
        self.total -= self._sizes.pop(session_id, 0)


@dataclass
class FolderCount:
    """A shared folder's sessions and their files' bytes, which its servers keep in its lease file: each moves it
    by what it changes, under the folder's write lock."""

    sessions: int = 0
    nbytes: int = 0

    def change(self, before: int | None, after: int | None) -> None:
        """One session's file went from ``before`` bytes to ``after`` (``None``: no file)."""
        self.sessions += (after is not None) - (before is not None)
        self.nbytes += (after or 0) - (before or 0)

    @classmethod
    def read(cls, fd: int) -> FolderCount | None:
        """The count the lease file ``fd`` holds; ``None`` if none (a new file, or one a failed update emptied)."""
        data = os.pread(fd, FOLDER_COUNT.size, 0)
        if len(data) != FOLDER_COUNT.size:
            return None
        sessions, nbytes = FOLDER_COUNT.unpack(data)
        return cls(sessions, nbytes) if sessions >= 0 and nbytes >= 0 else None

    def write(self, fd: int) -> None:
        """Keep the count in the lease file ``fd`` (its first bytes; the locks on its bytes are another matter)."""
        os.pwrite(fd, FOLDER_COUNT.pack(self.sessions, self.nbytes), 0)


def stored_size(path: Path) -> int | None:
    """The size of the session file at ``path`` as a count of the folder has it (a regular file; ``None`` for no
    file or something else at the path)."""
    try:
        status = path.stat()
    except FileNotFoundError:
        return None
    return status.st_size if stat.S_ISREG(status.st_mode) else None


class SessionLease:
    """The right to run one request on a session; :meth:`release` (idempotent) gives it back."""

    def __init__(self, store: SessionStore, session_id: str) -> None:
        self.store = store
        self.session_id = session_id

    def release(self) -> None:
        self.store.release(self)


class SessionStore:
    """The sessions of one model in ``directory``, with count and byte limits, an optional idle expiry
    (``idle_ttl`` seconds, against ``clock``, the Unix time of file times) and an LRU of decoded sessions; what it
    does is counted in ``metrics``."""

    def __init__(
        self,
        directory: Path,
        codec: SessionCodec,
        max_sessions: int,
        max_bytes: int,
        cache_bytes: int,
        shared: bool = False,
        idle_ttl: float | None = None,
        metrics: SessionMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = directory
        self.codec = codec
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self.cache_bytes = cache_bytes
        self.shared = shared
        self.idle_ttl = idle_ttl
        self.clock = clock
        self.metrics = metrics if metrics is not None else SessionMetrics.unregistered()
        self.metrics.cache_memory_total_bytes.set(cache_bytes)
        self.metrics.watch_store(max_sessions, max_bytes)
        self._lock = threading.Lock()
        self._write_lock = threading.RLock()  # shared folders: one write at a time in this process, too
        self._write_depth = 0  # how many _writing blocks the thread holding _write_lock is in
        self._sizes = SessionSizes()  # a folder of one process: its sessions' sizes by id
        self._in_flight: set[str] = set()  # ... and those whose file it is writing now (counted at their new size)
        self._folder = FolderCount()  # a shared folder: its count, as this store last read or changed it
        self._folder_on_disk: FolderCount | None = None  # ... and what its lease file held then
        self._cache: OrderedDict[str, tuple[StoredSession, FileVersion]] = OrderedDict()
        self._cache_used = 0
        self._leases: dict[str, SessionLease] = {}
        self._lease_fd: int | None = None
        try:
            if shared:  # the lease file needs the folder
                self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                self._lease_fd = os.open(self.directory / LEASE_FILE, os.O_RDWR | os.O_CREAT, 0o600)
                self.refresh()
            else:
                prepare_session_folder(directory)
                with self._lock:
                    self._sizes = SessionSizes(self._scan())
                    self._publish()
        except OSError as err:
            raise ValueError(f"cannot use the session folder {directory}: {err.strerror or err}") from err
        logger.info("sessions: %d stored in %s (%d bytes)", self.num_sessions, directory, self.stored_bytes)

    def _scan(self) -> dict[str, int]:
        """The sessions on disk and their sizes. The folder is made by the first write (a server whose clients
        use no sessions writes nothing)."""
        sizes: dict[str, int] = {}
        if not self.directory.exists():
            return sizes
        for entry in os.scandir(self.directory):
            session_id = entry.name.removesuffix(FILE_SUFFIX)
            if entry.name.endswith(FILE_SUFFIX) and SESSION_ID_PATTERN.fullmatch(session_id):
                try:
                    if entry.is_file():
                        sizes[session_id] = entry.stat().st_size
                except FileNotFoundError:  # deleted meanwhile (by another server of a shared folder)
                    pass
        return sizes

    @property
    def num_sessions(self) -> int:
        """The sessions stored: as this store counts them, or a shared folder's when this store last changed or
        counted it."""
        return self._folder.sessions if self.shared else len(self._sizes)

    @property
    def stored_bytes(self) -> int:
        """The bytes of their files, the same way."""
        return self._folder.nbytes if self.shared else self._sizes.total

    def refresh(self) -> None:
        """Count a shared folder afresh (what no server of it counted: files copied in or removed behind their
        back, a count a killed server did not update), drop from the LRU the sessions no longer there and update
        the gauges; a no-op for a folder of one process, whose count is kept as it changes."""
        with self._writing(recount=True):
            pass

    def sweep(self) -> int:
        """The periodic sweep (:func:`sweep_sessions`): :meth:`refresh`, and :meth:`expire_idle` with an expiry;
        how many sessions expired."""
        with self._writing(recount=True):
            return self.expire_idle()

    def _publish(self) -> None:
        """Set the stored-session gauges to this store's count (under ``_lock``, or a shared folder's write
        lock)."""
        self.metrics.set_stored(self.num_sessions, self.stored_bytes)

    def path(self, session_id: str) -> Path:
        return self.directory / f"{check_session_id(session_id)}{FILE_SUFFIX}"

    # --- one request at a time ------------------------------------------------------------------------

    def acquire(self, session_id: str) -> SessionLease:
        """The session for one request; 409 while another request (of any process sharing the folder) holds it."""
        with self._lock:
            if session_id in self._leases:
                raise busy(session_id)
            if self._lease_fd is not None:
                try:
                    fcntl.lockf(self._lease_fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, lease_byte(session_id))
                except OSError:  # held by another process
                    raise busy(session_id) from None
            lease = self._leases[session_id] = SessionLease(self, session_id)
        return lease

    def release(self, lease: SessionLease) -> None:
        with self._lock:
            if self._leases.get(lease.session_id) is lease:
                del self._leases[lease.session_id]
                if self._lease_fd is not None:
                    fcntl.lockf(self._lease_fd, fcntl.LOCK_UN, 1, lease_byte(lease.session_id))

    @contextmanager
    def _writing(self, recount: bool = False) -> Iterator[None]:
        """A change of a shared folder (a write with its check of the limits, a delete, an expiry), alone among
        the processes sharing it, with the folder's count as they left it (``recount`` or none kept: counted
        afresh), which the change moves (:meth:`_counted`); at its end, still alone, the count is kept for the
        others and published to the gauges: the last one published is the folder's as it is. Blocks nest (an
        expiry within a write's): the outermost one locks, reads, keeps and publishes."""
        if self._lease_fd is None:
            yield
            return
        with self._write_lock:
            outermost = self._write_depth == 0
            if outermost:
                fcntl.lockf(self._lease_fd, fcntl.LOCK_EX, 1, 0)
                try:
                    self._folder_on_disk = None if recount else self._read_folder_count()
                    if self._folder_on_disk is None:
                        self._recount()
                    else:
                        self._folder = replace(self._folder_on_disk)
                except BaseException:  # e.g. the folder cannot be listed: nothing changed, nothing to keep
                    fcntl.lockf(self._lease_fd, fcntl.LOCK_UN, 1, 0)
                    raise
            self._write_depth += 1
            try:
                yield
            finally:
                self._write_depth -= 1
                if outermost:
                    try:
                        self._keep_folder_count()
                    finally:
                        fcntl.lockf(self._lease_fd, fcntl.LOCK_UN, 1, 0)

    def _read_folder_count(self) -> FolderCount | None:
        """The count the shared folder's lease file holds (under its write lock); ``None`` if it holds none."""
        assert self._lease_fd is not None
        try:
            return FolderCount.read(self._lease_fd)
        except OSError as err:
            logger.warning("cannot read the session count of %s, counting anew: %s", self.directory, err)
            return None

    def _recount(self) -> None:
        """Count the shared folder afresh (under its write lock) and drop from the LRU what is gone."""
        sizes = self._scan()
        with self._lock:
            self._forget_missing(sizes)
        self._folder = FolderCount(len(sizes), sum(sizes.values()))

    def _keep_folder_count(self) -> None:
        """At the end of a change of the shared folder (under its write lock): write its count to the lease file
        if it moved, and publish it. If the file cannot be written it is emptied, so that the next change
        recounts (a stale count would hold for every server)."""
        assert self._lease_fd is not None
        if self._folder != self._folder_on_disk:
            try:
                self._folder.write(self._lease_fd)
                self._folder_on_disk = replace(self._folder)
            except OSError as err:
                logger.error("cannot keep the session count of %s (the next change recounts): %s", self.directory, err)
                with suppress(OSError):
                    os.ftruncate(self._lease_fd, 0)
        self._publish()

    def _counted(self, session_id: str, before: int | None, after: int | None) -> None:
        """A shared folder's session file changed (under its write lock) from ``before`` bytes to ``after``
        (``None``: no file): the count follows; gone, the session leaves the LRU."""
        self._folder.change(before, after)
        if after is None:
            with self._lock:
                self._forget(session_id)

    @contextmanager
    def _leased(self, session_id: str) -> Iterator[None]:
        lease = self.acquire(session_id)
        try:
            yield
        finally:
            lease.release()

    # --- reading --------------------------------------------------------------------------------------

    def load(self, session_id: str, leased: bool = False) -> StoredSession:
        """The session, decoded and checked; 404 or 422. From the LRU while its file is the one the LRU's copy
        came from (a file replaced or damaged behind the server's back is read again). ``leased``: the caller
        holds the session's lease (a turn), so an expired session is deleted without taking it."""
        self._expire_if_idle(session_id, leased)
        self.metrics.cache_queries.inc()
        cached = self._cached(session_id)
        if cached is not None:
            self.metrics.cache_hits.inc()
            return cached
        data, version = self._read(session_id)
        stored = self.codec.decode(session_id, data)
        self._remember(stored, version)
        return stored

    def info(self, session_id: str) -> SessionInfo:
        """The session's info from its header alone (the tensors are not read); 404 or 422."""
        self._expire_if_idle(session_id)
        cached = self._cached(session_id)
        if cached is not None:
            return cached.info
        with self._open(session_id) as file:
            size = os.fstat(file.fileno()).st_size
            head = file.read(HEADER_LENGTH_BYTES)
            if len(head) == HEADER_LENGTH_BYTES:
                (length,) = struct.unpack("<Q", head)
                head += file.read(min(length, MAX_HEADER_BYTES))
            self._found(session_id, file)
        metadata, _ = self.codec.read_header(session_id, head, size)
        num_tokens = metadata_int(session_id, metadata, "num_tokens", "the metadata's token count")
        created = self.codec.timestamp(session_id, metadata, "created")
        updated = self.codec.timestamp(session_id, metadata, "updated")
        return SessionInfo(session_id, created, updated, num_tokens, size)

    def export(self, session_id: str) -> bytes:
        """The session's file, checked first (a broken or foreign file is a 422, not a download)."""
        self._expire_if_idle(session_id)
        data, version = self._read(session_id)
        self._remember(self.codec.decode(session_id, data), version)
        self.metrics.operation("export").inc()
        return data

    # --- writing --------------------------------------------------------------------------------------

    def create(self) -> SessionInfo:
        """A new empty session (its first request's prompt starts it); 429 beyond the limits."""
        now = int(time.time())
        session_id = new_session_id()
        info = self._store(session_id, None, now, now, new=True)
        self.metrics.operation("create").inc()
        return info

    def save(self, session_id: str, snapshot: StateSnapshot, created: int) -> SessionInfo:
        """Store the state after a turn (the caller holds the session's lease)."""
        info = self._store(session_id, snapshot, created, int(time.time()), new=False)
        self.metrics.turns.inc()
        return info

    def fork(self, session_id: str) -> SessionInfo:
        """A new session with a copy of ``session_id``'s stored state."""
        source = self.load(session_id)
        now = int(time.time())
        info = self._store(new_session_id(), source.snapshot, now, now, new=True)
        self.metrics.operation("fork").inc()
        return info

    def import_state(self, session_id: str, data: bytes) -> tuple[SessionInfo, bool]:
        """Create or replace ``session_id`` from an exported file (checked like a stored one); whether it is
        new. A session in use is a 409 before the file is looked at (as any write to it, whatever it sends),
        then a file that cannot be stored is a 422."""
        with self._leased(session_id):
            try:
                self._expire_if_idle(session_id, leased=True)  # an expired session is replaced by a new one
            except APIError:
                pass
            stored = self.codec.decode(session_id, data)
            self.codec.check_continuable(session_id, stored.info.num_tokens)
            new = not self.path(session_id).exists()
            info = self._store(session_id, stored.snapshot, stored.info.created, int(time.time()), new=new)
        self.metrics.operation("import").inc()
        return info, new

    def delete(self, session_id: str) -> None:
        """Remove the session; 404 if there is none (or it expired), 409 while a request uses it."""
        with self._leased(session_id):
            self._expire_if_idle(session_id, leased=True)
            with self._writing():
                path = self.path(session_id)
                try:
                    size = stored_size(path) if self.shared else None
                    path.unlink()
                except FileNotFoundError:
                    raise self._missing(session_id) from None
                except OSError as err:  # e.g. a directory in its place
                    raise APIError(500, f"cannot delete session {session_id!r}: {err.strerror or err}",
                                   type="internal_error", code="session_write_failed") from None  # fmt: skip
                self._removed(session_id, size)
        self.metrics.operation("delete").inc()

    # --- idle expiry ----------------------------------------------------------------------------------

    def expire_idle(self) -> int:
        """Delete every session unused for ``idle_ttl`` seconds that no request holds; how many it deleted."""
        if self.idle_ttl is None or not self.directory.exists():
            return 0
        with self._writing():  # a shared folder: counted and published once, not once per expired session
            return self._expire_listed()

    def _expire_listed(self) -> int:
        """:meth:`expire_idle`'s pass over the folder."""
        expired = 0
        for entry in os.scandir(self.directory):
            session_id = entry.name.removesuffix(FILE_SUFFIX)
            if not (entry.name.endswith(FILE_SUFFIX) and SESSION_ID_PATTERN.fullmatch(session_id)):
                continue
            try:
                idle = self._idle(entry.stat())
            except FileNotFoundError:  # deleted meanwhile
                continue
            if not idle:
                continue
            try:
                lease = self.acquire(session_id)
            except APIError:  # in use
                continue
            try:
                expired += self._remove_if_idle(session_id)
            finally:
                lease.release()
        return expired

    def _idle(self, stat_result: os.stat_result) -> bool:
        """Whether a regular file was last used (written or read) ``idle_ttl`` or more seconds ago."""
        if self.idle_ttl is None or not stat.S_ISREG(stat_result.st_mode):
            return False
        last_use = max(stat_result.st_mtime_ns, stat_result.st_atime_ns) / 1e9
        return self.clock() - last_use >= self.idle_ttl

    def _expire_if_idle(self, session_id: str, leased: bool = False) -> None:
        """Before a request reads or writes a session: 404 (and the file deleted) if it expired, else mark it
        used now. A session another request holds is in use, not idle. ``leased``: the caller holds the lease."""
        if self.idle_ttl is None:
            return
        path = self.path(session_id)
        try:
            stat_result = path.stat()
        except OSError:  # missing or unreadable: the request's own read answers for it
            return
        if not self._idle(stat_result):
            if stat.S_ISREG(stat_result.st_mode):
                self._mark_used(path, stat_result)
            return
        if leased:
            removed = self._remove_if_idle(session_id)
        else:
            try:
                lease = self.acquire(session_id)
            except APIError:  # in use
                return
            try:
                removed = self._remove_if_idle(session_id)
            finally:
                lease.release()
        if removed:
            raise not_found(session_id)

    def _mark_used(self, path: Path, stat_result: os.stat_result) -> None:
        """Set the file's access time to now, its modification time unchanged (the LRU's copy stays valid)."""
        try:
            os.utime(path, ns=(int(self.clock() * 1e9), stat_result.st_mtime_ns))
        except OSError as err:  # deleted meanwhile, or a file of another owner
            logger.debug("cannot mark session file %s used: %s", path, err)

    def _remove_if_idle(self, session_id: str) -> bool:
        """Delete the session if it is (still) idle; the caller holds its lease. Whether it did."""
        path = self.path(session_id)
        with self._writing():
            try:
                status = path.stat()
                if not self._idle(status):
                    return False
                path.unlink()
            except FileNotFoundError:
                return False
            except OSError as err:
                logger.warning("cannot delete expired session %s: %s", session_id, err.strerror or err)
                return False
            self._removed(session_id, status.st_size)  # a regular file: an idle one
        self.metrics.expired.inc()
        logger.info("session %s expired: unused for %gs (--session-ttl)", session_id, self.idle_ttl)
        return True

    def _store(
        self, session_id: str, snapshot: StateSnapshot | None, created: int, updated: int, new: bool
    ) -> SessionInfo:
        data = self.codec.encode(snapshot, created, updated)
        store = self._store_shared if self.shared else self._store_alone
        version = store(session_id, data, new)
        num_tokens = len(snapshot.token_ids) + len(snapshot.pending_token_ids) if snapshot is not None else 0
        info = SessionInfo(session_id, created, updated, num_tokens, len(data))
        self._remember(StoredSession(info, snapshot), version)
        return info

    def _store_shared(self, session_id: str, data: bytes, new: bool) -> FileVersion:
        """Write a session of a shared folder, alone among its servers: its limits checked against the folder's
        count (recounted, with expired sessions deleted, if they are reached), which then moves by the file's
        change."""
        path = self.path(session_id)
        with self._writing():
            previous = stored_size(path)
            refused = self._over_limits(new, previous, len(data))
            if refused is not None:  # expired sessions, and files removed behind the servers' back, still counted
                self.expire_idle()
                self._recount()
                previous = stored_size(path)
                refused = self._over_limits(new, previous, len(data))
            if refused is not None:
                self.metrics.rejected.inc()
                raise limit_reached(refused)
            version = self._write_or_fail(session_id, data)
            self._counted(session_id, previous, len(data))
        return version

    def _store_alone(self, session_id: str, data: bytes, new: bool) -> FileVersion:
        """Write a session of a folder of one process. Its place is reserved (counted at the new size) before
        the file is written, so that writes of other sessions at the same time see it, and given back if the
        write fails."""
        with self._lock:
            at_limit = self._over_limits(new, self._sizes.get(session_id), len(data)) is not None
        if at_limit:  # expired sessions, and files removed behind the server's back, still counted
            self.expire_idle()
            sizes = self._scan()
            with self._lock:  # the writes in flight keep their places: their files may not be there yet
                writing = {i: n for i, n in self._sizes.items() if i in self._in_flight}
                self._sizes = SessionSizes({**sizes, **writing})
                self._publish()
        with self._lock:
            previous = self._sizes.get(session_id)
            refused = self._over_limits(new, previous, len(data))
            if refused is not None:
                self.metrics.rejected.inc()
                raise limit_reached(refused)
            self._sizes.set(session_id, len(data))
            self._in_flight.add(session_id)
        written = False
        try:
            version = self._write_or_fail(session_id, data)
            written = True
        finally:
            with self._lock:
                self._in_flight.discard(session_id)
                if not written:
                    if previous is None:
                        self._sizes.pop(session_id)
                    else:
                        self._sizes.set(session_id, previous)
                self._publish()
        return version

    def _over_limits(self, new: bool, previous: int | None, size: int) -> str | None:
        """Why storing ``size`` bytes as a session whose file has ``previous`` bytes (``None``: none) would pass
        ``--max-sessions`` (``new``: a session made now) or ``--max-session-bytes``, else ``None`` (under
        ``_lock``, or a shared folder's write lock)."""
        if new and previous is None and self.num_sessions >= self.max_sessions:
            return f"the server stores at most {self.max_sessions} sessions (--max-sessions); delete some first"
        if self.stored_bytes - (previous or 0) + size > self.max_bytes:
            return (
                f"storing this session ({size} bytes) would pass the {self.max_bytes}-byte limit on stored sessions "
                "(--max-session-bytes); delete some first"
            )
        return None

    def _write_or_fail(self, session_id: str, data: bytes) -> FileVersion:
        """:meth:`_write` of a session's file; a 500 ``session_write_failed`` if it fails."""
        try:
            return self._write(self.path(session_id), data)
        except OSError as err:
            logger.error("cannot write session %s: %s", session_id, err)
            raise APIError(
                500,
                f"cannot store session {session_id!r}: {err.strerror or err}",
                type="internal_error",
                code="session_write_failed",
            ) from err

    def _write(self, path: Path, data: bytes) -> FileVersion:
        """Atomically replace ``path`` with ``data``: durable once this returns. Returns the new file's version."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=self.directory, prefix=TEMP_PREFIX)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
                file.flush()
                now = int(self.clock() * 1e9)  # the store's time, which idle expiry compares file times with
                os.utime(file.fileno(), ns=(now, now))
                os.fsync(file.fileno())
                version = FileVersion.of(os.fstat(file.fileno()))
            os.replace(temp, path)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise
        directory = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        return version

    # --- bookkeeping ----------------------------------------------------------------------------------

    def _read(self, session_id: str) -> tuple[bytes, FileVersion]:
        with self._open(session_id) as file:
            version = FileVersion.of(os.fstat(file.fileno()))
            data = file.read()
            self._found(session_id, file)
        return data, version

    @contextmanager
    def _open(self, session_id: str) -> Iterator[BinaryIO]:
        """The session's file, open for reading; 404 if there is none, 422 ``session_corrupted`` if it is no
        regular file (a directory; a FIFO, opened without blocking, would hang the read) or cannot be opened or
        read."""
        try:
            fd = os.open(self.path(session_id), os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            raise self._missing(session_id) from None
        except OSError as err:
            raise corrupted(session_id, err.strerror or str(err)) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise corrupted(session_id, "its path is not a regular file")
        with os.fdopen(fd, "rb") as file:
            try:
                yield file
            except OSError as err:
                raise corrupted(session_id, err.strerror or str(err)) from None

    def _cached(self, session_id: str) -> StoredSession | None:
        """The LRU's copy of the session if its file has not changed since (one ``stat``)."""
        with self._lock:
            entry = self._cache.get(session_id)
        if entry is None:
            return None
        try:
            current = FileVersion.of(self.path(session_id).stat())
        except FileNotFoundError:
            current = None
        with self._lock:
            if current != entry[1]:
                self._forget(session_id)
                return None
            self._cache.move_to_end(session_id)
        return entry[0]

    def _found(self, session_id: str, file: BinaryIO) -> None:
        """A session's file that was read, still open: counted at its size from now on (also one copied in while
        the server runs), unless this store is writing the session or the file was deleted or replaced since it
        was opened, which whoever did it counted. A shared folder's count is kept by its writers, not its
        readers."""
        if self.shared:
            return
        with self._lock:
            if session_id in self._in_flight:
                return
            status = os.fstat(file.fileno())
            if status.st_nlink > 0 and self._sizes.get(session_id) != status.st_size:
                self._sizes.set(session_id, status.st_size)
                self._publish()

    def _missing(self, session_id: str) -> APIError:
        """The 404 of a session whose file was not found: no longer counted, unless this store is writing it or
        its file is there by now (written since), or in the LRU."""
        with self._lock:
            self._forget(session_id)
            if not self.shared and session_id in self._sizes and session_id not in self._in_flight:
                if not os.path.isfile(self.path(session_id)):
                    self._sizes.pop(session_id)
                    self._publish()
        return not_found(session_id)

    def _removed(self, session_id: str, size: int | None) -> None:
        """The session's file of ``size`` bytes was deleted (a shared folder's write lock held): no longer
        counted, or in the LRU."""
        if self.shared:
            self._counted(session_id, size, None)
            return
        with self._lock:
            self._sizes.pop(session_id)
            self._forget(session_id)
            self._publish()

    def _remember(self, stored: StoredSession, version: FileVersion) -> None:
        """Keep a decoded session in the LRU, evicting the least recently used beyond ``cache_bytes``."""
        with self._lock:
            self._forget(stored.info.id)
            if stored.host_bytes > self.cache_bytes:
                return
            self._cache[stored.info.id] = (stored, version)
            self._cache_used += stored.host_bytes
            while self._cache_used > self.cache_bytes:
                _, (evicted, _) = self._cache.popitem(last=False)
                self._cache_used -= evicted.host_bytes
            self.metrics.cache_memory_used_bytes.set(self._cache_used)

    def _forget_missing(self, sizes: dict[str, int]) -> None:
        """Drop from the LRU the sessions not in ``sizes``, a scan of the folder: in a shared folder, those another
        process deleted or expired, which this one would otherwise hold decoded (and count as used) until evicted
        (the caller holds the lock)."""
        for session_id in [cached for cached in self._cache if cached not in sizes]:
            self._forget(session_id)

    def _forget(self, session_id: str) -> None:
        """Drop a session from the LRU (the caller holds the lock)."""
        entry = self._cache.pop(session_id, None)
        if entry is not None:
            self._cache_used -= entry[0].host_bytes
            self.metrics.cache_memory_used_bytes.set(self._cache_used)


def lease_byte(session_id: str) -> int:
    """The byte of a shared folder's lease file whose lock is ``session_id``'s lease (byte 0 locks writes)."""
    return 1 + int.from_bytes(hashlib.blake2b(session_id.encode(), digest_size=6).digest(), "big")


def prepare_session_folder(directory: Path) -> None:
    """Before any server of the folder runs: remove what a killed server left behind, and check that the folder
    exists or can be made (``OSError`` if not)."""
    remove_temporary_files(directory)
    _check_creatable(directory)


def _check_creatable(directory: Path) -> None:
    """The folder, made by the first write, can be: it or its nearest existing parent is a writable directory.
    Else the server started, said it was ready, and answered every session 500 (a misconfigured volume)."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"{existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, f"{existing} is not writable")


def remove_temporary_files(directory: Path) -> None:
    """Remove the temporary files a killed server left behind in a session folder (none while a server of the
    folder may be writing one)."""
    if directory.exists():
        for entry in os.scandir(directory):
            if entry.name.startswith(TEMP_PREFIX):
                Path(entry.path).unlink(missing_ok=True)


def session_dir(config: ServerConfig, fingerprint: str) -> Path:
    """The session folder ``config`` asks for, for a model with this fingerprint."""
    return Path(config.session_dir).expanduser() if config.session_dir else default_session_dir(fingerprint)


def open_session_store(config: ServerConfig, engine: EngineInfo, metrics: SessionMetrics) -> SessionStore:
    """The store ``config`` asks for, for ``engine``'s model (ValueError if its folder cannot be used), counting in
    ``metrics``; shared by the processes of ``--api-servers``."""
    codec = SessionCodec(engine.model_fingerprint, engine.state_specs, engine.vocab_size, engine.max_model_len)
    return SessionStore(
        session_dir(config, codec.fingerprint),
        codec,
        config.max_sessions,
        config.max_session_bytes,
        config.session_cache_bytes,
        shared=config.api_servers > 1,
        idle_ttl=config.session_ttl,
        metrics=metrics,
    )


def sweep_interval(idle_ttl: float | None) -> float:
    """Seconds between two sweeps of the folder: for expired sessions a quarter of the expiry, at most a minute
    (a session named by a request is checked then anyway; the sweep frees the room of those no one names again);
    without an expiry (a shared folder's recount) :data:`REFRESH_INTERVAL`."""
    return REFRESH_INTERVAL if idle_ttl is None else min(idle_ttl / 4, MAX_SWEEP_INTERVAL)


def needs_sweep(store: SessionStore) -> bool:
    """Whether the store's folder is swept now and then: for expired sessions, or to recount a shared folder."""
    return store.idle_ttl is not None or store.shared


async def sweep_sessions(store: SessionStore, interval: float) -> None:
    """Now and then every ``interval`` seconds, off the event loop, until cancelled: :meth:`SessionStore.sweep`,
    which deletes expired sessions (with an expiry) and recounts a shared folder (the count and the gauges take in
    what no server counted, and the LRU drops the sessions other processes deleted, also while this one writes
    nothing). A sweep that fails is logged, and the next one tries again."""
    while True:
        try:
            await asyncio.to_thread(store.sweep)
        except OSError as err:  # e.g. the folder became unreadable: try again next time
            logger.warning("cannot sweep the session folder %s: %s", store.directory, err.strerror or err)
        except Exception:  # a bug: logged, and the next sweep tries again (no one awaits this task)
            logger.exception("the sweep of the session folder %s failed", store.directory)
        await asyncio.sleep(interval)


def max_state_upload_bytes(bytes_per_slot: int, max_model_len: int) -> int:
    """The body limit of ``PUT /v1/sessions/{id}/state``: twice a slot's state, 8 bytes per token of the
    longest history (``max_model_len``) and the largest header this server reads."""
    return 2 * bytes_per_slot + TOKEN_ID_BYTES * max_model_len + MAX_HEADER_BYTES


class SessionTurn:
    """One request's use of a session: its lease, the stored session it continues, and the write-back of the
    state after the response (awaited before the client sees the end of the answer)."""

    def __init__(self, store: SessionStore, lease: SessionLease, stored: StoredSession) -> None:
        self.store = store
        self.lease = lease
        self.stored = stored
        self._write: asyncio.Future[SessionInfo] | None = None
        self._released = False
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()

    @property
    def context(self) -> StateSnapshot | None:
        """The state the request continues (``None`` on a session's first turn)."""
        return self.stored.snapshot

    async def store_state(self, out: RequestOutput) -> None:
        """Store the state after a finished response, off the event loop. The write goes on (and the session
        stays leased) even if the client disconnects meanwhile, so a file is never half-replaced."""
        if out.final_state is None:
            if any(sample.finish_reason == "abort" for sample in out.outputs):  # e.g. cut by a shutdown's drain
                raise APIError(
                    503,
                    "the request was aborted before it finished (the server is shutting down or its engine failed); "
                    "the session keeps the state it had before this request",
                    type="service_unavailable",
                    retryable=True,
                )
            raise APIError(500, "the engine returned no state to store in the session", type="internal_error")
        save = asyncio.to_thread(self.store.save, self.lease.session_id, out.final_state, self.stored.info.created)
        self._write = asyncio.ensure_future(save)
        await asyncio.shield(self._write)

    def release(self) -> None:
        """Give the session back, once a write in flight has finished; later calls do nothing. Called off the
        event loop's thread, it hands the release to the loop (:meth:`release_soon`): the write's future is the
        loop's, and not thread-safe."""
        if threading.get_ident() != self._loop_thread:
            self.release_soon()
            return
        if self._released:
            return
        self._released = True
        if self._write is None or self._write.done():
            self.lease.release()
        else:
            self._write.add_done_callback(self._written)

    def release_soon(self) -> None:
        """:meth:`release` from any thread, also from a garbage-collected submission's finalizer, which runs on
        whichever thread collected it, maybe amid the loop's own code (or the store's, holding its lock): the
        release is handed to the loop, to run there next. Once the loop is closed no write can finish any more,
        and the lease is given back at once."""
        try:
            self._loop.call_soon_threadsafe(self.release)
        except RuntimeError:  # the loop is closed
            if not self._released:
                self._released = True
                self.lease.release()

    def _written(self, write: asyncio.Future[SessionInfo]) -> None:
        if not write.cancelled():
            write.exception()  # retrieved: the request that awaited it reported it
        self.lease.release()
