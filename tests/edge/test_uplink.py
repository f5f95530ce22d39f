"""Outbox durability and the in-memory transport's MQTT semantics."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from edge_sdk.uplink.outbox import Outbox
from edge_sdk.uplink.transport import InMemoryBroker, InMemoryTransport, TransportError, topic_matches


def test_outbox_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "state" / "outbox.sqlite"
    with Outbox(path) as box:
        box.put("update/1", "t/1", b"\x00one")
        box.put("update/2", "t/2", b"two")
        box.set_state("last_round", "2")
    with Outbox(path) as box:  # a "restart"
        assert [(m.message_id, m.topic, box.get(m.message_id).payload) for m in box.pending()] == [
            ("update/1", "t/1", b"\x00one"), ("update/2", "t/2", b"two")]
        assert box.get_state("last_round") == "2" and box.get_state("absent", "x") == "x"
        assert box.remove("update/1") is True and box.remove("update/1") is False
    with Outbox(path) as box:
        assert [m.message_id for m in box.pending()] == ["update/2"]
        assert box.get("update/2").payload == b"two" and box.get("update/1") is None


def test_outbox_is_committed_and_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "outbox.sqlite"
    box = Outbox(path)
    box.put("m", "t", b"p")
    # A second, independent connection sees the row at once: put() has committed.
    other = sqlite3.connect(path)
    assert other.execute("SELECT message_id FROM outbox").fetchall() == [("m",)]
    assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    other.close()
    box.put("m", "t", b"replaced")
    assert [box.get(m.message_id).payload for m in box.pending()] == [b"replaced"]
    box.close()


@pytest.mark.parametrize("filt,topic,ok", [
    ("a/+/c", "a/b/c", True), ("a/+/c", "a/b/d", False), ("a/#", "a/b/c", True), ("a/b", "a/b/c", False),
    ("wildfed/v1/f/site/+/update", "wildfed/v1/f/site/s1/update", True)])
def test_topic_matching(filt: str, topic: str, ok: bool) -> None:
    assert topic_matches(filt, topic) is ok


def test_in_memory_transport_outage_and_resubscribe() -> None:
    broker = InMemoryBroker()
    a, b = InMemoryTransport(broker), InMemoryTransport(broker)
    got, connects = [], []
    b.subscribe("x/#", lambda t, p: got.append((t, p)))
    b.add_connect_listener(lambda: connects.append(1))
    a.connect()
    b.connect()
    a.publish("x/1", b"p1")
    b.go_offline()
    a.publish("x/2", b"lost")  # b is offline: not delivered (no persistent session in this fake)
    with pytest.raises(TransportError):
        b.publish("x/3", b"p3")
    b.go_online()
    a.publish("x/4", b"p4")
    assert got == [("x/1", b"p1"), ("x/4", b"p4")] and len(connects) == 2
