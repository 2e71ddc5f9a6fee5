"""What ``rnnserve serve`` is configured with: the server's own options plus the engine's
:class:`EngineConfig`. Each field carries its command-line help, so the CLI flags are generated from here."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import Any

from rnnserve.engine.config import EngineConfig, add_config_arguments, config_from_args, option, parse_bytes
from rnnserve.engine.loader import DEFAULT_MODEL_DIR, resolve_device

DEFAULT_SERVED_NAME = "rnnserve-default"
API_KEY_ENV = "RNNSERVE_API_KEY"
# prometheus_client reads it as it is imported: the folder where the processes of a multi-process server keep
# their metrics
MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
LOG_LEVELS = ["debug", "info", "warning", "error"]
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "testserver")  # testserver: Starlette's TestClient
WILDCARD_BINDS = ("0.0.0.0", "::", "")


def serving_engine_config(**overrides: Any) -> EngineConfig:
    """An :class:`EngineConfig` with the command line's defaults (e.g. a bounded waiting queue) under
    ``overrides``, so a server built in code behaves like ``rnnserve serve``."""
    parser = argparse.ArgumentParser(add_help=False)
    add_config_arguments(parser, EngineConfig)
    return dataclasses.replace(config_from_args(EngineConfig, parser.parse_args([])), **overrides)


def port_number(text: str) -> int:
    """A TCP port, 0 to 65535 (0: the system picks a free one)."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 0 to 65535, got {text}")
    return value


@dataclass
class ServerConfig:
    """Everything ``rnnserve serve`` configures. ``engine.model=None`` serves the embedded default model.

    Build it from flat keywords with :meth:`build`: ``ServerConfig.build(model="random:mingru-tiny",
    max_num_seqs=4, api_key="k")``.
    """

    engine: EngineConfig = field(default_factory=serving_engine_config)
    served_model_name: list[str] = option(
        [], "model name(s) clients use in 'model' (default: the --model value, a local directory's name, or "
        "rnnserve-default)", metavar="NAME"
    )
    host: str = option("127.0.0.1", "address to listen on (default: 127.0.0.1, local only)")
    port: int = option(8000, "TCP port (0: any free one)", type=port_number)
    api_key: str | None = field(
        default_factory=lambda: os.environ.get(API_KEY_ENV) or None,
        metadata={
            "help": "require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize, /tokenizer_info "
            f"(default: ${API_KEY_ENV}, else no auth)",
            "metavar": "KEY",
        },
    )
    api_key_file: str | None = option(
        None, "read the API key from this file (overrides --api-key and $RNNSERVE_API_KEY; unlike --api-key, "
        "not visible in ps)", metavar="PATH",
    )
    allowed_hosts: list[str] = option(
        [], "Host header values accepted, others get 400 (/health, /ready and /metrics answer any); '*' accepts "
        "any; the list replaces the default: localhost, 127.0.0.1, ::1, testserver (Starlette's TestClient) and "
        "--host, and any IP address when --host is 0.0.0.0 or ::", metavar="HOST",
    )
    allowed_origins: list[str] = option(
        [], "web origins (scheme://host[:port]) whose pages may call the API from a browser (CORS); '*' allows "
        "any (default: none)", metavar="ORIGIN",
    )
    max_body_bytes: int = option(
        1 << 20, "larger request bodies get 413 (default: 1MiB)", type=parse_bytes, metavar="BYTES"
    )
    request_read_timeout: float = option(
        30.0, "a request's head, and then its body, must arrive within this time; else 408 and the connection "
        "is closed", metavar="SECONDS",
    )
    keep_alive_timeout: float = option(5.0, "close keep-alive connections idle for this long", metavar="SECONDS")
    limit_concurrency: int | None = option(
        None, "open connections + in-flight requests; beyond it uvicorn answers 503 (default: no limit)", metavar="N"
    )
    max_queued_bytes: int = option(
        64 << 20, "total size of the prompts waiting for their first token; beyond it 429 (default: 64MiB)",
        type=parse_bytes, metavar="BYTES",
    )
    chat_default_max_tokens: int = option(
        256, "max_tokens of chat requests that give none", flag="--chat-max-tokens", metavar="N"
    )
    chat_template: str | None = option(
        None, "Jinja chat template file for chat requests (default: chat_template.jinja in the model's directory, "
        "else the tokenizer's template, else 'Role: content' lines)", metavar="FILE",
    )
    retry_after_seconds: int = option(1, "Retry-After header of 429 (queue full) answers", metavar="SECONDS")
    drain_timeout: float = option(
        30.0, "on SIGTERM/SIGINT, let in-flight requests finish for this long, then exit", metavar="SECONDS"
    )
    sessions: bool = option(
        True, "turn off persistent sessions (/v1/sessions and the session_id request field)", flag="--no-sessions"
    )
    session_dir: str | None = option(
        None, "folder of the session files (default: $XDG_CACHE_HOME/rnnserve/sessions/<model fingerprint "
        "prefix>, else under ~/.cache)", metavar="DIR",
    )
    max_sessions: int = option(10000, "sessions stored at most; beyond it creating one gets 429", metavar="N")
    max_session_bytes: int = option(
        10 << 30, "total size of the stored session files; beyond it storing one gets 429 (default: 10GiB)",
        type=parse_bytes, metavar="BYTES",
    )
    session_cache_bytes: int = option(
        256 << 20, "host memory for recently used sessions' states, so a conversation's next turn skips the disk "
        "read (default: 256MiB)", type=parse_bytes, metavar="BYTES",
    )
    session_ttl: float | None = option(
        None, "delete a session that no request has used for this long (checked when it is next named, and by a "
        "sweep every quarter of it, at most every minute); a session in use never expires (default: never)",
        metavar="SECONDS",
    )
    engine_process: str = option(
        "auto", "run the engine in a process of its own, so that the HTTP event loop and the engine's host work "
        "do not take turns on one Python interpreter; auto: on for CUDA (on a CPU the model step is the host's "
        "own work, and a thread of the server's process keeps one OpenMP team)", choices=["auto", "on", "off"],
    )
    api_servers: int = option(
        1, "HTTP server processes in front of the one engine process (as vLLM's --api-server-count): they share "
        "the port, /metrics answers for all of them, and they share the session folder; more than one needs the "
        "engine in its own process", type=int, metavar="N",
    )
    api_server_stall_timeout: float = option(
        30.0, "an HTTP server process that leaves the engine process's outputs unacknowledged, or unread, or a "
        "command half-written, this long (its event loop blocked, the process stopped) is taken for stalled: the "
        "engine aborts its requests and drops it, and with --api-servers it is killed, which stops the server as "
        "when one crashes; with --api-servers, so is one whose event loop does not run this long, idle or not "
        "(0: never)", metavar="SECONDS",
    )
    max_compiling: int = option(
        256, "requests whose structured output (JSON schema, regex, grammar) waits to compile, or compiles; "
        "beyond it such a request gets 429", metavar="N",
    )
    http: str = option(
        "auto", "HTTP/1.1 implementation: httptools (C parser; about a third less server CPU per streamed token) "
        "or h11 (pure Python); auto: httptools when installed", choices=["auto", "httptools", "h11"],
    )
    log_level: str = option("info", "log verbosity", choices=LOG_LEVELS)
    access_log: bool = option(False, "log one line per HTTP request (uvicorn's access log)")

    def __post_init__(self) -> None:
        if self.api_key_file is not None:
            self.api_key = read_api_key(self.api_key_file)
        self.api_key = self.api_key or None
        if self.http == "httptools" and importlib.util.find_spec("httptools") is None:
            raise ValueError("--http httptools needs the httptools package (pip install httptools)")
        if self.api_servers < 1:
            raise ValueError("--api-servers must be at least 1")
        if self.max_compiling < 1:
            raise ValueError(f"--max-compiling must be at least 1, got {self.max_compiling}")
        timeouts = [("--request-read-timeout", self.request_read_timeout, False),
                    ("--keep-alive-timeout", self.keep_alive_timeout, False),
                    ("--drain-timeout", self.drain_timeout, True),
                    ("--api-server-stall-timeout", self.api_server_stall_timeout, True)]  # fmt: skip
        for flag, seconds, zero_ok in timeouts:
            if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not zero_ok):
                least = "0 or more" if zero_ok else "above 0"
                raise ValueError(f"{flag} must be a number of seconds {least}, got {seconds}")
        if self.session_ttl is not None and not (math.isfinite(self.session_ttl) and self.session_ttl > 0):
            raise ValueError(f"--session-ttl must be a number of seconds above 0, got {self.session_ttl}")
        if self.api_servers > 1 and self.engine_process == "off":
            raise ValueError("--api-servers above 1 needs the engine in its own process (not --engine-process off)")

    @classmethod
    def build(cls, **options: Any) -> ServerConfig:
        """Server and engine options as one set of keywords; engine fields go to :attr:`engine`."""
        engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
        engine = {name: options.pop(name) for name in list(options) if name in engine_fields}
        return cls(engine=serving_engine_config(**engine), **options)

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """The ``rnnserve serve`` flags: one per engine field and one per server field."""
        add_config_arguments(parser, EngineConfig)
        add_config_arguments(parser, ServerConfig)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        """The config the flags of :meth:`add_arguments` describe."""
        return config_from_args(cls, args, engine=config_from_args(EngineConfig, args))

    @property
    def model_path(self) -> str:
        """The model as given, or the embedded default model's directory."""
        return self.engine.model if self.engine.model is not None else str(DEFAULT_MODEL_DIR)

    @property
    def uses_engine_process(self) -> bool:
        """Whether the engine runs in a process of its own (``engine_process``, auto resolved by the device)."""
        if self.engine_process != "auto" or self.api_servers > 1:
            return self.engine_process != "off"
        return resolve_device(self.engine.device).type == "cuda"

    @property
    def trusted_hosts(self) -> tuple[frozenset[str], bool]:
        """The accepted ``Host`` names (``*`` for any) and whether any IP address is accepted too."""
        if self.allowed_hosts:
            return frozenset(h.lower() for h in self.allowed_hosts), False
        return frozenset((*LOOPBACK_HOSTS, self.host.lower())), self.host in WILDCARD_BINDS

    @property
    def model_is_local_path(self) -> bool:
        model = self.engine.model
        return model is None or os.path.isabs(model) or os.path.exists(model)

    @property
    def model_root(self) -> str:
        """What ``/v1/models`` reports as ``root``: the model id as given, but never a local path."""
        return self.model_names[0] if self.model_is_local_path else str(self.engine.model)

    @property
    def model_names(self) -> list[str]:
        """Names clients may use in ``model``; the first is the default. Without ``--served-model-name``: the
        model id as given, or a local directory's name (its path stays private)."""
        if self.served_model_name:
            return list(self.served_model_name)
        model = self.engine.model
        if model is None:
            return [DEFAULT_SERVED_NAME]
        return [os.path.basename(os.path.normpath(model)) if self.model_is_local_path else model]


def rnnserve_version() -> str:
    """The installed package's version (``0+unknown`` when run from a checkout that was never installed)."""
    try:
        return importlib.metadata.version("rnnserve")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def read_api_key(path: str) -> str:
    """The API key stored in ``path`` (surrounding whitespace removed); ValueError if unreadable or empty."""
    try:
        with open(path, encoding="utf-8") as file:
            key = file.read().strip()
    except OSError as err:
        raise ValueError(f"cannot read --api-key-file {path}: {err.strerror}") from err
    if not key:
        raise ValueError(f"--api-key-file {path} is empty")
    return key
