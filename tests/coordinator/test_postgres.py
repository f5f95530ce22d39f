"""The same ledger and store against PostgreSQL (127.0.0.1:5432, db ``test``), in a throw-away schema."""

from __future__ import annotations

import uuid

import dp_accounting
import pytest
from dp_accounting import rdp
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key, public_key_to_pem
from shared.privacy.events import DPSGDEvent

from coordinator.ledger import LedgerError, PrivacyLedger
from coordinator.registry import EnrolmentError, SiteRegistry
from coordinator.storage import Store

PG_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/test"
LC = IUCNCategory.LC


@pytest.fixture
def pg_schema():
    try:
        engine = create_engine(PG_URL, connect_args={"connect_timeout": 3})
        with engine.begin() as conn:
            conn.execute(text("SELECT 1"))
    except OperationalError as exc:
        pytest.skip(f"PostgreSQL not reachable at {PG_URL} ({exc.orig}); start it (see .ci/run) to run this test")
    schema = f"wf_test_{uuid.uuid4().hex[:12]}"
    with engine.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield schema
    finally:
        with engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        engine.dispose()


def test_ledger_on_postgres_matches_direct_composition_and_survives_restart(pg_schema, tmp_path):
    # Prepare
    events = [(1.1, 0.02, 10), (1.1, 0.02, 10), (1.4, 0.03, 12)]
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    for z, q, t in events:
        acc.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), t))
    expected = acc.get_epsilon(1e-5)
    # Execute
    s1 = Store(PG_URL, tmp_path / "d", schema=pg_schema)
    ledger = PrivacyLedger(s1, target_delta=1e-5)
    for r, e in enumerate(events, start=1):
        ledger.record_round("pg-site", r, {LC: DPSGDEvent(*e)})
    with pytest.raises(LedgerError):
        ledger.record_round("pg-site", 1, {LC: DPSGDEvent(9.0, 0.02, 10)})
    ledger.halt("pg-site", LC, round=4, reason="test")
    s1.dispose()
    s2 = Store(PG_URL, tmp_path / "d", schema=pg_schema)
    reloaded = PrivacyLedger(s2, target_delta=1e-5)
    # Assert
    assert reloaded.spent("pg-site", LC) == pytest.approx(expected, rel=1e-9)
    assert reloaded.halted("pg-site") == {LC}
    s2.dispose()


def test_registry_and_rejections_on_postgres(pg_schema, tmp_path):
    store = Store(PG_URL, tmp_path / "d", schema=pg_schema)
    reg = SiteRegistry(store)
    pem = public_key_to_pem(generate_signing_key().public_key())
    reg.enrol("pg1", pem, {"capacity": 5})
    with pytest.raises(EnrolmentError, match="already enrolled"):
        SiteRegistry(store).enrol("pg1", pem)
    store.add_rejection(round=1, site_id="pg1", topic="t", reason="duplicate", error_kind="check", detail="")
    assert [s.site_id for s in SiteRegistry(store).list()] == ["pg1"]
    assert store.rejection_counts() == {"duplicate": 1}
    store.dispose()


def test_federation_rounds_on_postgres(pg_schema, tmp_path):
    import numpy as np

    from coordinator.service import Coordinator
    from coordinator.transport import InMemoryTransport
    from tests.coordinator.helpers import EVENT, FakeSite, make_config, tiny_weights

    transport, key = InMemoryTransport(), generate_signing_key()
    cfg = make_config(tmp_path, database_url=PG_URL)
    coord = Coordinator(cfg, transport=transport, signing_key=key, initial_weights=tiny_weights(), schema=pg_schema)
    for sid, value, n in (("a", 1.0, 10), ("b", 4.0, 30)):
        site = FakeSite(sid, transport, key.public_key(), value=value, num_examples=n, events={LC: EVENT}).attach()
        coord.enrol(sid, site.public_pem, {"capacity": n})
    results = coord.run()
    assert [r.status for r in results] == ["closed", "closed"]
    _, weights = coord.rounds.current_model()
    np.testing.assert_allclose(weights["psi.b"], tiny_weights()["psi.b"] + 6.5, rtol=1e-6)
    assert coord.status().accepted == 4
    coord.close()
