"""What the coordinator learns about its sites beyond their registration rows, for the operator (`fedbroker
sites`): each site's history (store_sites.py) written as the control queue hears of it, the warnings and errors
sites forward (`SiteLogIntake`), and the sites whose heartbeats stopped (`SiteWatch`).

A site log is filed under the site its sender's broker user speaks for (`SenderBinding.site_for`), never under
the worker id the message names: a site cannot put lines into another site's log. Each site's records are
rate-limited here too (a token bucket per site, whatever the site's own limit says), and kept bounded by the
store, so a hostile site can neither flood the disk nor crowd the others out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from fedbroker.coordinator import metrics
from fedbroker.coordinator.control import SenderBinding
from fedbroker.coordinator.records import WorkerRecord
from fedbroker.coordinator.store import StateStore
from fedbroker.proto import fedbroker_pb2 as pb

log = logging.getLogger(__name__)

LOG_BURST = 30             # a site's log records taken at once ...
LOG_PER_S = 0.5            # ... and after that, this many a second (30 a minute)
MAX_BUCKETS = 10_000       # rate-limit state kept at most (one per registered site that forwarded a record)
WATCH_MIN_S, WATCH_MAX_S = 1.0, 15.0  # how often SiteWatch looks for silent sites


class TokenBuckets:
    """A token bucket per key: `take(key)` is True while the key has a token left (`burst` at first, `per_s` more
    each second). `clock`: monotonic seconds (a test's own)."""

    def __init__(self, *, burst: float, per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.burst, self.per_s, self._clock = burst, per_s, clock
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # key → (tokens, at)

    def take(self, key: str) -> bool:
        """Spend one of the key's tokens; False when it has none."""
        now = self._clock()
        with self._lock:
            if len(self._buckets) >= MAX_BUCKETS and key not in self._buckets:
                self._buckets.clear()  # a bound, never reached by a real federation: everyone starts full again
            tokens, at = self._buckets.get(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.per_s)
            if tokens < 1.0:
                self._buckets[key] = (tokens, now)
                return False
            self._buckets[key] = (tokens - 1.0, now)
            return True


class SiteLogIntake:
    """Files the site logs of the control queue (after `control.check_control`); `receive` says what became of one."""

    def __init__(self, store: StateStore, senders: SenderBinding, *, buckets: TokenBuckets | None = None) -> None:
        self.store = store
        self.senders = senders
        self.buckets = buckets or TokenBuckets(burst=LOG_BURST, per_s=LOG_PER_S)
        self._lock = threading.Lock()
        self._dropped: dict[str, int] = {}  # records refused by the rate limit since the site's last kept one

    def receive(self, record: pb.SiteLog, sender: str | None) -> str:
        """Keep the record under its sender's site; the outcome (a SITE_LOG_OUTCOMES value), counted."""
        outcome = self._receive(record, sender)
        metrics.SITE_LOG_RECORDS.labels(outcome).inc()
        return outcome

    def _receive(self, record: pb.SiteLog, sender: str | None) -> str:
        site = self.senders.site_for(sender, record.worker_id)
        if site is None:
            log.warning("a site log from broker user %r claiming worker %r dropped: that user speaks for no site "
                        "(or for several, not that one)", (sender or "")[:140], record.worker_id)
            return "foreign_sender"
        if self.store.recorded_epsilon(site) is None:  # a registered site only: an unknown id takes no room
            return "unknown_site"
        if not self.buckets.take(site):
            with self._lock:
                self._dropped[site] = self._dropped.get(site, 0) + 1
            return "rate_limited"
        with self._lock:
            dropped = self._dropped.pop(site, 0)
        claimed = record.worker_id if record.worker_id != site else ""
        self.store.add_site_log(site, sender=sender or "", claimed=claimed, site_time=record.time_unix,
                                level=record.level, logger=record.logger, message=record.message,
                                dropped_before=min(record.dropped_before + dropped, 2**31 - 1))
        if claimed:
            log.warning("broker user %r sent a log record naming worker %r: filed under %r, the site it speaks for",
                        (sender or "")[:140], claimed, site)
            self.store.note_site_event(site, "misnamed_log", f"it sent a log record naming worker {claimed!r}: "
                                                             f"filed under this site (its broker user's)")
            return "misattributed"
        return "stored"


class SiteWatch:
    """A thread that writes an `expired` event for each site whose heartbeats stopped (store.mark_silent), every
    `heartbeat_timeout_s / 4` seconds (within [1, 15]). Its first look is a heartbeat timeout after it starts: a
    coordinator that was down heard nobody meanwhile, and its sites get the time to beat before any is silent."""

    def __init__(self, store: StateStore, *, heartbeat_timeout_s: float) -> None:
        self.store = store
        self.timeout_s = heartbeat_timeout_s
        self.every_s = min(WATCH_MAX_S, max(WATCH_MIN_S, heartbeat_timeout_s / 4))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Look a heartbeat timeout from now, then every `every_s` seconds until `stop`."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="site-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop looking (waits for a look in progress)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def look(self) -> list[str]:
        """One look: the sites marked silent now (a store outage is logged, and the next look tries again)."""
        try:
            silent = self.store.mark_silent(timeout_s=self.timeout_s)
        except Exception as exc:  # the thread must outlive a store outage
            log.warning("could not look for silent sites: %s", exc)
            return []
        for worker_id in silent:
            log.warning("site %s: no heartbeat for over %gs", worker_id, self.timeout_s)
        return silent

    def _run(self) -> None:
        self._stop.wait(self.timeout_s)
        while not self._stop.is_set():
            self.look()
            self._stop.wait(self.every_s)


def note_revoked(store: StateStore, senders: SenderBinding) -> list[str]:
    """At start: every registered site that no broker user may speak for any more (removed from
    coordinator.worker_broker_users) gets a `revoked` event; their ids. Nothing when senders are not checked.
    While the coordinator runs, a site the followed map stops binding gets one as the change is seen."""
    provisioned = senders.provisioned()
    if not senders.enabled:
        return []
    revoked = [w.worker_id for w in store.workers() if w.worker_id not in provisioned]
    _note(store, revoked)

    def unbound(worker_ids: list[str]) -> None:
        _note(store, [w.worker_id for w in store.workers() if w.worker_id in worker_ids])

    senders.on_unbound = unbound
    return revoked


def _note(store: StateStore, worker_ids: list[str]) -> None:
    for worker_id in worker_ids:
        store.note_site_event(worker_id, "revoked", "no broker user may speak for it any more (not in "
                                                    "coordinator.worker_broker_users): its messages are refused")
        log.warning("site %s is registered but no broker user may speak for it any more: revoked", worker_id)


def registration_summary(r: pb.Registration) -> str:
    """What a registration says the site holds, in one line (its first event)."""
    dp = (f"DP σ {r.dp_policy.noise_multiplier:g}, clip {r.dp_policy.max_grad_norm:g}, δ {r.dp_policy.delta:g}, "
          f"ε budget {r.dp_policy.epsilon_budget:g}") if r.dp_enabled else "no DP"
    return (f"categories {', '.join(r.categories)}; {r.num_samples} samples of shape {list(r.input_shape)}, "
            f"{r.num_classes} classes, {r.evaluation_samples} held out for evaluation; {dp}; device {r.device}")


def registration_changes(old: WorkerRecord | None, r: pb.Registration) -> list[str]:
    """What a registration changes of the site's stored one (none for a first registration)."""
    if old is None:
        return []
    out: list[str] = []
    pairs: Sequence[tuple[str, object, object]] = (
        ("categories", list(old.categories), list(r.categories)),
        ("samples", old.num_samples, r.num_samples),
        ("held-out samples", old.evaluation_samples, r.evaluation_samples),
        ("sample shape", list(old.input_shape), list(r.input_shape)),
        ("classes", old.num_classes, r.num_classes),
        ("device", old.device, r.device),
        ("DP", old.dp.enabled, r.dp_enabled),
    )
    out += [f"{name} {before} → {after}" for name, before, after in pairs if before != after]
    if old.dp.enabled and r.dp_enabled:
        p = r.dp_policy
        before_p = (old.dp.noise_multiplier, old.dp.max_grad_norm, old.dp.delta, old.dp.epsilon_budget)
        after_p = (p.noise_multiplier, p.max_grad_norm, p.delta, p.epsilon_budget)
        if before_p != after_p:
            out.append(f"DP policy (σ, clip, δ, budget) {before_p} → {after_p}")
    return out
