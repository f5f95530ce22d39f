"""The gateway's half of record-level budgets: each training record keeps the cohort it joined, and a task's cohorts
decide which records may be sampled (edge_sdk.rounds.cohorts)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

from shared.iucn import IUCNCategory as Cat
from shared.protocol import TrainingTask, decode_update

from edge_sdk.agent import EdgeAgent
from edge_sdk.rounds.cohorts import CohortRegistry
from edge_sdk.uplink.transport import InMemoryBroker, InMemoryTransport

from .test_agent import make_site

LC, CR, NT = Cat.LC.rank, Cat.CR.rank, Cat.NT.rank


def task(round_: int, cohorts: dict | None) -> TrainingTask:
    return TrainingTask(federation_id="f", round=round_, model_hash="0" * 64, local_steps=1, expected_batch_size=2,
                        learning_rate=0.1, clipping_norm=1.0, target_delta=1e-5, planned_rounds=5,
                        budgets={Cat.LC: 1.0, Cat.CR: 0.5}, capacity=10, cohorts=cohorts)


def test_records_join_the_round_they_first_train_in_and_train_only_where_their_cohort_allows(tmp_path: Path):
    reg = CohortRegistry(tmp_path / "cohorts.sqlite")
    ids, cats = ("a", "b", "c"), np.array([LC, CR, LC], np.int8)
    # round 1: every record joins cohort 1
    assert reg.mask(ids, cats, task(1, {1: []})).tolist() == [True, True, True]
    # round 2: d arrives and joins cohort 2; LC is halted in cohort 1, so a and c wait out
    ids2, cats2 = (*ids, "d"), np.array([LC, CR, LC, LC], np.int8)
    assert reg.mask(ids2, cats2, task(2, {1: ["LC"], 2: []})).tolist() == [False, True, False, True]
    # round 3: cohort 1 retired (not listed); a relabelled d (now CR) trains no more; e cannot join a round whose
    # own cohort is not listed (even one round would pass a budget), so it waits
    ids3, cats3 = (*ids, "d", "e"), np.array([LC, CR, LC, CR, LC], np.int8)
    assert reg.mask(ids3, cats3, task(3, {2: []})).tolist() == [False, False, False, False, False]
    assert "e" not in reg.assignments()
    reg.close()
    # durable: a restarted gateway keeps every assignment
    again = CohortRegistry(tmp_path / "cohorts.sqlite")
    assert again.assignments() == {"a": (1, LC), "b": (1, CR), "c": (1, LC), "d": (2, LC)}
    assert again.mask(ids, cats, task(4, None)) is None  # a task without cohorts: every record may train
    again.close()


def test_the_agent_samples_only_the_records_the_task_s_cohorts_allow(tmp_path: Path):
    # Prepare: the tiny package (m1 elephant CR; m2, m4 zebras NT); tasks ask for exact per-class counts of the
    # records that may be sampled (privacy none: the counts are the eligible records themselves)
    broker = InMemoryBroker()
    coordinator = make_site(tmp_path, InMemoryTransport(broker))
    config = yaml.safe_load((tmp_path / "site.yaml").read_text())
    (tmp_path / "site.yaml").write_text(yaml.safe_dump({**config, "allow_non_private": True}))
    agent = EdgeAgent.from_config(tmp_path / "site.yaml", transport=InMemoryTransport(broker))
    rounds = [(1, {1: ()}), (2, {1: (Cat.NT,), 2: ()}), (3, {3: ()})]
    try:
        agent.start()
        for r, cohorts in rounds:
            coordinator.send(coordinator.task(r, privacy="none", budgets={}, count_noise_multiplier=0.0,
                                              cohorts=cohorts))
            assert agent.run(max_rounds=1, idle_timeout_s=30) == 1
    finally:
        agent.close()
    counts = [decode_update(env.payload)[0].species_counts for env in coordinator.updates]
    # Assert: round 1 all three join cohort 1; round 2 the zebras' NT is halted in cohort 1; round 3 cohort 1 has
    # retired and the new cohort holds nothing
    assert [dict(c) for c in counts] == [{0: 1.0, 1: 2.0}, {0: 1.0, 1: 0.0}, {0: 0.0, 1: 0.0}]
