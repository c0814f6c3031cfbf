"""`fedbroker --help`: every registered verb, grouped by who uses it, with the exit-code convention.

The listing is built from the parser's own subcommands after they are all registered, so a new verb shows up
by itself (under "more" until it is given a group); tests/app/test_cli_conventions.py compares it with the registry.
"""

from __future__ import annotations

import argparse
import textwrap

DESCRIPTION = "fedbroker: federated learning over RabbitMQ, with differential privacy at every site."
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("try it on this machine", ("demo", "new", "simulate", "audit")),
    ("submit and follow jobs", ("submit", "status", "jobs", "models")),
    ("run a federation", ("provision", "token", "aggregator", "coordinator", "worker", "teardown")),
    ("operate", ("workers", "sites", "ledger", "backup", "restore", "broker")),
)
EXIT_CODES = ("exit codes: 0 ok, 1 refused by a service (or the job failed), 2 usage or local validation; an error is "
              "one line on stderr, `fedbroker VERB: ORIGIN: message` (ORIGIN: usage, config, file, coordinator, "
              "broker, job, state, tracking or system).")


def commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> dict[str, str]:
    """Every registered verb and its one-line help, in registration order."""
    helps = {action.dest: action.help or "" for action in sub._choices_actions}
    return {name: helps.get(name, "") for name in sub.choices}


def listing(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> str:
    """The epilog of `fedbroker --help`: each group's verbs with their help, then the exit codes."""
    verbs = commands(sub)
    grouped = [(title, [n for n in names if n in verbs]) for title, names in GROUPS]
    placed = {n for _, names in grouped for n in names}
    grouped.append(("more", [n for n in verbs if n not in placed]))
    width = max(map(len, verbs), default=0)
    lines = ["commands (`fedbroker COMMAND --help` for each one's options):"]
    for title, names in grouped:
        if names:
            lines.append(f"  {title}")
            lines += [f"    {name.ljust(width)}  {verbs[name]}" for name in names]
    return "\n".join([*lines, "", *textwrap.wrap(EXIT_CODES, 100)])


def finish(parser: argparse.ArgumentParser, sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Give the top-level parser its listing (call once every verb is registered)."""
    parser.description = DESCRIPTION
    parser.epilog = listing(sub)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
