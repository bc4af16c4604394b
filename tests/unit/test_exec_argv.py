"""`thinvm exec NAME -- ARGV`: the guest runs exactly ARGV, word for word."""

import subprocess

import pytest

from thinvm.cli import parse_args
from thinvm.errors import GuestError
from thinvm.guest.agent import shell_line

# argv that a space-joining CLI mangled, and what they must print.
CASES = [
    (["echo", "two  spaces"], "two  spaces\n"),
    (["echo", "it's", '"quoted"'], 'it\'s "quoted"\n'),
    (["echo", "$HOME", "`id`", "$(id)"], "$HOME `id` $(id)\n"),
    (["echo", "a>b", "c|d", "e;f", "&"], "a>b c|d e;f &\n"),
    (["printf", "%s|", "", "*", "--"], "|*|--|"),
    (["sh", "-c", "echo out; echo err >&2 2>/dev/null; echo $((1+2))"], "out\n3\n"),
]


@pytest.mark.parametrize(("argv", "expected"), CASES)
def test_shell_line_runs_argv_intact(argv: list[str], expected: str) -> None:
    # The agent runs `/bin/sh -c LINE`: do the same on the host.
    done = subprocess.run(
        ["/bin/sh", "-c", shell_line(argv)], capture_output=True, text=True, check=True
    )
    assert done.stdout == expected


def test_an_empty_command_says_what_to_do() -> None:
    with pytest.raises(GuestError, match="give one after '--'"):
        shell_line([])


@pytest.mark.parametrize(
    ("argv", "name", "command", "timeout"),
    [
        (
            ["exec", "vm", "--", "sh", "-c", "dd 2>/dev/null"],
            "vm",
            ["sh", "-c", "dd 2>/dev/null"],
            300,
        ),
        # A `--` inside the guest's argv is the guest's (argparse would drop it).
        (["exec", "vm", "--", "sh", "--", "x"], "vm", ["sh", "--", "x"], 300),
        # Options of thinvm before the `--`, and the guest's after it.
        (["exec", "vm", "--timeout", "5", "--", "ls", "--timeout"], "vm", ["ls", "--timeout"], 5),
        (["exec", "--timeout", "5", "vm", "echo", "hi"], "vm", ["echo", "hi"], 5),
        (["fleet", "exec", "vm", "--", "a", "--", "b c"], "vm", ["a", "--", "b c"], None),
    ],
)
def test_cli_keeps_everything_after_double_dash(
    argv: list[str], name: str, command: list[str], timeout: float | None
) -> None:
    args = parse_args(argv)
    assert (args.name, args.command) == (name, command)
    assert getattr(args, "timeout", None) == timeout


def test_other_commands_parse_as_before() -> None:
    args = parse_args(["balloon", "--", "vm", "1G"])
    assert (args.name, args.size) == ("vm", "1G")
