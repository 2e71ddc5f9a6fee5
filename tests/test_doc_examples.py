"""Every example in README.md, CONTRIBUTING.md and docs/*.md works as written.

Each fenced code block is checked by its language tag (the convention is in CONTRIBUTING.md, "Examples in the
docs"):

- ``bash``: commands. ``rnnserve`` lines (and the flags after a ``docker run`` image) must parse with the CLI's
  own parser, ``make`` targets must exist, scripts named must exist and know the flags given, and repository
  paths must exist. A block that calls ``curl`` runs in bash against a real ``rnnserve serve`` of the embedded
  default model, with ``HOST:8000`` rewritten to that server: every call must answer 2xx with the documented
  shape.
- ``console``: ``$ `` lines are commands, run in order in one folder per doc (``rnnserve serve`` starts a real
  server there); the lines after a command are its output, where ``...`` stands for any text.
- ``python``: runs in a fresh interpreter in an empty folder (``127.0.0.1:8000`` rewritten as above).
- ``json`` parses; ``promql``: every ``rnnserve_*`` series it names is on a server's ``/metrics``.
- ``text``: output, a sample or a sketch; not checked.

A mark on the line before a block:

- ``<!-- doc-test: skip REASON -->``: the block is not run (pytest reports the skip with REASON); a Python
  block's syntax and a shell block's command lines are still checked.
- ``<!-- doc-test: answer of GET /PATH -->`` before a ``json`` block: a server's answer to ``GET /PATH`` has the
  same keys, at every level (the values are an example).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from torch.utils.cpp_extension import get_default_build_root

from rnnserve.engine.lsrl.cli import build_parser as build_lsrl_parser
from rnnserve.server.cli import build_parser
from tests.server.server_process import running_server

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
TAGS = {"bash", "console", "python", "json", "promql", "text"}
MARK = re.compile(r"<!-- doc-test: (skip|answer of GET) (.+) -->")
DOC_PORT = re.compile(r"\b(?:localhost|127\.0\.0\.1|[a-z][\w.-]*):8000\b")  # any HOST:8000 is the server
TIMEOUT_S = 180

# Run before a shell example: every curl call must answer 2xx (--fail-with-body); its arguments, response head
# and body are kept in $DOC_RESPONSES for check_responses.
CURL_RECORDER = r"""set -euo pipefail
curl() {
  local record
  record=$(mktemp "$DOC_RESPONSES/call.XXXXXX")
  printf '%s\0' "$@" > "$record.args"
  command curl --fail-with-body --silent --show-error --dump-header "$record.head" "$@" | tee "$record.body"
}
"""


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # the opening fence's line number
    tag: str
    text: str
    mark: tuple[str, str] | None  # ("skip", REASON) or ("answer of GET", PATH)

    def __str__(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"

    @property
    def skip(self) -> str | None:
        return self.mark[1] if self.mark and self.mark[0] == "skip" else None


def doc_blocks(doc: Path) -> list[Block]:
    """The fenced code blocks of ``doc``, in order."""
    lines = doc.read_text().splitlines()
    blocks: list[Block] = []
    opening: int | None = None
    for index, line in enumerate(lines):
        if not line.startswith("```"):
            continue
        if opening is None:
            opening = index
            continue
        mark = MARK.fullmatch(lines[opening - 1].strip()) if opening else None
        body = "\n".join(lines[opening + 1 : index])
        blocks.append(Block(doc, opening + 1, lines[opening][3:].strip(), body, mark and (mark[1], mark[2])))
        opening = None
    assert opening is None, f"{doc}:{opening + 1}: the block is never closed"
    return blocks


ALL_BLOCKS = [block for doc in DOCS for block in doc_blocks(doc)]


def blocks_tagged(*tags: str) -> list[Block]:
    return [block for block in ALL_BLOCKS if block.tag in tags]


class Servers:
    """Real ``rnnserve serve`` processes, one per set of flags and folder, started on first use."""

    def __init__(self, stack: ExitStack, cache: Path) -> None:
        self.stack = stack
        # Sessions are written there, not in the user's cache; the fused CPU kernels stay where this run built them
        # (a fresh cache would rebuild them at the first server's start: minutes on a loaded 2-core machine).
        self.env = {"XDG_CACHE_HOME": str(cache),
                    "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()}
        self.urls: dict[tuple[tuple[str, ...], Path], str] = {}

    def url(self, flags: tuple[str, ...] = (), cwd: Path = REPO) -> str:
        if (flags, cwd) not in self.urls:
            server = self.stack.enter_context(running_server(*flags, env=self.env, cwd=cwd, timeout=TIMEOUT_S))
            self.urls[flags, cwd] = server.url
        return self.urls[flags, cwd]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    with ExitStack() as stack:
        yield Servers(stack, tmp_path_factory.mktemp("cache"))


def run_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def with_server(text: str, url: str) -> str:
    """``text`` with every ``HOST:8000`` (URLs with or without a scheme) pointing at ``url``."""
    return DOC_PORT.sub(url.removeprefix("http://"), text)


def matches_output(expected: str, actual: str) -> bool:
    """Whether ``actual`` is ``expected`` where each ``...`` stands for any text (also several lines)."""
    pattern = ".*".join(re.escape(part) for part in expected.split("..."))
    return re.fullmatch(pattern, actual.strip("\n"), re.S) is not None


# --- shell command lines -----------------------------------------------------------------------------------


def command_lines(script: str) -> list[list[str]]:
    """The commands of a shell script as word lists: continued lines joined, comments, variable assignments
    before a command and operators (``|``, ``&&``, ``;``, ``&``, redirections) dropped."""
    commands = []
    pending = ""
    for line in script.replace("\\\n", " ").splitlines():
        pending += line + "\n"
        lexer = shlex.shlex(pending, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        try:
            words = list(lexer)
        except ValueError:  # a quoted string that goes on on the next line
            continue
        pending = ""
        command: list[str] = []
        for word in [*words, ";"]:
            if set(word) <= set("();<>|&"):
                if command:
                    commands.append(command)
                command = []
            elif command or not re.fullmatch(r"\w+=.*", word):
                command.append(word)
    assert not pending, f"a quote is never closed: {pending}"
    return commands


def program(words: list[str]) -> str:
    return Path(words[0]).name


def check_rnnserve(args: list[str]) -> None:
    """``rnnserve ARGS`` parses: the subcommand and its flags exist (nothing runs)."""
    parser, args = (build_lsrl_parser(), args[1:]) if args[:1] == ["lsrl"] else (build_parser(), args)
    try:
        parser.parse_args(args)
    except SystemExit as exit_:
        assert exit_.code == 0, f"rnnserve {shlex.join(args)}: the CLI does not take these arguments"


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))


def check_script(words: list[str]) -> None:
    """``python SCRIPT ARGS``: the script exists and mentions every ``--flag`` given."""
    if words[1].startswith("-"):
        return  # python -m MODULE: its paths are checked with every command's
    script = REPO / words[1]
    assert script.is_file(), f"{words[1]}: no such script"
    source = script.read_text()
    for flag in (word.split("=")[0] for word in words[2:] if word.startswith("--")):
        assert f'"{flag}"' in source, f"{words[1]} has no flag {flag}"


def check_paths(words: list[str]) -> None:
    """Every word that names something in the repository (``benchmarks/x.py``, ``deploy/k8s/base``,
    ``Dockerfile.cuda``) exists."""
    top_level = {path.name for path in REPO.iterdir() if not path.name.startswith(".")}
    for word in words[1:]:
        path = word.removeprefix("./").split("*")[0].rstrip("/")
        if path.split("/")[0] in top_level and "/" in path or path.startswith("Dockerfile"):
            assert (REPO / path).exists(), f"{word}: no such file or folder in the repository"


def check_command_lines(block: Block, script: str) -> None:
    for words in command_lines(script):
        check_paths(words)
        name = program(words)
        if name == "rnnserve":
            check_rnnserve(words[1:])
        elif name == "make":
            missing = {word for word in words[1:] if "=" not in word} - make_targets()
            assert not missing, f"{block}: no make target {missing}"
        elif re.fullmatch(r"python[\d.]*", name):
            check_script(words)
        elif words[:2] == ["docker", "run"]:  # the images' entrypoint is `rnnserve serve`: what follows is its flags
            image = next(i for i, word in enumerate(words) if re.fullmatch(r"rnnserve(:[\w.-]+)?", word))
            check_rnnserve(["serve", *words[image + 1 :]])


# --- HTTP calls ---------------------------------------------------------------------------------------------


def request_of(args: list[str]) -> tuple[str, dict | None]:
    """A recorded curl call's URL path and JSON body (None when it sends none or another kind)."""
    url = next(arg for arg in args if re.match(r"(https?://)?[\w.-]+:\d+(/|$)", arg))
    data = next((args[i + 1] for i, arg in enumerate(args[:-1]) if arg in ("-d", "--data", "--data-raw")), None)
    path = "/" + url.split("://")[-1].partition("/")[2].split("?")[0]
    return path, json.loads(data) if data else None


def response_objects(head: str, body: str) -> list[dict]:
    """The JSON objects of a response: the body, or each event of a stream (which must end with ``[DONE]``)."""
    if "text/event-stream" in head:
        events = [line.removeprefix("data: ") for line in body.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", f"the stream does not end with [DONE]: {body[-300:]}"
        return [json.loads(event) for event in events[:-1]]
    return [json.loads(body)] if "application/json" in head and body else []


# The `object` of each route's answers (streams: their chunks').
OBJECTS = {
    "/v1/completions": "text_completion",
    "/v1/chat/completions": "chat.completion",
    "/v1/sessions": "session",
}


def check_shape(path: str, request: dict | None, answer: dict) -> None:
    """One answer (or stream event) has the shape docs/api.md gives its route, and follows the request's
    structured output."""
    assert "error" not in answer, answer
    if path == "/ready":
        assert answer == {"status": "ready"}
    route = "/v1/sessions" if path.startswith("/v1/sessions") else path
    if route not in OBJECTS:
        return
    expected = OBJECTS[route] + (".chunk" if request and request.get("stream") and "chat" in route else "")
    assert answer["object"] == expected, answer
    if route == "/v1/sessions":
        assert answer["id"].startswith("sess-"), answer
        return
    for choice in answer["choices"]:
        text = choice["text"] if route == "/v1/completions" else (choice.get("message") or choice["delta"])["content"]
        assert isinstance(text, str), choice
        if request and request.get("stream"):
            continue
        regex = request.get("structured_outputs", {}).get("regex") if request else None
        if regex:
            assert re.fullmatch(regex, text), (regex, text)
        if request and request.get("response_format", {}).get("type") == "json_schema":
            json.loads(text)


def check_responses(folder: Path) -> int:
    """Checks every curl call recorded in ``folder``; returns how many there were."""
    calls = sorted(folder.glob("call.??????"))
    for call in calls:
        args = Path(f"{call}.args").read_text().split("\0")[:-1]
        head, body = Path(f"{call}.head").read_text(), Path(f"{call}.body").read_text()
        status = re.findall(r"^HTTP/\S+ (\d+)", head, re.M)[-1]
        assert status.startswith("2"), f"{shlex.join(args)}: {status}\n{body}"
        path, request = request_of(args)
        for answer in response_objects(head, body):
            check_shape(path, request, answer)
    return len(calls)


def checkout_view(folder: Path) -> Path:
    """``folder``, with links to the repository's top-level entries added: the docs' commands run from the
    repository's root (``examples/lsrl/majority.py``), what they write goes to ``folder``."""
    for entry in REPO.iterdir():
        if entry.name != ".git" and not (folder / entry.name).exists():
            (folder / entry.name).symlink_to(entry)
    return folder


INSTALLED = {name for name in ("curl", "jq", "grep") if shutil.which(name)}


def run_shell(script: str, cwd: Path, responses: Path) -> subprocess.CompletedProcess:
    """``script`` in bash after CURL_RECORDER, ``rnnserve`` being this checkout's CLI."""
    rnnserve = f"rnnserve() {{ {shlex.quote(sys.executable)} -m rnnserve.server.cli \"$@\"; }}\n"
    env = {**run_env(), "DOC_RESPONSES": str(responses)}
    return subprocess.run(
        ["bash", "-c", CURL_RECORDER + rnnserve + script], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=TIMEOUT_S,
    )  # fmt: skip


# --- the tests ----------------------------------------------------------------------------------------------


def test_every_block_has_a_known_tag() -> None:
    untagged = [f"{block} ```{block.tag}" for block in ALL_BLOCKS if block.tag not in TAGS]
    assert not untagged, f"tag these blocks with one of {sorted(TAGS)} (output samples: text): {untagged}"


@pytest.mark.parametrize("block", blocks_tagged("bash"), ids=str)
def test_shell_example(block: Block, servers: Servers, tmp_path: Path) -> None:
    check_command_lines(block, block.text)
    if not re.search(r"\bcurl\b", block.text):
        return
    if block.skip:
        pytest.skip(f"{block}: {block.skip}")
    missing = sorted({program(words) for words in command_lines(block.text)} - INSTALLED)
    if missing:
        pytest.skip(f"{block}: needs {', '.join(missing)} (not installed)")
    responses = tmp_path / "responses"
    responses.mkdir()
    done = run_shell(with_server(block.text, servers.url()), checkout_view(tmp_path), responses)
    assert done.returncode == 0, f"{block} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    assert check_responses(responses) > 0


def console_commands(text: str) -> list[tuple[str, str]]:
    """A console block's commands (``$ `` lines and their continuations) with the output written under each."""
    commands: list[tuple[str, list[str]]] = []
    continued = False
    for line in text.splitlines():
        if line.startswith("$ ") or continued:
            if continued:
                commands[-1] = (commands[-1][0] + "\n" + line, [])
            else:
                commands.append((line[2:], []))
            continued = line.endswith("\\")
        else:
            commands[-1][1].append(line)
    return [(command, "\n".join(output)) for command, output in commands]


CONSOLE_DOCS = sorted({block.doc for block in blocks_tagged("console")})


@pytest.mark.parametrize("doc", CONSOLE_DOCS, ids=lambda doc: str(doc.relative_to(REPO)))
def test_console_examples(doc: Path, servers: Servers, tmp_path: Path) -> None:
    """A doc's console blocks, in order, in one folder: a later one uses what an earlier one made."""
    url = None
    for block in (block for block in doc_blocks(doc) if block.tag == "console"):
        check_command_lines(block, "\n".join(command for command, _ in console_commands(block.text)))
        if block.skip:
            continue
        for command, expected in console_commands(block.text):
            words = command_lines(command)[0]
            if words[:2] == ["rnnserve", "serve"]:
                url = servers.url(tuple(words[2:]), cwd=tmp_path)
                continue
            if DOC_PORT.search(command):
                command = with_server(command, url or servers.url())
            responses = tmp_path / "responses"
            responses.mkdir(exist_ok=True)
            done = run_shell(command, checkout_view(tmp_path), responses)
            output = done.stdout + done.stderr
            assert done.returncode == 0, f"{block}: `{command}` failed:\n{output[-3000:]}"
            assert matches_output(expected, done.stdout), f"{block}: `{command}` printed\n{done.stdout[-3000:]}"
            check_responses(responses)


@pytest.mark.parametrize("block", blocks_tagged("python"), ids=str)
def test_python_example(block: Block, servers: Servers, tmp_path: Path) -> None:
    compile(block.text, str(block), "exec")
    if block.skip:
        pytest.skip(f"{block}: {block.skip}")
    code = with_server(block.text, servers.url()) if DOC_PORT.search(block.text) else block.text
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )  # fmt: skip
    assert done.returncode == 0, f"{block} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def key_paths(value: object, path: str = "") -> set[str]:
    """The paths of a JSON value's keys (``points[].ttft.p50``), a list's from its first item."""
    if isinstance(value, dict):
        inner = {inner for key, item in value.items() for inner in key_paths(item, f"{path}{key}.")}
        return {f"{path}{key}" for key in value} | inner
    if isinstance(value, list) and value:
        return key_paths(value[0], path.removesuffix(".") + "[].")
    return set()


@pytest.mark.parametrize("block", blocks_tagged("json"), ids=str)
def test_json_example(block: Block, servers: Servers) -> None:
    documented = key_paths(json.loads(block.text))
    if not block.mark or block.mark[0] != "answer of GET":
        return
    deadline = time.monotonic() + 10  # a list the server fills as it runs (the dashboard's points) may be empty
    while (actual := key_paths(httpx.get(servers.url() + block.mark[1], timeout=30).json())) != documented:
        assert time.monotonic() < deadline, (
            f"{block}: GET {block.mark[1]} answers other keys: documented only {sorted(documented - actual)}, "
            f"answered only {sorted(actual - documented)}"
        )
        time.sleep(0.5)


@pytest.mark.parametrize("block", blocks_tagged("promql"), ids=str)
def test_promql_example(block: Block, servers: Servers) -> None:
    exposition = httpx.get(f"{servers.url()}/metrics", timeout=30).text
    exported = set(re.findall(r"^(rnnserve_\w+)", exposition, re.M))
    named = set(re.findall(r"\b(rnnserve_\w+)", block.text))
    assert named <= exported, f"{block}: series no server exports: {sorted(named - exported)}"
