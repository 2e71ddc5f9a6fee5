"""``make gpu-bench``: one table of rnnserve's throughput per model on a CUDA device.

Per model (``random:`` presets, bf16 weights, fp32 states):

- decode tok/ms at each batch size, one CUDA-graph replay per step (the model step), and the fraction of the
  HBM roofline: the bytes a step must move (every weight once, each sequence's state read and written) over
  the device-to-device copy bandwidth measured in the same run;
- prefill tok/ms for ``1 x 16384`` and ``8 x 2048`` prompt tokens;
- offline engine throughput (``LLMEngine.step`` with sampling and outputs, prompt 16, 256 new tokens) at
  each concurrency, with async scheduling (CUDA's default) and synchronous, and the heap frozen as ``LLM`` and
  the server freeze it once the engine is built, its ratio to the model step; at the
  largest concurrency also ``streamed``: every request reads each step's output, built as the row the engine
  process sends to the server (the engine's part of serving streams);
- the same load over HTTP (async scheduling) through one real ``rnnserve serve`` process per model, after an
  untimed run of short requests as the offline rows have, with the client's time to first token and tokens per
  chunk and the CPU cores the serving and engine processes kept busy, the engine process's also less its waits for
  the device (``rnnserve_engine_device_wait_seconds_total``), which spin (skipped when fastapi/uvicorn are not
  importable: carry their wheels, see the device notes);
- the Based paper's Table 1 figures (H100) where the paper has a row for the model.

The prefix cache is off (every request here is new, and the anchors are engines without one) unless
``--prefix-cache``, which prices keeping it (each prompt's and each finished request's state stored, and
demoted to the host tier once the device tier is full); ``benchmarks/multi_turn.py`` measures its hits.

``--smoke`` runs tiny presets on CPU with small sizes: the CI check that this script keeps working.

    python benchmarks/gpu_bench.py [--models mamba-370m ...] [--batches 1 32 128 256] [--no-http] [--profile]
        [--smoke]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a checkout without installing: rnnserve finds its folders beside rnnserve/.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import importlib.util  # noqa: E402
import os  # noqa: E402
import pickle  # noqa: E402
import re  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field, replace  # noqa: E402
from typing import IO  # noqa: E402

import httpx  # noqa: E402
import torch  # noqa: E402

from benchmarks.decode import copy_bandwidth, seconds_per_step, weight_bytes  # noqa: E402
from benchmarks.engine_throughput import generated_tokens_per_second, served_heap  # noqa: E402
from rnnserve.engine.config import EngineConfig  # noqa: E402
from rnnserve.engine.cuda_graph_runner import CUDAGraphDecodeRunner  # noqa: E402
from rnnserve.engine.llm_engine import LLMEngine  # noqa: E402
from rnnserve.engine.loader import build_random  # noqa: E402
from rnnserve.engine.models.base import DecodeBatch, PrefillBatch  # noqa: E402
from rnnserve.engine.sampling_params import OutputKind  # noqa: E402
from rnnserve.engine.state_pool import StatePool  # noqa: E402
from rnnserve.kernels.cpu_extension import build_cpu_extension  # noqa: E402
from rnnserve.server.engine_core import OutputEncoder  # noqa: E402

DEFAULT_MODELS = [
    "mamba-370m", "mamba2-370m", "hawk-100m", "mingru-100m", "based-360m", "lattice-110m", "tmlt-wt103",
]
# Based paper (arXiv 2402.18668) Table 1, H100: prefill tok/ms at 16,384 tokens, generated tok/ms.
PAPER_TABLE_1 = {"mamba-370m": ("Mamba-358M", 267.09, 39.95), "based-360m": ("Based-363M", 514.57, 47.23)}
PROMPT_LEN, NEW_TOKENS = 16, 256


@dataclass
class Sizes:
    batches: list[int]
    prefills: list[tuple[int, int]]  # (sequences, tokens each)
    concurrency: list[int]
    new_tokens: int = NEW_TOKENS
    steps: int = 30


@dataclass
class Row:
    model: str
    cells: dict[str, str] = field(default_factory=dict)


def prefill_tokens_per_ms(model, pool: StatePool, seqs: int, length: int, device: torch.device) -> float:
    """Whole-prompt prefill of ``seqs`` random prompts of ``length`` tokens into fresh slots."""
    gen = torch.Generator().manual_seed(0)
    chunks = [torch.randint(0, model.vocab_size, (length,), generator=gen) for _ in range(seqs)]
    batch = PrefillBatch.build(chunks, list(range(seqs)), device=device)

    def step() -> None:
        pool.reset(torch.arange(seqs, device=device))
        model.prefill(batch, pool.tensors)

    return seqs * length / (seconds_per_step(step, device, 3) * 1e3)


def served_by() -> str:
    """``; HTTP <protocol>+<loop>`` as ``rnnserve serve`` runs here; empty without fastapi/uvicorn."""
    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
        return ""
    from rnnserve.server.http_server import http_stack

    return f"; HTTP {http_stack('auto')}"


def cpu_seconds(pid: int) -> float:
    """CPU seconds a process has used so far (user + system, Linux ``/proc``); 0.0 where unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    """The direct children of ``pid`` (Linux ``/proc``); none where unreadable."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children += [int(child) for child in task.read_text().split()]
        except OSError:
            pass
    return children


def serving_processes(pid: int, api_servers: int, log: IO[str]) -> tuple[list[int], list[int]]:
    """The pids of the processes that serve HTTP and of the engine process (if any) of the ``rnnserve serve``
    process ``pid``: with one API server, it and its children; with several, as its log names them."""
    if api_servers == 1:
        return [pid], child_pids(pid)
    log.seek(0)
    found = re.search(r"engine=process \(pid (\d+)\), API server pids ([\d, ]+) http=", log.read())
    if found is None:
        return [pid], []
    return [int(server) for server in found.group(2).split(", ")], [int(found.group(1))]


def device_wait_seconds(url: str) -> float:
    """The served engine's ``rnnserve_engine_device_wait_seconds_total`` (all API servers'), from ``/metrics``; 0.0
    where a server does not export it."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("rnnserve_engine_device_wait_seconds_total"))  # fmt: skip


def http_tokens_per_ms(
    preset: str, dtype: str, concurrency: list[int], new_tokens: int, engine_process: str = "auto",
    api_servers: int = 1, prefix_cache: bool = False,
) -> dict[int, tuple[float, str] | str]:
    """Generated tok/ms of ``2 x c`` streamed requests at each concurrency ``c``, one after the other, against
    one fresh ``rnnserve serve --engine-process ENGINE_PROCESS --api-servers API_SERVERS`` (started once per
    model: a start builds the model and captures its graphs), each with its client-side latencies: time to first
    token (p50, p99) and tokens per streamed chunk (above 1 when the server writes several steps at once). A
    failure is a string in place of the pair. Beside them, the CPU cores the serving processes and the engine
    process kept busy: a serving process near 1.00, or the engine process, is the side HTTP waits on. The engine
    process's figure includes its waits for the device (a CUDA event's ``synchronize`` spins), so the cores it
    kept busy less those waits (``rnnserve_engine_device_wait_seconds_total``) follow it: its host work, near
    1.00 when the host is the limit. With ``prefix_cache`` the server keeps its prefix cache."""
    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
        return dict.fromkeys(concurrency, "no fastapi")
    from rnnserve.clients.bench import BenchConfig, benchmark

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-c", "import sys; from rnnserve.server.cli import main; sys.exit(main())", "serve",
               "--model", f"random:{preset}", "--dtype", dtype, "--port", str(port),
               "--max-num-seqs", str(max(concurrency)), "--log-level", "warning",
               "--engine-process", engine_process, "--api-servers", str(api_servers)]
    if not prefix_cache:
        command.append("--no-prefix-cache")
    if api_servers > 1:
        command += ["--log-level", "info"]  # info: the line naming the processes
    log = tempfile.TemporaryFile("w+")
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                log.seek(0)
                return dict.fromkeys(concurrency, f"server exited: {log.read()[-200:]}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                return dict.fromkeys(concurrency, "server did not start")
            time.sleep(0.5)
        rates: dict[int, tuple[float, str] | str] = {}
        for c in concurrency:
            # One client process parses ~20K chunks/s; on a GPU host with cores to spare, one per 32 streams.
            processes = max(1, min(8, c // 32, (os.cpu_count() or 1) // 2))
            config = BenchConfig(url=url, num_prompts=2 * c, concurrency=c, input_len=PROMPT_LEN,
                                 output_len=new_tokens, progress=False, processes=processes)
            # Untimed first, as the offline rows: c short requests pay this concurrency's one-time costs.
            asyncio.run(benchmark(replace(config, num_prompts=c, output_len=4)))
            servers, engines = serving_processes(server.pid, api_servers, log)
            cpu_before = [list(map(cpu_seconds, servers)), sum(map(cpu_seconds, engines))]
            wait_before = device_wait_seconds(url)
            figures = asyncio.run(benchmark(config))
            cpu = [[cpu_seconds(pid) - before for pid, before in zip(servers, cpu_before[0], strict=True)],
                   sum(map(cpu_seconds, engines)) - cpu_before[1]]  # fmt: skip
            device_wait = device_wait_seconds(url) - wait_before
            if figures["failed"]:
                rates[c] = f"{figures['failed']} failed"
                continue
            ttft = figures["ttft_ms"]
            per_chunk = figures["total_output_tokens"] / max(1, figures["total_chunks"])
            cores = " + ".join(f"{seconds / figures['duration_s']:.2f}" for seconds in cpu[0])
            busy = f"serving process{'es' if len(servers) > 1 else ''} {cores} cores"
            if engines:
                engine_busy = cpu[1] / figures["duration_s"]
                host_work = (cpu[1] - device_wait) / figures["duration_s"]
                busy += f", engine process {engine_busy:.2f} ({host_work:.2f} less its device wait)"
            detail = f"TTFT p50 {ttft['p50']:.0f} / p99 {ttft['p99']:.0f} ms, {per_chunk:.1f} tok/chunk, {busy}"
            rates[c] = (figures["output_throughput"] / 1e3, detail)
        return rates
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def print_profile(model, pool: StatePool, batch: int, device: torch.device, prompt_len: int) -> None:
    """The kernels of one eager decode step at ``batch`` and one ``1 x prompt_len`` prefill, by device time."""
    ids = torch.randint(0, model.vocab_size, (batch,)).tolist()
    step = DecodeBatch.build(ids, range(batch), [PROMPT_LEN] * batch, device=device)
    prompt = PrefillBatch.build([torch.randint(0, model.vocab_size, (prompt_len,))], [0], device=device)
    sort_by = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for what, run in ((f"decode b={batch}", lambda: model.decode(step, pool.tensors)),
                      (f"prefill 1x{prompt_len}", lambda: model.prefill(prompt, pool.tensors))):
        run()
        sync()
        with torch.profiler.profile() as prof:
            run()
            sync()
        print(f"profile: {what}")
        print(prof.key_averages().table(sort_by=sort_by, row_limit=12), flush=True)


def model_step_rows(model, preset: str, device: torch.device, sizes: Sizes, peak: float, profile: bool = False
                    ) -> tuple[list[Row], dict[int, float]]:
    """Decode (graph replays on CUDA) and prefill rows of the bare model; also the ms per decode step."""
    max_batch = max(sizes.batches + [s for s, _ in sizes.prefills])
    pool = StatePool(model.state_spec(), num_slots=max_batch, device=device)
    if device.type == "cuda":
        decode = CUDAGraphDecodeRunner(model, pool.tensors, pool.scratch_slot, max_batch)
        decode.capture()
    else:
        def decode(batch: DecodeBatch) -> torch.Tensor:
            return model.decode(batch, pool.tensors)
    weights = weight_bytes(model)
    rows, step_ms = [], {}
    for batch in sizes.batches:
        ids = torch.randint(0, model.vocab_size, (batch,)).tolist()
        step = DecodeBatch.build(ids, range(batch), [PROMPT_LEN] * batch, device=device)
        seconds = seconds_per_step(lambda s=step: decode(s), device, sizes.steps)
        step_ms[batch] = seconds * 1e3
        roof = (weights + 2 * batch * pool.bytes_per_slot) / peak
        rows.append(Row(preset, {"what": f"decode b={batch}", "tok/ms": f"{batch / step_ms[batch]:.2f}",
                                 "ms/step": f"{step_ms[batch]:.3f}", "HBM roofline": f"{roof / seconds:.0%}"}))
    if profile:
        print_profile(model, pool, max(sizes.batches), device, max(length for _, length in sizes.prefills))
    for seqs, length in sizes.prefills:
        limit = model.max_model_len
        if limit is not None and length > limit:
            rows.append(Row(preset, {"what": f"prefill {seqs}x{length}", "tok/ms": f"over the {limit}-token limit"}))
            continue
        rate = prefill_tokens_per_ms(model, pool, seqs, length, device)
        rows.append(Row(preset, {"what": f"prefill {seqs}x{length}", "tok/ms": f"{rate:.1f}"}))
    return rows, step_ms


def streamed_tokens_per_second(engine: LLMEngine, concurrency: int, new_tokens: int) -> float:
    """Generated tok/s of ``concurrency`` streams' worth of engine work for a server that takes every step's
    outputs: each request reads each step's outputs (``DELTA``), built as rows and columns and pickled as the engine
    process sends them. Against the ``engine`` row (outputs only at the end), this is the most the engine pays
    to serve streams; a server that falls behind gets several steps' outputs collected at once, for less."""
    encoder = OutputEncoder()

    def send(engine: LLMEngine) -> None:
        rows = engine.collect(encoder.row, bulk=encoder.take_deltas)  # the compact outputs go to columns
        pickle.dumps((rows, encoder.take_columns()), protocol=pickle.HIGHEST_PROTOCOL)

    generated_tokens_per_second(engine, concurrency, PROMPT_LEN, 4, OutputKind.DELTA, send)
    return generated_tokens_per_second(engine, concurrency, PROMPT_LEN, new_tokens, OutputKind.DELTA, send)


def bench_model(preset: str, device: torch.device, dtype: torch.dtype, sizes: Sizes, peak: float,
                http: list[tuple[str, int]], profile: bool = False, prefix_cache: bool = False) -> list[Row]:
    """Every row of one model; ``http`` lists the ``--engine-process`` and ``--api-servers`` values of the HTTP
    rows, one set of rows each (none: no rows); ``prefix_cache``: the engine and HTTP rows keep a prefix cache."""
    model, tokenizer = build_random(preset, device, dtype)
    with torch.inference_mode():
        rows, step_ms = model_step_rows(model, preset, device, sizes, peak, profile)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    offline: dict[int, float] = {}
    for mode in ("off", "auto") if device.type == "cuda" else ("auto",):  # auto: async scheduling on CUDA
        config = EngineConfig(max_num_seqs=max(sizes.concurrency), enable_prefix_cache=prefix_cache,
                              async_scheduling=mode,
                              max_num_batched_tokens=max(PROMPT_LEN * max(sizes.concurrency), 2048))
        engine = LLMEngine(model, tokenizer, config)
        with served_heap():
            for c in sizes.concurrency:
                # A short untimed run at this concurrency first: whichever engine runs first would otherwise also pay
                # the one-time costs of this batch's shapes (kernel specializations, allocator growth).
                generated_tokens_per_second(engine, c, PROMPT_LEN, 4)
                rate = generated_tokens_per_second(engine, c, PROMPT_LEN, sizes.new_tokens) / 1e3
                label = f"engine c={c}" if mode == "auto" else f"engine c={c}, synchronous"
                cells = {"what": label, "tok/ms": f"{rate:.2f}"}
                if c in step_ms:
                    cells["vs model step"] = f"{rate / (c / step_ms[c]):.0%}"
                rows.append(Row(preset, cells))
                if mode == "auto":
                    offline[c] = rate
                if mode == "auto" and c == max(sizes.concurrency):
                    rate = streamed_tokens_per_second(engine, c, sizes.new_tokens) / 1e3
                    cells = {"what": f"engine c={c}, streamed", "tok/ms": f"{rate:.2f}"}
                    if c in step_ms:
                        cells["vs model step"] = f"{rate / (c / step_ms[c]):.0%}"
                    rows.append(Row(preset, cells))
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    for engine_process, api_servers in http:
        rates = http_tokens_per_ms(preset, dtype_name, sizes.concurrency, sizes.new_tokens, engine_process,
                                   api_servers, prefix_cache)
        for c, rate in rates.items():
            label = f"HTTP c={c}" if engine_process == "auto" else f"HTTP c={c}, engine process {engine_process}"
            label += f", {api_servers} API servers" if api_servers > 1 else ""
            cells = {"what": label}
            if isinstance(rate, str):
                cells["tok/ms"] = rate
            else:
                cells["tok/ms"] = f"{rate[0]:.2f}"
                cells["vs offline"] = f"{rate[0] / offline[c]:.0%}"
                cells["client"] = rate[1]
            rows.append(Row(preset, cells))
    if preset in PAPER_TABLE_1:
        name, prefill, generate = PAPER_TABLE_1[preset]
        rows.append(Row(preset, {"what": f"paper: {name}", "tok/ms": f"prefill {prefill} / decode {generate}"}))
    return rows


def print_table(rows: list[Row]) -> None:
    columns = ["model", "what", "tok/ms", "ms/step", "HBM roofline", "vs model step", "vs offline", "client"]
    cells = [[row.model, *(row.cells.get(c, "") for c in columns[1:])] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, help="random: presets")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32, 128, 256])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 64, 256])
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--no-http", action="store_true", help="skip the HTTP rows")
    parser.add_argument("--engine-process", nargs="+", choices=["auto", "on", "off"], default=["auto"],
                        help="the servers' --engine-process, one set of HTTP rows each (default: auto, on for CUDA)")
    parser.add_argument("--api-servers", nargs="+", type=int, default=[1],
                        help="the servers' --api-servers, one set of HTTP rows each (with an engine process)")
    parser.add_argument("--prefix-cache", action="store_true",
                        help="engine and HTTP rows with the prefix cache on (default budgets): what storing each "
                        "prompt's and each finished request's state, and demoting them to the host tier, costs")
    parser.add_argument("--smoke", action="store_true", help="tiny presets on CPU, small sizes")
    parser.add_argument("--profile", action="store_true",
                        help="also print each model's kernels (one eager decode step, one prefill) by time")
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        models = [m for m in args.models if m.endswith("-tiny")] or ["mamba-tiny", "mamba2-tiny"]
        sizes = Sizes(batches=[1, 4], prefills=[(1, 64), (2, 16)], concurrency=[2], new_tokens=4, steps=2)
    elif not torch.cuda.is_available():
        parser.error("no CUDA device (use --smoke for the CPU check)")
    else:
        device, models = torch.device("cuda"), args.models
        sizes = Sizes(batches=args.batches, prefills=[(1, 16384), (8, 2048)], concurrency=args.concurrency)
    if device.type == "cpu":
        build_cpu_extension()  # the fused CPU kernels, built before timing (a CUDA run never uses them)
    peak = copy_bandwidth(device, (16 if args.smoke else 1024) * 2**20)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{name}: copy bandwidth {peak / 1e9:.0f} GB/s; weights {dtype}, states fp32; "
          f"torch {torch.__version__}; prompt {PROMPT_LEN}, {sizes.new_tokens} new tokens; prefix cache "
          f"{'on' if args.prefix_cache else 'off'}{served_by()}")
    rows: list[Row] = []
    for preset in models:
        start = time.perf_counter()
        http = [] if args.no_http else [
            (engine_process, api_servers) for engine_process in args.engine_process for api_servers in args.api_servers
            if api_servers == 1 or engine_process != "off"
        ]  # fmt: skip
        model_rows = bench_model(preset, device, dtype, sizes, peak, http=http, profile=args.profile,
                                 prefix_cache=args.prefix_cache)
        print_table(model_rows)  # each model's rows as soon as they exist: a run cut short keeps them
        print(f"[{preset}: {time.perf_counter() - start:.0f} s]", file=sys.stderr, flush=True)
        rows += model_rows
    print_table(rows)


if __name__ == "__main__":
    main()
