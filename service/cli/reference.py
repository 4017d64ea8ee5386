"""The command-line reference (docs/cli.md), made from the parser itself: every command's ``--help``
as a user sees it, at a fixed width, so the page changes only when a command or a flag does (a test
checks the page against it)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator

WIDTH = 100
"""Columns the help is formatted to (argparse reads ``COLUMNS``)."""


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every command the parser knows, with the words that name it, the top level first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


def cli_reference(parser: argparse.ArgumentParser) -> str:
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)
    try:
        sections = [
            "# Command-line reference",
            "",
            "Every `gateway` command and its flags, as its `--help` prints them (generated: `gateway settings",
            "--cli-reference > docs/cli.md`). A setting's flag, its environment variable and its whole description",
            "are in [the settings reference](settings.md); `gateway settings --effective` prints the settings a",
            "process would run with and where each value came from.",
            "",
        ]
        for path, command in commands(parser):
            name = " ".join(("gateway", *path))
            sections += [f"## {name}", "", "```text", command.format_help().rstrip(), "```", ""]
        return "\n".join(sections)
    finally:
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before
