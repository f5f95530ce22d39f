"""Upgrades of an existing coordinator database in place: :func:`upgrade_schema`, which
:class:`coordinator.storage.Store` runs before it creates missing tables.

SQLAlchemy's ``create_all`` creates the tables that do not exist and never changes one that does. A new table (such
as ``site_health``, the fleet's health records) therefore needs no step: the store creates it in an existing
database at its next start. A change to the shape of an existing table is an upgrade step here. Each step detects the old shape by inspecting the
database and rewrites what it must in ONE transaction: PostgreSQL runs DDL inside transactions; on SQLite the step
runs on an autocommit connection between an explicit ``BEGIN IMMEDIATE`` and ``COMMIT``, so that the DDL is inside
the transaction too (the sqlite3 module would otherwise commit before each DDL statement). A crash or an error
therefore leaves the old table or the new one, never half of each, and no row is lost. Steps are idempotent: a
database in the new shape is left as it is. Processes that start together are serialised (SQLite: the write lock
``BEGIN IMMEDIATE`` takes; PostgreSQL: a transaction-scoped advisory lock), and each inspects the database inside
its transaction.

Steps:

1. **Deployments keyed by site** (``deployments``: the primary key was ``deployment_id``; it is ``(site_id,
   deployment_id)``). Deployment ids are unique within one site's package only, so the old key let a second site's
   ``StationA`` overwrite the first one's coordinates. Each old row is given the site(s) whose detection records
   name its deployment id; a row named by the records of several sites becomes one row per site, each at the old
   coordinates (what the view showed for all of them), and a warning names them, so that the operator re-imports
   each site's package with ``--site``. A row no record names gets the only enrolled site, or ``""`` when there are
   none or several (unassigned: it joins no records, and the next ``import-deployments --site S`` of the same
   deployment id takes it over). The members of every protected place (``protected_places.members_json``, lists
   of deployment ids) become the keys ``"<site>/<deployment>"`` of the rows they became
   (:func:`coordinator.storage.deployment_key`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, MetaData, Table, inspect, select, text, update
from sqlalchemy.engine import Engine

__all__ = ["upgrade_schema", "UPGRADE_TABLE"]

log = logging.getLogger(__name__)

UPGRADE_TABLE = "deployments_upgrade"
"""The name the new ``deployments`` table is built under before it replaces the old one (same transaction)."""

_PG_LOCK_KEY = 0x57494C44  # "WILD": the advisory lock of schema upgrades


@contextmanager
def _transaction(engine: Engine) -> Iterator[Connection]:
    """One transaction that holds DDL too, with concurrent upgraders serialised (module docstring)."""
    if engine.dialect.name == "sqlite":
        with engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            conn.exec_driver_sql("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.exec_driver_sql("ROLLBACK")
                raise
            conn.exec_driver_sql("COMMIT")
        return
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_LOCK_KEY})
        yield conn


def upgrade_schema(engine: Engine, *, schema: str | None = None) -> list[str]:
    """Run every upgrade step the database needs (module docstring).

    Args:
        engine: the store's engine (with its ``schema_translate_map`` when it has one).
        schema: the PostgreSQL schema the tables live in (None: the default one).

    Returns:
        one line per change made (empty when the database was up to date); each is also logged (WARNING when the
        operator should act on it).

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the database refused a statement (nothing of the step is kept).
    """
    if not inspect(engine).has_table("deployments", schema=schema):  # a new database: create_all makes it
        return []
    with _transaction(engine) as conn:
        return _deployments_by_site(conn, schema)


def _deployments_by_site(conn: Connection, schema: str | None) -> list[str]:
    """Step 1 (module docstring), inside the caller's transaction."""
    insp = inspect(conn)
    if not insp.has_table("deployments", schema=schema):
        return []
    if "site_id" in {c["name"] for c in insp.get_columns("deployments", schema=schema)}:
        return []  # already keyed by site (another process upgraded it first)
    from coordinator.tables import DeploymentRow, deployment_key  # the new shape

    meta = MetaData()
    old = Table("deployments", meta, autoload_with=conn, schema=schema)
    rows = [dict(r._mapping) for r in conn.execute(select(old))]
    named_by: dict[str, set[str]] = {}
    if insp.has_table("detections", schema=schema):
        det = Table("detections", meta, autoload_with=conn, schema=schema)
        for site, dep in conn.execute(select(det.c.site_id, det.c.deployment_id).distinct()):
            named_by.setdefault(dep, set()).add(site)
    enrolled: list[str] = []
    if insp.has_table("sites", schema=schema):
        enrolled = sorted(conn.execute(select(Table("sites", meta, autoload_with=conn, schema=schema).c.site_id))
                          .scalars())
    notes: list[str] = []

    def sites_of(dep: str) -> list[str]:
        if dep in named_by:
            return sorted(named_by[dep])
        return [enrolled[0]] if len(enrolled) == 1 else [""]

    if insp.has_table(UPGRADE_TABLE, schema=schema):  # left by a failed attempt outside a transaction
        Table(UPGRADE_TABLE, meta, autoload_with=conn, schema=schema).drop(conn)
    new = DeploymentRow.__table__.to_metadata(MetaData(), schema=schema, name=UPGRADE_TABLE)
    new.create(conn)
    columns = {c.name for c in new.columns}
    copied: list[dict[str, Any]] = []
    for row in rows:
        sites = sites_of(row["deployment_id"])
        if len(sites) > 1:
            notes.append(f"deployment {row['deployment_id']!r} is named by the records of sites {', '.join(sites)}: "
                         "each keeps the old coordinates; re-import each site's package with "
                         "`import-deployments PATH --site SITE`")
        elif sites == [""]:
            notes.append(f"deployment {row['deployment_id']!r} has no site (no record names it, and "
                         f"{len(enrolled)} sites are enrolled): it is shown unassigned until "
                         "`import-deployments PATH --site SITE` imports it")
        copied += [{**{k: v for k, v in row.items() if k in columns}, "site_id": site} for site in sites]
    if copied:
        conn.execute(new.insert(), copied)
    old.drop(conn)
    quote = conn.dialect.identifier_preparer.quote
    qualified = f"{quote(schema)}.{quote(UPGRADE_TABLE)}" if schema else quote(UPGRADE_TABLE)
    conn.exec_driver_sql(f"ALTER TABLE {qualified} RENAME TO deployments")
    if insp.has_table("protected_places", schema=schema):
        places = Table("protected_places", meta, autoload_with=conn, schema=schema)
        for pid, members_json in conn.execute(select(places.c.id, places.c.members_json)).all():
            keys = sorted({deployment_key(site, dep) for dep in json.loads(members_json or "[]")
                           for site in sites_of(dep)})
            conn.execute(update(places).where(places.c.id == pid).values(members_json=json.dumps(keys)))
    notes.insert(0, f"upgraded the deployments table to one row per (site, deployment): {len(rows)} row(s) -> "
                    f"{len(copied)}")
    for i, note in enumerate(notes):
        (log.info if i == 0 else log.warning)("schema upgrade: %s", note)
    return notes
