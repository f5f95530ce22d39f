"""A database made with the old ``deployments`` table (keyed by deployment id alone) upgrades in place to one row per
(site, deployment) without losing a row (coordinator.schema_upgrade), on SQLite and on PostgreSQL (skipped when it is
not running). The old table is made here by SQL, with the shape and rows the previous release wrote; the expected
rows are worked out by hand from the records that name each deployment."""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from shared.keys import generate_signing_key, public_key_to_pem

from coordinator.registry import SiteRegistry
from coordinator.schema_upgrade import upgrade_schema
from coordinator.storage import DeploymentRow, DetectionRow, PlaceRow, Store
from coordinator.web.deployments import import_camtrap_dp, species_table_categories
from tests.coordinator.test_postgres import PG_URL, pg_schema  # noqa: F401 - the fixture

OLD_DEPLOYMENTS = """CREATE TABLE {table} (
    deployment_id VARCHAR(128) NOT NULL PRIMARY KEY, latitude FLOAT NOT NULL, longitude FLOAT NOT NULL,
    location_name VARCHAR(256) NOT NULL, source VARCHAR(256) NOT NULL, categories_json TEXT NOT NULL,
    species_json TEXT NOT NULL, start VARCHAR(40), "end" VARCHAR(40))"""
OLD_ROWS = [  # (deployment, lat, lon, name); records name d-shared at two sites, d-a at one, d-none at none
    ("d-shared", 3.5, -77.2, "river"), ("d-a", 3.6, -77.3, "ridge"), ("d-none", 3.7, -77.4, "pan")]


def _record_row(site: str, dep: str, media: str) -> DetectionRow:
    return DetectionRow(site_id=site, media_id=media, deployment_id=dep, file="x.JPG",
                        captured_at="2024-01-01T00:00:00+00:00", num_detections=0, record_json="{}", sequence=1,
                        payload_sha256="ab" * 32, sent_at=_dt.datetime(2024, 1, 1))


def _old_database(url: str, data: Path, schema: str | None, sites: tuple[str, ...]) -> None:
    """Every table as the current release makes it, except ``deployments`` in its old shape with OLD_ROWS, records
    of the sites, and one protected place listing two old deployment ids."""
    store = Store(url, data, schema=schema)
    for site in sites:
        SiteRegistry(store).enrol(site, public_key_to_pem(generate_signing_key().public_key()))
    with store.session() as s:
        s.add_all([_record_row("site-a", "d-shared", "1" * 32), _record_row("site-b", "d-shared", "2" * 32),
                   _record_row("site-a", "d-a", "3" * 32)] if len(sites) > 1 else [])
        s.add(PlaceRow(latitude=3.5, longitude=-77.2, members_json=json.dumps(["d-none", "d-shared"])))
    table = f'"{schema}".deployments' if schema else "deployments"
    with store.engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {table}"))
        conn.execute(text(OLD_DEPLOYMENTS.format(table=table)))
        for dep, lat, lon, name in OLD_ROWS:
            conn.execute(text(f"INSERT INTO {table} VALUES (:d, :lat, :lon, :n, 'camtrap-dp:pkg', '[\"VU\"]', "
                              "'[]', NULL, NULL)"), {"d": dep, "lat": lat, "lon": lon, "n": name})
    store.dispose()


def _upgrade_and_check(url: str, data: Path, schema: str | None) -> Store:
    store = Store(url, data, schema=schema)  # the upgrade runs here
    with store.session() as s:
        rows = {(r.site_id, r.deployment_id): (r.latitude, r.longitude, r.location_name, r.categories_json)
                for r in s.query(DeploymentRow)}
        members = [json.loads(p.members_json) for p in s.query(PlaceRow)]
    # d-shared was named by both sites' records: one row each, at the old coordinates; d-a by site-a's only;
    # d-none by none, with two sites enrolled: unassigned
    assert rows == {("site-a", "d-shared"): (3.5, -77.2, "river", '["VU"]'),
                    ("site-b", "d-shared"): (3.5, -77.2, "river", '["VU"]'),
                    ("site-a", "d-a"): (3.6, -77.3, "ridge", '["VU"]'),
                    ("", "d-none"): (3.7, -77.4, "pan", '["VU"]')}
    assert members == [["/d-none", "site-a/d-shared", "site-b/d-shared"]]
    assert upgrade_schema(store.engine, schema=schema) == []  # a second start changes nothing
    return store


def _take_over(store: Store, tmp_path: Path) -> None:
    """import-deployments --site site-b of d-none takes over the unassigned row and its place membership."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "deployments.csv").write_text("deploymentID,locationName,latitude,longitude\nd-none,pan,3.71,-77.4\n")
    (pkg / "observations.csv").write_text("observationID,deploymentID,scientificName\n")
    assert import_camtrap_dp(store, pkg, species_table_categories([]), site_id="site-b") == 1
    with store.session() as s:
        assert {(r.site_id, r.latitude) for r in s.query(DeploymentRow) if r.deployment_id == "d-none"} == {
            ("site-b", 3.71)}
        assert [json.loads(p.members_json) for p in s.query(PlaceRow)] == [
            ["site-a/d-shared", "site-b/d-none", "site-b/d-shared"]]


def test_sqlite_database_of_the_old_schema_upgrades_without_losing_rows(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'data' / 'coordinator.db'}"
    _old_database(url, tmp_path / "data", None, ("site-a", "site-b"))
    store = _upgrade_and_check(url, tmp_path / "data", None)
    _take_over(store, tmp_path)
    store.dispose()


def test_postgres_database_of_the_old_schema_upgrades_without_losing_rows(tmp_path: Path, pg_schema) -> None:  # noqa: F811
    _old_database(PG_URL, tmp_path / "data", pg_schema, ("site-a", "site-b"))
    store = _upgrade_and_check(PG_URL, tmp_path / "data", pg_schema)
    _take_over(store, tmp_path)
    store.dispose()


def test_with_one_site_enrolled_every_old_row_is_that_sites(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'data' / 'coordinator.db'}"
    _old_database(url, tmp_path / "data", None, ("only",))
    store = Store(url, tmp_path / "data")
    with store.session() as s:
        assert sorted((r.site_id, r.deployment_id) for r in s.query(DeploymentRow)) == [
            ("only", "d-a"), ("only", "d-none"), ("only", "d-shared")]
        assert [json.loads(p.members_json) for p in s.query(PlaceRow)] == [["only/d-none", "only/d-shared"]]
    store.dispose()


def test_a_failing_upgrade_keeps_the_old_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step is one transaction: an error after the old table was dropped leaves it as it was."""
    import coordinator.schema_upgrade as su

    url = f"sqlite:///{tmp_path / 'data' / 'coordinator.db'}"
    _old_database(url, tmp_path / "data", None, ("site-a", "site-b"))
    engine = create_engine(url)
    real_update = su.update

    def broken_update(*args, **kwargs):  # the last statement of the step: the places' members
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(su, "update", broken_update)
    with pytest.raises(RuntimeError, match="disk on fire"):
        upgrade_schema(engine)
    with engine.connect() as conn:
        columns = [r[1] for r in conn.exec_driver_sql("PRAGMA table_info(deployments)")]
        old = conn.exec_driver_sql("SELECT deployment_id FROM deployments ORDER BY deployment_id").scalars().all()
        tables = set(conn.exec_driver_sql("SELECT name FROM sqlite_master WHERE type='table'").scalars())
    assert "site_id" not in columns and old == ["d-a", "d-none", "d-shared"]
    assert su.UPGRADE_TABLE not in tables
    engine.dispose()
    monkeypatch.setattr(su, "update", real_update)
    _upgrade_and_check(url, tmp_path / "data", None).dispose()
