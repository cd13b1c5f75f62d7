"""The command lines the docs show are ones the commands take, and the
defaults the docs state are the parsers' own: an operator who copies a line
from README.md or docs/ gets no "unrecognized arguments", and one who leaves
a flag out gets what the text says (trial 94 checked them by hand; this keeps
them so). Every command of Ponto's in a ```sh block (continued lines joined)
or an inline `code span` is read up to the next pipe, `;`, `&&` or command of
Ponto's; its flags, subcommands' included, must be in its parser."""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane import cli
from controlplane import settings as control_settings
from dataplane import settings as proxy_settings
from ponto import demo
from ponto.originsim import __main__ as originsim
from tests.unit.test_cliargs import _parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCED = re.compile(r"^ *```[a-z]*\n(.*?)^ *```", re.MULTILINE | re.DOTALL)
# A code span opens with a run of backticks and closes with a run as long
# (``error: ... `pontoctl get regions` ...`` holds single ones).
SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
FLAG = re.compile(r"^[\[(|]*(--[a-z0-9][a-z0-9-]*)")
MODULES = {
    "dataplane": "ponto-proxy",
    "controlplane": "ponto-control",
    "controlplane.cli": "pontoctl",
    "ponto.demo": "ponto-demo",
    "ponto.originsim": "ponto-origin-sim",
}
ENDS = {"|", "||", "&&", ";", "&"}


def _commands(parser: argparse.ArgumentParser, name: str) -> dict[str, set[str]]:
    """Each command and subcommand under `parser` (`pontoctl key create`) and
    the flags it takes."""
    found = {name: set[str]()}
    for action in parser._actions:
        found[name] |= set(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                found |= _commands(subparser, f"{name} {sub}")
    return found


def _defaults(parser: argparse.ArgumentParser) -> dict[str, object]:
    return {o: a.default for a in parser._actions for o in a.option_strings}


PARSERS = {
    "ponto-proxy": _parser(proxy_settings.parse),
    "ponto-control": control_settings.parser(),
    "pontoctl": cli._parser(),
    "ponto-demo": _parser(demo.main),
    "ponto-origin-sim": originsim._parser(),
}
COMMANDS = {k: v for name, p in PARSERS.items() for k, v in _commands(p, name).items()}


def _program(tokens: list[str], i: int) -> tuple[str, int] | None:
    """The Ponto command at tokens[i] and the index after its name, if any."""
    word = tokens[i].rsplit("/", 1)[-1]
    if word in PARSERS:
        return word, i + 1
    if word.startswith("python") and tokens[i + 1 : i + 2] == ["-m"] and i + 2 < len(tokens):
        program = MODULES.get(tokens[i + 2])
        return (program, i + 3) if program is not None else None
    return None


def unknown_flags(line: str) -> Iterator[str]:
    """`command: --flag` for each flag `line` gives a Ponto command that it
    does not take."""
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:  # an unclosed quote in prose
        tokens = line.split()
    i = 0
    while i < len(tokens):
        if (found := _program(tokens, i)) is None:
            i += 1
            continue
        command, i = found
        while i < len(tokens) and tokens[i] not in ENDS and _program(tokens, i) is None:
            if f"{command} {tokens[i]}" in COMMANDS:
                command = f"{command} {tokens[i]}"
            elif (flag := FLAG.match(tokens[i])) and flag[1] != "--help":
                # A subcommand's flags, and the program's own before it.
                program = command.split(" ", 1)[0]
                if flag[1] not in COMMANDS[command] | COMMANDS[program]:
                    yield f"{command}: {flag[1]}"
            i += 1


def code_lines(text: str) -> Iterator[str]:
    """The lines of a Markdown text's fenced blocks, and its code spans."""
    for block in FENCED.findall(text):
        yield from block.replace("\\\n", " ").splitlines()
    for _, span in SPAN.findall(FENCED.sub("", text)):
        yield span.replace("\n", " ")


def doc_lines() -> Iterator[tuple[str, str]]:
    for path in DOCS:
        for line in code_lines(path.read_text(encoding="utf-8")):
            yield path.name, line


def test_the_checker_finds_a_flag_a_command_does_not_take() -> None:
    assert list(unknown_flags("pontoctl key create --tenant acme --cache exact")) == [
        "pontoctl key create: --cache"
    ]
    assert list(unknown_flags("ponto-proxy [--workers N [--worker-hang-timeout 15]]")) == []
    assert list(unknown_flags("python -m dataplane --region r --no-such")) == [
        "ponto-proxy: --no-such"
    ]
    # Another program's flags after a pipe are its own.
    assert list(unknown_flags("pontoctl export | yq --no-doc")) == []
    text = "``error: see `pontoctl get regions` `` and\n`ponto-proxy\n--nope`"
    assert list(code_lines(text)) == ["error: see `pontoctl get regions` ", "ponto-proxy --nope"]
    text = "```sh\nponto-control --etcd E \\\n  --listen L\n```\n"
    assert list(code_lines(text)) == ["ponto-control --etcd E    --listen L"]


def test_every_flag_the_docs_give_a_command_is_one_it_takes() -> None:
    lines = list(doc_lines())
    assert sum("pontoctl" in line for _, line in lines) > 100  # the scan reads them
    unknown = [
        f"{name}: {bad}   ({line.strip()[:120]})"
        for name, line in lines
        for bad in unknown_flags(line)
    ]
    assert unknown == []


def _number(text: str) -> float:
    return float(text.replace(",", ""))


TABLE_ROW = re.compile(r"^\| `(ponto-proxy|ponto-control|ponto-origin-sim) (.*?)` \|", re.MULTILINE)


def test_the_readmes_commands_table_shows_the_defaults() -> None:
    """The Commands table writes `[--flag N]` with N the default (its proxy
    row says: "defaults shown, as --help gives them")."""
    rows = TABLE_ROW.findall((ROOT / "README.md").read_text(encoding="utf-8"))
    assert {program for program, _ in rows} == {"ponto-proxy", "ponto-control", "ponto-origin-sim"}
    shown = [
        (program, flag, value)
        for program, row in rows
        for flag, value in re.findall(r"(--[a-z0-9-]+) (-?[0-9][0-9.]*)\b", row)
    ]
    assert len(shown) > 15
    wrong = [
        (program, flag, value, default)
        for program, flag, value in shown
        if not isinstance(default := _defaults(PARSERS[program])[flag], int | float)
        or _number(value) != default
    ]
    assert wrong == []


# "`--flag` (default 60", "`--flag`, default 10 s", "`--flag` (8 MiB by default".
PROSE = re.compile(
    r"`(?:(ponto-proxy|ponto-control) )?(--[a-z0-9-]+)(?: [A-Z]+)?`"
    r"(?:,| \()\s*(?:default:?\s+([0-9][0-9,.]*)\s*(MiB|ms|s\b)?"
    r"|([0-9][0-9,.]*)\s*(MiB|ms|s|[A-Za-z]*)\s+by\s+default)"
)
SCALE = {"MiB": 1 << 20, "s": 1000, "ms": 1 / 1000}


def _stated(m: re.Match[str]) -> tuple[str | None, str, float]:
    """(program, flag, value) of a PROSE match: the program named, or the one
    of the proxy and the control plane that has the flag (None: both)."""
    named, flag, value, unit, value_by, unit_by = m.groups()
    owners = [p for p in ("ponto-proxy", "ponto-control") if flag in COMMANDS[p]]
    number = _number(value or value_by)
    # Bytes said in MiB; milliseconds in seconds, or seconds in milliseconds.
    unit = unit or unit_by or ""
    in_ms = flag.endswith("-ms")
    if unit == "MiB" or (unit == "s" and in_ms) or (unit == "ms" and not in_ms):
        number *= SCALE[unit]
    return named or (owners[0] if len(owners) == 1 else None), flag, number


@pytest.mark.parametrize(
    ("text", "stated"),
    [
        ("`--max-body-bytes` (8 MiB by default)", ("ponto-proxy", "--max-body-bytes", 8 << 20)),
        ("`--lease-ttl`, default 10 s", ("ponto-control", "--lease-ttl", 10)),
        ("`--report-interval-ms`, 1 s by default", ("ponto-proxy", "--report-interval-ms", 1000)),
        ("`--redis-deadline-ms` (default 50 ms", ("ponto-proxy", "--redis-deadline-ms", 50)),
        ("`--max-body-bytes` (default 8 MiB)", ("ponto-proxy", "--max-body-bytes", 8 << 20)),
        (
            "`ponto-proxy --stream-idle-timeout SECONDS` (default 60)",
            ("ponto-proxy", "--stream-idle-timeout", 60),
        ),
    ],
)
def test_the_prose_reader_reads_each_form(text: str, stated: tuple[str, str, float]) -> None:
    [m] = PROSE.finditer(text)
    assert _stated(m) == stated


def test_the_defaults_the_prose_states_are_the_parsers() -> None:
    stated = [
        (path.name, *_stated(m))
        for path in DOCS
        for m in PROSE.finditer(re.sub(r"\s+", " ", path.read_text(encoding="utf-8")))
    ]
    assert len(stated) > 15
    wrong = [
        (name, program, flag, value, default)
        for name, program, flag, value in stated
        if program is not None and (default := _defaults(PARSERS[program])[flag]) != value
    ]
    assert wrong == []


def test_the_proxys_flags_page_names_every_flag_it_takes() -> None:
    """docs/proxy-flags.md, to which the README's Commands table sends
    readers of ponto-proxy's flags, names every one `--help` shows."""
    page = (ROOT / "docs" / "proxy-flags.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`(--[a-z0-9-]+)", page))
    shown = {
        flag
        for action in PARSERS["ponto-proxy"]._actions
        if action.help != argparse.SUPPRESS
        for flag in action.option_strings
        if flag.startswith("--") and flag != "--help"
    }
    assert shown - named == set()


# A row of docs/proxy-flags.md's tables: its flags, and the default it states.
FLAGS_ROW = re.compile(r"^\| (`--.*?`) \| (.*?) \| ", re.MULTILINE)


def test_the_proxys_flags_page_shows_the_defaults() -> None:
    """Each default docs/proxy-flags.md states as a value (a number, a word,
    "none") is the parser's; one said in words ("the cores it may use") is
    not read. The page replaced the README's Commands cell, whose defaults
    test_the_readmes_commands_table_shows_the_defaults kept true."""
    page = (ROOT / "docs" / "proxy-flags.md").read_text(encoding="utf-8")
    defaults = _defaults(PARSERS["ponto-proxy"])
    checked: list[tuple[str, object, object]] = []
    for flags, stated in FLAGS_ROW.findall(page):
        value = re.sub(r" \(.*\)$", "", stated)  # "8388608 (8 MiB)"
        for flag in re.findall(r"`(--[a-z0-9-]+)", flags):
            default = defaults[flag]
            if re.fullmatch(r"[0-9][0-9.]*", value):
                checked.append((flag, _number(value), default))
            elif value == "none":
                checked.append((flag, None, default or None))
            elif re.fullmatch(r"[A-Za-z0-9.:_-]+", value):
                checked.append((flag, value, default))
    assert len(checked) > 40  # the reader reads the tables
    assert [(flag, value, default) for flag, value, default in checked if value != default] == []
