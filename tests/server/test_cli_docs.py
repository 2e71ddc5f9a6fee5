"""The command line against its documentation: every ``rnnserve serve`` flag is documented, and every flag the
docs name exists (in ``rnnserve``'s commands, a script of this repository, or the outside tool named below)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from rnnserve.server.cli import build_parser
from rnnserve.server.config import LOOPBACK_HOSTS

REPO = Path(__file__).resolve().parents[2]
DOCS = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md", REPO / "CONTRIBUTING.md"]
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
# Flags of other programs that the docs name, with the program.
OUTSIDE_FLAGS = {
    "--build-arg": "docker build",
    "--gpus": "docker run",
    "--rm": "docker run",
    "--data-binary": "curl",
    "--from-literal": "kubectl create secret",
    "--api-server-count": "vLLM",
    "--tool-call-parser": "vLLM",
    "--metric-percentiles": "vllm bench serve",
}
# A command line of the server, up to the end of its code span, a comment or a shell operator.
SERVE_COMMAND = re.compile(r"rnnserve serve([^`#&|\n]*)")


def subcommand_flags() -> dict[str, set[str]]:
    """Each ``rnnserve`` subcommand's long flags, and the program's own under ``""``."""
    parser = build_parser()
    flags = {"": {o for a in parser._actions for o in a.option_strings if o.startswith("--")}}
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, subparser in commands.choices.items():
        flags[name] = {o for a in subparser._actions for o in a.option_strings if o.startswith("--")}
    return flags


def documented_flags() -> dict[str, set[str]]:
    """Every ``--flag`` the docs write, with the files that write it."""
    found: dict[str, set[str]] = {}
    for path in DOCS:
        for flag in FLAG.findall(path.read_text()):
            found.setdefault(flag, set()).add(path.name)
    return found


def script_flags() -> set[str]:
    """The flags the repository's own scripts and benchmarks define (quoted in their sources) or pass (Makefile)."""
    flags = set(FLAG.findall((REPO / "Makefile").read_text()))
    for folder in ("benchmarks", "scripts", "clients", "engine", "kernels", "server", "tests"):
        for path in (REPO / folder).rglob("*.py"):
            flags |= set(re.findall(r"[\"'](--[a-z][a-z0-9-]*)[\"']", path.read_text()))
    return flags


def test_every_serve_flag_is_documented() -> None:
    missing = subcommand_flags()["serve"] - {"--help"} - set(documented_flags())
    assert not missing, f"rnnserve serve flags no doc names: {sorted(missing)}"


def test_every_documented_flag_exists() -> None:
    known = set().union(*subcommand_flags().values(), script_flags(), OUTSIDE_FLAGS)
    unknown = {flag: sorted(files) for flag, files in documented_flags().items() if flag not in known}
    assert not unknown, f"the docs name flags nothing here defines: {unknown}"


def test_documented_serve_command_lines_use_serve_flags() -> None:
    serve = subcommand_flags()["serve"]
    for path in DOCS:
        for command in SERVE_COMMAND.findall(path.read_text()):
            unknown = set(FLAG.findall(command)) - serve
            assert not unknown, f"{path.name}: `rnnserve serve{command}` uses {sorted(unknown)}"


def test_allowed_hosts_help_and_docs_name_the_default_hosts() -> None:
    """``--allowed-hosts``' help, its row in docs/cli.md and the limits of docs/api.md name every host of the
    default list (they left out ``testserver``, which it holds for Starlette's TestClient)."""
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    (action,) = [a for a in commands.choices["serve"]._actions if "--allowed-hosts" in a.option_strings]
    cli_doc = (REPO / "docs" / "cli.md").read_text()
    (row,) = [line for line in cli_doc.splitlines() if line.startswith("| `--allowed-hosts")]
    (limit,) = [line for line in (REPO / "docs" / "api.md").read_text().splitlines() if "`--allowed-hosts` |" in line]
    for where, text in (("the help", action.help or ""), ("docs/cli.md", row), ("docs/api.md", limit)):
        missing = [host for host in LOOPBACK_HOSTS if host not in text]
        assert not missing, f"{where} does not name {missing} among --allowed-hosts' defaults"
