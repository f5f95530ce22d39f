"""``wildfed-coordinator service`` against a REAL Mosquitto started here on a free port (skipped without the
mosquitto binary): detection records a gateway publishes while no coordinator runs are kept by the broker for the
coordinator's persistent session and stored exactly once when the service starts (an update sent meanwhile is
not: a clean stop unsubscribes from updates); a second start stores nothing new; a record with a bad signature is a rejection that ``status`` shows; a round in progress at SIGTERM is left
open and closed at the next start; ``run`` is refused while the service runs.

The service runs as a real process (``python -m coordinator.cli service``); the test waits on the lines it logs,
never on a clock. Expected counts are those of the records published here.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from shared.codec import encode_tensors, model_hash
from shared.envelope import MessageKind, seal
from shared.keys import generate_signing_key, save_public_key
from shared.protocol import Detection, DetectionRecord, encode_detection
from shared.topics import detection_topic, update_topic

from coordinator.cli import app
from coordinator.config import load_config
from coordinator.detections import detection_counts
from coordinator.storage import RoundRow, Store
from coordinator.transport.mqtt import MqttTransport
from tests.coordinator.helpers import tiny_weights, wide_cli_consoles
from tests.support import free_port

pytestmark = pytest.mark.slow  # three coordinator processes: about 20 s

ROOT = Path(__file__).resolve().parents[2]
MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)
FED, SITE = "svc", "site-a"


@pytest.fixture
def broker(tmp_path: Path):
    """A private Mosquitto that lives through every coordinator start of the test (its queue is the point)."""
    if MOSQUITTO is None:
        pytest.skip("no mosquitto binary: install mosquitto to run the persistent-session test")
    port = free_port()
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"mqtt://127.0.0.1:{port}"
    probe = MqttTransport(url, client_id="probe", connect_timeout_s=10.0)
    for _ in range(100):  # until it accepts a connection (each try waits for the CONNACK or a refusal)
        try:
            probe.connect()
            break
        except Exception:  # noqa: BLE001 - not listening yet
            if proc.poll() is not None:
                pytest.skip(f"mosquitto did not start: {proc.stderr.read().decode(errors='replace')[:300]}")
            threading.Event().wait(0.1)
    probe.close()
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


class Service:
    """``python -m coordinator.cli service`` as a process, its log lines readable as they come. Every one started
    is in :attr:`started`, so that the test's fixture kills one a failed assertion left running."""

    started: list["Service"] = []

    def __init__(self, config: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "COLUMNS": "200"}
        self.proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "service", "--config", str(config),
                                      "--no-web"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        Service.started.append(self)
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str, count: int = 1, timeout_s: float = 90.0) -> None:
        """Block until ``count`` log lines (in all) match ``pattern``; fail with the log after ``timeout_s``."""
        rx = re.compile(pattern)
        while sum(bool(rx.search(x)) for x in self.lines) < count:
            try:
                line = self._queue.get(timeout=timeout_s)
            except queue.Empty:
                pytest.fail(f"no {count} x {pattern!r} within {timeout_s} s; log:\n" + "".join(self.lines))
            if line is None:
                pytest.fail(f"the service exited ({self.proc.wait()}) before {pattern!r}; log:\n" + "".join(self.lines))
            self.lines.append(line)

    def count(self, pattern: str) -> int:
        return sum(bool(re.search(pattern, x)) for x in self.lines)

    def stop(self) -> int:
        """SIGTERM, then the exit status (and the rest of the log)."""
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        while (line := self._queue.get(timeout=10)) is not None:
            self.lines.append(line)
        return code


@pytest.fixture(autouse=True)
def _no_service_left_running():
    yield
    while Service.started:
        proc = Service.started.pop().proc
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def _federation(tmp_path: Path, broker_url: str):  # noqa: ANN202 - (config path, site key)
    runner = CliRunner()
    home = tmp_path / "fed"
    assert runner.invoke(app, ["init", str(home), "--federation-id", FED, "--broker", broker_url]).exit_code == 0
    config = home / "coordinator.yaml"
    data = yaml.safe_load(config.read_text())
    data.update(round_deadline_s=600.0, ship_ort_artifacts=False)  # a round outlives the test: SIGTERM lands in it
    config.write_text(yaml.safe_dump(data))
    site_key = generate_signing_key()
    pub = save_public_key(site_key.public_key(), tmp_path / "site.pub")
    res = runner.invoke(app, ["enrol", SITE, "--public-key", str(pub), "-c", str(config),
                              "--metadata", '{"capacity": 10}'])
    assert res.exit_code == 0, res.output
    cfg = load_config(config)
    store = Store(cfg.database_url or "", cfg.data_dir)
    store.put_model(model_hash(tiny_weights()), encode_tensors(tiny_weights()), round=0)  # no torch needed
    store.dispose()
    return config, site_key


def _record(n: int, key, *, sequence: int) -> bytes:  # noqa: ANN001
    rec = DetectionRecord(media_id=f"{n:032x}", file=f"cam1/IMG_{n:04d}.JPG", deployment_id="cam1",
                          timestamp=f"2024-05-0{n}T06:00:00+00:00", timestamp_source="exif", width=64, height=48,
                          detections=(Detection("animal", 0.9, (0.1, 0.2, 0.3, 0.4)),), detector="yolox")
    return seal(private_key=key, federation_id=FED, site_id=SITE, round=0, base_model_hash="",
                kind=MessageKind.DETECTION, sequence=sequence, payload=encode_detection(rec)).to_bytes()


def _publish(broker_url: str, payloads: list[bytes], *, topic: str = detection_topic(FED, SITE)) -> None:
    """Publish at QoS 1 as the gateway would; each publish returns once the broker has it (PUBACK)."""
    gateway = MqttTransport(broker_url, client_id="gateway-site-a")
    gateway.connect()
    for raw in payloads:
        gateway.publish(topic, raw, qos=1)
    gateway.close()


def test_records_published_while_the_service_is_down_are_stored_once(tmp_path: Path, broker: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    wide_cli_consoles(monkeypatch)
    config, key = _federation(tmp_path, broker)
    cfg = load_config(config)

    # 1. the first start creates the coordinator's session at the broker; SIGTERM arrives during round 1
    svc = Service(config)
    svc.wait_for(r"rounds: round 1 open")
    assert svc.stop() == 0, "".join(svc.lines)
    assert svc.count(r"stopped during a round") == 1
    store = Store(cfg.database_url or "", cfg.data_dir)
    assert [(r.round, r.status) for r in store.rounds()] == [(1, "open")]  # left for the next start to close

    # 2. while no coordinator runs: three photos, the first one delivered twice, and one forged record; and a
    #    message on the update topic, which a cleanly stopped coordinator has unsubscribed from (gateways re-send
    #    updates until ACKed: queued, the copies would crowd detection records out of the broker's queue)
    forged = _record(4, generate_signing_key(), sequence=4)
    _publish(broker, [_record(1, key, sequence=1), _record(2, key, sequence=2), _record(1, key, sequence=1),
                      _record(3, key, sequence=3), forged])
    _publish(broker, [b"not an envelope"], topic=update_topic(FED, SITE))
    assert detection_counts(store).rows == 0

    # 3. the service starts: the broker delivers what it kept; each photo is stored once, the forgery refused
    svc = Service(config)
    svc.wait_for(r"round 1 was interrupted before; closed now from its stored updates: failed")
    svc.wait_for(r"detections: (stored|duplicate) record", count=4)
    svc.wait_for(r"detections: rejected message .*bad_signature")
    # 4. `run` beside the service is refused, visibly
    res = CliRunner().invoke(app, ["run", "--config", str(config)])
    assert res.exit_code == 2 and "another coordinator of this federation is running" in " ".join(res.output.split())
    assert svc.stop() == 0, "".join(svc.lines)
    counts = detection_counts(store)
    assert (counts.rows, counts.from_gateways) == (3, 3)
    assert counts.outcomes == {"stored": 3, "duplicate": 1, "replaced": 0, "stale": 0}
    assert counts.refused == {"bad_signature": 1}
    assert store.rejection_counts() == {"bad_signature": 1}  # the update sent while it was stopped never came
    assert [(r.round, r.status) for r in store.rounds()] == [(1, "failed")]  # next slot: a day after round 1

    # 5. a second start stores nothing new: a record published after it starts arrives after anything the broker
    #    could still have held, and is the only one stored
    svc = Service(config)
    svc.wait_for(r"service: round 2 due at")
    _publish(broker, [_record(5, key, sequence=5)])
    svc.wait_for(r"detections: stored record 0+5 ")
    assert svc.stop() == 0, "".join(svc.lines)
    assert svc.count(r"detections: (stored|duplicate|replaced|stale) record") == 1
    counts = detection_counts(store)
    assert counts.rows == 4 and counts.outcomes["stored"] == 4 and counts.outcomes["duplicate"] == 1
    with store.session() as s:
        assert s.query(RoundRow).count() == 1  # no round ran: the next slot is a day after round 1
    store.dispose()

    # 6. `status` shows the counts and the refusal, from the database
    res = CliRunner().invoke(app, ["status", "--config", str(config)])
    out = " ".join(res.output.split())
    assert res.exit_code == 0, res.output
    assert "detection records: 4 stored (4 from gateways, 0 imported)" in out
    assert re.search(r"duplicate \(delivered again: nothing written\) │ 1 ", out)
    assert re.search(r"refused: bad_signature │ 1 ", out)
