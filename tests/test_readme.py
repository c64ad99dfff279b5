"""The README's set-up section, as a newcomer reads it (issue 48): the two commands CI runs
verbatim, then, first thing after them, how to reach `runner` (the set-up installs it into
`.venv` and leaves the shell as it was: `runner init ...` typed next said `runner: command not
found`); and `just` is never offered as if the set-up installed it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
SETUP = README.split("## On a fresh machine", 1)[1].split("\n## ", 1)[0]
COMMANDS = ("bash scripts/demo.sh", "bash scripts/test.sh")


def test_the_two_setup_commands_are_there_verbatim():
    for cmd in COMMANDS:
        assert f"```bash\n{cmd}\n```" in SETUP, cmd
    ci = (ROOT / ".ci" / "run").read_text()
    assert COMMANDS[1] in ci.splitlines()  # CI runs the README's test command as written


def test_the_first_lines_after_the_setup_say_how_to_reach_runner():
    after = SETUP.split(f"{COMMANDS[1]}\n```", 1)[1].strip()
    first = after.split("\n\n", 1)[0]
    assert ".venv" in first and "`source .venv/bin/activate`" in first, first
    assert "`.venv/bin/runner" in first, first


def test_just_is_not_offered_as_part_of_the_setup():
    recipes = set(re.findall(r"^([\w-]+):", (ROOT / "Justfile").read_text(), re.M))
    paragraphs = [p for p in README.split("\n\n") if re.search(r"`just [\w-]+`", p)]
    for p in paragraphs:
        assert "does not install" in p or "not installed" in p, p
        for name in re.findall(r"`just ([\w-]+)`", p):
            assert name in recipes, name
