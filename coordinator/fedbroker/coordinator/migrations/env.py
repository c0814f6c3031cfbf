"""Alembic's environment for the coordinator's state: the store passes its open write transaction's connection
(`config.attributes["connection"]`) and the migrations run inside it, so they commit with the version they record.
Without one (a developer's `alembic -x url=... upgrade head`), it connects to `-x url=...` itself."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from fedbroker.coordinator.tables import METADATA


def _run(connection: object) -> None:
    context.configure(connection=connection, target_metadata=METADATA, render_as_batch=True)  # type: ignore[arg-type]
    with context.begin_transaction():  # inside the store's transaction: no new one
        context.run_migrations()


def run() -> None:
    """The store's connection when it gave one, else `-x url=...` (a developer's upgrade by hand)."""
    given = context.config.attributes.get("connection")
    if given is not None:
        _run(given)
        return
    url = context.get_x_argument(as_dictionary=True).get("url")
    if not url:
        raise SystemExit("the coordinator's migrations run when a store opens; by hand, pass -x url=<database URL>")
    if context.is_offline_mode():
        context.configure(url=url, target_metadata=METADATA, literal_binds=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    with create_engine(url).begin() as connection:
        _run(connection)


run()
