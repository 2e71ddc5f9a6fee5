"""The ``rnnserve`` command: ``serve`` (HTTP API), ``generate`` (offline, streams to the terminal),
``bench`` (load generator for any OpenAI-compatible server) and ``lsrl`` (LSRL program tools)."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import time

from rnnserve.engine.loader import DEFAULT_MODEL_DIR, ModelLoadError

logger = logging.getLogger("rnnserve")

BYTE_UNITS = {
    "": 1,
    "k": 2**10,
    "kb": 10**3,
    "kib": 2**10,
    "m": 2**20,
    "mb": 10**6,
    "mib": 2**20,
    "g": 2**30,
    "gb": 10**9,
    "gib": 2**30,
    "t": 2**40,
    "tb": 10**12,
    "tib": 2**40,
}
DTYPES = ["auto", "float32", "float16", "bfloat16", "float64"]


def parse_bytes(text: str) -> int:
    """``"1073741824"``, ``"512M"``, ``"1GiB"``, ``"2GB"`` -> bytes (K/M/G alone are binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 1073741824, 512M, 1GiB)")
    return int(float(match.group(1)) * BYTE_UNITS[match.group(2).lower()])


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        metavar="PATH|NAME",
        help="checkpoint directory, random:<preset> or a registered name such as lsrl:<program> "
        f"(default: the embedded model in {DEFAULT_MODEL_DIR})",
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the model and state pool live; auto picks CUDA when present (default: auto)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="weight dtype; auto keeps the checkpoint's (states always accumulate in fp32+)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rnnserve", description="Inference server for recurrent language models."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        description="Serve a model over the OpenAI-compatible HTTP API with Prometheus metrics at /metrics.",
    )
    add_model_arguments(serve)
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, local only)"
    )
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    serve.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=64,
        help="state slots, i.e. sequences running at once (default: 64)",
    )
    serve.add_argument(
        "--state-memory",
        type=parse_bytes,
        default=None,
        metavar="BYTES",
        help="state-pool budget, e.g. 2GiB; the pool gets the smaller of this and --max-num-seqs",
    )
    serve.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=2048,
        help="prompt tokens prefilled per engine step; longer prompts are chunked (default: 2048)",
    )
    serve.add_argument(
        "--max-prompt-tokens",
        type=positive_int,
        default=None,
        help="reject longer prompts with 400 (default: no limit besides the body size)",
    )
    serve.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run decode eagerly instead of replaying CUDA graphs captured at start-up",
    )
    serve.add_argument(
        "--max-waiting",
        type=positive_int,
        default=256,
        help="requests that may wait for a slot; beyond it the server answers 429 (default: 256)",
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get("RNNSERVE_API_KEY"),
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize "
        "(default: $RNNSERVE_API_KEY, else no auth)",
    )
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=[],
        metavar="NAME",
        help="model name(s) clients use in 'model' (default: the --model value, or rnnserve-default)",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=parse_bytes,
        default=1 << 20,
        metavar="BYTES",
        help="larger request bodies get 413 (default: 1MiB)",
    )
    serve.add_argument(
        "--chat-max-tokens",
        type=positive_int,
        default=256,
        help="max_tokens of chat requests that give none (default: 256)",
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, let in-flight requests finish for this long, then exit (default: 30)",
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    generate = commands.add_parser(
        "generate",
        help="generate offline from a prompt, streaming to the terminal",
        description="Load a model and stream a completion of PROMPT to stdout.",
    )
    add_model_arguments(generate)
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

    from rnnserve.clients.bench import add_bench_arguments

    bench = commands.add_parser(
        "bench",
        help="load-test an OpenAI-compatible server (rnnserve, vLLM, ...)",
        description="Send synthetic completion requests and report throughput and "
        "latency (TTFT, inter-token latency).",
    )
    add_bench_arguments(bench)

    commands.add_parser(
        "lsrl", help="LSRL tools: compile and run LSRL programs (rnnserve lsrl --help)", add_help=False
    )
    return parser


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from rnnserve.server.app import ServerConfig, build_engine, create_app

    config = ServerConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        device=args.device,
        dtype=None if args.dtype == "auto" else args.dtype,
        max_num_seqs=args.max_num_seqs,
        state_memory=args.state_memory,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        max_waiting=args.max_waiting,
        enforce_eager=args.enforce_eager,
        api_key=args.api_key or None,
        max_body_bytes=args.max_body_bytes,
        chat_default_max_tokens=args.chat_max_tokens,
    )
    if args.model is None and not (DEFAULT_MODEL_DIR / "config.json").exists():
        logger.error(
            "the embedded default model is missing (%s); pass --model, e.g. --model random:mingru-tiny",
            DEFAULT_MODEL_DIR,
        )
        return 1
    try:
        engine = build_engine(config)
    except (ModelLoadError, ValueError) as err:
        logger.error("cannot load model: %s", err)
        return 1
    app = create_app(config, engine)
    pool = engine.pool
    weight = next(iter(engine.model.parameters()), None)
    logger.info(
        "serving model=%s name=%s device=%s dtype=%s state_bytes_per_slot=%d slots=%d state_memory=%d "
        "auth=%s url=http://%s:%d",
        config.model_path,
        ",".join(config.model_names),
        engine.device,
        str(weight.dtype).removeprefix("torch.") if weight is not None else "none",
        pool.bytes_per_slot,
        pool.num_slots,
        pool.total_bytes,
        "on" if config.api_key else "off",
        args.host,
        args.port,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=args.drain_timeout,
            access_log=False,
        )
    )
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal: make that a clean exit.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sys.exit(0))
    server.run()
    return 0


def generate(args: argparse.Namespace) -> int:
    from rnnserve.engine.llm_engine import LLMEngine
    from rnnserve.engine.sampling_params import InvalidParameterError, SamplingParams

    model = args.model if args.model is not None else str(DEFAULT_MODEL_DIR)
    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
            stop=args.stop,
            max_tokens=args.max_tokens,
        )
        engine = LLMEngine.from_name(
            model, device=args.device, dtype=None if args.dtype == "auto" else args.dtype, max_num_seqs=1
        )
        request_id = engine.add_request(args.prompt, params)
    except (ModelLoadError, InvalidParameterError, ValueError) as err:
        print(f"rnnserve generate: {err}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    tokens = 0
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                sample = out.outputs[0]
                tokens += len(sample.new_token_ids)
                sys.stdout.write(sample.text_delta)
                sys.stdout.flush()
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
    return 0


def lsrl(argv: list[str]) -> int:
    try:
        from rnnserve.engine.lsrl.cli import main as lsrl_main
    except ImportError as err:
        print(f"rnnserve lsrl: the LSRL tools are not available ({err})", file=sys.stderr)
        return 2
    return lsrl_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["lsrl"]:
        return lsrl(argv[1:])
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
    from rnnserve.clients.bench import run_bench

    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
