"""The synchronous round loop: select → open at the aggregator → publish tasks → wait for quorum or deadline
→ close → checkpoint, evaluate, record → ask the sites to score it (federated.py; the next round does not wait).

Faults (deploy/RELIABILITY.md): a round is recorded in the store before it is opened anywhere, so a
restarted coordinator resumes the open round with the same participants and deadline instead of starting
it over; a service that lost the job (restarted without its spool) gets the global model and the open round
again, and the round's tasks are re-sent; publishing retries through a broker outage until the round's
deadline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NoReturn, TypeVar

import grpc

from fedbroker.bus import envelope
from fedbroker.close_report import SelectionRecord, Verdict, judged, names_json, to_json
from fedbroker.coordinator import federated, metrics, secure_reopen
from fedbroker.coordinator.checkpoints import save_checkpoint
from fedbroker.coordinator.job_context import JobContext
from fedbroker.coordinator.job_run import JobFailed, OpenRound, Run, Stopped
from fedbroker.coordinator.participants import sample_participants
from fedbroker.coordinator.records import RoundRecord
from fedbroker.coordinator.secure_reopen import RoundLost
from fedbroker.coordinator.store_rounds import Discarded
from fedbroker.coordinator.store_site_dp import account_round
from fedbroker.coordinator.waiting import unaffordable
from fedbroker.errors import BusError, Rejection
from fedbroker.job.status import ParticipantStatus, RoundStatus
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc.plumbing import RemoteError
from fedbroker.secagg.ddp_record import from_stats, has_record
from fedbroker.secagg.groups import MIN_GROUPS, fewest_uploads
from fedbroker.secagg.secure_round import needed_uploads, threshold_note

log = logging.getLogger(__name__)
T = TypeVar("T")

# A participant that answered its task without an upload: the round does not wait for it.
_ANSWERED = (ParticipantStatus.REFUSED, ParticipantStatus.FAILED)


class SyncRounds:
    """Drives one synchronous job's rounds, in the job's thread."""

    def __init__(self, ctx: JobContext, run: Run) -> None:
        self.ctx = ctx
        self.run = run

    def drive(self, first_round: int) -> None:
        """Install the global model the job is at, then run its rounds from `first_round` to the last."""
        run, job_id = self.run, self.run.job_id
        # Idempotent at the service: after our own restart it keeps the job's settings, the open round, its uploads.
        self._call("install the job", lambda: self.ctx.aggregator.install_job(run.settings))
        self._call("install the global model",
                   lambda: self.ctx.aggregator.put_global(job_id, run.version, run.spec_json, run.tensors))
        run.reopened = secure_reopen.reopened(self.ctx.store, job_id)  # after our restart too
        round_number = first_round
        while round_number <= run.last_round:
            if self.ctx.stop.is_set():
                raise Stopped
            self.ctx.halt_if_cancelled()
            row = self.ctx.store.round(job_id, round_number)
            if row is not None and row.status == RoundStatus.ABANDONED:  # counted in run.reopened: never reused
                round_number += 1
                continue
            if round_number > 1 and federated.stopped_early(self.ctx, run):  # evaluation.patience
                break
            try:
                self._round(round_number)
            except Stopped:
                raise
            except RoundLost as lost:
                self._reopen(lost)
            except Exception:
                metrics.ROUNDS_FAILED.labels(job_id).inc()
                metrics.ROUND_OPEN.labels(job_id).set(0)
                raise
            round_number += 1
        federated.await_last(self.ctx, run)  # the final federated score is in before the job completes

    # ----- one round -----

    def _round(self, round_number: int) -> None:
        job_id = self.run.job_id
        row = self.ctx.store.round(job_id, round_number)
        if row is not None and row.status == RoundStatus.OPEN:
            rnd, reply = self._resume_round(row)
        else:
            rnd, reply = self._new_round(round_number), None
        metrics.ROUNDS_STARTED.labels(job_id).inc()
        metrics.ROUND.labels(job_id).set(round_number)
        metrics.ROUND_OPEN.labels(job_id).set(1)
        metrics.ROUND_DEADLINE.labels(job_id).set(rnd.deadline)
        metrics.ROUND_PARTICIPANTS.labels(job_id).set(len(rnd.participants))
        if reply is None:
            self._publish_tasks(rnd)
            accepted = self._wait_for_quorum(rnd)
            if self.ctx.stop.is_set():
                raise Stopped  # the round stays open in the store: a restarted coordinator resumes it
            self.ctx.halt_if_cancelled()
            self._count_stragglers(rnd, accepted)
            lost = self._lost_hint(rnd, accepted)  # then the close's answer says whether the service lost it
            if len(accepted) < self._fewest(rnd) and not lost:
                self._fail_round(rnd, accepted)
            # Idempotent at the service: a retry after a lost reply gets the same result back.
            try:
                reply = self._call(f"close round {round_number}",
                                   lambda: self.ctx.aggregator.close_round(job_id, round_number))
            except RemoteError as exc:
                if exc.reason != Rejection.SECURE_PROTOCOL:
                    raise
                if secure_reopen.is_lost(str(exc)):
                    raise RoundLost(rnd, str(exc)) from None
                if len(accepted) < self._fewest(rnd):  # a hint that was not a loss: the short round fails as ever
                    self._fail_round(rnd, accepted)
                self._fail_secure_round(rnd, str(exc))
        self._finish_round(rnd, reply)

    def _count_stragglers(self, rnd: OpenRound, accepted: list[str]) -> None:
        stragglers = len(set(rnd.participants) - set(accepted) - self._answered(rnd.number))
        if stragglers:
            metrics.STRAGGLERS.labels(self.run.job_id).inc(stragglers)

    def _fail_round(self, rnd: OpenRound, accepted: list[str]) -> None:
        """Too few uploads by the deadline: the round is recorded failed, and so is the job, naming each
        participant's part. The round is abandoned at the service first, so its waiting workers are answered
        at once."""
        job_id, store = self.run.job_id, self.ctx.store
        store.fail_round(job_id, rnd.number, time.time() - rnd.started, discarded=self._abandon(rnd))
        reasons = "; ".join(f"{p.worker_id}: {p.status}{' (' + p.reason + ')' if p.reason else ''}"
                            for p in store.participants(job_id, rnd.number))
        raise JobFailed(f"round {rnd.number}: {len(accepted)} upload(s), schedule.min_clients is "
                        f"{self.run.job.schedule.min_clients}"
                        f"{'; ' + threshold_note(len(rnd.participants)) if self.run.job.aggregation.secure else ''}"
                        f" [{reasons}]")

    def _fail_secure_round(self, rnd: OpenRound, why: str) -> NoReturn:
        """The service could not unmask the secure round (too few valid unmask shares, a site's cheat proven):
        abandoned there, recorded failed with the service's reason (which names any site it excluded)."""
        self.ctx.store.fail_round(self.run.job_id, rnd.number, time.time() - rnd.started, why=why,
                                  discarded=self._abandon(rnd))
        raise JobFailed(f"round {rnd.number}: {why}")

    def _lost_hint(self, rnd: OpenRound, accepted: list[str], *, reports: bool = True) -> bool:
        """A secure round the service may have lost (secure_reopen.lost_hint); never a plain round."""
        return self.run.job.aggregation.secure and secure_reopen.lost_hint(
            self.ctx.store, self.run.job_id, rnd.number, accepted, reports=reports)

    def _reopen(self, lost: RoundLost) -> None:
        """The service lost the secure round: abandon it there and here (its participants' reported ε kept),
        and let the loop open the next round number from the same global version; past the bound the job
        fails naming the cause (secure_reopen.py)."""
        run, rnd = self.run, lost.round
        metrics.ROUND_OPEN.labels(run.job_id).set(0)
        if run.reopened >= secure_reopen.MAX_SECURE_REOPENS:
            metrics.ROUNDS_FAILED.labels(run.job_id).inc()
            self._fail_secure_round(rnd, secure_reopen.exhausted(rnd, lost.why, run.reopened))
        discarded = self._abandon(rnd)
        self.ctx.store.abandon_round(run.job_id, rnd.number, time.time() - rnd.started, discarded=discarded,
                                     why=f"{lost.why}; re-opened as round {rnd.number + 1} from version {run.version}")
        run.reopened += 1
        run.round = None
        log.warning("round %d of %s was lost at the aggregation service; re-opening it as round %d (%d of at most "
                    "%d re-opens)", rnd.number, run.job_id, rnd.number + 1, run.reopened,
                    secure_reopen.MAX_SECURE_REOPENS)

    def _abandon(self, rnd: OpenRound) -> Discarded:
        """Drop a failed round at the service (never closed: no version comes of it); its secure session then
        answers every waiting worker at once. The uploads it dropped, each with the ε its worker spent on it: the
        store keeps them with the round's end (no later round may close to bring that ε). Best effort: the
        round's deadline ends it anyway (then the workers' own reports are what reaches the record)."""
        job_id = self.run.job_id
        try:
            dropped = self._call(f"abandon round {rnd.number}",
                                 lambda: self.ctx.aggregator.abandon_round(job_id, rnd.number), reinstall=False)
        except RemoteError as exc:
            log.warning("failed round %d of %s could not be abandoned at the aggregation service: %s", rnd.number,
                        job_id, exc)
            return []
        return [(u.worker_id, u.num_samples, u.epsilon, u.train_loss) for u in dropped]

    def _fewest(self, rnd: OpenRound) -> int:
        """The fewest uploads the round may close with: min_clients, and for a secure round at least its
        threshold t (fewer masked inputs cannot be unmasked: fedbroker.secagg.secure_round); grouped, the
        smallest groups' thresholds the close needs (fedbroker.secagg.groups); with privacy.distributed its
        quorum (fewer would carry less noise than promised: the service refuses them)."""
        job = self.run.job
        fewest = job.schedule.min_clients
        if job.privacy.distributed.enabled:
            fewest = max(fewest, job.privacy.distributed.quorum)
        if not job.aggregation.secure:
            return fewest
        n, g = len(rnd.participants), job.aggregation.secure_group_size
        return max(fewest, fewest_uploads(n, g) if g and n >= g * MIN_GROUPS else needed_uploads(n))

    def _new_round(self, round_number: int) -> OpenRound:
        run, job = self.run, self.run.job
        participants = self._select(round_number)  # may wait for workers that can afford it
        started = time.time()
        rnd = OpenRound(round_number, participants, started, started + job.schedule.round_timeout_s,
                        self._histograms(participants))
        # Recorded before the service hears of it: a coordinator that dies from here on resumes this round.
        self.ctx.store.open_round(run.job_id, round_number, participants, deadline=rnd.deadline, started=started)
        run.round = rnd
        self._open_at_aggregator(rnd)
        return rnd

    def _histograms(self, participants: list[str]) -> dict[str, list[int]]:
        return self.ctx.histograms(self.run.job_id, participants)  # what they shared with this job

    def _resume_round(self, row: RoundRecord) -> tuple[OpenRound, pb.CloseRoundReply | None]:
        """The round that was open when this coordinator stopped: same participants, same deadline."""
        run, job, round_number = self.run, self.run.job, row.round
        job_id = run.job_id
        participants = [p.worker_id for p in self.ctx.store.participants(job_id, round_number)]
        deadline = row.deadline if row.deadline is not None else row.started + job.schedule.round_timeout_s
        rnd = OpenRound(round_number, participants, row.started, deadline, self._histograms(participants),
                        resumed=True)
        log.info("resuming round %d of %s (%d participant(s), deadline in %.0fs)", round_number, job_id,
                 len(participants), deadline - time.time())
        try:
            accepted, is_open = self._call(f"status of round {round_number}",
                                           lambda: self.ctx.aggregator.status(job_id, round_number))
        except RemoteError as exc:
            if exc.reason != Rejection.UNKNOWN_ROUND:
                raise
            accepted, is_open = [], True  # we died before opening it there: opened below
        if not is_open:
            # Either the service closed it before we died (the close is idempotent: we get its result back),
            # or it never heard of it (we died before opening it there): then it is opened below.
            try:
                reply = self._call(f"close round {round_number}",
                                   lambda: self.ctx.aggregator.close_round(job_id, round_number), reinstall=False)
                log.info("round %d of %s had been closed by the aggregation service; recording it", round_number,
                         job_id)
                run.round = rnd
                return rnd, reply
            except RemoteError as exc:
                if exc.code != grpc.StatusCode.NOT_FOUND:
                    raise
        if time.time() >= deadline and len(accepted) < job.schedule.min_clients:
            rnd.deadline = time.time() + job.schedule.round_timeout_s  # it expired while we were away
            self.ctx.store.set_round_deadline(job_id, round_number, rnd.deadline)
            log.info("round %d of %s expired while the coordinator was down; deadline moved %.0fs ahead",
                     round_number, job_id, job.schedule.round_timeout_s)
        run.round = rnd
        self._open_at_aggregator(rnd)
        return rnd, None

    def _select(self, round_number: int) -> list[str]:
        """The round's participants, drawn among the active workers that can afford it (by their heartbeats'
        budgets and costs: participants.why_unaffordable). Fewer than min_clients of them: no round is opened,
        so no worker spends ε on a round that would fail; the job waits up to wait_for_workers_s (a worker
        may register), then fails naming each worker's reason; at once when too few sites could ever afford it
        (spent ε never comes back: `fail_if_out_of_budget`). While it waits,
        the job says why (JobRow.waiting, and a `waiting` event when the reason changes)."""
        job_id, job = self.run.job_id, self.run.job

        def reason(why: dict[str, str]) -> str:
            return unaffordable(why, what=f"round {round_number}", category=job.category,
                                rule=f"schedule.min_clients is {job.schedule.min_clients}")

        def affordability() -> tuple[bool, dict[str, str]]:
            why = self.ctx.why_unaffordable(job_id, job)
            self.ctx.fail_if_out_of_budget(job_id, job, needed=job.schedule.min_clients, what=f"round {round_number}")
            done = sum(not r for r in why.values()) >= job.schedule.min_clients
            if not done:
                self.ctx.waiting.note(job_id, reason(why), round_number=round_number)
            return done, why

        done, why = self.ctx.poll(affordability, within_s=job.schedule.wait_for_workers_s)
        if not done:
            raise JobFailed(f"round {round_number} not opened: {reason(why)}; no worker trained (no ε spent)")
        self.ctx.waiting.clear(job_id)
        able = [w for w, r in why.items() if not r]
        return sample_participants(able, job.schedule.clients_per_round, seed=job.seed, round_number=round_number)

    def _open_at_aggregator(self, rnd: OpenRound, *, reinstall: bool = True) -> None:
        job_id = self.run.job_id
        # what each participant registered bounds the sample count its upload may claim (its FedAvg weight)
        members = set(rnd.participants)
        registered = {w.worker_id: w.num_samples for w in self.ctx.store.workers() if w.worker_id in members}
        rnd.model_version = self._call(f"open round {rnd.number}", lambda: self.ctx.aggregator.open_round(
            job_id, rnd.number, rnd.participants, rnd.deadline, seed=self.run.job.seed,
            histograms=rnd.histograms, num_samples=registered), reinstall=reinstall)

    def _answered(self, round_number: int) -> set[str]:
        return {p.worker_id for p in self.ctx.store.participants(self.run.job_id, round_number)
                if p.status in _ANSWERED}

    def _publish_tasks(self, rnd: OpenRound, *, only_missing: bool | None = None) -> None:
        """One task per participant; a resumed round re-sends the tasks of participants with no upload yet
        (we may have died halfway through publishing; a worker that already has the task handles the copy
        idempotently: it acks it without training once its update is accepted)."""
        job_id, job = self.run.job_id, self.run.job
        if time.time() >= rnd.deadline:  # a resumed round past its deadline: closes with what it has
            rnd.published = True
            return
        task = pb.RoundTask(
            job_id=job_id, round=rnd.number, category=job.category, model_version=rnd.model_version,
            aggregator_target=self.ctx.aggregator_target, deadline_unix=rnd.deadline,
            population_distribution=self.ctx.population(job_id), participants=len(rnd.participants), seed=job.seed)
        recipients = list(rnd.participants)
        if rnd.resumed if only_missing is None else only_missing:
            accepted, _ = self._call(f"status of round {rnd.number}",
                                     lambda: self.ctx.aggregator.status(job_id, rnd.number))
            done = set(accepted) | self._answered(rnd.number)
            recipients = [w for w in recipients if w not in done]
        recorded = self.ctx.recorded_epsilon()

        def body_for(worker_id: str) -> bytes:
            task.recorded_epsilon_spent = recorded.get(worker_id, 0.0)
            self.run.task_settings(task, worker_id)
            return envelope.encode(round_task=task)

        sent = self.ctx.publish_tasks([(worker_id, body_for(worker_id)) for worker_id in recipients], rnd.deadline,
                                      training=job.training, job_id=self.run.job_id)
        self.run.settings_sent |= sent
        rnd.published = True
        log.info("round %d of %s published to %d worker(s)", rnd.number, job_id, len(sent))

    def _wait_for_quorum(self, rnd: OpenRound) -> list[str]:
        job_id, round_number = self.run.job_id, rnd.number
        quorum = max(self.run.job.schedule.quorum or len(rnd.participants), self._fewest(rnd))
        accepted: list[str] = []
        while not self.ctx.stop.is_set():
            accepted, _ = self._call(f"status of round {round_number}",
                                     lambda: self.ctx.aggregator.status(job_id, round_number))
            self.ctx.store.set_uploaded(job_id, round_number, accepted)
            if len(accepted) >= quorum or self._lost_hint(rnd, accepted, reports=False):
                break
            answered = self._answered(round_number)
            if len(set(accepted) | answered) >= len(rnd.participants) or time.time() >= rnd.deadline:
                break
            self._await_round_event(round_number, rnd.deadline, enough=quorum,
                                    everyone=len(rnd.participants) - len(answered))
            self.ctx.halt_if_cancelled()  # before the close: a cancelled job's round is abandoned, not closed
        return accepted

    def _await_round_event(self, round_number: int, deadline: float, *, enough: int, everyone: int) -> None:
        """Until the service's events say the round has `enough` uploads (or `everyone` who can still
        upload has), a worker's refusal comes in, the deadline (a one-shot timer) or the safety poll."""
        job_id, events = self.run.job_id, self.ctx.events
        until = min(deadline, time.time() + self.ctx.safety_poll_s)
        while not self.ctx.stop.is_set():
            left = until - time.time()
            if left <= 0 or not events.wait(job_id, left):
                return
            snapshot = events.latest(job_id)
            if snapshot is None or snapshot.round != round_number or not snapshot.open:
                return  # a poke (a refusal), or the round is no longer the one we wait on
            if snapshot.accepted >= min(enough, everyone):
                return

    def _finish_round(self, rnd: OpenRound, reply: pb.CloseRoundReply) -> None:
        """The closed round's version: downloaded, checkpointed, evaluated, then recorded with the round in
        one transaction (a resume starts after it); a RoundCompleted event tells whoever listens."""
        run, job_id, round_number = self.run, self.run.job_id, rnd.number
        new_version, new_spec_json, tensors = self._call(
            f"download global model {reply.model_version}",
            lambda: self.ctx.aggregator.download(job_id, reply.model_version), reinstall=False)
        checkpoint = save_checkpoint(self.ctx.checkpoint_dir, job_id, round_number, tensors, new_spec_json)
        scores = self.ctx.evaluator(run.job, new_spec_json, tensors) if self.ctx.evaluator else None
        accuracy, loss = scores if scores else (None, None)
        seconds = time.time() - rnd.started
        verdicts = judged([Verdict.from_proto(v) for v in reply.verdicts])
        # privacy.site: accounted before the close is recorded, so a resume records the round again (same key)
        account_round(self.ctx.store, job_id, run.job, round_number=round_number, participants=rnd.participants)
        self.ctx.store.close_round(
            job_id, round_number, model_version=new_version, aggregated=list(reply.aggregated),
            updates=[(u.worker_id, u.num_samples, u.epsilon, u.train_loss) for u in reply.updates],
            accuracy=accuracy, loss=loss, seconds=seconds, checkpoint=checkpoint, stats=dict(reply.stats),
            model_spec_json=new_spec_json,
            reasons={v.worker_id: f"{v.rule} {v.judgement} its update ({v.ratio:.0%} of its share)" for v in verdicts},
        )
        run.version, run.spec_json, run.tensors, run.round = new_version, new_spec_json, tensors, None
        selection = SelectionRecord.from_proto(reply.selection)
        if selection.chosen < selection.accepted or selection.method == "ga":
            # which updates went in, and whether the GA or a random draw chose them: the face words it (`jobs logs`)
            self.ctx.store.note_event(job_id, "selection", to_json(selection), round_number=round_number)
        if verdicts:  # which updates the robust rule discarded or down-weighted (`jobs logs`, `jobs show`)
            log.info("round %d of %s: %s %s", round_number, job_id, verdicts[0].rule,
                     ", ".join(f"{v.judgement} {v.worker_id}" for v in verdicts))
            self.ctx.store.note_event(job_id, "robust", to_json(verdicts), round_number=round_number)
        if reply.excluded:  # the sites a secure round excluded, by name: the face words it (`jobs logs`, `jobs show`)
            log.warning("round %d of %s: secure aggregation excluded %s", round_number, job_id,
                        ", ".join(reply.excluded))
            self.ctx.store.note_event(job_id, "secure", names_json(reply.excluded), round_number=round_number)
        if has_record(reply.stats):  # a distributed-DP round's noise, survivors and ring: `jobs show`, `jobs logs`
            self.ctx.store.note_event(job_id, "ddp", from_stats(reply.stats).to_json(), round_number=round_number)
        metrics.ROUNDS_COMPLETED.labels(job_id).inc()
        metrics.ROUND_DURATION.observe(seconds)
        metrics.ROUND_OPEN.labels(job_id).set(0)
        metrics.ROUND_AGGREGATED.labels(job_id).set(len(reply.aggregated))
        if accuracy is not None and loss is not None:
            metrics.MODEL_ACCURACY.labels(job_id).set(accuracy)
            metrics.MODEL_LOSS.labels(job_id).set(loss)
        try:  # a notification: the store is the truth, so a broker outage must not fail the job here
            self.ctx.bus.publish_event(envelope.encode(round_completed=pb.RoundCompleted(
                job_id=job_id, round=round_number, model_version=new_version, aggregated=len(reply.aggregated),
                accuracy=accuracy or 0.0, loss=loss or 0.0, final=round_number == run.last_round,
                seconds=seconds,
            )))
        except BusError as exc:
            log.warning("RoundCompleted event of round %d of %s not published: %s", round_number, job_id, exc)
        log.info("round %d of %s closed: %d aggregated, accuracy %s, %.1fs", round_number, job_id,
                 len(reply.aggregated), f"{accuracy:.4f}" if accuracy is not None else "n/a", seconds)
        federated.after_round(self.ctx, run, round_number, new_version, rnd.participants)  # the sites score it

    # ----- the aggregation service's outages -----

    def _call(self, what: str, fn: Callable[[], T], *, reinstall: bool = True) -> T:
        """`fn()` through the service's outages (service_calls.py). `reinstall`: a service that lost the job
        (restarted without its spool) gets it back (`_reinstall`) and the call is repeated."""
        return self.ctx.calls.call(self.run.job_id, what, fn, on_lost_job=self._reinstall if reinstall else None)

    def _reinstall(self, why: str) -> None:
        """Install the global model and the open round again, re-send the round's tasks (the uploads it had
        accepted are gone; their workers acked their tasks) and give the round a fresh deadline."""
        run, job_id = self.run, self.run.job_id
        log.warning("the aggregation service lost job %s (%s): installing global model %d again%s", job_id, why,
                    run.version, f" and re-opening round {run.round.number}" if run.round else "")
        self._call("reinstall the job", lambda: self.ctx.aggregator.install_job(run.settings), reinstall=False)
        self._call("reinstall the global model",
                   lambda: self.ctx.aggregator.put_global(job_id, run.version, run.spec_json, run.tensors),
                   reinstall=False)
        rnd = run.round
        if rnd is None:
            return
        rnd.deadline = max(rnd.deadline, time.time() + run.job.schedule.round_timeout_s)
        self.ctx.store.set_round_deadline(job_id, rnd.number, rnd.deadline)
        self.ctx.store.reset_uploads(job_id, rnd.number)
        self._open_at_aggregator(rnd, reinstall=False)
        if rnd.published:  # else the round's own publishing comes next
            self._publish_tasks(rnd, only_missing=True)
