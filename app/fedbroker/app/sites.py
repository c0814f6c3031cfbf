"""`fedbroker sites list | show | logs`: the operator's view of every site that ever registered at the coordinator:
what it runs and holds, when it was last heard, its DP policy and the ε recorded for it, its jobs, its own history
and the warnings and errors it forwarded (docs/cli.md, "Seeing the sites").

Tables by default, JSON with `--json` (`logs` prints one JSON object per record, so `--follow` can be piped). Every
text a site sent is printed through `fedbroker.printable`, so a site cannot write escape codes to the operator's
terminal; JSON escapes them by itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections.abc import Callable
from typing import Any

from fedbroker.app.jobs import as_dict, client
from fedbroker.app.status import DASH, table
from fedbroker.printable import printable

FOLLOW_POLL_S = 1.0
MAX_CELL = 60  # a site's text in a table cell (`show` and `--json` give it whole)


def _when(unix: float) -> str:
    return datetime.datetime.fromtimestamp(unix, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S") if unix else DASH


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago" if seconds < 172800 else f"{seconds / 86400:.0f}d ago"


def dp_text(site: Any) -> str:
    """A site's DP policy in one cell."""
    if not site.dp_enabled:
        return "off"
    p = site.dp_policy
    ddp = f", distributed DP share{f', floor ε {p.local_floor_epsilon:g}' if p.local_floor_epsilon else ''}" \
        if p.mode == "distributed" else ""   # local (or a site from before dp.mode): the whole dose itself
    return f"σ {p.noise_multiplier:g}, clip {p.max_grad_norm:g}, δ {p.delta:g}, budget {p.epsilon_budget:g}{ddp}"


def data_text(site: Any) -> str:
    """A site's data, as its registration described it (never the data)."""
    shape = "×".join(str(d) for d in site.input_shape) or "?"
    return f"{site.num_samples} × [{shape}], {site.num_classes or '?'} classes"


def list_table(reply: Any) -> str:
    """`sites list`: a row per site."""
    rows = [[printable(s.worker_id), printable(s.software_version) or DASH, "yes" if s.active else "no",
             _ago(s.last_seen_seconds_ago), s.state or DASH, printable(",".join(s.categories), limit=MAX_CELL),
             data_text(s), dp_text(s), f"{s.epsilon_recorded:.3f}", f"{s.current_jobs}/{s.past_jobs}",
             s.log_records, printable(s.last_error, limit=MAX_CELL) or DASH] for s in reply.sites]
    return table(["site", "version", "active", "last heartbeat", "state", "categories", "data", "DP",
                  "ε recorded", "jobs now/past", "warnings", "last error"], rows)


def show_text(reply: Any) -> str:
    """`sites show NAME`: the site's facts, its jobs and its history."""
    s = reply.site
    facts = [("site", s.worker_id), ("software version", s.software_version or "not reported"),
             ("active", "yes" if s.active else "no"),
             ("last heartbeat", f"{_when(s.last_heartbeat_unix)} UTC ({_ago(s.last_seen_seconds_ago)})"),
             ("state", s.state or DASH), ("first registered", f"{_when(s.first_registered_unix)} UTC"),
             ("restarts", str(s.restarts)), ("broker user", s.broker_user or DASH),
             ("categories", ", ".join(s.categories)), ("data", data_text(s)), ("device", s.device),
             ("DP", dp_text(s)), ("ε recorded", f"{s.epsilon_recorded:.6g}"),
             ("warnings forwarded", str(s.log_records)),
             ("last error", f"{s.last_error} ({_when(s.last_error_unix)} UTC)" if s.last_error else DASH)]
    width = max(len(k) for k, _ in facts)
    parts = ["\n".join(f"{k.ljust(width)}  {printable(v)}" for k, v in facts), "", "JOBS", table(
        ["job", "status", "ε", "rounds", "shared"],
        [[printable(j.job_id), j.status, f"{j.epsilon:.3f}" if j.epsilon else DASH, j.rounds,
          printable(",".join(j.shared)) or DASH] for j in reply.jobs])]
    parts += ["", "EVENTS (the newest kept, oldest first)", table(
        ["time (UTC)", "event", "count", "message"],
        [[_when(e.time_unix), printable(e.kind), e.count if e.count > 1 else "", printable(e.message)]
         for e in reply.events])]
    return "\n".join(parts)


def log_line(r: Any) -> str:
    """One forwarded record on one line: when the coordinator got it, its level, logger and text; who sent it
    when it named another site; how many were dropped before it."""
    notes = []
    if r.claimed:
        notes.append(f"[sent by broker user {printable(r.sender)!r}, naming {printable(r.claimed)!r}]")
    if r.dropped_before:
        notes.append(f"[{r.dropped_before} dropped before]")
    return " ".join([_when(r.received_unix), f"{printable(r.level):<8}", printable(r.logger) + ":",
                     printable(r.message), *notes])


def cmd_list(args: argparse.Namespace) -> int:
    """`sites list`: every site that ever registered."""
    with client(args) as c:
        reply = c.list_sites()
    print(json.dumps([as_dict(s) for s in reply.sites], indent=2) if args.json else list_table(reply))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """`sites show NAME`: one site (an unknown name exits 1 with the sites there are)."""
    with client(args) as c:
        reply = c.site_detail(args.site)
    print(json.dumps(as_dict(reply), indent=2) if args.json else show_text(reply))
    return 0


def follow_logs(c: Any, site: str, *, follow: bool, limit: int, sleep: Callable[[float], None] = time.sleep) -> Any:
    """The site's newest `limit` records, then (with `follow`) each new one as it arrives, until interrupted."""
    after = 0
    first = True
    while True:
        records = c.site_logs(site, after=after, limit=limit if first else 0).records
        first = False
        for r in records:
            after = max(after, r.seq)
            yield r
        if not follow:
            return
        if not records:
            sleep(FOLLOW_POLL_S)


def cmd_logs(args: argparse.Namespace) -> int:
    """`sites logs NAME [--follow]`: the warnings and errors the site forwarded, one line (or JSON object) each."""
    with client(args) as c:
        try:
            for r in follow_logs(c, args.site, follow=args.follow, limit=args.limit):
                print(json.dumps({**as_dict(r), "site": args.site}) if args.json else log_line(r), flush=True)
        except KeyboardInterrupt:
            return 130
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`fedbroker sites ...` under the main parser's subcommands."""
    sites = sub.add_parser("sites", help="every site: version, last heartbeat, data, DP, ε, jobs, events, logs")
    verbs = sites.add_subparsers(dest="verb", required=True)

    def verb(name: str, fn: Callable[[argparse.Namespace], int], help_text: str, *,
             site: bool = True) -> argparse.ArgumentParser:
        p = verbs.add_parser(name, help=help_text)
        if site:
            p.add_argument("site", metavar="NAME", help="the site's worker id")
        p.add_argument("--coordinator", help="host:port of the coordinator, or several comma-separated (a standby is passed over; default: coordinator.targets, else coordinator.target)")
        p.add_argument("--config", help="YAML config with the client section (token, CA) and coordinator.target")
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        p.set_defaults(run=fn)
        return p

    verb("list", cmd_list, "every site that ever registered, one row each", site=False)
    verb("show", cmd_show, "one site: its registration, DP policy, ε, jobs and its history")
    logs = verb("logs", cmd_logs, "the warnings and errors a site forwarded (newest last)")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing new records until Ctrl-C")
    logs.add_argument("--limit", type=_count, default=200, help="the newest this many first (default 200, "
                                                               "at most 1000)")


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"{value} is not in [1, 1000]")
    return value
