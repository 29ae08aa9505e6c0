"""The command line: every flag of every subcommand has its help line, `tilepilot --help` shows
worked examples, and bad flag values are one line and exit status 2 before anything runs."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from tilepilot import cli

ROOT = Path(__file__).resolve().parent.parent


def subcommands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_flag_has_help() -> None:
    parsers = subcommands()
    assert {"pilot", "gate", "tune", "image", "submit", "status", "merge"} <= set(parsers)
    missing = [
        f"{name} {a.option_strings or a.dest}"
        for name, p in [("tilepilot", cli._parser()), *parsers.items()]
        for a in p._actions
        if not a.help or a.help == argparse.SUPPRESS
    ]
    assert missing == []
    pilot = {o for a in parsers["pilot"]._actions for o in a.option_strings}
    assert {"--compile-only", "--allow-unpinned", "--trials", "--device", "--no-publish"} <= pilot


def test_help_shows_three_worked_examples() -> None:
    r = subprocess.run([sys.executable, "-m", "tilepilot", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0
    examples = r.stdout.split("examples:", 1)[1]
    commands = [x.strip() for x in examples.splitlines() if x.strip().startswith("tilepilot ")]
    assert len(commands) == 3 and any("--compile-only" in c for c in commands), examples
    # Each example parses as it is written.
    for c in commands:
        cli._parser().parse_args(c.replace("'gemm/tiny-16/*'", "gemm/tiny-16/*").split()[1:])


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["pilot", "--device", "sm90", "--trials", "0"], "--trials"),
        (["pilot", "--device", "sm90", "--trials", "-3"], "--trials"),
        (["pilot", "--device", "sm90", "--workers", "0"], "--workers"),
        (["tune", "--device", "sm90", "--budget-s", "0"], "--budget-s"),
    ],
)
def test_bad_numbers_are_one_line(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1 and f"argument {flag}" in err, err


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["pilot", "--device", "sm90", "--host", "--cases", "gemm/no-such-shape/*"], "matches no case"),
        (["pilot", "--device", "sm90", "--cases", "nope"], "matches no case"),  # container mode: before the image
        (
            ["tune", "--device", "sm90", "--cases", "gemm/tiny-16/*"],
            "matches no representative gemm/attention/decode/swiglu case",
        ),
    ],
)
def test_a_pattern_that_selects_nothing_stops_first(
    argv: list[str], want: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and want in err and "--cases" in err, err
