"""No uncharged counts: two sites whose data differ by one record release the same bytes apart from the noised
payload. The update report, the secure-aggregation message body and the enrolment metadata carry the declared
capacity (a public constant), never the record count; the coordinator refuses a count at enrolment and a report
whose N_k is not the declared capacity."""

from __future__ import annotations

import json

import numpy as np
import pytest

from shared.iucn import IUCNCategory as Cat
from shared.protocol import SecAggMessage, SecAggSettings, encode_secagg, encode_update

from edge_sdk.data.camtrap_dp import LocalDataset
from edge_sdk.training import clipped_sum_locally, train_locally

from .test_training import FakeBackend, ZeroNoise, task

CATS = [Cat.CR, Cat.EN, Cat.LC]
SETTINGS = SecAggSettings(site_ids=("a", "b"), threshold=2, vector_length=2, max_abs_value=4.0, scale=2.0 ** 20)


def _data(extra: bool) -> LocalDataset:
    pixels = [(3, 4), (6, 8), (100, 100)] + ([(9, 1)] if extra else [])
    cats = [Cat.CR, Cat.LC, Cat.EN] + ([Cat.CR] if extra else [])
    n = len(pixels)
    return LocalDataset(images=np.array(pixels, np.uint8).reshape(n, 1, 2), labels=np.zeros(n, np.int64),
                        categories=np.array([c.rank for c in cats], np.int8), media_ids=tuple("abcd"[:n]))


def _metadata(payload: bytes) -> dict:
    """The JSON a payload carries (safetensors header metadata), without the tensors."""
    header_len = int.from_bytes(payload[:8], "little")
    return json.loads(json.loads(payload[8:8 + header_len])["__metadata__"]["wildfed"])


def test_neighbouring_datasets_release_identical_reports() -> None:
    tk = task(budgets={Cat.CR: 0.5, Cat.EN: 1.0, Cat.LC: 2.0}, expected_batch_size=2, capacity=100)
    results = [train_locally(backend=FakeBackend(), dataset=_data(extra), task=tk,
                             global_weights={"w": np.zeros(2, np.float32)}, site_categories=CATS,
                             randomness=ZeroNoise()) for extra in (False, True)]
    reports = [r.report for r in results]
    assert reports[0] == reports[1] and reports[0].num_examples == 100  # the capacity, not 3 or 4
    assert results[0].sampling_rate == results[1].sampling_rate == 2 / 100  # q = B / N_k
    metas = [_metadata(encode_update(r.report, r.delta)) for r in results]
    assert metas[0] == metas[1]
    assert not np.array_equal(results[0].delta["w"], results[1].delta["w"])  # only the (noised) payload differs


def test_neighbouring_datasets_send_identical_secure_aggregation_bodies() -> None:
    tk = task(expected_batch_size=2, privacy="global", local_steps=1, secagg=SETTINGS, noise_multiplier=3.0,
              capacity=100, budgets={Cat.CR: 0.5, Cat.EN: 1.0, Cat.LC: 2.0}, halted=())
    sums = [clipped_sum_locally(backend=FakeBackend(), dataset=_data(extra), task=tk,
                                global_weights={"w": np.zeros(2, np.float32)}, site_categories=CATS,
                                randomness=ZeroNoise()) for extra in (False, True)]
    bodies = [{"num_examples": s.num_examples, "categories": [c.value for c in s.categories]} for s in sums]
    assert bodies[0] == bodies[1] == {"num_examples": 100, "categories": ["CR", "EN", "LC"]}
    masked = np.zeros(2, np.uint32)
    wire = [encode_secagg(SecAggMessage("masked", b, masked)) for b in bodies]
    assert wire[0] == wire[1]


def test_an_empty_site_still_trains_and_reports_its_capacity() -> None:
    empty = LocalDataset(images=np.zeros((0, 1, 2), np.uint8), labels=np.zeros(0, np.int64),
                         categories=np.zeros(0, np.int8), media_ids=())
    result = train_locally(backend=FakeBackend(), dataset=empty, task=task(capacity=50, halted=()),
                           global_weights={"w": np.zeros(2, np.float32)}, site_categories=CATS,
                           randomness=ZeroNoise())
    assert result.report.num_examples == 50 and set(result.report.events) == set(CATS)
    np.testing.assert_array_equal(result.delta["w"], [0.0, 0.0])  # zero noise, nothing to sample


def test_the_coordinator_refuses_a_count_at_enrolment(tmp_path) -> None:
    from coordinator.registry import EnrolmentError, SiteRegistry
    from coordinator.storage import Store
    from shared.keys import generate_signing_key, public_key_to_pem

    registry = SiteRegistry(Store(f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path))
    pem = public_key_to_pem(generate_signing_key().public_key())
    with pytest.raises(EnrolmentError, match="capacity") as info:
        registry.enrol("s1", pem, {"num_examples": 1234})
    assert info.value.field == "metadata.num_examples"
    assert registry.enrol("s1", pem, {"capacity": 1000}).capacity == 1000
    # (a report whose N_k is not the capacity: tests/coordinator/test_ingest.py, test_report_sanity...)
