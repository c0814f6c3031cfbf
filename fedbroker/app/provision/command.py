"""The `fedbroker provision` verb (registered by fedbroker.app.cli)."""

from __future__ import annotations

import argparse

from fedbroker.app.provision.kits import provision
from fedbroker.app.provision.project import load_project


def cmd_provision(args: argparse.Namespace) -> int:
    """Provision the project and say where each kit went, and which folder must stay with the operator."""
    project = load_project(args.project)
    kits = provision(project, args.out)
    print(f"provisioned {project.name} into {args.out}:")
    for who, folder in kits.items():
        print(f"  {who:<28} {folder}")
    print("hand each participant its own folder only; ca/ (the CA's key) stays with you")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`fedbroker provision project.yaml --out DIR` under the main parser's subcommands."""
    p = sub.add_parser("provision", help="write one kit per participant (server, sites, scientists) from project.yaml")
    p.add_argument("project", help="project.yaml: name, server (host, ports), sites, scientists")
    p.add_argument("--out", required=True, help="a new folder for the kits")
    p.set_defaults(run=cmd_provision)
