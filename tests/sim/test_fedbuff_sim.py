"""The asynchronous replay: one FedBuff buffer of every site on always-on links is one synchronous round (and the
demo replay's FedAvg round); late updates are charged and discarded; too-stale ones are dropped unsent. Timelines
are worked by hand in the comments (training 20 minutes, transfers instant)."""

from __future__ import annotations

import numpy as np
import pytest

from shared.iucn import IUCNCategory as Cat

from wildfed_sim.demo_sim import SimConfig, SimFederation, SimSite, simulate
from wildfed_sim.fedbuff_sim import AsyncConfig, run_async


def _federation() -> SimFederation:
    rng = np.random.default_rng(0)

    def site(name, n, classes):
        labels = np.asarray([classes[i % len(classes)] for i in range(n)], np.int64)
        return SimSite(name, rng.uniform(0, 6, (n, 1280)).astype(np.float32), labels,
                       np.full(n, Cat.NE.rank, np.int8), (Cat.NE,), tuple(classes))

    return SimFederation(sites=(site("site-00", 6, [0, 1]), site("site-01", 3, [2])),
                         test_features=rng.uniform(0, 6, (9, 1280)).astype(np.float32),
                         test_labels=np.arange(9) % 3, public_features=rng.uniform(0, 6, (5, 1280)).astype(np.float32),
                         class_categories=(Cat.NE, Cat.NE, Cat.NE))


PLAIN = dict(privacy="none", local_steps=2, expected_batch_size=100, learning_rate=0.3, server_momentum=0.0,
             prediction_tau=0.0, class_reweighting=0.0)


@pytest.mark.parametrize("mode", ["sync", "fedbuff"])
def test_one_update_per_site_on_always_on_links_is_one_fedavg_round(mode):
    fed = _federation()
    out = run_async(fed, AsyncConfig(mode=mode, buffer_size=2, planned_updates=1, **PLAIN), seed=5)
    ref = simulate(fed, SimConfig(privacy="none", rounds=1, local_steps=2, expected_batch_size=100, learning_rate=0.3,
                                  server_momentum=0.0), seed=5)
    for name, w in ref["weights"].items():
        np.testing.assert_allclose(out["weights"][name], w, rtol=1e-6, atol=1e-7)
    assert (out["versions"], out["charged"], out["discarded"], out["budget_spent_minutes"]) == (1, 2, 0, 20.0)
    assert [p["minutes"] for p in out["points"]] == [0.0, 20.0, 20.0, 20.0]  # round 0, a charge, model, charge
    assert out["points"][-1]["version"] == 1


def test_sync_rounds_on_always_on_links():
    # round 0 opens at 0, both updates arrive at 20 and close it; round 1 opens at 20 and closes at 40
    out = run_async(_federation(), AsyncConfig(mode="sync", planned_updates=2, **PLAIN), seed=1)
    models = [(p["minutes"], p["version"]) for p in out["points"]]
    assert sorted(set(models)) == [(0.0, 0), (20.0, 0), (20.0, 1), (40.0, 1), (40.0, 2)]
    assert (out["charged"], out["discarded"], out["budget_spent_minutes"]) == (4, 0, 40.0)


def test_fedbuff_drops_what_it_knows_is_too_stale_and_never_charges_it():
    # K = 1, max staleness 0. t=20: site 0's update (v0) makes v1; site 1's (v0) is 1 old: dropped, retrains from v1.
    # t=40: site 0 (v1) makes v2 and is done (2 sent); site 1's (v1) is stale again: dropped, retrains from v2.
    # t=60 and 80: site 1's updates make v3 and v4.
    out = run_async(_federation(), AsyncConfig(mode="fedbuff", buffer_size=1, max_staleness=0, planned_updates=2,
                                               **PLAIN), seed=1)
    assert (out["charged"], out["dropped_unsent"], out["discarded"], out["versions"]) == (4, 2, 0, 4)
    assert sorted({(p["minutes"], p["version"]) for p in out["points"]}) == [(0.0, 0), (20.0, 1), (40.0, 2),
                                                                             (60.0, 3), (80.0, 4)]
    assert [p["sent"] for p in out["points"]][-1] == [2, 2]


def test_sync_charges_and_discards_updates_after_a_short_deadline():
    # satellite passes every 90 min with a 1-minute deadline: every update arrives a pass after its round closed
    ccdp = dict(PLAIN, privacy="ccdp")
    sync = run_async(_federation(), AsyncConfig(mode="sync", link="satellite", deadline_minutes=1.0,
                                                planned_updates=2, **ccdp), seed=2)
    assert (sync["charged"], sync["discarded"], sync["versions"]) == (4, 4, 0)
    assert {p["version"] for p in sync["points"]} == {0}  # the only model is round 0's...
    assert len({p["accuracy"] for p in sync["points"]}) == 1
    fedbuff = run_async(_federation(), AsyncConfig(mode="fedbuff", link="satellite", buffer_size=2, planned_updates=2,
                                                   **ccdp), seed=2)
    assert (fedbuff["charged"], fedbuff["discarded"], fedbuff["versions"]) == (4, 0, 2)
    # ...yet both spent the same: each site's two planned updates, NE's whole budget (calibration: within 1 %)
    budget = AsyncConfig().budgets[Cat.NE]
    assert sync["points"][-1]["epsilon"]["NE"] == fedbuff["points"][-1]["epsilon"]["NE"]
    assert fedbuff["points"][-1]["epsilon"]["NE"] == pytest.approx(budget, rel=0.01)
    assert fedbuff["points"][1]["epsilon"]["NE"] < budget  # after one update, less
