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


def test_max_staleness_rides_only_in_buffered_tasks():
    assert "max_staleness" not in task().to_json()  # synchronous rounds: an older gateway reads the task as before
    back, _ = decode_task(encode_task(task(max_staleness=3), W))
    assert back.max_staleness == 3 and back.to_json()["max_staleness"] == 3
    for bad in (-1, 1.5, True):
        with pytest.raises(PayloadError, match="max_staleness"):
            task(max_staleness=bad)


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


# ---- Global DP mode: secagg settings in the task, SECAGG stage messages ------------------------------------------

def secagg(**kw):
    from shared.protocol import SecAggSettings

    base = dict(site_ids=("b", "a", "c"), threshold=2, vector_length=8, max_abs_value=4.0, scale=2.0 ** 20)
    base.update(kw)
    return SecAggSettings(**base)


def test_global_task_round_trip_and_rules():
    t = task(privacy="global", local_steps=1, secagg=secagg(), noise_multiplier=1.5)
    back, _ = decode_task(encode_task(t, W))
    assert back == t and back.secagg.params("f", 2).site_ids == ("a", "b", "c") and back.noise_multiplier == 1.5
    # a ccdp task leaves the fields out, so older gateways read it unchanged
    assert "secagg" not in task().to_json() and "noise_multiplier" not in task().to_json()
    with pytest.raises(PayloadError, match="exactly 1 local step"):
        task(privacy="global", local_steps=5, secagg=secagg(), noise_multiplier=1.5)
    with pytest.raises(PayloadError, match="carry secagg"):
        task(privacy="global", local_steps=1)
    with pytest.raises(PayloadError, match="positive noise_multiplier"):
        task(privacy="global", local_steps=1, secagg=secagg())
    with pytest.raises(PayloadError, match="only for global"):
        task(secagg=secagg())
    with pytest.raises(PayloadError, match="noise_multiplier is only for global"):
        task(noise_multiplier=1.0)
    with pytest.raises(PayloadError, match="threshold"):
        task(privacy="global", local_steps=1, secagg=secagg(threshold=1), noise_multiplier=1.5)  # 2t > n fails
    with pytest.raises(PayloadError, match="wrap"):
        task(privacy="global", local_steps=1, secagg=secagg(scale=2.0 ** 29), noise_multiplier=1.5)


def test_colluding_sites_rides_in_the_secagg_settings_and_is_optional():
    from shared.protocol import SecAggSettings

    # Prepare: a distributed task whose shares survive one colluder (f = 1 < t = 2)
    t = task(privacy="global", local_steps=1, secagg=secagg(colluding_sites=1), noise_multiplier=1.5,
             distributed_noise=True)
    # Execute
    back, _ = decode_task(encode_task(t, W))
    # Assert: carried; a task written without the field (f = 0) reads as f = 0 and leaves it out of its JSON
    assert back.secagg.colluding_sites == 1 and t.to_json()["secagg"]["colluding_sites"] == 1
    plain = task(privacy="global", local_steps=1, secagg=secagg(), noise_multiplier=1.5, distributed_noise=True)
    body = plain.to_json()["secagg"]
    assert "colluding_sites" not in body and SecAggSettings.from_json(body).colluding_sites == 0
    with pytest.raises(PayloadError, match="fields"):
        SecAggSettings.from_json({**body, "colluders": 1})  # an unknown field is refused, as ever
    for bad in (2, -1, True, 1.0):  # f < t = 2, a non-negative integer
        with pytest.raises(PayloadError, match="colluding_sites"):
            secagg(colluding_sites=bad)
    with pytest.raises(PayloadError, match="only for distributed"):
        task(privacy="global", local_steps=1, secagg=secagg(colluding_sites=1), noise_multiplier=1.5)


def test_global_task_carries_the_feature_centre_digest_and_checks_it():
    digest = "ab" * 32
    t = task(privacy="global", local_steps=1, secagg=secagg(), noise_multiplier=1.5, feature_centre=digest)
    back, _ = decode_task(encode_task(t, W))
    assert back.feature_centre == digest
    assert "feature_centre" not in task(privacy="global", local_steps=1, secagg=secagg(),
                                        noise_multiplier=1.5).to_json()
    with pytest.raises(PayloadError, match="feature_centre is only for global"):
        task(feature_centre=digest)
    with pytest.raises(PayloadError, match="hex SHA-256"):
        task(privacy="global", local_steps=1, secagg=secagg(), noise_multiplier=1.5, feature_centre="AB" * 32)


def test_ccdp_variant_is_carried_and_checked():
    assert task().to_json()["ccdp_variant"] == "sample"
    t = task(ccdp_variant="scale")
    back, _ = decode_task(encode_task(t, W))
    assert back.ccdp_variant == "scale"
    with pytest.raises(PayloadError, match="ccdp_variant must be one of"):
        task(ccdp_variant="split")


def test_prediction_offsets_are_carried_as_floats_and_checked():
    assert "prediction_offsets" not in task().to_json()  # absent when off: older gateways read the same JSON
    t = task(prediction_offsets=[0.25, -0.25])
    back, _ = decode_task(encode_task(t, W))
    assert back.prediction_offsets == (0.25, -0.25) and back == t
    for bad in ([0.1], [0.1, float("nan")], [True, 0.0], "0.1,0.2", {"a": 0.1, "b": 0.2}):
        with pytest.raises(PayloadError, match="prediction_offsets"):
            task(prediction_offsets=bad)


def test_secagg_messages_round_trip_and_refuse_misplaced_parts():
    from shared.protocol import COORDINATOR_STAGES, SITE_STAGES, SecAggMessage, decode_secagg, encode_secagg

    masked = np.arange(5, dtype=np.uint32)
    msg = decode_secagg(encode_secagg(SecAggMessage("masked", {"num_examples": 3, "categories": ["LC"]}, masked)),
                        stages=SITE_STAGES)
    assert msg.stage == "masked" and msg.body == {"num_examples": 3, "categories": ["LC"]}
    np.testing.assert_array_equal(msg.masked, masked)
    # a site stage is refused where coordinator stages are expected, and the other way round
    with pytest.raises(PayloadError, match="not one of"):
        decode_secagg(encode_secagg(SecAggMessage("keys", {})), stages=COORDINATOR_STAGES)
    with pytest.raises(PayloadError, match="only with it"):
        encode_secagg(SecAggMessage("keys", {}, masked))
    with pytest.raises(PayloadError, match="only with it"):
        encode_secagg(SecAggMessage("masked", {}))
    # a float vector is not a masked vector
    bad = encode_tensors({"masked": np.zeros(3, np.float32)},
                         {"wildfed": json.dumps({"stage": "masked", "body": {}})})
    with pytest.raises(PayloadError, match="uint32/uint64"):
        decode_secagg(bad, stages=SITE_STAGES)


def test_canonical_flatten_orders_by_name():
    from shared.protocol import canonical_flatten, canonical_unflatten

    flat = canonical_flatten({"z": np.array([1.0, 2.0], np.float32), "a": np.array([[3.0]], np.float32)})
    np.testing.assert_array_equal(flat, [3.0, 1.0, 2.0])
    back = canonical_unflatten(flat, {"z": np.zeros(2, np.float32), "a": np.zeros((1, 1), np.float32)})
    np.testing.assert_array_equal(back["a"], [[3.0]]) and np.testing.assert_array_equal(back["z"], [1.0, 2.0])
    with pytest.raises(PayloadError, match="3 values"):
        canonical_unflatten(np.zeros(4), {"z": np.zeros(2), "a": np.zeros((1, 1))})
