"""The persistent calibration cache (shared/privacy/calibration_cache.py) behind ``plan_ccdp``.

A hit gives the plan a fresh calibration gives, bit for bit; a corrupt, mismatching or overspending entry is never
used; the key changes with every public input of the calibration (and only with those).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from shared.iucn import IUCNCategory as Cat
from shared.privacy.accounting import epsilon_spent
from shared.privacy.calibration_cache import CalibrationCache, canonical_json
from shared.privacy.events import DPSGDEvent

from edge_sdk.privacy import ccdp_plan as ccdp
from edge_sdk.privacy.ccdp import (CALIBRATION_KIND, calibration_environment, calibration_inputs, plan_ccdp)

BUDGETS = {Cat.CR: 0.5, Cat.EN: 0.75, Cat.VU: 1.0, Cat.NT: 1.25, Cat.LC: 1.5, Cat.NE: 2.0}
FIXED = (DPSGDEvent(40.0, 1.0, 5),)  # NIRA-like noisy counts over 5 planned rounds
PLAN = dict(budgets=BUDGETS, active=[Cat.CR, Cat.NE], target_delta=1e-5, sampling_rate=0.2, steps=10,
            clipping_norm=1.0, fixed_events=FIXED)


@pytest.fixture(autouse=True)
def _fresh_memo():
    """Each test starts without the process memo, so every plan below is calibrated or read from disk."""
    ccdp._plan_ccdp_cached.cache_clear()
    yield
    ccdp._plan_ccdp_cached.cache_clear()


@pytest.fixture
def count_calibrations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Counts the accountant searches behind plans (``ccdp._calibrate``), keeping their results."""
    calls: list[str] = []
    real = ccdp._calibrate

    def counting(variant, *args, **kwargs):
        calls.append(variant)
        return real(variant, *args, **kwargs)

    monkeypatch.setattr(ccdp, "_calibrate", counting)
    return calls


def _entries(root: Path) -> list[Path]:
    return sorted(root.glob(f"{CALIBRATION_KIND}-*.json"))


def _same_plan(a: ccdp.CCDPPlan, b: ccdp.CCDPPlan) -> bool:
    """Bit-identical: every float compared with ==, and the same categories."""
    return (a.variant == b.variant and a.anchor == b.anchor and a.noise_std == b.noise_std
            and a.sampling_rates == b.sampling_rates and a.clipping_norms == b.clipping_norms)


@pytest.mark.parametrize("variant", ["sample", "scale"])
def test_a_cache_hit_is_the_uncached_plan_bit_for_bit(tmp_path: Path, variant: str,
                                                      count_calibrations: list[str]) -> None:
    # Prepare: the plan as a process without any cache computes it
    uncached = plan_ccdp(variant=variant, **PLAN)
    ccdp._plan_ccdp_cached.cache_clear()

    # Execute: one process fills the cache, a later one (a new cache object, an empty memo) reads it
    first = plan_ccdp(variant=variant, **PLAN, cache=CalibrationCache(tmp_path))
    ccdp._plan_ccdp_cached.cache_clear()
    calls_before_hit = len(count_calibrations)
    hit = plan_ccdp(variant=variant, **PLAN, cache=CalibrationCache(tmp_path))

    # Assert: one entry, read without a new search, and all three plans equal to the last bit
    assert len(_entries(tmp_path)) == 1
    assert calls_before_hit == 2 and len(count_calibrations) == 2  # uncached + first; the hit searched nothing
    assert _same_plan(first, uncached) and _same_plan(hit, uncached)
    # the file holds exactly the accountant's outputs the plan is built from
    result = json.loads(_entries(tmp_path)[0].read_text())["result"]
    z = result["noise_multiplier"]
    assert uncached.noise_std == z * 1.0
    if variant == "sample":
        assert {Cat(k): v for k, v in result["per_category"].items()} == uncached.sampling_rates
    else:
        assert {Cat(k): uncached.noise_std / max(v, z) for k, v in result["per_category"].items()} \
            == uncached.clipping_norms
    # and the guarantee the plan claims holds for every category (independent accountant evaluation)
    for c, event in hit.events(PLAN["steps"]).items():
        assert epsilon_spent([event, *FIXED], target_delta=1e-5) <= BUDGETS[c]


def test_the_clipping_norm_is_not_in_the_key_and_scales_a_cached_plan_exactly(tmp_path: Path,
                                                                               count_calibrations: list[str]) -> None:
    plan_ccdp(variant="scale", **PLAN, cache=CalibrationCache(tmp_path))
    ccdp._plan_ccdp_cached.cache_clear()

    from_cache = plan_ccdp(variant="scale", **{**PLAN, "clipping_norm": 2.5}, cache=CalibrationCache(tmp_path))
    searches = len(count_calibrations)
    ccdp._plan_ccdp_cached.cache_clear()
    fresh = plan_ccdp(variant="scale", **{**PLAN, "clipping_norm": 2.5})

    assert searches == 1 and len(_entries(tmp_path)) == 1
    assert _same_plan(from_cache, fresh)


def _forge(path: Path, mutate) -> None:
    """Rewrite a valid entry with ``mutate(result)`` applied and a checksum that matches again (so only the value
    checks or the accountant's re-check can catch it)."""
    import hashlib

    entry = json.loads(path.read_text())
    body = {"record": entry["record"], "result": mutate(entry["result"])}
    body["sha256"] = hashlib.sha256(canonical_json({"record": body["record"], "result": body["result"]})
                                    .encode()).hexdigest()
    path.write_text(canonical_json(body))


CORRUPTIONS = {
    "torn": lambda p: p.write_text(p.read_text()[: len(p.read_text()) // 2]),
    "empty": lambda p: p.write_bytes(b""),
    "not-json": lambda p: p.write_bytes(b"\x80\x04\x95 a pickle, say"),
    "a list": lambda p: p.write_text("[1, 2, 3]"),
    "digit flipped, checksum stale": lambda p: p.write_text(
        p.read_text().replace('"noise_multiplier":', '"noise_multiplier":1', 1)),
    "other inputs": lambda p: _forge_record(p),
    "overspending z": lambda p: _forge(p, lambda r: {**r, "noise_multiplier": r["noise_multiplier"] / 2}),
    "overspending rate": lambda p: _forge(p, lambda r: {**r, "per_category": {k: min(0.2, v * 4) for k, v in
                                                                              r["per_category"].items()}}),
    "missing category": lambda p: _forge(p, lambda r: {**r, "per_category": {"NE": r["per_category"]["NE"]}}),
    "negative rate": lambda p: _forge(p, lambda r: {**r, "per_category": {k: -v for k, v in
                                                                          r["per_category"].items()}}),
    "string value": lambda p: _forge(p, lambda r: {**r, "noise_multiplier": str(r["noise_multiplier"])}),
}


def _forge_record(path: Path) -> None:
    """A self-consistent entry for other inputs (steps 100) under this key's file name."""
    import hashlib

    entry = json.loads(path.read_text())
    record = {**entry["record"], "inputs": {**entry["record"]["inputs"], "steps": 100}}
    body = {"record": record, "result": entry["result"]}
    body["sha256"] = hashlib.sha256(canonical_json(body).encode()).hexdigest()
    path.write_text(canonical_json(body))


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupt_or_untrustworthy_entry_is_ignored_and_recalibrated(
        tmp_path: Path, corruption: str, count_calibrations: list[str], caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: a valid entry, then damaged
    good = plan_ccdp(variant="sample", **PLAN, cache=CalibrationCache(tmp_path))
    (entry,) = _entries(tmp_path)
    CORRUPTIONS[corruption](entry)
    ccdp._plan_ccdp_cached.cache_clear()

    # Execute
    with caplog.at_level("WARNING", logger="shared.privacy.calibration_cache"):
        again = plan_ccdp(variant="sample", **PLAN, cache=CalibrationCache(tmp_path))

    # Assert: searched again (not trusted), the same plan, a warning naming the file, and the entry repaired
    assert count_calibrations == ["sample", "sample"]
    assert _same_plan(again, good)
    assert any(entry.name in r.getMessage() for r in caplog.records)
    assert _entries(tmp_path) == [entry]
    assert json.loads(entry.read_text())["result"]["noise_multiplier"] == good.noise_std
    ccdp._plan_ccdp_cached.cache_clear()
    plan_ccdp(variant="sample", **PLAN, cache=CalibrationCache(tmp_path))
    assert len(count_calibrations) == 2  # the repaired entry is a hit


def test_the_key_changes_with_every_public_input_and_only_with_those() -> None:
    base = dict(variant="sample", budgets=BUDGETS, active=[Cat.CR, Cat.VU], target_delta=1e-5, sampling_rate=0.2,
                steps=10, fixed_events=FIXED, accountant="rdp", site_categories=[Cat.CR, Cat.VU, Cat.NE])
    env = calibration_environment()

    def key(**changes) -> str:
        return CalibrationCache.key(CALIBRATION_KIND, calibration_inputs(**{**base, **changes}), env)

    variations = {
        "variant": key(variant="scale"),
        "budget of an active category": key(budgets={**BUDGETS, Cat.CR: 0.4}),
        "budget of the anchor": key(budgets={**BUDGETS, Cat.NE: 2.5}),
        "budget of another category": key(budgets={**BUDGETS, Cat.LC: 1.4}),
        "active categories": key(active=[Cat.CR]),
        "anchor (species table)": key(site_categories=[Cat.CR, Cat.VU, Cat.LC]),
        "delta": key(target_delta=1e-6),
        "q": key(sampling_rate=0.2000000001),
        "steps": key(steps=11),
        "fixed releases' noise": key(fixed_events=(DPSGDEvent(41.0, 1.0, 5),)),
        "fixed releases' count": key(fixed_events=(DPSGDEvent(40.0, 1.0, 6),)),
        "no fixed releases": key(fixed_events=()),
        "accountant": key(accountant="pld"),
    }
    other_env = {
        "dp-accounting version": CalibrationCache.key(CALIBRATION_KIND, calibration_inputs(**base),
                                                      {**env, "dp-accounting": "0.0.1"}),
        "calibration code": CalibrationCache.key(CALIBRATION_KIND, calibration_inputs(**base),
                                                 {**env, "code": "0" * 64}),
    }
    keys = [key(), *variations.values(), *other_env.values()]
    assert len(set(keys)) == len(keys), "two different calibrations share a key"
    # the same calibration: the species table enters only through its anchor, a category's order not at all
    assert key(site_categories=[Cat.NE, Cat.VU, Cat.CR, Cat.EN]) == key()
    assert key(active=[Cat.VU, Cat.CR]) == key()
    assert set(env) == {"python", "dp-accounting", "numpy", "scipy", "code"}


def test_floats_round_trip_bit_for_bit_and_writes_leave_no_temporaries(tmp_path: Path) -> None:
    cache = CalibrationCache(tmp_path / "c")
    values = [0.1 + 0.2, 1e-300, 5e-324, 1 / 3, math.pi * 1e17, 2.0 ** -1074 * 3]
    inputs = {"q": 0.1 + 0.2, "steps": 7}

    path = cache.store("test", inputs, {"v": "1"}, {"values": values})
    got = cache.load("test", inputs, {"v": "1"}, decode=lambda r: r["values"], verify=lambda v: True)

    assert path is not None and [p.name for p in (tmp_path / "c").iterdir()] == [path.name]
    assert got == values and all(a.hex() == b.hex() for a, b in zip(got, values))
    assert cache.load("test", {**inputs, "steps": 8}, {"v": "1"}, decode=lambda r: r, verify=lambda v: True) is None
    assert cache.load("test", inputs, {"v": "2"}, decode=lambda r: r, verify=lambda v: True) is None
    assert cache.load("test", inputs, {"v": "1"}, decode=lambda r: r, verify=lambda v: False) is None


def test_an_unwritable_cache_only_costs_time(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    cache = CalibrationCache(blocker)

    with caplog.at_level("WARNING", logger="shared.privacy.calibration_cache"):
        path = cache.store("test", {"a": 1}, {}, {"b": 2.0})
    value = cache.get_or_compute("test", {"a": 1}, {}, compute=lambda: 3.0, encode=float, decode=float,
                                 verify=lambda v: True)

    assert path is None and value == 3.0
    assert any("cannot write" in r.getMessage() for r in caplog.records)


def test_the_gateway_keeps_its_calibration_in_its_cache_folder(tmp_path: Path, monkeypatch) -> None:
    """A round on a real agent writes one entry in ``calibration_cache``; the default is under $WILDFED_CACHE."""
    from edge_sdk.agent import EdgeAgent
    from edge_sdk.site_paths import calibration_cache_dir
    from edge_sdk.config import load_site_config
    from edge_sdk.uplink.transport import InMemoryBroker, InMemoryTransport

    from .test_agent import make_site

    monkeypatch.setenv("WILDFED_CACHE", str(tmp_path / "wildfed-cache"))
    broker = InMemoryBroker()
    coordinator = make_site(tmp_path, InMemoryTransport(broker))
    assert calibration_cache_dir(load_site_config(tmp_path / "site.yaml")) == tmp_path / "wildfed-cache" / "calibration"
    config = yaml.safe_load((tmp_path / "site.yaml").read_text())
    (tmp_path / "site.yaml").write_text(yaml.safe_dump({**config, "calibration_cache": "calib"}))
    agent = EdgeAgent.from_config(tmp_path / "site.yaml", transport=InMemoryTransport(broker))
    agent.start()

    coordinator.send(coordinator.task(1))
    assert agent.run(max_rounds=1, idle_timeout_s=20) == 1
    agent.close()

    (entry,) = _entries(tmp_path / "calib")
    inputs = json.loads(entry.read_text())["record"]["inputs"]
    assert inputs["active"] == ["CR", "NT"] and inputs["budgets"] == [["CR", 0.5], ["NT", 1.5]]
    assert inputs["steps"] == 5 * 2  # planned_rounds * local_steps of FakeCoordinator's task
