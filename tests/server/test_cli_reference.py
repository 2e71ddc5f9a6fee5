"""docs/cli.md against the parsers: each command's tables list exactly its flags, with the defaults they apply."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from rnnserve.engine.config import parse_bytes
from rnnserve.engine.lsrl.cli import build_parser as build_lsrl_parser
from rnnserve.server.cli import build_parser

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
CELL = r"(?:[^|\\]|\\.)*"  # a table cell's text, where \| is a | of the text
ROW = re.compile(rf"^\| (`-{CELL}) \| ({CELL}) \|", re.M)
# A command line of another subcommand than serve, up to the end of its code span, a comment or a table cell.
COMMAND_LINE = re.compile(r"rnnserve (lsrl (?:compile|run)|generate|bench|convert)\b([^`\n#|]*)")
HELP_DEFAULT = re.compile(r"\(default: (.*)\)$", re.S)


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """A parser's flags (``--help`` aside), each with its action."""
    return {o: a for a in parser._actions if not isinstance(a, argparse._HelpAction) for o in a.option_strings}


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """A parser's subcommands by name."""
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def commands() -> dict[str, dict[str, argparse.Action]]:
    """Every command's flags (``--help`` aside) with their actions, by the command's name as the doc's headings
    write it (``rnnserve lsrl`` stands for its subcommands, which the doc lists together)."""
    flags = {f"rnnserve {name}": options(parser) for name, parser in subcommands(build_parser()).items()}
    flags["rnnserve lsrl"] = {}
    for parser in subcommands(build_lsrl_parser()).values():
        flags["rnnserve lsrl"] |= options(parser)
    return flags


def doc_sections() -> dict[str, str]:
    """The doc's ``## rnnserve ...`` sections by heading."""
    parts = re.split(r"^## (.+)$", DOC.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def documented_rows(section: str) -> list[tuple[list[str], str]]:
    """Each flag row of a section's tables: the flags its first cell names, and its Default cell."""
    return [(re.findall(r"`(--?[a-z][a-z0-9-]*)", flags), default.strip()) for flags, default in ROW.findall(section)]


def expected_default(action: argparse.Action) -> str | None:
    """What the Default cell must say: the help's ``(default: ...)``, ``—`` for a switch, else the value the
    parser applies (``None`` where there is none: the cell says in words what happens)."""
    help_default = HELP_DEFAULT.search(action.help or "")
    if help_default:
        return help_default[1]
    if action.nargs == 0:
        return "—"
    if action.default in (None, []):
        return None
    return str(action.default)


def same_default(documented: str, expected: str) -> bool:
    """The cell is the expected text, its start up to a clause break, or the same number."""
    documented = documented.replace("`", "").replace("\\|", "|")
    if documented == expected or re.match(re.escape(documented) + r"[,:;(]", expected):
        return True
    try:
        return float(documented) == float(expected)
    except ValueError:
        return False


@pytest.mark.parametrize("command", sorted(commands()))
def test_every_flag_is_listed_once(command: str) -> None:
    section = doc_sections().get(command)
    assert section is not None, f"docs/cli.md has no section '## {command}'"
    listed = [flag for flags, _ in documented_rows(section) for flag in flags]
    duplicated = sorted({flag for flag in listed if listed.count(flag) > 1})
    assert not duplicated, f"{command}: listed twice: {duplicated}"
    actual = set(commands()[command])
    assert set(listed) == actual, (
        f"{command}: the doc lists flags the command lacks {sorted(set(listed) - actual)}, "
        f"and lacks {sorted(actual - set(listed))}"
    )


@pytest.mark.parametrize("command", sorted(commands()))
def test_documented_defaults_are_the_parsers(command: str) -> None:
    flags = commands()[command]
    wrong = []
    for names, default in documented_rows(doc_sections()[command]):
        if len(names) != 1 and not (len(names) == 2 and flags[names[0]] is flags[names[1]]):
            continue  # a row of several flags points elsewhere for their defaults
        expected = expected_default(flags[names[-1]])
        if expected is not None and not same_default(default, expected):
            wrong.append(f"{names[-1]}: documented {default!r}, the parser's is {expected!r}")
    assert not wrong, f"{command}: " + "; ".join(wrong)


def test_generate_shares_the_engine_flags_with_serve() -> None:
    """``generate``'s row of engine flags, whose defaults the serve section gives, are serve's flags with serve's
    defaults."""
    serve, generate = commands()["rnnserve serve"], commands()["rnnserve generate"]
    (shared,) = [names for names, _ in documented_rows(doc_sections()["rnnserve generate"]) if len(names) > 1]
    assert set(shared) <= set(serve), sorted(set(shared) - set(serve))
    for flag in shared:
        assert expected_default(generate[flag]) == expected_default(serve[flag]), flag


@pytest.mark.parametrize("command", sorted(commands()))
def test_help_defaults_are_the_applied_ones(command: str) -> None:
    """A ``(default: N)`` written by hand in a flag's help (a number or a byte size) is the value it gets."""
    wrong = []
    for flag, action in commands()[command].items():
        help_default = HELP_DEFAULT.search(action.help or "")
        if help_default is None or not isinstance(action.default, int | float) or isinstance(action.default, bool):
            continue
        text = help_default[1].split(",")[0]
        value = action.type(text) if action.type is parse_bytes else float(text)
        if value != action.default:
            wrong.append(f"{flag}: help says {text}, the parser applies {action.default}")
    assert not wrong, wrong


def test_command_lines_in_the_docs_use_their_commands_flags() -> None:
    """``rnnserve bench --x``, ``rnnserve generate --x`` and the others, in any doc's text or examples, name flags of
    that command (``tests/server/test_cli_docs.py`` checks ``rnnserve serve``'s)."""
    flags = {command.removeprefix("rnnserve "): set(actions) for command, actions in commands().items()}
    repo = DOC.parents[1]
    wrong = []
    for doc in [repo / "README.md", repo / "CONTRIBUTING.md", *sorted(DOC.parent.glob("*.md"))]:
        for command, rest in COMMAND_LINE.findall(doc.read_text()):
            known = flags["lsrl" if command.startswith("lsrl") else command]
            named = re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", rest)
            wrong += [f"{doc.name}: rnnserve {command} {flag}" for flag in named if flag not in known]
    assert not wrong, wrong
