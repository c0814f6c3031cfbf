"""The coordinator's state migrations (Alembic): `env.py` and `versions/`, run by `store_schema.upgrade` when a
store opens, with no alembic.ini. Revision ids are the schema version numbers, zero-padded (`0004`, `0005`, ...),
continuing the `PRAGMA user_version` numbers of the releases before Alembic (1-3)."""

import os

SCRIPT_LOCATION = os.path.dirname(os.path.abspath(__file__))
