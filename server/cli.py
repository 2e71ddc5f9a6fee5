"""The ``rnnserve`` command: ``serve`` (HTTP API), ``generate`` (offline, streams to the terminal),
``bench`` (load generator for any OpenAI-compatible server), ``convert`` (released checkpoints to
safetensors) and ``lsrl`` (LSRL program tools).

Nothing here imports torch (or the engine, which does) at module level: the seconds torch takes to load then
pass inside :func:`main`, where Ctrl-C ends the program quietly with 130, not with a traceback.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from rnnserve.engine.sampling_params import StructuredOutputParams
    from rnnserve.server.config import ServerConfig
    from rnnserve.server.engine_core import EngineInfo

logger = logging.getLogger("rnnserve")

GENERATE_ENGINE_FLAGS_SKIPPED = ("max_num_seqs", "max_waiting", "state_memory")  # one request, one slot
# How long the server's OpenMP threads spin after a parallel region before they sleep, unless OMP_WAIT_POLICY or
# GOMP_SPINCOUNT is set. libgomp's default (300,000 spins, milliseconds) takes the core that the event loop needs
# on a small machine; PASSIVE (no spin) pays a wake-up for each of the ~100 parallel regions of a decode step
# (-30% at batch 1). 10,000 spins bridge the gaps between the regions of a step. See docs/performance.md.
GOMP_SPINCOUNT_DEFAULT = "10000"
# PyTorch's CPU allocator puts tensors of 2 MB and more on transparent huge pages when THP_MEM_ALLOC_ENABLE is set
# (read once, as torch starts): the weights stream with fewer TLB misses. Zen 5, two threads, alternating runs:
# mamba-370m bf16 decode at batch 1 3-5% faster, at batch 4 1-3%.
THP_MEM_ALLOC_DEFAULT = "1"
STARTUP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # held across serve's restart and torch's import


def serving_environment(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` with what a serving process needs before torch loads: OpenMP's spin count unless it chooses a
    wait policy (``OMP_WAIT_POLICY`` or libgomp's ``GOMP_SPINCOUNT``), and huge pages for large tensors unless it
    sets ``THP_MEM_ALLOC_ENABLE``."""
    added = {}
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        added["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT_DEFAULT
    if "THP_MEM_ALLOC_ENABLE" not in environ:
        added["THP_MEM_ALLOC_ENABLE"] = THP_MEM_ALLOC_DEFAULT
    return {**environ, **added} if added else environ


def reexec_with_serving_environment() -> None:
    """Restart this process (same pid) with :func:`serving_environment` when it adds anything (libgomp and
    PyTorch's allocator read those variables once, when torch loads). Returns only when nothing needs changing.

    A Ctrl-C or SIGTERM during the restart is not lost: both are blocked across the exec (one that comes stays
    pending; one that came before is raised by the blocking call) and unblocked when this returns, in the
    restarted program, inside ``main``'s handling. Before, a Ctrl-C that came just before the exec vanished and
    the server started anyway."""
    environ = serving_environment(dict(os.environ))
    if environ != dict(os.environ):
        signal.pthread_sigmask(signal.SIG_BLOCK, STARTUP_SIGNALS)
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STARTUP_SIGNALS)


def import_torch() -> None:
    """Import torch (a second or more) with Ctrl-C and SIGTERM held until it is done: interrupted midway, its
    import aborted the process, failed with an unrelated error or left it hanging, where ``main`` is to end it
    quietly with 130. A signal that came meanwhile is delivered when the import ends."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STARTUP_SIGNALS)
    try:
        import torch  # noqa: F401
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STARTUP_SIGNALS)


def build_parser() -> argparse.ArgumentParser:
    from rnnserve.engine.config import EngineConfig, add_config_arguments, positive_int
    from rnnserve.server.config import ServerConfig, rnnserve_version

    parser = argparse.ArgumentParser(
        prog="rnnserve", description="Inference server for recurrent language models."
    )
    parser.add_argument("--version", action="version", version=f"rnnserve {rnnserve_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        description="Serve a model over the OpenAI-compatible HTTP API with Prometheus metrics at /metrics.",
    )
    ServerConfig.add_arguments(serve)

    generate = commands.add_parser(
        "generate",
        help="generate offline from a prompt, streaming to the terminal",
        description="Load a model and stream a completion of PROMPT to stdout.",
    )
    add_config_arguments(generate, EngineConfig, skip=GENERATE_ENGINE_FLAGS_SKIPPED)
    generate.add_argument("prompt", metavar="PROMPT", help="the text to continue")
    generate.add_argument(
        "--max-tokens", type=positive_int, default=128, help="tokens to generate (default: 128)"
    )
    generate.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default: 0.8)")
    generate.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0, off)"
    )
    generate.add_argument(
        "--top-k", type=int, default=0, help="keep the k most likely tokens (default: 0, off)"
    )
    generate.add_argument("--repetition-penalty", type=float, default=1.0, help="(default: 1.0, off)")
    generate.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    generate.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop before this text (repeatable)"
    )
    constraint = generate.add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema", metavar="SCHEMA", help="the output follows this JSON schema (JSON text, or @FILE)"
    )
    constraint.add_argument("--json", action="store_true", help="the output is a JSON object")
    constraint.add_argument("--regex", metavar="RE", help="the output matches this regular expression")
    constraint.add_argument(
        "--choice", action="append", metavar="TEXT", help="the output is one of these texts (repeatable)"
    )
    constraint.add_argument("--grammar", metavar="LARK", help="the output follows this Lark grammar (or @FILE)")

    from rnnserve.clients.bench import add_bench_arguments

    bench = commands.add_parser(
        "bench",
        help="load-test an OpenAI-compatible server (rnnserve, vLLM, ...)",
        description="Send synthetic completion requests and report throughput and "
        "latency (TTFT, inter-token latency).",
    )
    add_bench_arguments(bench)

    convert = commands.add_parser(
        "convert",
        help="convert an authors' released checkpoint (pickled) into a native safetensors directory",
        description="Read SRC (a released training checkpoint; pickles are loaded with weights_only=True) "
        "and write DEST: config.json + model.safetensors [+ tokenizer.json], loadable with --model DEST.",
    )
    convert.add_argument("src", metavar="SRC", help="checkpoint file or directory")
    convert.add_argument("dest", metavar="DEST", help="output directory (created)")
    convert.add_argument("--format", default=None, help="source format (default: detected)")
    convert.add_argument("--tokenizer", default=None, metavar="FILE", help="tokenizer.json to copy alongside")
    convert.add_argument("--force", action="store_true", help="replace DEST if it holds a checkpoint convert wrote")
    convert.add_argument(
        "--allow-non-finite", action="store_true",
        help="convert tensors holding NaN or infinite numbers (refused by default, naming the tensor)",
    )

    commands.add_parser(
        "lsrl", help="LSRL tools: compile and run LSRL programs (rnnserve lsrl --help)", add_help=False
    )
    return parser


def serve(args: argparse.Namespace) -> int:
    from rnnserve.engine.loader import DEFAULT_MODEL_DIR, ModelLoadError, resolve_device
    from rnnserve.server.config import API_KEY_ENV, MULTIPROCESS_DIR_ENV, ServerConfig, rnnserve_version

    # A folder inherited from the environment would make a single server's metrics multi-process ones, carried
    # over from earlier runs; --api-servers sets its own. Before prometheus_client is imported, which reads it.
    os.environ.pop(MULTIPROCESS_DIR_ENV, None)
    from rnnserve.engine.llm_engine import freeze_startup_heap, retain_freed_memory
    from rnnserve.kernels.cpu_extension import build_cpu_extension
    from rnnserve.server.app import create_app
    from rnnserve.server.http_server import build_server, listen_socket

    try:
        config = ServerConfig.from_args(args)
    except ValueError as err:
        logger.error("%s", err)
        return 1
    if args.api_key and args.api_key != os.environ.get(API_KEY_ENV) and args.api_key_file is None:
        logger.warning("--api-key is visible to every local user in ps; prefer --api-key-file or $%s", API_KEY_ENV)
    if config.engine.model is None and not (DEFAULT_MODEL_DIR / "config.json").exists():
        logger.error(
            "the embedded default model is missing (%s); pass --model, e.g. --model random:mingru-tiny",
            DEFAULT_MODEL_DIR,
        )
        return 1
    try:
        if config.api_servers > 1:  # not beside a server already listening there, whatever its options
            listen_socket(config.host, config.port).close()
        sock = listen_socket(config.host, config.port, reuse_port=config.api_servers > 1)
    except OSError as err:
        logger.error("cannot listen on %s:%d: %s", config.host, config.port, err.strerror or err)
        return 1
    logger.info(
        "rnnserve %s: loading model %s (on CPU a machine's first start also compiles the fused kernels, about a "
        "minute); the port opens when it is ready", rnnserve_version(), config.model_path,
    )
    # A signal while loading exits through Python (so a kernel build releases torch's build lock): SIGTERM with 0,
    # SIGINT as Ctrl-C does anywhere before the server runs, by KeyboardInterrupt (main's quiet 130).
    signal.signal(signal.SIGTERM, exit_after_signal)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    start = time.perf_counter()
    if config.api_servers > 1:
        return serve_api_servers(config, sock, start)
    try:
        if not config.uses_engine_process and resolve_device(config.engine.device).type == "cpu":
            build_cpu_extension()  # here, where a signal interrupts the build cleanly (the engine thread would not)
        app = create_app(config)  # the engine's thread (one OpenMP team, see EngineThread) or process loads it
    except (ModelLoadError, ValueError) as err:
        sock.close()
        logger.error("cannot load model: %s", err)
        return 1
    logger.info("model loaded in %.1f s (weights, state pool and kernels)", time.perf_counter() - start)
    freeze_startup_heap()
    retain_freed_memory()
    log_serving(config, app.state.engine.info, "process" if config.uses_engine_process else "thread", sock)
    server = build_server(app, config)
    # uvicorn drains on SIGTERM/SIGINT, puts these handlers back and re-raises the signal: the stop asked for is
    # done, a clean exit either way.
    signal.signal(signal.SIGINT, exit_after_signal)
    server.run(sockets=[sock])
    return 0


def exit_after_signal(signum: int, frame: FrameType | None) -> NoReturn:
    """A signal handler that ends the program with 0, through Python (``finally`` blocks and ``with`` exits run)."""
    sys.exit(0)


def serve_api_servers(config: ServerConfig, sock: socket.socket, start: float) -> int:
    """``serve`` with ``config.api_servers`` server processes in front of the engine process."""
    from rnnserve.engine.loader import ModelLoadError
    from rnnserve.server.api_servers import APIServers

    try:
        servers = APIServers(config, sock)
    except (ModelLoadError, ValueError) as err:
        sock.close()
        logger.error("cannot load model: %s", err)
        return 1
    logger.info("model loaded in %.1f s (weights, state pool and kernels)", time.perf_counter() - start)
    pids = ", ".join(str(server.pid) for server in servers.servers)
    log_serving(config, servers.info, f"process (pid {servers.engine.process.pid}), API server pids {pids}", sock)
    try:
        return servers.wait()
    finally:
        sock.close()


def log_serving(config: ServerConfig, info: EngineInfo, engine: str, sock: socket.socket) -> None:
    """The line that says what ``rnnserve serve`` serves, and where (the bound address: ``--port 0`` picks one)."""
    from rnnserve.server.http_server import http_stack

    host, port = sock.getsockname()[:2]

    logger.info(
        "serving model=%s name=%s device=%s dtype=%s quantize=%s state_bytes_per_slot=%d slots=%d state_memory=%d "
        "engine=%s http=%s auth=%s url=http://%s:%d",
        config.model_path,
        ",".join(config.model_names),
        info.device,
        info.dtype,
        config.engine.quantize or "none",
        info.bytes_per_slot,
        info.num_slots,
        info.num_slots * info.bytes_per_slot,
        engine,
        http_stack(config.http),
        "on" if config.api_key else "off",
        f"[{host}]" if ":" in host else host,
        port,
    )


def read_argument(value: str | None) -> str | None:
    """A flag's text, or the contents of the file it names as ``@FILE``."""
    if value is None or not value.startswith("@"):
        return value
    return Path(value[1:]).read_text()


def output_constraint(args: argparse.Namespace) -> StructuredOutputParams | None:
    """``generate``'s structured-output flags as the engine's constraint (``None`` without one)."""
    from rnnserve.engine.sampling_params import InvalidParameterError, StructuredOutputParams

    if args.json_schema is not None:
        try:
            schema = json.loads(read_argument(args.json_schema))  # type: ignore[arg-type]
        except ValueError as err:
            raise InvalidParameterError("json_schema", f"--json-schema is not JSON: {err}") from err
        return StructuredOutputParams(json=schema, param="json_schema")
    if args.json:
        return StructuredOutputParams(json_object=True, param="json")
    if args.regex is not None:
        return StructuredOutputParams(regex=args.regex, param="regex")
    if args.choice:
        return StructuredOutputParams(choice=args.choice, param="choice")
    if args.grammar is not None:
        return StructuredOutputParams(grammar=read_argument(args.grammar), param="grammar")
    return None


def generate(args: argparse.Namespace) -> int:
    from rnnserve.engine.config import EngineConfig, config_from_args
    from rnnserve.engine.llm_engine import LLMEngine
    from rnnserve.engine.loader import ModelLoadError
    from rnnserve.engine.sampling_params import InvalidParameterError, OutputKind, SamplingParams

    if isinstance(sys.stdout, io.TextIOWrapper):  # a console that cannot encode a character shows a replacement
        sys.stdout.reconfigure(errors="replace")

    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
            stop=args.stop,
            max_tokens=args.max_tokens,
            output_kind=OutputKind.DELTA,
            structured_outputs=output_constraint(args),
        )
        engine = LLMEngine.from_config(config_from_args(EngineConfig, args, max_num_seqs=1))
        request_id = engine.add_request(args.prompt, params)
    except (ModelLoadError, InvalidParameterError, ValueError, OSError) as err:
        print(f"rnnserve generate: {err}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    tokens = 0
    error = None
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                sample = out.outputs[0]
                tokens += len(sample.new_token_ids)
                sys.stdout.write(sample.text_delta)
                sys.stdout.flush()
                error = out.error or error
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        print(file=sys.stderr)
        return 130
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    print(
        f"[{tokens} tokens in {elapsed:.2f} s, {tokens / max(elapsed, 1e-9):.1f} tokens/s, "
        f"finish_reason={sample.finish_reason}]",
        file=sys.stderr,
    )
    if error is not None:
        print(f"rnnserve generate: generation failed: {error}", file=sys.stderr)
        return 1
    return 0


def convert(args: argparse.Namespace) -> int:
    from rnnserve.engine.convert import ConvertError, convert_checkpoint, describe

    try:
        checkpoint = convert_checkpoint(
            args.src, args.dest, args.format, args.tokenizer, args.force, allow_non_finite=args.allow_non_finite
        )
    except ConvertError as err:
        logger.error("cannot convert: %s", err)
        return 1
    summary = describe(checkpoint)
    print(
        f"wrote {args.dest}: architecture={summary['architecture']} tensors={summary['tensors']} "
        f"parameters={summary['parameters']:,}"
    )
    for note in checkpoint.notes:
        print(f"note: {note}")
    return 0


def lsrl(argv: list[str]) -> int:
    try:
        from rnnserve.engine.lsrl.cli import main as lsrl_main
    except ImportError as err:
        print(f"rnnserve lsrl: the LSRL tools are not available ({err})", file=sys.stderr)
        return 2
    return lsrl_main(argv)


def main(argv: list[str] | None = None) -> int:
    """The ``rnnserve`` program; ``argv`` defaults to the command line, whose ``serve`` first sets the serving
    environment (:func:`reexec_with_serving_environment`) and, once it stopped, ends the process at once
    (:func:`~rnnserve.engine.llm_engine.exit_process`: its ``atexit`` handlers run, the interpreter's teardown
    does not). Ctrl-C exits with 130, and a reader of stdout that goes away (``| head``) ends the program quietly
    with 141, as SIGPIPE ends other tools."""
    serving = argv is None and sys.argv[1:2] == ["serve"]
    try:
        code = run_command(argv)
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not raise again
        code = 128 + signal.SIGPIPE
    except SystemExit as stop:  # exit_after_signal's, once uvicorn drained; argparse's (already said)
        if not serving or not isinstance(stop.code, int | None):
            raise
        code = stop.code or 0
    if serving and "torch" in sys.modules:  # torch's heap is what the teardown spends its seconds on
        from rnnserve.engine.llm_engine import exit_process

        exit_process(code)
    return code


def run_command(argv: list[str] | None) -> int:
    if argv is None and sys.argv[1:2] == ["serve"]:
        reexec_with_serving_environment()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["lsrl"]:
        return lsrl(argv[1:])
    import_torch()
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, getattr(args, "log_level", "info").upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would drown bench output
    if args.command == "serve":
        return serve(args)
    if args.command == "generate":
        return generate(args)
    if args.command == "convert":
        return convert(args)
    from rnnserve.clients.bench import run_bench

    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
