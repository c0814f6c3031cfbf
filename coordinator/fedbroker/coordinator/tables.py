"""PROVISIONAL (helper storemix): the tables the share, evaluation, site and site-DP mixins read and write, as
SQLAlchemy Core `Table` objects with the names and columns of the SQL tables they mirror. Helper "store" owns
this module; its version replaces this one on merge."""

from __future__ import annotations

from sqlalchemy import Column, Float, Integer, MetaData, PrimaryKeyConstraint, Table, Text

metadata = MetaData()

jobs = Table(
    "jobs", metadata,
    Column("job_id", Text, primary_key=True), Column("name", Text, nullable=False),
    Column("spec_json", Text, nullable=False), Column("status", Text, nullable=False),
    Column("rounds_total", Integer, nullable=False), Column("rounds_done", Integer, nullable=False, default=0),
    Column("model_spec_json", Text, nullable=False), Column("error", Text, nullable=False, default=""),
    Column("created", Float, nullable=False), Column("updated", Float, nullable=False),
    Column("submitter", Text, nullable=False, default=""),
)
workers = Table(
    "workers", metadata,
    Column("worker_id", Text, primary_key=True), Column("last_seen", Float, nullable=False),
)
events = Table(
    "events", metadata,
    Column("seq", Integer, primary_key=True, autoincrement=True), Column("job_id", Text, nullable=False),
    Column("time", Float, nullable=False), Column("kind", Text, nullable=False),
    Column("round", Integer, nullable=False, default=0), Column("worker_id", Text, nullable=False, default=""),
    Column("message", Text, nullable=False, default=""),
)
share_phases = Table(
    "share_phases", metadata,
    Column("job_id", Text, primary_key=True), Column("status", Text, nullable=False),
    Column("histogram", Integer, nullable=False), Column("statistics", Integer, nullable=False),
    Column("lower_json", Text, nullable=False), Column("upper_json", Text, nullable=False),
    Column("features", Integer, nullable=False), Column("classes", Integer, nullable=False),
    Column("started", Float, nullable=False), Column("deadline", Float, nullable=False),
    Column("finished", Float), Column("model_spec_json", Text, nullable=False, server_default=""),
)
shares = Table(
    "shares", metadata,
    Column("job_id", Text, nullable=False), Column("worker_id", Text, nullable=False),
    Column("status", Text, nullable=False), Column("reason", Text, nullable=False, server_default=""),
    Column("time", Float), Column("histogram_json", Text, nullable=False, server_default="[]"),
    Column("histogram_noised", Integer, nullable=False, server_default="0"),
    Column("histogram_epsilon", Float, nullable=False, server_default="0"),
    Column("feature_sum_json", Text, nullable=False, server_default="[]"),
    Column("feature_sq_sum_json", Text, nullable=False, server_default="[]"),
    Column("count", Integer, nullable=False, server_default="0"),
    Column("statistics_noised", Integer, nullable=False, server_default="0"),
    Column("statistics_epsilon", Float, nullable=False, server_default="0"),
    Column("statistics_delta", Float, nullable=False, server_default="0"),
    Column("charged_epsilon", Float, nullable=False, server_default="0"),
    PrimaryKeyConstraint("job_id", "worker_id"),
)
evaluation_rounds = Table(
    "evaluation_rounds", metadata,
    Column("job_id", Text, nullable=False), Column("round", Integer, nullable=False),
    Column("model_version", Integer, nullable=False), Column("published", Float, nullable=False),
    Column("deadline", Float, nullable=False), Column("settled", Integer, nullable=False, server_default="0"),
    Column("task", Text, nullable=False, server_default=""),
    PrimaryKeyConstraint("job_id", "round"),
)
evaluations = Table(
    "evaluations", metadata,
    Column("job_id", Text, nullable=False), Column("round", Integer, nullable=False),
    Column("worker_id", Text, nullable=False), Column("status", Text, nullable=False),
    Column("reason", Text, nullable=False, server_default=""), Column("loss", Float), Column("accuracy", Float),
    Column("num_samples", Integer), Column("model_version", Integer, nullable=False), Column("time", Float),
    Column("sums", Text),
    PrimaryKeyConstraint("job_id", "round", "worker_id"),
)
site_info = Table(
    "site_info", metadata,
    Column("worker_id", Text, primary_key=True), Column("software_version", Text, nullable=False, server_default=""),
    Column("first_registered", Float, nullable=False), Column("started", Float, nullable=False, server_default="0"),
    Column("restarts", Integer, nullable=False, server_default="0"),
    Column("broker_user", Text, nullable=False, server_default=""),
    Column("silent", Float, nullable=False, server_default="0"),
    Column("last_error", Text, nullable=False, server_default=""), Column("last_error_time", Float),
    Column("log_records", Integer, nullable=False, server_default="0"),
)
site_events = Table(
    "site_events", metadata,
    Column("seq", Integer, primary_key=True, autoincrement=True), Column("worker_id", Text, nullable=False),
    Column("time", Float, nullable=False), Column("kind", Text, nullable=False),
    Column("message", Text, nullable=False, server_default=""),
    Column("count", Integer, nullable=False, server_default="1"), Column("first_time", Float, nullable=False),
)
site_logs = Table(
    "site_logs", metadata,
    Column("seq", Integer, primary_key=True, autoincrement=True), Column("worker_id", Text, nullable=False),
    Column("received", Float, nullable=False), Column("site_time", Float, nullable=False),
    Column("level", Text, nullable=False), Column("logger", Text, nullable=False),
    Column("message", Text, nullable=False), Column("sender", Text, nullable=False, server_default=""),
    Column("claimed", Text, nullable=False, server_default=""),
    Column("dropped_before", Integer, nullable=False, server_default="0"),
)
site_dp_rounds = Table(
    "site_dp_rounds", metadata,
    Column("job_id", Text, nullable=False), Column("round", Integer, nullable=False),
    Column("asked", Integer, nullable=False), Column("registered", Integer, nullable=False),
    Column("noise_multiplier", Float, nullable=False), Column("time", Float, nullable=False),
    PrimaryKeyConstraint("job_id", "round"),
)
site_dp_epsilon = Table(
    "site_dp_epsilon", metadata,
    Column("job_id", Text, primary_key=True), Column("epsilon", Float, nullable=False),
    Column("delta", Float, nullable=False), Column("rounds", Integer, nullable=False),
    Column("time", Float, nullable=False),
)
