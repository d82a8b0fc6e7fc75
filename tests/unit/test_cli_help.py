"""`kvsvc --help` and every subcommand's: each flag has help text and says its default, each
subcommand shows examples, and every example parses."""

from __future__ import annotations

import argparse
import shlex

import pytest

from kvsvc.cli.main import build_parser


def subparsers() -> dict[str, argparse.ArgumentParser]:
    ap = build_parser()
    action = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


SUBCOMMANDS = sorted(subparsers())


def test_the_subcommands_are_all_here():
    assert SUBCOMMANDS == ["bench", "demo", "engines", "health", "info", "leases", "serve"]


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_flag_has_help_and_its_default(name):
    parser = subparsers()[name]
    text = parser.format_help()
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        assert action.help, (name, action.dest)
        if isinstance(action, (argparse._StoreTrueAction, argparse._CountAction)) or action.default is argparse.SUPPRESS:
            continue  # off unless given
        shown = parser._get_formatter()._get_help_string(action) % {"default": action.default}
        assert "default" in shown or action.required, (name, action.dest, shown)
        assert shown.split("(default")[0].strip()[:20] in " ".join(text.split()), (name, action.dest)


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_subcommand_shows_examples_that_parse(name):
    text = subparsers()[name].format_help()
    assert "examples:" in text, name
    examples = [line.strip() for line in text.split("examples:", 1)[1].splitlines() if line.strip()]
    assert examples
    for example in examples:
        argv = shlex.split(example)
        assert argv[:2] == ["kvsvc", name] or argv[0] == "kvsvc", example
        args = build_parser().parse_args(argv[1:])
        assert args.cmd == name, example


def test_global_flags_work_after_the_subcommand_too():
    before = build_parser().parse_args(["-v", "--log-format", "json", "info"])
    after = build_parser().parse_args(["info", "-v", "--log-format", "json"])
    assert (before.verbose, before.log_format) == (after.verbose, after.log_format) == (1, "json")


@pytest.mark.parametrize("name", ["info", "health", "leases"])
def test_the_inspection_commands_speak_tls(name):
    args = build_parser().parse_args([name, "h:1", "--ca", "a", "--cert", "b", "--key", "c", "--server-name", "e"])
    assert (args.ca, args.cert, args.key, args.server_name) == ("a", "b", "c", "e")
