"""``make gpu-bench`` and the launch tuners stay runnable without a GPU: their CPU smoke modes measure every row kind
(HTTP included) and every choice."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from rnnserve.kernels.mamba2_decode import fused_recurrent as mamba2_fused
from rnnserve.kernels.mamba_decode import fused_recurrent as mamba_fused

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_bench_smoke_prints_every_row_kind():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_bench.py"), "--smoke", "--models", "mamba-tiny",
         "--engine-process", "auto", "on", "--api-servers", "1", "2"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "; prefix cache off" in result.stdout.splitlines()[0]
    lines = [line.split() for line in result.stdout.splitlines()]
    kinds = {(row[1], row[2]) for row in lines if row and row[0] == "mamba-tiny"}
    assert kinds == {("decode", "b=1"), ("decode", "b=4"), ("prefill", "1x64"), ("prefill", "2x16"),
                     ("engine", "c=2"), ("engine", "c=2,"), ("HTTP", "c=2"), ("HTTP", "c=2,")}, result.stdout
    streamed = next(row for row in lines if row[:4] == ["mamba-tiny", "engine", "c=2,", "streamed"])
    assert float(streamed[4]) > 0, streamed
    http = next(row for row in lines if row[:3] == ["mamba-tiny", "HTTP", "c=2"])
    assert float(http[3]) > 0 and http[4].endswith("%"), http  # a rate and its ratio to offline, not a failure
    assert http[5:7] == ["TTFT", "p50"] and float(http[7]) > 0, http
    chunk = http.index("tok/chunk,")
    assert float(http[chunk - 1]) >= 1.0, http  # the client's view of the same run
    assert http[chunk + 1 : chunk + 3] == ["serving", "process"] and float(http[chunk + 3]) > 0, http
    assert http[chunk + 4] == "cores", http  # no engine process on CPU by default: nothing more
    in_process = next(row for row in lines if row[:6] == ["mamba-tiny", "HTTP", "c=2,", "engine", "process", "on"])
    assert float(in_process[6]) > 0 and in_process[7].endswith("%"), in_process
    busy = " ".join(in_process[in_process.index("tok/chunk,") + 1 :])
    serving, engine = (float(part.split()[2]) for part in busy.split(", "))
    # /proc counts CPU time in 10 ms ticks: a serving process that only relays a few streamed tokens to the engine
    # process can read 0.00 cores in so short a run (the row above checks that the serving process is measured)
    assert busy.startswith("serving process ") and ", engine process " in busy and serving >= 0 and engine > 0, busy
    shared = next(row for row in lines if row[:5] == ["mamba-tiny", "HTTP", "c=2,", "2", "API"])
    assert float(shared[6]) > 0 and shared[7].endswith("%"), shared  # auto: the engine process comes with them
    busy = " ".join(shared[shared.index("tok/chunk,") + 1 :])
    # Each server process by its pid from the server's log (a short load may leave one at 0.00: clock ticks).
    # The engine process's cores, then those less its waits for the device: none on a CPU, so the same.
    cores = re.fullmatch(r"serving processes (\d+\.\d\d) \+ (\d+\.\d\d) cores, engine process (\d+\.\d\d) "
                         r"\((\d+\.\d\d) less its device wait\)", busy)  # fmt: skip
    assert cores is not None and cores.group(3) == cores.group(4), busy


def test_gpu_bench_smoke_with_the_prefix_cache():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_bench.py"), "--smoke", "--models", "mamba-tiny", "--no-http",
         "--prefix-cache"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "; prefix cache on" in result.stdout.splitlines()[0]
    rows = {line for line in result.stdout.splitlines() if line.startswith("mamba-tiny  engine")}
    rates = sorted(float(row.split()[4 if "streamed" in row else 3]) for row in rows)
    assert len(rates) == 2 and rates[0] > 0, rows  # the offline row and the streamed one


def _tune_smoke(script: str, *options: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """Run ``benchmarks/<script>.py --smoke`` under the interpreter; its result and its table's rows, split."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--smoke", *options],
                            capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, [line.split() for line in result.stdout.splitlines()[1:] if not line.startswith("#")]


def test_scan_tune_smoke_times_each_choice_on_both_shapes():
    result, rows = _tune_smoke("scan_tune")
    assert sorted((row[0], row[1]) for row in rows) == [("1x40", "(8,"), ("1x40", "default"), ("2x16", "(8,"),
                                                        ("2x16", "default")], result.stdout


def test_ssd_tune_smoke_times_each_choice_and_kernel_on_both_shapes():
    result, rows = _tune_smoke("ssd_tune")
    choices = sorted((row[0], row[1]) for row in rows if row[3] == "tok/ms")
    smoke = "chunk_size=32,block_m=16,block_k=16,precompute_cb=0"
    assert choices == [("1x40", smoke), ("1x40", "default"), ("2x16", smoke), ("2x16", "default")], result.stdout
    assert all(float(row[5]) < 1e-4 for row in rows if row[3] == "tok/ms"), result.stdout  # same outputs
    kernels = {row[2] for row in rows if row[0] == "1x40" and row[1] == "kernel"}
    assert kernels == {"_ssd_chunk_cumsum_kernel", "_ssd_chunk_cb_kernel", "_ssd_chunk_state_kernel",
                       "_ssd_state_passing_kernel", "_ssd_chunk_scan_kernel", "(all,"}, result.stdout


def test_conv_tune_smoke_times_each_choice_on_both_shapes():
    result, rows = _tune_smoke("conv_tune")
    assert sorted((row[1], row[2]) for row in rows) == [("1x40", "(16,"), ("1x40", "default"), ("2x16", "(16,"),
                                                        ("2x16", "default")], result.stdout
    assert all(float(row[-2]) > 0 for row in rows), result.stdout


def test_decode_tune_smoke_times_the_op_by_op_step_and_each_choice():
    result, rows = _tune_smoke("decode_tune")
    knobs = ("IN_PROJ_ROWS", "OUT_PROJ_ROWS", "TILE", "OUT_PROJ_TILE", "NUM_WARPS", "SSM_CHANNELS", "SSM_WARPS",
             "LAUNCH_PDL", "PREFETCH_INPUTS", "EARLY_LOADS", "PREFETCH_AHEAD", "PERSISTENT")
    # Each model runs both stacks' defaults; its own is marked, the other one's is named (a knob a stack lacks: off).
    other = {model: "(" + ",".join(str(getattr(stack, knob, False)) for knob in knobs) + ")"
             for model, stack in (("mamba-tiny", mamba2_fused), ("mamba2-tiny", mamba_fused))}
    names = sorted((row[0], row[1], row[2]) for row in rows)
    assert names == [(model, "b=1", name) for model in ("mamba-tiny", "mamba2-tiny")
                     for name in sorted((other[model], "default", "op"))], result.stdout
    assert all(float(row[-1]) < 1e-4 for row in rows), result.stdout  # the stack's logits == the op-by-op step's


def test_decode_tune_runs_the_models_and_batches_asked_for():
    result, rows = _tune_smoke("decode_tune", "--models", "mamba2-tiny", "--batches", "2", "--steps", "2")
    assert sorted((row[0], row[1], row[2]) for row in rows) == [("mamba2-tiny", "b=2", "default"),
                                                                ("mamba2-tiny", "b=2", "op")], result.stdout


def test_api_servers_bench_compares_one_and_two_server_processes():
    # ~0.4 s timed: /proc counts CPU time in 10 ms ticks, and a shorter run can read 0 for a busy engine.
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "api_servers.py"), "--api-servers", "1", "2", "--requests", "32",
         "--concurrency", "4", "--output-len", "8", "--step-ms", "5", "--rounds", "1"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    table = {row[0].strip(): [cell.strip() for cell in row[1:]] for row in rows[1:]}
    assert set(table) == {"1", "2"}, result.stdout
    assert float(table["2"][0]) > 0 and table["1"][1] == "1.00x", result.stdout
    assert len(table["2"][6].split(" + ")) == 2 and float(table["2"][7]) > 0, result.stdout  # each process's cores


def test_gpu_check_script_runs_each_part_to_its_log(tmp_path: Path):
    # Without a GPU every part must get as far as the device check: the script's flags all parse, the tests
    # collect (and skip), and each part's status and log reach $OUT.
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), "TESTS_S": "600", "BENCH_S": "300",
           "TUNE_S": "300", "HOST_S": "120"}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                            timeout=1500, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode-tune.log", "device.txt", "gpu-bench.log",
                                                          "gpu-tests.log", "host-loop.log"]
    assert "gpu-tests: exit 0 " in result.stdout and " skipped" in (tmp_path / "gpu-tests.log").read_text()
    for part in ("gpu-bench", "decode-tune", "host-loop"):
        assert f"{part}: exit 2 " in result.stdout, result.stdout
        log = (tmp_path / f"{part}.log").read_text()
        assert "error: no CUDA device" in log and "unrecognized arguments" not in log, log
