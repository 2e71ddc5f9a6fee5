"""The ``rnnserve`` command: --help, generate, serve (startup line, SIGTERM drain, Ctrl-C while it starts),
lsrl forwarding."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from rnnserve.engine import loader
from rnnserve.engine.config import parse_bytes
from rnnserve.engine.llm import LLM
from rnnserve.engine.sampling_params import SamplingParams
from rnnserve.server import cli
from rnnserve.server.config import ServerConfig
from tests.server.conftest import TINY
from tests.server.server_process import REPO, free_port, running_server

pytestmark = pytest.mark.timeout(120)

SERVE_FLAGS = [
    "--model", "--host", "--port", "--device", "--dtype", "--max-num-seqs", "--state-memory",
    "--max-prompt-tokens", "--api-key", "--served-model-name", "--max-num-batched-tokens", "--max-waiting",
    "--enforce-eager",
    "--max-body-bytes", "--drain-timeout", "--api-key-file", "--allowed-hosts", "--request-read-timeout",
    "--keep-alive-timeout", "--limit-concurrency", "--max-queued-bytes",
]  # fmt: skip


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_help_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0 and all(c in out for c in ("serve", "generate", "bench", "lsrl"))
    code, out, _ = run_main(["serve", "--help"], capsys)
    assert code == 0 and [f for f in SERVE_FLAGS if f not in out] == []
    code, out, _ = run_main(["generate", "--help"], capsys)
    assert code == 0 and all(f in out for f in ("--model", "--max-tokens", "--temperature", "--seed", "PROMPT"))
    code, out, _ = run_main(["bench", "--help"], capsys)
    flags = ("--url", "--num-prompts", "--concurrency", "--request-rate", "--input-len", "--output-len", "--json")
    assert code == 0 and all(f in out for f in flags)


def test_bad_flag_values_are_rejected(capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    assert run_main(["serve", "--max-num-seqs", "0"], capsys)[0] == 2
    assert run_main(["serve", "--state-memory", "lots"], capsys)[0] == 2
    assert run_main(["bench", "--concurrency", "2", "--request-rate", "1"], capsys)[0] == 2
    # a server that answered 408 to every request with a body started from --request-read-timeout -1
    for flag, value in [("--request-read-timeout", "-1"), ("--keep-alive-timeout", "0"), ("--drain-timeout", "nan")]:
        assert run_main(["serve", flag, value], capsys)[0] == 1
        assert f"{flag} must be a number of seconds" in caplog.text
    parse = cli.build_parser().parse_args
    assert ServerConfig.from_args(parse(["serve", "--decoded-prompt-tokens", "0"])).engine.decoded_prompt_tokens == 0
    assert ServerConfig.from_args(parse(["serve", "--drain-timeout", "0"])).drain_timeout == 0


def test_serve_flags_and_code_build_the_same_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RNNSERVE_API_KEY", "from-env")
    parse = cli.build_parser().parse_args
    defaults = ServerConfig.from_args(parse(["serve"]))
    assert defaults == ServerConfig.build()
    assert (defaults.host, defaults.port, defaults.api_key) == ("127.0.0.1", 8000, "from-env")
    assert defaults.engine.max_waiting == 256
    flags = ["serve", "--model", TINY, "--max-num-seqs", "3", "--chat-max-tokens", "7", "--port", "0", "--api-key", "",
             "--max-body-bytes", "2KiB", "--served-model-name", "a", "b", "--dtype", "auto"]  # fmt: skip
    config = ServerConfig.from_args(parse(flags))
    assert config == ServerConfig.build(
        model=TINY, max_num_seqs=3, chat_default_max_tokens=7, port=0, api_key=None, max_body_bytes=2048,
        served_model_name=["a", "b"],
    )  # fmt: skip
    assert config.engine.dtype is None and config.model_names == ["a", "b"]


def test_parse_bytes() -> None:
    assert parse_bytes("1024") == 1024
    assert parse_bytes("512M") == 512 * 2**20
    assert parse_bytes("1GiB") == 2**30
    assert parse_bytes("2GB") == 2 * 10**9


def test_generate_streams_the_greedy_completion(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(["generate", "--model", TINY, "--max-tokens", "8", "--temperature", "0", "Hello"], capsys)
    assert code == 0
    [expected] = LLM(TINY, max_num_seqs=1).generate("Hello", SamplingParams(temperature=0, max_tokens=8))
    assert out == expected.outputs[0].text + "\n"
    assert "8 tokens" in err


def test_generate_follows_a_constraint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``--json-schema`` (inline or ``@FILE``), ``--regex``, ``--choice``: the streamed text follows it."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    base = ["generate", "--model", TINY, "--max-tokens", "40", "--temperature", "1", "--seed", "4"]
    for flag in (json.dumps(schema), f"@{tmp_path / 'schema.json'}"):
        code, out, err = run_main([*base, "--json-schema", flag, "Hi"], capsys)
        assert code == 0 and json.loads(out) in ({"ok": True}, {"ok": False}) and "finish_reason=stop" in err
    code, out, _ = run_main([*base, "--regex", "[0-9]{4}", "Hi"], capsys)
    assert code == 0 and re.fullmatch(r"[0-9]{4}\n", out)
    code, out, _ = run_main([*base, "--choice", "red", "--choice", "blue", "Hi"], capsys)
    assert code == 0 and out in ("red\n", "blue\n")
    code, _, err = run_main([*base, "--json-schema", "{not json", "Hi"], capsys)
    assert code == 2 and "--json-schema" in err
    code, _, err = run_main([*base, "--regex", "(", "Hi"], capsys)
    assert code == 2 and "regex" in err


def test_generate_reports_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["generate", "--model", "random:no-such-preset", "x"], capsys)
    assert code == 2 and "no-such-preset" in err
    code, _, err = run_main(["generate", "--model", TINY, "--temperature", "-1", "x"], capsys)
    assert code == 2 and "temperature" in err


def test_generate_exits_non_zero_when_generation_fails(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request the engine failed printed finish_reason=error and exited 0: a script could not tell."""
    from rnnserve.engine.models import MODEL_REGISTRY

    def broken(*args: object) -> None:
        raise RuntimeError("decode broke")

    monkeypatch.setattr(MODEL_REGISTRY["mingru"], "decode", broken)
    code, _, err = run_main(["generate", "--model", TINY, "--max-tokens", "8", "--temperature", "0", "Hello"], capsys)
    assert code == 1 and "generation failed" in err and "decode broke" in err


def test_serve_without_the_default_model_explains_itself(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(loader, "DEFAULT_MODEL_DIR", tmp_path / "missing")  # serve reads it when it runs
    assert cli.main(["serve"]) == 1
    assert "--model" in caplog.text


def test_lsrl_subcommand_forwards_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("rnnserve.engine.lsrl.cli")
    fake.main = lambda argv: seen.append(argv) or 7  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "rnnserve.engine.lsrl.cli", fake)
    assert cli.main(["lsrl", "compile", "--help"]) == 7
    assert seen == [["compile", "--help"]]


def test_serving_environment_adds_a_short_spin_and_huge_pages_unless_chosen() -> None:
    assert cli.serving_environment({"PATH": "/bin"}) == {
        "PATH": "/bin",
        "GOMP_SPINCOUNT": "10000",
        "THP_MEM_ALLOC_ENABLE": "1",
    }
    for policy in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "300000"}):
        assert cli.serving_environment(policy) == {**policy, "THP_MEM_ALLOC_ENABLE": "1"}
    chosen = {"GOMP_SPINCOUNT": "300000", "THP_MEM_ALLOC_ENABLE": "0"}
    assert cli.serving_environment(chosen) == chosen


def test_serve_reexecs_only_when_the_environment_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Also: Ctrl-C and SIGTERM are blocked across the exec, and unblocked when it returns."""
    calls: list[tuple[str, list[str], dict[str, str]]] = []
    blocked_at_exec: list[set[signal.Signals]] = []

    def execve(path: str, args: list[str], env: dict[str, str]) -> None:
        calls.append((path, args, env))
        blocked_at_exec.append(signal.pthread_sigmask(signal.SIG_BLOCK, []))

    monkeypatch.setattr(cli.os, "execve", execve)
    monkeypatch.setattr(cli.sys, "orig_argv", [sys.executable, "-m", "rnnserve.server.cli", "serve", "--port", "1"])
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    cli.reexec_with_serving_environment()
    assert calls == []
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")
    cli.reexec_with_serving_environment()
    [(path, args, env)] = calls
    assert path == sys.executable and args == [sys.executable, "-m", "rnnserve.server.cli", "serve", "--port", "1"]
    assert env["GOMP_SPINCOUNT"] == "10000" and env["THP_MEM_ALLOC_ENABLE"] == "1" and "OMP_WAIT_POLICY" not in env
    assert {signal.SIGINT, signal.SIGTERM} <= blocked_at_exec[0]
    assert not {signal.SIGINT, signal.SIGTERM} & signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_a_ctrl_c_pending_across_the_restart_ends_serve_with_130() -> None:
    """A Ctrl-C that came while ``serve`` restarted itself with its environment (here: pending, blocked, from
    before it started) ends it with 130 once it runs, instead of vanishing or staying blocked while it serves."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    args = ["-m", "rnnserve.server.cli", "serve", "--model", TINY, "--port", str(free_port())]
    proc = subprocess.Popen(with_ctrl_c_by_default(args, pending=True), cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Uvicorn running" not in output and "Traceback" not in output, output


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def child_pids(pid: int) -> set[int]:
    return {int(c) for path in Path(f"/proc/{pid}/task").glob("*/children") for c in path.read_text().split()}


@pytest.mark.parametrize("engine", ["thread", "process"])
def test_serve_logs_startup_and_drains_on_sigterm(monkeypatch: pytest.MonkeyPatch, engine: str) -> None:
    """Also: the served process (the same pid, re-executed) runs with the server's OpenMP spin count; an engine
    process ends with the server."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    flags = ("--engine-process", "on" if engine == "process" else "off")
    with running_server("--model", TINY, "--max-num-seqs", "3", "--drain-timeout", "20", *flags) as server:
        environ = Path(f"/proc/{server.proc.pid}/environ").read_bytes().split(b"\0")
        assert b"GOMP_SPINCOUNT=10000" in environ
        [startup] = [line for line in server.log if "serving model=" in line]
        assert f"model={TINY}" in startup and "device=cpu" in startup and "slots=3" in startup
        assert "quantize=none" in startup
        assert "state_bytes_per_slot=" in startup and f"engine={engine}" in startup
        children = child_pids(server.proc.pid)
        assert bool(children) == (engine == "process")  # the engine (and multiprocessing's resource tracker)
        body = {"prompt": "Hello", "max_tokens": 60, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: ") :])
                if len(events) == 2:
                    server.proc.send_signal(signal.SIGTERM)
        assert events[-1] == "[DONE]"
        texts = [json.loads(e)["choices"][0] for e in events[:-1]]
        assert texts[-1]["finish_reason"] == "length"
        assert server.proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10  # they see the server's end of their pipes close, then exit
        while any(alive(child) for child in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(child) for child in children)


# Runs the Python command in its arguments with SIGINT's default action, as in a terminal's foreground, whatever this
# process inherited (a shell starts a background job, such as a CI run, with SIGINT ignored, and Python keeps that),
# and with "pending" first, a Ctrl-C pending and blocked. A small process that execs, not a preexec_fn: that forks the
# whole test process, which the kernel's overcommit check refuses once the test process has reserved enough memory.
CTRL_C_BY_DEFAULT = (
    "import os, signal, sys\n"
    "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
    "if sys.argv[1] == 'pending':\n"
    "    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])\n"
    "    os.kill(os.getpid(), signal.SIGINT)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)


def with_ctrl_c_by_default(args: list[str], pending: bool = False) -> list[str]:
    """The command that runs ``python args`` with SIGINT's default action (:data:`CTRL_C_BY_DEFAULT`)."""
    return [sys.executable, "-c", CTRL_C_BY_DEFAULT, "pending" if pending else "now", *args]


def torch_is_loading(pid: int, _: str) -> bool:
    """Whether the process has begun importing torch (its library is mapped; the import then takes a second)."""
    try:
        return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False


def model_is_loading(_: int, log: str) -> bool:
    return "loading model" in log


@pytest.mark.parametrize("moment", [torch_is_loading, model_is_loading], ids=["importing-torch", "loading-model"])
def test_ctrl_c_while_serve_starts_exits_quietly_with_130(moment: Callable[[int, str], bool]) -> None:
    """Ctrl-C while torch loaded (before ``main`` ran, a KeyboardInterrupt traceback) or while the model loads
    (the exit was 0) ends ``rnnserve serve`` with 130 and no traceback."""
    args = ["-m", "rnnserve.server.cli", "serve", "--model", TINY, "--port", str(free_port())]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(with_ctrl_c_by_default(args), cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while not moment(proc.pid, "".join(log)):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(log)
            time.sleep(0.005)
        assert "Uvicorn running" not in "".join(log)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
        reader.join(timeout=5)
    output = "".join(log)
    assert code == 130 and "Traceback" not in output and "KeyboardInterrupt" not in output, (code, output)


def test_torch_is_imported_with_ctrl_c_held() -> None:
    """A Ctrl-C in the middle of torch's import aborted the process, failed with an unrelated error (a
    ``RuntimeError`` from a class torch was defining) or hung it: the program holds SIGINT and SIGTERM while torch
    loads, and they are delivered after."""
    code = """if True:
        import json, signal, sys
        masks = []
        def hook(event, args):
            if event == "import" and args[0] == "torch" and not masks:
                masks.append(signal.pthread_sigmask(signal.SIG_BLOCK, []))
        sys.addaudithook(hook)
        from rnnserve.server import cli
        try:
            cli.main(["--version"])
        except SystemExit:
            pass
        print(json.dumps([sorted(map(int, masks[0])), sorted(map(int, signal.pthread_sigmask(signal.SIG_BLOCK, [])))]))
        """
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    during, after = json.loads(done.stdout.splitlines()[-1])
    held = {signal.SIGINT, signal.SIGTERM}
    assert held <= set(during) and not held & set(after), done.stdout + done.stderr


def test_importing_the_cli_loads_no_torch() -> None:
    """The module's imports run before ``main``'s ``try``: torch, seconds to load, must load inside it."""
    code = "import sys, rnnserve.server.cli; print([m for m in ('torch', 'rnnserve.engine') if m in sys.modules])"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_sigint_once_serving_drains_and_exits_0() -> None:
    with running_server("--model", TINY) as server:
        pass
    assert server.proc.returncode == 0 and "Traceback" not in server.output, server.output


def test_api_key_file(tmp_path: Path) -> None:
    (tmp_path / "key").write_text("s3cret\n")
    assert ServerConfig.build(api_key="flag", api_key_file=str(tmp_path / "key")).api_key == "s3cret"
    (tmp_path / "empty").write_text("\n")
    for path in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(ValueError, match="api-key-file"):
            ServerConfig.build(api_key_file=str(path))


def test_a_reader_that_goes_away_ends_generate_quietly() -> None:
    """``rnnserve generate ... | head -c 5``: exit 141 (SIGPIPE's) without a traceback (a BrokenPipeError one
    before)."""
    import subprocess

    # the default model: it writes text (a random one's greedy ids may have none, and head would wait for EOF)
    command = f"{sys.executable} -m rnnserve.server.cli generate --max-tokens 20000 --temperature 0 Hi"
    result = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {command} | head -c 5 > /dev/null; echo ${{PIPESTATUS[0]}}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.stdout.strip() == "141" and "Traceback" not in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_a_port_out_of_range_is_a_usage_error(capsys: pytest.CaptureFixture[str], port: str) -> None:
    code, _, err = run_main(["serve", "--port", port], capsys)
    assert code == 2 and "port number from 0 to 65535" in err


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def build(:\n", "line 1: syntax error"),
        ("raise RuntimeError('at import')\n", "importing it raised RuntimeError: at import"),
        ("def build():\n    return [][1]\n", "build() raised IndexError"),
        ("ALPHABET = ''\nfrom rnnserve.engine.lsrl import Input\ndef build():\n    return Input(1)\n", "ALPHABET"),
    ],
)
def test_lsrl_program_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], source: str, expected: str
) -> None:
    program = tmp_path / "program.py"
    program.write_text(source)
    code, _, err = run_main(["lsrl", "compile", str(program), "-o", str(tmp_path / "out")], capsys)
    assert code == 1 and expected in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_lsrl_compile_refuses_an_output_in_use_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    program = Path(__file__).resolve().parents[2] / "examples" / "lsrl" / "majority.py"
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("keep")
    code, _, err = run_main(["lsrl", "compile", str(program), "-o", str(used)], capsys)
    assert code == 1 and "not empty" in err and not (used / "model.safetensors").exists()
    assert run_main(["lsrl", "compile", str(program), "-o", str(used), "--force"], capsys)[0] == 0
    assert (used / "model.safetensors").exists() and (used / "notes.txt").read_text() == "keep"
    code, _, err = run_main(["lsrl", "compile", str(program), "-o", str(used / "notes.txt")], capsys)
    assert code == 1 and "not a directory" in err


def test_the_serving_line_gives_the_bound_address(caplog: pytest.LogCaptureFixture) -> None:
    """``--port 0`` logged ``url=http://127.0.0.1:0`` and ``--host ::`` ``http://:::8000``."""
    import socket

    info = types.SimpleNamespace(device="cpu", dtype="float32", bytes_per_slot=8, num_slots=2)
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        try:
            sock = socket.socket(family)
            sock.bind((host, 0))
        except OSError:
            continue  # no IPv6 here
        with sock, caplog.at_level(logging.INFO, logger="rnnserve"):
            cli.log_serving(ServerConfig.build(model=TINY, host=host, port=0), info, "thread", sock)
            port = sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        assert f"url=http://{shown}:{port}" in caplog.text and port != 0
