"""Fleet health: a real gateway's signed health records and presence messages reach the coordinator's database
(coordinator/fleet.py), ``wildfed-coordinator fleet`` and the operator page show them, a gateway that stops turns
silent (an injected clock: no sleeping), and a record from an unenrolled site, with a wrong signature or with a bad
signing time is refused.
"""

from __future__ import annotations

import datetime as _dt
import logging
import re
from importlib.metadata import version
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from shared.envelope import MessageKind, seal
from shared.health import DISK_FREE_STEP_BYTES, HealthRecord, encode_health
from shared.keys import generate_signing_key, load_private_key, public_key_to_pem
from shared.topics import health_topic, status_payload, status_topic

from edge_sdk.agent import EdgeAgent
from edge_sdk.uplink.health import HealthReporter

from coordinator.cli import app
from coordinator.config import load_config
from coordinator.fleet import fleet_rows
from coordinator.inbound.reject import Rejected, RejectReason
from coordinator.service import Coordinator
from coordinator.storage import RejectionRow, SiteHealthRow, utcnow
from coordinator.transport import InMemoryTransport
from coordinator.web.app import create_app
from coordinator.web.auth import AccountStore
from tests.coordinator.test_model_release import Bridge
from tests.coordinator.web_fixtures import HASHER
from tests.support import camera_site

runner = CliRunner()
FED = "fleetfed"
H = "ab" * 32


class Clock:
    """Naive-UTC time that moves only when told to."""

    def __init__(self) -> None:
        self.now = utcnow()

    def __call__(self) -> _dt.datetime:
        return self.now


@pytest.fixture
def fed(tmp_path: Path):
    """A coordinator (initialised by the CLI) on an in-process bus, with sites ridge (a real gateway) and river
    (enrolled, never heard from)."""
    d = tmp_path / "coord"
    assert runner.invoke(app, ["init", str(d), "--federation-id", FED]).exit_code == 0
    cfg_path = d / "coordinator.yaml"
    cfg = load_config(cfg_path)
    bus = InMemoryTransport()
    coord = Coordinator(cfg, transport=bus, signing_key=load_private_key(cfg.signing_key_path))
    clock = Clock()
    coord.fleet._clock = clock
    ridge_key = camera_site(tmp_path / "ridge", "ridge", load_private_key(cfg.signing_key_path), federation_id=FED)
    coord.enrol("ridge", public_key_to_pem(ridge_key.public_key()), {"capacity": 8})
    coord.enrol("river", public_key_to_pem(generate_signing_key().public_key()), {"capacity": 8})
    coord.start()
    yield coord, bus, clock, cfg_path, tmp_path
    coord.close()


def _gateway(tmp_path: Path, bus: InMemoryTransport) -> EdgeAgent:
    return EdgeAgent.from_config(tmp_path / "ridge" / "site.yaml", transport=Bridge(bus))


def _seal(site: str, key, record: HealthRecord, *, timestamp: int | None = None) -> bytes:  # noqa: ANN001
    return seal(private_key=key, federation_id=FED, site_id=site, round=0, base_model_hash="",
                kind=MessageKind.HEALTH, sequence=1, payload=encode_health(record), timestamp=timestamp).to_bytes()


def _record(**overrides: object) -> HealthRecord:
    fields = dict(sdk_version="0.1.0", model_round=None, model_hash="", last_round=-1, outbox_backlog=0,
                  incoming_backlog=None, detection_backlog=None, disk_free_bytes=None, last_error="",
                  last_error_at=None, started_at=1_700_000_000)
    fields.update(overrides)
    return HealthRecord(**fields)  # type: ignore[arg-type]


def test_a_gateway_reports_on_start_and_fleet_shows_it(fed) -> None:
    coord, bus, clock, cfg_path, tmp_path = fed
    agent = _gateway(tmp_path, bus)
    agent.start()  # the connect is queued for the loop: the first record goes out there
    agent.run(idle_timeout_s=0.1)
    assert agent.stats["health_sent"] == 1
    agent.close()
    with coord.store.session() as s:
        row = s.get(SiteHealthRow, "ridge")
        assert row is not None and row.received_at == clock.now
    rows = {r.site_id: r for r in fleet_rows(coord.store, coord.registry, now=clock.now)}
    rec = rows["ridge"].record
    assert rec is not None and rec.sdk_version == version("wildfed")
    assert (rec.model_round, rec.model_hash, rec.last_round, rec.outbox_backlog) == (None, "", -1, 0)
    assert rec.incoming_backlog is None and rec.detection_backlog is None  # no incoming folder: not public
    assert rec.disk_free_bytes is not None and rec.disk_free_bytes % DISK_FREE_STEP_BYTES == 0
    assert not rows["ridge"].silent and rows["river"].silent and rows["river"].last_seen is None

    out = runner.invoke(app, ["fleet", "--config", str(cfg_path)])
    assert out.exit_code == 0, out.output
    assert "2 gateway(s), 0 online, 1 silent" in out.output
    line = next(x for x in out.output.splitlines() if "│ ridge" in x)
    cells = [c.strip() for c in line.split("│")[1:-1]]
    assert cells[0] == "ridge" and cells[1] == "unknown" and cells[3] == version("wildfed")
    assert cells[4:8] == ["-", "none", "0", "-"]
    assert cells[9].endswith("GiB")
    assert "never heard" in next(x for x in out.output.splitlines() if "│ river" in x)
    failing = runner.invoke(app, ["fleet", "--config", str(cfg_path), "--fail-if-silent"])
    assert failing.exit_code == 1 and "silent: river" in failing.output


def test_a_gateway_that_stops_is_shown_silent(fed) -> None:
    coord, bus, clock, _, tmp_path = fed
    agent = _gateway(tmp_path, bus)
    agent.start()
    agent.run(idle_timeout_s=0.1)
    agent.close()  # the gateway stops: nothing more comes from it
    heard = clock.now
    assert not {r.site_id: r for r in fleet_rows(coord.store, coord.registry, now=heard + _dt.timedelta(
        minutes=50))}["ridge"].silent
    later = heard + _dt.timedelta(hours=3)
    row = {r.site_id: r for r in fleet_rows(coord.store, coord.registry, now=later)}["ridge"]
    assert row.silent and row.silent_s == pytest.approx(3 * 3600)
    assert not {r.site_id: r for r in fleet_rows(coord.store, coord.registry, now=later,
                                                silent_after_s=4 * 3600)}["ridge"].silent
    # the operator page, on the same injected clock
    AccountStore(coord.store, hasher=HASHER).create("olga", "operator-password-1", "operator")
    client = TestClient(create_app(coord.config, store=coord.store, hasher=HASHER, clock=lambda: later),
                        base_url="https://testserver")
    token = re.search(r'name="csrf_token" value="([^"]+)"', client.get("/login").text).group(1)
    assert client.post("/login", data={"username": "olga", "password": "operator-password-1", "csrf_token": token,
                                       "next": "/map"}, follow_redirects=False).status_code == 303
    api = {r["site_id"]: r for r in client.get("/api/operator/fleet").json()}
    assert api["ridge"]["silent"] is True and api["ridge"]["silent_s"] == pytest.approx(3 * 3600)
    assert api["ridge"]["record"]["sdk_version"] == version("wildfed")
    assert api["river"]["silent"] is True and api["river"]["last_seen"] is None
    assert not {r["site_id"]: r for r in client.get("/api/operator/fleet?silent_hours=4").json()}["ridge"]["silent"]
    page = client.get("/operator/fleet").text
    assert re.search(r'data-site="ridge" data-silent="yes"', page) and "silent 3.0 h" in page
    assert client.get("/api/operator/fleet?silent_hours=0").status_code == 422


def test_presence_of_enrolled_sites_is_stored_and_anything_else_ignored(fed) -> None:
    coord, bus, clock, _, _ = fed
    bus.publish(status_topic(FED, "ridge"), status_payload("ridge", "online"), retain=True)
    bus.publish(status_topic(FED, "ghost"), status_payload("ghost", "online"), retain=True)  # not enrolled
    bus.publish(status_topic(FED, "river"), status_payload("ridge", "offline"))  # names another site
    bus.publish(status_topic(FED, "river"), b"{not json")
    rows = {r.site_id: r for r in fleet_rows(coord.store, coord.registry, now=clock.now)}
    assert (rows["ridge"].presence, rows["ridge"].last_seen) == ("online", clock.now)
    assert rows["river"].presence is None
    assert coord.fleet.counts["presence"] == 1 and coord.fleet.counts["presence_ignored"] == 3
    with coord.store.session() as s:
        assert s.get(SiteHealthRow, "ghost") is None
        assert s.query(RejectionRow).count() == 0  # presence is advisory: never a rejection
    clock.now += _dt.timedelta(minutes=5)
    bus.publish(status_topic(FED, "ridge"), status_payload("ridge", "offline"))  # the broker's last will
    row = {r.site_id: r for r in fleet_rows(coord.store, coord.registry, now=clock.now)}["ridge"]
    assert (row.presence, row.last_seen) == ("offline", clock.now)


def test_health_records_from_unenrolled_or_wrongly_signed_sites_or_at_bad_times_are_refused(fed) -> None:
    coord, _, clock, _, tmp_path = fed
    ridge_key = load_private_key(tmp_path / "ridge" / "keys" / "site.key")
    topic = health_topic(FED, "ridge")
    now_ms = int(clock.now.replace(tzinfo=_dt.timezone.utc).timestamp() * 1000)
    cases = [
        (health_topic(FED, "ghost"), _seal("ghost", generate_signing_key(), _record()), RejectReason.UNKNOWN_SITE),
        (topic, _seal("ridge", generate_signing_key(), _record()), RejectReason.BAD_SIGNATURE),
        (health_topic(FED, "river"), _seal("ridge", ridge_key, _record()), RejectReason.TOPIC_MISMATCH),
        (topic, _seal("ridge", ridge_key, _record(), timestamp=now_ms + 3_600_000), RejectReason.BAD_TIMESTAMP),
        (topic, seal(private_key=ridge_key, federation_id=FED, site_id="ridge", round=0, base_model_hash="",
                     kind=MessageKind.HEALTH, sequence=1, payload=b"junk").to_bytes(), RejectReason.MALFORMED_PAYLOAD),
        (topic, b"x" * 20_000, RejectReason.OVERSIZED),
    ]
    for t, raw, reason in cases:
        result = coord.fleet.handle(t, raw)
        assert isinstance(result, Rejected) and result.reason is reason, (reason, result)
    with coord.store.session() as s:
        assert s.query(SiteHealthRow).count() == 0
        assert s.query(RejectionRow).filter(RejectionRow.topic.like("%/health")).count() == len(cases)
    # a genuine record is stored; an older one (a re-delivery) does not replace it
    assert coord.fleet.handle(topic, _seal("ridge", ridge_key, _record(outbox_backlog=2), timestamp=now_ms)) \
        == "stored"
    assert coord.fleet.handle(topic, _seal("ridge", ridge_key, _record(outbox_backlog=9),
                                           timestamp=now_ms - 60_000)) == "stale"
    row = {r.site_id: r for r in fleet_rows(coord.store, coord.registry, now=clock.now)}["ridge"]
    assert row.record.outbox_backlog == 2


def test_the_record_counts_photos_only_where_detections_are_published_and_carries_the_last_error(tmp_path) -> None:
    from tests.edge.test_agent import make_site

    from edge_sdk.uplink.transport import InMemoryBroker, InMemoryTransport as EdgeBus

    broker = InMemoryBroker()
    make_site(tmp_path, EdgeBus(broker))
    site_yaml = tmp_path / "site.yaml"
    site_yaml.write_text(site_yaml.read_text() + "incoming: incoming\n")
    incoming = tmp_path / "incoming"
    (incoming / "cam-1").mkdir(parents=True)
    for name in ("cam-1/a.jpg", "b.JPG", "c.jpg.part", ".d.jpg", "notes.txt"):
        (incoming / name).write_bytes(b"x")
    agent = EdgeAgent.from_config(site_yaml, transport=EdgeBus(broker))
    try:
        logging.getLogger("edge_sdk.test").error("field: %s", "the detector weights are missing " + "x" * 300)
        rec = agent.health.record()
        assert (rec.incoming_backlog, rec.detection_backlog) == (2, 0)  # two photos; nothing queued yet
        assert rec.last_error.startswith("field: the detector weights are missing") and len(rec.last_error) == 200
        assert rec.last_error_at is not None
    finally:
        agent.close()
    # a site that publishes no detection records does not disclose its photo counts either, nor its errors if told
    site_yaml.write_text(site_yaml.read_text() + "field: {publish_detections: false}\nhealth_report_errors: false\n")
    agent = EdgeAgent.from_config(site_yaml, transport=EdgeBus(broker))
    try:
        logging.getLogger("edge_sdk.test").error("something failed")
        rec = agent.health.record()
        assert (rec.incoming_backlog, rec.detection_backlog, rec.last_error) == (None, None, "")
    finally:
        agent.close()


def test_records_are_periodic_and_off_at_interval_zero(tmp_path) -> None:
    from tests.edge.test_agent import make_site

    from edge_sdk.uplink.transport import InMemoryBroker, InMemoryTransport as EdgeBus

    broker = InMemoryBroker()
    make_site(tmp_path, EdgeBus(broker))
    agent = EdgeAgent.from_config(tmp_path / "site.yaml", transport=EdgeBus(broker))
    agent.transport.connect()
    now = [0.0]
    reporter = HealthReporter(agent.ctx, clock=lambda: now[0])
    try:
        assert not reporter.due()  # nothing is due before the first record (sent at connect)
        assert reporter.send("start")
        now[0] = 899.0
        assert not reporter.due()
        now[0] = 900.0
        assert reporter.due() and reporter.send("interval") and not reporter.due()
        sent = [t for t, _ in broker.published if t.endswith("/health")]
        assert sent == [health_topic("fed1", "site-1")] * 2
    finally:
        agent.close()
    (tmp_path / "site.yaml").write_text((tmp_path / "site.yaml").read_text() + "health_interval_s: 0\n")
    agent = EdgeAgent.from_config(tmp_path / "site.yaml", transport=EdgeBus(broker))
    try:
        agent.transport.connect()
        assert not agent.health.enabled and agent.health.send("start") is False
    finally:
        agent.close()
