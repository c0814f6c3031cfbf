"""Experiment tracking with MLflow: a job's rounds (async: versions), ε and settings as one MLflow run.

The tracker sits on the data scientist's side and reads what `fedbroker jobs show --json` shows (the
coordinator's status and the job's events); nothing in the federation knows of it. One MLflow run per job id
(tag `fedbroker.job_id`), found again each time, so tracking a job twice logs nothing twice and a tracker
started late, or again after an interruption, logs only the points the run lacks.

MLflow is an optional extra (`pip install 'fedbroker[tracking]'`), imported here only, and only when tracking
is asked for. Its store is MLflow's own default (`MLFLOW_TRACKING_URI`, else the SQLite file `mlflow.db` in
the current folder) or the URI given: a `.db` path, `sqlite:///...`, a tracking server `http(s)://...`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import sqlite3
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import numpy as np

from fedbroker.app.replies import job_status, participant_status, round_status
from fedbroker.app.status import round_progress
from fedbroker.errors import ConfigError, FedbrokerError
from fedbroker.job.status import REFUSED_OR_FAILED, SENT, JobStatus, RoundStatus

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

EXTRA = "pip install 'fedbroker[tracking]' (or pip install -r requirements-tracking.txt)"
JOB_TAG = "fedbroker.job_id"
MODEL_DIGEST_TAG = "fedbroker.model.sha256"
SPEC_ARTIFACT = "job.json"
MAX_PARAM_CHARS = 6000      # MLflow refuses a longer param value
PARAMS_PER_BATCH = 100      # MLflow's limits on one log_batch call
METRICS_PER_BATCH = 1000
# A finished job's status → its MLflow run's (each also names the event that says the job ended).
ENDED = {JobStatus.COMPLETED: "FINISHED", JobStatus.FAILED: "FAILED", JobStatus.CANCELLED: "KILLED"}
# Events after which the job's status holds something new to log: a round closed, a round's sites' score
# settled, the job ended.
TRIGGERS = frozenset({"round_closed", "federated_score", "stopped_early", *ENDED})
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class TrackingError(FedbrokerError):
    """The MLflow store refused or could not be reached: exit 1, origin `tracking`."""

    reason = "tracking_failed"


@dataclass(frozen=True)
class Point:
    """One metric value at one step (the round; async: the global version), timed by the event that made it."""

    key: str
    step: int
    value: float
    timestamp_ms: int


def job_params(spec: dict[str, Any]) -> dict[str, str]:
    """The job's settings as MLflow params: one per leaf of the accepted spec, dotted (`training.lr`); strings
    as they are, anything else as JSON (a list, such as the model's layers, is one JSON value). A value over
    MLflow's limit becomes its digest; the whole spec is the run's `job.json` artifact."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        else:
            flat[prefix] = value if isinstance(value, str) else json.dumps(value)

    walk("", spec)
    for key, value in flat.items():
        if len(value) > MAX_PARAM_CHARS:
            flat[key] = f"sha256:{hashlib.sha256(value.encode()).hexdigest()} ({len(value)} chars, in {SPEC_ARTIFACT})"
    return flat


def round_points(doc: dict[str, Any], events: Iterable[dict[str, Any]]) -> list[Point]:
    """Every metric point `doc` (`jobs show --json`) holds for the job's closed rounds, each at the time of the
    event that recorded it: the round's own numbers once `round_closed` is among `events`, its sites' federated
    score once `federated_score` says it has settled (never a score that more reports would still move)."""
    closed_at: dict[int, float] = {}
    settled_at: dict[int, float] = {}
    for e in events:
        if e["kind"] == "round_closed":
            closed_at[e["round"]] = e["time_unix"]
        elif e["kind"] == "federated_score":
            settled_at[e["round"]] = e["time_unix"]
    asynchronous = doc.get("mode") == "async"
    central = bool(((doc.get("spec") or {}).get("evaluation") or {}).get("dataset"))
    points: list[Point] = []
    for r in doc["rounds"]:
        number = r["round"]
        if round_status(r) is not RoundStatus.CLOSED or number not in closed_at:
            continue
        step = r["model_version"] if asynchronous else number
        values: dict[str, float] = {
            "train_loss": r["mean_train_loss"], "participants": r["participants"], "uploaded": r["uploaded"],
            "aggregated": r["aggregated"], "seconds": r["seconds"],
            **_participants(doc["participants"], number)}
        if central:
            values.update(accuracy=r["accuracy"], loss=r["loss"])
        if asynchronous:
            values.update(versions=number, mean_staleness=r["mean_staleness"])
        else:
            values["model_version"] = r["model_version"]
        points += [Point(k, step, float(v), int(closed_at[number] * 1000)) for k, v in values.items()]
        if number in settled_at and r["federated_samples"]:
            federated = {"federated_accuracy": r["federated_accuracy"], "federated_loss": r["federated_loss"],
                         "federated_samples": r["federated_samples"], "evaluated_sites": r["evaluated_sites"]}
            points += [Point(k, step, float(v), int(settled_at[number] * 1000)) for k, v in federated.items()]
    return points


def _participants(rows: Iterable[dict[str, Any]], round_number: int) -> dict[str, float]:
    """A round's refusals and failures, and the ε its job had spent on each site that uploaded in it, kept by
    selection or not (the largest and the mean; none without DP)."""
    mine = [p for p in rows if p["round"] == round_number]
    out: dict[str, float] = {"refused_or_failed": sum(participant_status(p) in REFUSED_OR_FAILED for p in mine)}
    spent = [p["epsilon"] for p in mine if participant_status(p) in SENT and p["epsilon"] > 0]
    if spent:
        out.update(epsilon_max=max(spent), epsilon_mean=sum(spent) / len(spent))
    return out


def resolve_uri(uri: str | None) -> str | None:
    """A `--track` value as MLflow takes it: None (MLflow's own default), a URI as given, or a `.db` path as
    the SQLite file it names."""
    if not uri:
        return None
    if "://" in uri or uri.startswith(("sqlite:", "file:", "databricks")):
        return uri
    if uri.endswith(".db"):
        return f"sqlite:///{Path(uri).expanduser().resolve()}"
    raise ConfigError("--track", f"{uri!r} is neither a URI (sqlite:///runs/mlflow.db, http://host:5000) nor a path "
                                 f"to a SQLite file ending in .db")


def _mlflow() -> Any:
    """MLflow's client module, or a clear error naming the extra that installs it."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # a federation's client does not phone home
    try:
        import mlflow.tracking
    except ImportError:
        raise ConfigError("--track", f"MLflow is not installed: {EXTRA}") from None
    for name in ("mlflow", "alembic"):  # the store's first-use schema setup talks at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    return mlflow


class JobTracker:
    """One job's MLflow run, kept in step with the coordinator's view of the job by `sync`."""

    def __init__(self, client: MlflowClient, run_id: str, job_id: str, *, logged: dict[str, set[int]],
                 tags: dict[str, str], artifacts: set[str], params: dict[str, str]) -> None:
        self.client, self.run_id, self.job_id = client, run_id, job_id
        self.logged, self.tags, self.artifacts = logged, tags, artifacts
        self.params = params  # logged beside the job's settings (simulate's own options)
        self.events: list[Any] = []
        self.after = 0
        self.uri = str(client.tracking_uri)

    @classmethod
    def open(cls, uri: str | None, *, job: Any, experiment: str = "", params: dict[str, str] | None = None
             ) -> JobTracker:
        """The job's run, wherever the store holds it, else a new one in `experiment` (default: the job's name);
        `job` is its status row, `params` any settings to log beside the job's own."""
        if not _JOB_ID.fullmatch(job.job_id):
            raise ConfigError("job", f"{job.job_id!r} is not a job id")
        mlflow = _mlflow()
        resolved = resolve_uri(uri)
        name = experiment or job.name or job.job_id
        try:
            client = mlflow.tracking.MlflowClient(tracking_uri=resolved)
            every = [e.experiment_id for e in client.search_experiments()]
            runs = client.search_runs(every, filter_string=f"tags.`{JOB_TAG}` = '{job.job_id}'",
                                      max_results=1) if every else []
            if runs:
                run = runs[0]
                logged = {key: {m.step for m in client.get_metric_history(run.info.run_id, key)}
                          for key in run.data.metrics}
                artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
                return cls(client, run.info.run_id, job.job_id, logged=logged, tags=dict(run.data.tags),
                           artifacts=artifacts, params=params or {})
            found = client.get_experiment_by_name(name)
            experiment_id = found.experiment_id if found is not None else client.create_experiment(
                name, artifact_location=_artifacts_beside(str(client.tracking_uri)))
            run = client.create_run(experiment_id, start_time=int(job.created_unix * 1000) or None,
                                    run_name=job.job_id, tags={JOB_TAG: job.job_id})
        except mlflow.exceptions.MlflowException as exc:
            raise TrackingError(f"MLflow at {resolved or 'its default store'}: {exc.message}") from None
        return cls(client, run.info.run_id, job.job_id, logged={}, tags={JOB_TAG: job.job_id}, artifacts=set(),
                   params=params or {})

    def sync(self, coordinator: Any, *, force: bool = False) -> int:
        """Read the job's new events, and when one of them (or `force`) says there is more to log, its status;
        log what the run lacks. The number of metric points logged."""
        from fedbroker.app.jobs import as_dict, show_document

        new = list(coordinator.events(self.job_id, after=self.after))
        if new:
            self.after = new[-1].seq
            self.events += new
        if not force and not any(e.kind in TRIGGERS for e in new):
            return 0
        # the status after the events: a round whose close (or settled score) is among them is in it as recorded
        doc = show_document(coordinator.status(self.job_id), self.events)
        return self.log(doc, [as_dict(e) for e in self.events])

    def log(self, doc: dict[str, Any], events: Iterable[dict[str, Any]]) -> int:
        """Log the job's settings (once), its status tags, and every point of `round_points` the run lacks."""
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.exceptions import MlflowException

        fresh = [p for p in round_points(doc, events) if p.step not in self.logged.get(p.key, set())]
        tags = {"fedbroker.job_name": doc["name"], "fedbroker.category": doc["category"],
                "fedbroker.mode": doc["mode"] or "sync", "fedbroker.submitter": doc["submitter"],
                "fedbroker.status": doc["status"], "fedbroker.rounds_done": str(doc["rounds_done"]),
                "fedbroker.rounds_total": str(doc["rounds_total"]), "fedbroker.error": doc["error"]}
        tags = {k: v for k, v in tags.items() if self.tags.get(k) != v}
        try:
            if SPEC_ARTIFACT not in self.artifacts and doc.get("spec") is not None:
                everything = {**job_params(doc["spec"]), **self.params}
                for batch in _chunks(list(everything.items()), PARAMS_PER_BATCH):
                    self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in batch])
                self.client.log_text(self.run_id, json.dumps(doc["spec"], indent=2) + "\n", SPEC_ARTIFACT)
                self.artifacts.add(SPEC_ARTIFACT)
            if tags:
                self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
            for batch in _chunks(fresh, METRICS_PER_BATCH):
                self.client.log_batch(self.run_id, metrics=[Metric(p.key, p.value, p.timestamp_ms, p.step)
                                                            for p in batch])
        except MlflowException as exc:
            raise TrackingError(f"MLflow at {self.uri}: {exc.message}") from None
        self.tags.update(tags)
        for p in fresh:
            self.logged.setdefault(p.key, set()).add(p.step)
        return len(fresh)

    def finish(self, coordinator: Any) -> None:
        """Once the job has ended: its last global model as the run's `model/` artifact (the files `jobs
        download` writes, their digest a tag), and the run ended with the job's outcome."""
        (job,) = coordinator.status(self.job_id).jobs
        ended = job_status(job)
        if ended not in ENDED:
            return
        from mlflow.exceptions import MlflowException

        try:
            if job.rounds_done and MODEL_DIGEST_TAG not in self.tags:
                self._log_model(coordinator, job.spec_json)
            self.client.set_terminated(self.run_id, status=ENDED[ended],
                                       end_time=int(job.updated_unix * 1000) or None)
        except MlflowException as exc:
            raise TrackingError(f"MLflow at {self.uri}: {exc.message}") from None

    def _log_model(self, coordinator: Any, spec_json: str) -> None:
        from fedbroker.app.jobs import MODEL_FILE, write_model

        header, tensors = coordinator.download(self.job_id, 0)
        with tempfile.TemporaryDirectory(prefix="fedbroker-track-") as folder:
            write_model(Path(folder), header, tensors, spec_json)
            self.client.log_artifacts(self.run_id, folder, "model")
        tags = {"fedbroker.model.round": str(header.round), "fedbroker.model.version": str(header.version),
                "fedbroker.model.file": f"model/{MODEL_FILE}", MODEL_DIGEST_TAG: weights_digest(tensors)}
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, value)
        self.tags.update(tags)


def weights_digest(tensors: Mapping[str, Any]) -> str:
    """sha256 of a model's weights, the same from the download and from any file they were saved in (a
    safetensors file's own bytes vary with its header's order): each tensor by name, its dtype, shape and
    bytes, in name order."""
    sha = hashlib.sha256()
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        sha.update(json.dumps([name, array.dtype.str, list(array.shape)]).encode())
        sha.update(array.tobytes())
    return sha.hexdigest()


def _artifacts_beside(tracking_uri: str) -> str | None:
    """A local SQLite store's artifacts in `mlartifacts/` beside its file (else the store's own default)."""
    if tracking_uri.startswith("sqlite:///") and tracking_uri != "sqlite:///:memory:":
        return str(Path(tracking_uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts")
    return None


def _chunks(items: list[Any], size: int) -> Iterable[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def track(coordinator: Any, tracker: JobTracker, *, follow: bool,
          on_event: Callable[[Any], None] | None = None) -> int:
    """Log the job into its run; with `follow`, as its rounds close, until it ends (then its model). The number
    of points logged."""
    from fedbroker.app.jobs import follow_events

    logged = tracker.sync(coordinator, force=True)
    if follow:
        for event in follow_events(coordinator, tracker.job_id, follow=True):
            if on_event is not None:
                on_event(event)
            if event.kind in TRIGGERS:
                logged += tracker.sync(coordinator)
        logged += tracker.sync(coordinator, force=True)
    tracker.finish(coordinator)
    return logged


def check_store(track: str | None, *, experiment: str = "") -> None:
    """Refuse `--track` now, before a job is submitted or a cluster started, if MLflow is missing or its store
    cannot be opened; None: no tracking asked for (then no `--experiment` either). The store is looked at first
    without MLflow (a SQLite file that cannot be one, a server that does not answer within `PROBE_S`): MLflow
    itself retries such a store for minutes. Its own first call then runs under `CHECK_S`."""
    if track is None:
        if experiment:
            raise ConfigError("--experiment", "names the MLflow experiment of --track: give --track too")
        return
    mlflow = _mlflow()
    resolved = resolve_uri(track)
    if resolved is None:
        resolved = os.environ.get("MLFLOW_TRACKING_URI") or None
    if resolved is not None:
        _check_reachable(resolved)
    where = resolved or "its default store"

    def first_call() -> None:
        mlflow.tracking.MlflowClient(tracking_uri=resolved).search_experiments(max_results=1)

    try:
        _within(CHECK_S, first_call, what=f"MLflow at {where}")
    except mlflow.exceptions.MlflowException as exc:
        raise TrackingError(f"MLflow at {where}: {exc.message}") from None
    except TrackingError:
        raise
    except Exception as exc:  # a store's own error (SQLAlchemy, an HTTP library): one line, not a traceback
        raise TrackingError(f"MLflow at {where}: {type(exc).__name__}: {_first_line(exc)}") from None


PROBE_S = 5.0    # a tracking server's TCP and HTTP answer, before the job is sent
CHECK_S = 30.0   # MLflow's first call on the store (a new SQLite file runs its migrations: seconds)


def _check_reachable(uri: str) -> None:
    """A SQLite store's file can be one (ConfigError naming the path); a tracking server answers HTTP within
    `PROBE_S` (TrackingError). Any other scheme is left to MLflow."""
    scheme, _, rest = uri.partition(":")
    if scheme == "sqlite":
        path = rest.removeprefix("///").split("?", 1)[0]
        if path and path != ":memory:" and rest.startswith("///"):
            _check_sqlite_file(Path(path))
    elif scheme in ("http", "https"):
        _probe_server(uri)


def _check_sqlite_file(path: Path) -> None:
    """`path` is a SQLite file MLflow can open and write, or a new one it can create."""
    shown = _shown(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        st = None
    except OSError as exc:  # a name too long, a folder on the way that is a file, no permission
        raise ConfigError("--track", f"the SQLite store {shown} cannot be used: {exc.strerror}") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise ConfigError("--track", f"the SQLite store {shown} is a folder, not a file: name a file in it, e.g. "
                                     f"{path / 'mlflow.db'}")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise ConfigError("--track", f"the SQLite store {shown} is not a regular file (a device, a pipe or a "
                                     f"socket): name a file")
    if st is None and not path.parent.is_dir():
        raise ConfigError("--track", f"the SQLite store {shown} cannot be created: its folder {_shown(path.parent)} "
                                     f"does not exist")
    try:  # SQLite's own limits (its path length, a read-only folder, a file that is not a database)
        db = sqlite3.connect(f"file:{quote(str(path))}?mode={'rw' if st is not None else 'rwc'}", uri=True,
                             timeout=PROBE_S)
        try:
            db.execute("PRAGMA schema_version").fetchone()
            db.execute("BEGIN IMMEDIATE")
            db.execute("ROLLBACK")
        finally:
            db.close()
    except sqlite3.Error as exc:
        if st is None:
            path.unlink(missing_ok=True)
        raise ConfigError("--track", f"the SQLite store {shown} cannot be opened for writing: {exc} (a path "
                                     f"too long for SQLite, a folder this user cannot write, a file that is no "
                                     f"database)") from None


def _shown(path: Path) -> str:
    """A path for a message: a long one cut in its middle, its length said."""
    text = str(path)
    return text if len(text) <= 120 else f"{text[:60]}…{text[-40:]} ({len(text)} chars)"


def _probe_server(uri: str) -> None:
    """One HTTP request to the tracking server's health endpoint: any HTTP answer will do (MLflow's own call
    then says what it thinks of it); no answer within `PROBE_S` is refused."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=PROBE_S):
            pass
    except urllib.error.HTTPError:
        pass  # it answered
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise TrackingError(f"MLflow at {uri} does not answer ({reason}; waited at most {PROBE_S:g}s): start the "
                            f"tracking server, or give another --track URI") from None


def _within(seconds: float, call: Callable[[], None], *, what: str) -> None:
    """`call()` in a daemon thread, its error raised here; TrackingError when it has not returned in `seconds`
    (MLflow's own retries may go on for minutes: the thread is left to them and dies with the process)."""
    failed: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # raised again in the caller's thread
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="mlflow-check", daemon=True).start()
    if not done.wait(seconds):
        raise TrackingError(f"{what} did not answer within {seconds:g}s: check the store (its file, its server)")
    if failed:
        raise failed[0]


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


def start(track: str | None, coordinator: Any, job_id: str, *, experiment: str = "",
          params: dict[str, str] | None = None) -> JobTracker | None:
    """The submitted job's tracker when `--track` was given (its settings logged at once), else None."""
    if track is None:
        return None
    (job,) = coordinator.status(job_id).jobs
    tracker = JobTracker.open(track or None, job=job, experiment=experiment, params=params)
    tracker.sync(coordinator, force=True)
    return tracker


def end(tracker: JobTracker | None, coordinator: Any) -> None:
    """Log what the job's end added, its model, and end the run (nothing without a tracker)."""
    if tracker is not None:
        tracker.sync(coordinator, force=True)
        tracker.finish(coordinator)


def add_track_arguments(parser: argparse.ArgumentParser, *, what: str) -> None:
    """`--track [URI]` and `--experiment NAME`, as submit, simulate and demo take them."""
    parser.add_argument("--track", nargs="?", const="", default=None, metavar="URI",
                        help=f"log {what}'s rounds (async: versions), ε and settings to MLflow: the URI's store "
                             f"(sqlite:///file.db, a .db path, http://server:5000), else MLFLOW_TRACKING_URI, else "
                             f"./mlflow.db. Needs the tracking extra. Put it last, or write --track=URI")
    parser.add_argument("--experiment", default="", help="with --track: the MLflow experiment (default: the job's name)")


def cmd_track(args: argparse.Namespace) -> int:
    """`jobs track ID`: log the job into its MLflow run (what the run lacks); with --follow, until the job ends."""
    from fedbroker.app.jobs import client

    check_store(args.uri or "")
    with client(args) as c:
        try:
            (job,) = c.status(args.job_id).jobs
            tracker = JobTracker.open(args.uri or None, job=job, experiment=args.experiment)
            logged = track(c, tracker, follow=args.follow)
            reply = c.status(args.job_id)
        except KeyboardInterrupt:
            return 130
    (job,) = reply.jobs
    steps = max((max(s) for s in tracker.logged.values() if s), default=0)
    if args.json:
        print(json.dumps({"job_id": job.job_id, "status": job.status, "run_id": tracker.run_id,
                          "tracking_uri": tracker.uri, "logged": logged, "last_step": steps}))
    else:
        print(f"job {job.job_id} ({job.status}, {round_progress(job, reply.rounds)}): {logged} new point(s), "
              f"{'versions' if job.mode == 'async' else 'rounds'} up to {steps} in MLflow run {tracker.run_id} "
              f"at {tracker.uri}")
    return 0


def add_jobs_track(verb: Callable[..., argparse.ArgumentParser]) -> None:
    """`fedbroker jobs track ID`, added with `jobs`' own verb maker (fedbroker.app.jobs.add_parser)."""
    tracked = verb("track", cmd_track, "log the job's rounds, ε and settings to MLflow (one run per job; run it "
                                       "again safely: it logs only what the run lacks)")
    tracked.add_argument("--uri", default="", help="the MLflow store: sqlite:///file.db, a .db path, http://server:5000 "
                                                   "(default: MLFLOW_TRACKING_URI, else ./mlflow.db)")
    tracked.add_argument("--experiment", default="", help="the MLflow experiment (default: the job's name)")
    tracked.add_argument("--follow", "-f", action="store_true", help="keep logging as rounds close, until the job ends")
