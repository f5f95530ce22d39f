"""Payload codecs: round trips and rejection of malformed payloads."""

import json

import numpy as np
import pytest

from shared.codec import encode_tensors
from shared.errors import PayloadError
from shared.iucn import CCDPBudget, IUCNCategory
from shared.privacy.events import DPSGDEvent
from shared.protocol import (Ack, TrainingTask, UpdateReport, decode_ack, decode_task, decode_update, encode_ack,
                             encode_task, encode_update)

W = {"phi.0.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "psi.bias": np.zeros(2, np.float32)}


def task(**kw):
    base = dict(federation_id="f", round=2, model_hash="c" * 64, local_steps=5, expected_batch_size=32,
                learning_rate=0.5, clipping_norm=1.0, target_delta=1e-5, planned_rounds=10,
                budgets=CCDPBudget.from_max(2.0, 1.0).table(), halted=(IUCNCategory.EN, IUCNCategory.CR), seed=None)
    base.update(kw)
    return TrainingTask(**base)


def test_task_round_trip():
    t = task()
    back, weights = decode_task(encode_task(t, W))
    assert back == t and back.halted == (IUCNCategory.CR, IUCNCategory.EN)
    for k in W:
        np.testing.assert_array_equal(weights[k], W[k])


def test_update_and_ack_round_trip():
    r = UpdateReport(num_examples=120, local_steps=5, events={IUCNCategory.LC: DPSGDEvent(1.5, 0.25, 5)})
    back, delta = decode_update(encode_update(r, W))
    assert back == r and set(delta) == set(W)
    assert decode_ack(encode_ack(Ack(3, False, "duplicate"))) == Ack(3, False, "duplicate")


@pytest.mark.parametrize("kw", [dict(local_steps=0), dict(clipping_norm=-1.0), dict(target_delta=1.0),
                                dict(privacy="laplace"), dict(budgets={"XX": 1.0}), dict(budgets={})])
def test_task_bad_values(kw):
    with pytest.raises(PayloadError):
        task(**kw)


def test_update_rejects_non_finite_and_wrong_dtype_and_unknown_fields():
    r = UpdateReport(num_examples=1, local_steps=1)
    with pytest.raises(PayloadError, match="non-finite"):
        decode_update(encode_tensors({"w": np.array([np.nan], np.float32)}, {"wildfed": json.dumps(r.to_json())}))
    with pytest.raises(PayloadError, match="float32"):
        decode_update(encode_tensors({"w": np.array([1.0])}, {"wildfed": json.dumps(r.to_json())}))
    with pytest.raises(PayloadError, match="unknown fields"):
        decode_update(encode_tensors({}, {"wildfed": json.dumps({**r.to_json(), "loss": 0.1})}))
    with pytest.raises(PayloadError, match="metadata"):
        decode_update(encode_tensors({}, {}))
