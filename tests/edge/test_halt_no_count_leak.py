"""A category's halt must not reveal its exact record count.

Before the fix, a gateway reported ``num_examples = N_active`` (records of the non-halted categories) and sampled at
``q = B / N_active``: once EN halted, both changed, and their difference was the exact, un-noised EN count. Now
everything that leaves the gateway is a function of public values only (the site's public record count N_site,
the task's B, the public species table and halted list):

- through the real agent (``EdgeAgent`` from a site.yaml, real Camtrap DP package, the head model and the torch
  backend, signed envelopes over the in-memory transport), the updates of a round before and a round after the EN
  halt report ``num_examples == N_site`` both times and the same ``q = B / N_site`` in every event, and the non-halted
  category's event is identical; N_site is counted here from the package's CSV, not by the loader;
- hand-worked on a linear fake backend, the step's normaliser is ``q * N_site`` (= B) before and after the halt;
- the Global DP path's clipped sum carries the same ``num_examples`` and ``q`` before and after the halt.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import yaml

from shared.iucn import IUCNCategory as Cat
from shared.protocol import SecAggSettings, decode_update

from edge_sdk.agent import EdgeAgent
from edge_sdk.data.camtrap_dp import LocalDataset
from edge_sdk.training import clipped_sum_locally, train_locally
from edge_sdk.uplink.transport import InMemoryBroker, InMemoryTransport

from .test_agent import make_site
from .test_training import FakeBackend, ZeroNoise, task

SETTINGS = SecAggSettings(site_ids=("a", "b"), threshold=2, vector_length=2, max_abs_value=4.0, scale=2.0 ** 20)

B = 2  # the fake coordinator's expected_batch_size


def public_record_count(package: Path) -> int:
    """N_site counted from observations.csv: media with at least one media-level animal observation (one record
    per image), independent of the loader."""
    with (package / "observations.csv").open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    return len({r["mediaID"] for r in rows if r["observationLevel"] == "media" and r["observationType"] == "animal"})


def test_agent_reports_the_same_public_values_before_and_after_the_en_halt(tmp_path: Path) -> None:
    # Prepare: the tiny package with its elephant declared EN in the site's species table (1 EN, 2 NT records)
    broker = InMemoryBroker()
    coordinator = make_site(tmp_path, InMemoryTransport(broker))
    config = yaml.safe_load((tmp_path / "site.yaml").read_text())
    config["species"][0]["iucn_category"] = "EN"
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(config))
    n_site = public_record_count(tmp_path / "pkg")
    assert n_site == 3  # m1 (elephant), m2 and m4 (zebras); m3 is blank
    agent = EdgeAgent.from_config(tmp_path / "site.yaml", transport=InMemoryTransport(broker))
    budgets = {Cat.EN: 0.8, Cat.NT: 1.5}
    try:
        # Execute: round 1 with nothing halted, round 2 after the coordinator halted EN
        agent.start()
        coordinator.send(coordinator.task(1, budgets=budgets))
        assert agent.run(max_rounds=1, idle_timeout_s=30) == 1
        coordinator.send(coordinator.task(2, budgets=budgets, halted=(Cat.EN,)))
        assert agent.run(max_rounds=1, idle_timeout_s=30) == 1
    finally:
        agent.close()
    reports = [decode_update(env.payload)[0] for env in coordinator.updates]
    assert [env.header.round for env in coordinator.updates] == [1, 2]
    before, after = reports
    # Assert: num_examples is the public count both times (the old code sent 3 then 2: the EN count leaked)
    assert before.num_examples == after.num_examples == n_site
    # q's denominator is N_site both times: the anchor category (NT, the larger budget) samples at q = B / N_site
    # (the old code sent 2/3 then 2/2); EN, under CCDP "sample", at a lower rate calibrated from public values
    for report in reports:
        assert report.events[Cat.NT].sampling_rate == pytest.approx(B / n_site, rel=0, abs=1e-15)
    assert 0 < before.events[Cat.EN].sampling_rate < B / n_site
    assert set(before.events) == {Cat.EN, Cat.NT} and set(after.events) == {Cat.NT}
    # the non-halted category's event (z calibrated at that q for the planned rounds) is the same function of
    # public values before and after: identical
    assert after.events[Cat.NT] == before.events[Cat.NT]
    assert before.species_counts == after.species_counts == {}


def en_dataset() -> LocalDataset:
    """4 records: CR (3,4), LC (6,8), and two EN (100,100); gradients are the pixels (FakeBackend)."""
    pixels = [(3, 4), (6, 8), (100, 100), (100, 100)]
    cats = [Cat.CR, Cat.LC, Cat.EN, Cat.EN]
    return LocalDataset(images=np.array(pixels, np.uint8).reshape(4, 1, 2), labels=np.zeros(4, np.int64),
                        categories=np.array([c.rank for c in cats], np.int8), media_ids=tuple("abcd"))


@pytest.mark.parametrize("halted", [(), (Cat.EN,)])
def test_step_normaliser_is_q_times_the_public_count(halted) -> None:
    # N_site = 4, B = 2: q = 1/2 and the normaliser q * N_site = 2 whatever is halted.
    # Clipped (C = 1): (3,4) -> (0.6,0.8); (6,8) -> (0.6,0.8); each (100,100) -> (0.7071, 0.7071).
    # Not halted: sum (1.2 + 1.4142, 1.6 + 1.4142) / 2; EN halted: (1.2, 1.6) / 2 = (0.6, 0.8). lr 0.5, w0 = 0.
    tk = task(halted=halted, budgets={Cat.CR: 0.5, Cat.EN: 1.0, Cat.LC: 2.0}, expected_batch_size=2)
    result = train_locally(backend=FakeBackend(), dataset=en_dataset(), task=tk,
                           global_weights={"w": np.zeros(2, np.float32)}, site_categories=[Cat.CR, Cat.EN, Cat.LC],
                           randomness=ZeroNoise())
    en = 2 * np.sqrt(0.5) if not halted else 0.0
    expected = -0.5 * np.array([1.2 + en, 1.6 + en]) / (0.5 * 4)
    np.testing.assert_allclose(result.delta["w"], expected, rtol=2e-5)
    assert result.sampling_rate == 0.5 and result.report.num_examples == 4
    # the anchor (LC, the largest budget) samples at q; CR (and EN) below it (ZeroNoise still takes every record)
    events = result.report.events
    assert events[Cat.LC].sampling_rate == 0.5 and events[Cat.CR].sampling_rate < 0.5


def test_global_dp_clipped_sum_reports_public_values_before_and_after_the_halt() -> None:
    sums = [clipped_sum_locally(backend=FakeBackend(), dataset=en_dataset(),
                                task=task(halted=halted, expected_batch_size=2, privacy="global", local_steps=1,
                                          secagg=SETTINGS, noise_multiplier=3.0),
                                global_weights={"w": np.zeros(2, np.float32)},
                                site_categories=[Cat.CR, Cat.EN, Cat.LC], randomness=ZeroNoise())
            for halted in ((), (Cat.EN,))]
    assert [(s.num_examples, s.sampling_rate) for s in sums] == [(4, 0.5), (4, 0.5)]
    assert [s.categories for s in sums] == [(Cat.CR, Cat.EN, Cat.LC), (Cat.CR, Cat.LC)]  # public: table - halted


def test_active_category_without_records_still_trains_on_noise_only() -> None:
    # Every record is EN and EN is halted: the site still trains its (public) active categories CR and LC on no
    # records, so whether it answers does not tell that the halted category held every record.
    data = LocalDataset(images=np.full((2, 1, 2), 100, np.uint8), labels=np.zeros(2, np.int64),
                        categories=np.array([Cat.EN.rank] * 2, np.int8), media_ids=("a", "b"))
    result = train_locally(backend=FakeBackend(), dataset=data, task=task(halted=(Cat.EN,)),
                           global_weights={"w": np.zeros(2, np.float32)}, site_categories=[Cat.CR, Cat.EN, Cat.LC],
                           randomness=ZeroNoise())
    assert result.report.num_examples == 2 and set(result.report.events) == {Cat.CR, Cat.LC}
    np.testing.assert_array_equal(result.delta["w"], [0.0, 0.0])  # zero noise, nothing sampled
