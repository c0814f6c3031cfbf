"""Schema version 4, the first under Alembic: every table of the coordinator's state, and the catch-up of any file
an earlier release wrote.

The releases before Alembic versioned their SQLite file with `PRAGMA user_version` (0: before versions, then 1-3),
and created some tables and columns only on first use, so a file of theirs may lack any table or column added
since the oldest layout. This revision creates each table that is missing and, in a table that exists, adds each
column and index it lacks (every such column is nullable or has a default, as the old steps added them): a new
database gets the whole schema, an old file exactly what it lacks, its rows kept. That is what the old
hand-written steps did, one table at a time; they are replaced by this one step.

The tables are a frozen copy of `fedbroker.coordinator.tables` as of this revision: a later change to a table is a
new revision, never an edit here (tests/coordinator/test_store_schema.py checks the head matches tables.py).

Revision ID: 0004
Revises:
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import BigInteger, Column, Float, Identity, Index, Integer, MetaData, String, Table, Text, inspect

revision = "0004"
down_revision = None
branch_labels = None
depends_on = None

METADATA = MetaData()

TIME = Float(53)           # seconds since the epoch, and every real number kept (ε, loss, accuracy)
COUNT = BigInteger()       # counts, rounds, versions: 64 bits on both engines
FLAG = Integer()           # 0/1, as every release before wrote it
# a log's sequence number: SQLite's rowid alias must be declared INTEGER; PostgreSQL gets a bigint identity
SEQ = BigInteger().with_variant(Integer(), "sqlite")


def _text(name: str, *, default: str | None = None, nullable: bool = False, key: bool = False) -> Column[str]:
    return Column(name, Text, primary_key=key, nullable=nullable,
                  server_default=None if default is None else default)


def _seq() -> Column[int]:
    return Column("seq", SEQ, Identity(), primary_key=True, autoincrement=True)


jobs = Table(
    "jobs", METADATA,
    _text("job_id", key=True), _text("name"), _text("spec_json"), _text("status"),
    Column("rounds_total", COUNT, nullable=False), Column("rounds_done", COUNT, nullable=False, server_default="0"),
    _text("model_spec_json"), _text("error", default=""),
    Column("created", TIME, nullable=False), Column("updated", TIME, nullable=False),
    _text("submitter", default=""),
)

workers = Table(
    "workers", METADATA,
    _text("worker_id", key=True), _text("categories_json"), _text("histogram_json"),
    Column("dp_enabled", FLAG, nullable=False), _text("dp_json"), Column("epsilon_spent", TIME, nullable=False),
    _text("device"), Column("num_samples", COUNT, nullable=False),
    Column("registered", TIME, nullable=False), Column("last_seen", TIME, nullable=False),
    _text("state", default="idle"), _text("input_shape_json", default="[]"),
    Column("num_classes", COUNT, nullable=False, server_default="0"),
    Column("evaluation_samples", COUNT, nullable=False, server_default="0"),
)

rounds = Table(
    "rounds", METADATA,
    _text("job_id", key=True), Column("round", COUNT, primary_key=True, autoincrement=False), _text("status"),
    Column("participants", COUNT, nullable=False), Column("uploaded", COUNT, nullable=False, server_default="0"),
    Column("aggregated", COUNT, nullable=False, server_default="0"),
    Column("accuracy", TIME), Column("loss", TIME), Column("mean_train_loss", TIME), Column("seconds", TIME),
    Column("model_version", COUNT), _text("checkpoint", nullable=True), _text("stats_json", default="{}"),
    Column("started", TIME, nullable=False), Column("closed", TIME), Column("deadline", TIME),
)

events = Table(
    "events", METADATA,
    _seq(), _text("job_id"), Column("time", TIME, nullable=False), _text("kind"),
    Column("round", COUNT, nullable=False, server_default="0"), _text("worker_id", default=""),
    _text("message", default=""),
    Index("events_by_job", "job_id", "seq"),
    sqlite_autoincrement=True,
)

participants = Table(
    "participants", METADATA,
    _text("job_id", key=True), Column("round", COUNT, primary_key=True, autoincrement=False),
    _text("worker_id", key=True), _text("status"), _text("reason", default=""),
    Column("epsilon", TIME), Column("train_loss", TIME), Column("num_samples", COUNT),
    Column("epsilon_local_floor", TIME),
)

issued_epsilon = Table(
    "issued_epsilon", METADATA,
    _text("worker_id"), Column("deadline", TIME, nullable=False), Column("cost", TIME, nullable=False),
    _text("job_id", default=""),
    Index("issued_epsilon_by_job", "worker_id", "job_id"),
)

epsilon_corrections = Table(
    "epsilon_corrections", METADATA,
    _seq(), _text("worker_id"), Column("time", TIME, nullable=False), _text("by"),
    Column("old", TIME, nullable=False), Column("new", TIME, nullable=False), _text("ledger_sha256"),
    Column("ledger_epsilon", TIME, nullable=False), _text("note", default=""),
    sqlite_autoincrement=True,
)

site_shares = Table(
    "site_shares", METADATA,
    _text("job_id", key=True), _text("worker_id", key=True), _text("what", key=True),
    Column("time", TIME, nullable=False),
)

share_phases = Table(
    "share_phases", METADATA,
    _text("job_id", key=True), _text("status"), Column("histogram", FLAG, nullable=False),
    Column("statistics", FLAG, nullable=False), _text("lower_json"), _text("upper_json"),
    Column("features", COUNT, nullable=False), Column("classes", COUNT, nullable=False),
    Column("started", TIME, nullable=False), Column("deadline", TIME, nullable=False), Column("finished", TIME),
    _text("model_spec_json", default=""),
)

shares = Table(
    "shares", METADATA,
    _text("job_id", key=True), _text("worker_id", key=True), _text("status"), _text("reason", default=""),
    Column("time", TIME), _text("histogram_json", default="[]"),
    Column("histogram_noised", FLAG, nullable=False, server_default="0"),
    Column("histogram_epsilon", TIME, nullable=False, server_default="0"),
    _text("feature_sum_json", default="[]"), _text("feature_sq_sum_json", default="[]"),
    Column("count", COUNT, nullable=False, server_default="0"),
    Column("statistics_noised", FLAG, nullable=False, server_default="0"),
    Column("statistics_epsilon", TIME, nullable=False, server_default="0"),
    Column("statistics_delta", TIME, nullable=False, server_default="0"),
    Column("charged_epsilon", TIME, nullable=False, server_default="0"),
    Index("shares_by_worker", "worker_id", "status"),
)

evaluation_rounds = Table(
    "evaluation_rounds", METADATA,
    _text("job_id", key=True), Column("round", COUNT, primary_key=True, autoincrement=False),
    Column("model_version", COUNT, nullable=False), Column("published", TIME, nullable=False),
    Column("deadline", TIME, nullable=False), Column("settled", FLAG, nullable=False, server_default="0"),
    _text("task", default=""),
)

evaluations = Table(
    "evaluations", METADATA,
    _text("job_id", key=True), Column("round", COUNT, primary_key=True, autoincrement=False),
    _text("worker_id", key=True), _text("status"), _text("reason", default=""),
    Column("loss", TIME), Column("accuracy", TIME), Column("num_samples", COUNT),
    Column("model_version", COUNT, nullable=False), Column("time", TIME), _text("sums", nullable=True),
)

site_info = Table(
    "site_info", METADATA,
    _text("worker_id", key=True), _text("software_version", default=""),
    Column("first_registered", TIME, nullable=False), Column("started", TIME, nullable=False, server_default="0"),
    Column("restarts", COUNT, nullable=False, server_default="0"), _text("broker_user", default=""),
    Column("silent", TIME, nullable=False, server_default="0"), _text("last_error", default=""),
    Column("last_error_time", TIME), Column("log_records", COUNT, nullable=False, server_default="0"),
)

site_events = Table(
    "site_events", METADATA,
    _seq(), _text("worker_id"), Column("time", TIME, nullable=False), _text("kind"), _text("message", default=""),
    Column("count", COUNT, nullable=False, server_default="1"), Column("first_time", TIME, nullable=False),
    Index("site_events_by_worker", "worker_id", "seq"),
    sqlite_autoincrement=True,
)

site_logs = Table(
    "site_logs", METADATA,
    _seq(), _text("worker_id"), Column("received", TIME, nullable=False), Column("site_time", TIME, nullable=False),
    _text("level"), _text("logger"), _text("message"), _text("sender", default=""), _text("claimed", default=""),
    Column("dropped_before", COUNT, nullable=False, server_default="0"),
    Index("site_logs_by_worker", "worker_id", "seq"),
    sqlite_autoincrement=True,
)

site_dp_rounds = Table(
    "site_dp_rounds", METADATA,
    _text("job_id", key=True), Column("round", COUNT, primary_key=True, autoincrement=False),
    Column("asked", COUNT, nullable=False), Column("registered", COUNT, nullable=False),
    Column("noise_multiplier", TIME, nullable=False), Column("time", TIME, nullable=False),
)

site_dp_epsilon = Table(
    "site_dp_epsilon", METADATA,
    _text("job_id", key=True), Column("epsilon", TIME, nullable=False), Column("delta", TIME, nullable=False),
    Column("rounds", COUNT, nullable=False), Column("time", TIME, nullable=False),
)

leases = Table(
    "leases", METADATA,
    Column("name", String(200), primary_key=True),
    Column("holder", String(200), nullable=False),
    Column("term", BigInteger, nullable=False),
    Column("expires", Float, nullable=False),
)


def upgrade() -> None:
    """Create what is missing: every table of a new database, the tables and columns an old file lacks."""
    bind = op.get_bind()
    found = inspect(bind)
    for table in METADATA.sorted_tables:
        if not found.has_table(table.name):
            table.create(bind)
            continue
        have = {c["name"] for c in found.get_columns(table.name)}
        for column in table.columns:
            if column.name not in have:
                op.add_column(table.name, column._copy())
        indexes = {i["name"] for i in found.get_indexes(table.name)}
        for index in table.indexes:
            if index.name not in indexes:
                index.create(bind)


def downgrade() -> None:
    """Refused: a downgrade would drop what a newer release recorded."""
    raise RuntimeError("the coordinator's state is never downgraded: restore a backup taken before the upgrade")
