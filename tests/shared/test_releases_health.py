"""The MODEL and HEALTH payloads round-trip, and their decoders refuse what they must."""

from __future__ import annotations

import json

import numpy as np
import pytest

from shared.codec import encode_tensors
from shared.errors import PayloadError
from shared.health import (DISK_FREE_STEP_BYTES, MAX_ERROR_CHARS, HealthRecord, decode_health, encode_health,
                           round_disk_free)
from shared.releases import ModelRelease, decode_release, encode_release
from shared.topics import model_chunk_topic, model_filter, model_topic, parse_topic

H = "ab" * 32


def _record(**overrides: object) -> HealthRecord:
    fields = dict(sdk_version="0.1.0", model_round=3, model_hash=H, last_round=4, outbox_backlog=1,
                  incoming_backlog=12, detection_backlog=0, disk_free_bytes=5 * DISK_FREE_STEP_BYTES,
                  last_error="site s1: round 4 update refused", last_error_at=1_700_000_000, started_at=1_699_990_000)
    fields.update(overrides)
    return HealthRecord(**fields)  # type: ignore[arg-type]


def test_a_release_round_trips_with_its_weights_and_offsets() -> None:
    weights = {"psi.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "psi.bias": np.zeros(2, np.float32)}
    release = ModelRelease(federation_id="fed", round=7, model_hash=H, prediction_offsets=(0.25, -0.25))
    back, got = decode_release(encode_release(release, weights))
    assert back == release and back.prediction_offsets == (0.25, -0.25)
    assert set(got) == set(weights)
    for name in weights:
        np.testing.assert_array_equal(got[name], weights[name])


@pytest.mark.parametrize("payload, message", [
    (encode_tensors({"w": np.zeros(2, np.float64)}, {"wildfed": json.dumps(
        {"federation_id": "fed", "round": 1, "model_hash": H})}), "float32"),
    (encode_tensors({"w": np.array([np.nan], np.float32)}, {"wildfed": json.dumps(
        {"federation_id": "fed", "round": 1, "model_hash": H})}), "non-finite"),
    (encode_tensors({"w": np.zeros(2, np.float32)}, {"wildfed": json.dumps(
        {"federation_id": "fed", "round": 1, "model_hash": H, "extra": 1})}), "unknown"),
    (encode_tensors({"w": np.zeros(2, np.float32)}, {"wildfed": json.dumps(
        {"federation_id": "fed", "round": 0, "model_hash": H})}), "round"),
    (encode_tensors({}, {"wildfed": json.dumps({"federation_id": "fed", "round": 1, "model_hash": H})}), "no weights"),
    (b"not safetensors", "safetensors"),
])
def test_a_release_that_is_not_one_is_refused(payload: bytes, message: str) -> None:
    with pytest.raises(PayloadError, match=message):
        decode_release(payload)


def test_a_health_record_round_trips_and_carries_exactly_its_declared_fields() -> None:
    record = _record()
    assert decode_health(encode_health(record)) == record
    assert set(record.to_json()) == {"sdk_version", "model_round", "model_hash", "last_round", "outbox_backlog",
                                     "incoming_backlog", "detection_backlog", "disk_free_bytes", "last_error",
                                     "last_error_at", "started_at"}
    assert decode_health(encode_health(_record(model_round=None, model_hash="", incoming_backlog=None,
                                               detection_backlog=None, disk_free_bytes=None, last_error="",
                                               last_error_at=None, last_round=-1))).model_round is None


@pytest.mark.parametrize("overrides, message", [
    ({"last_error": "x" * (MAX_ERROR_CHARS + 1)}, "last_error"),
    ({"disk_free_bytes": DISK_FREE_STEP_BYTES + 1}, "whole GiB"),
    ({"model_hash": ""}, "together"),
    ({"outbox_backlog": -1}, "outbox_backlog"),
    ({"sdk_version": "1.0 beta"}, "version"),
    ({"last_round": -2}, "last_round"),
])
def test_a_health_record_out_of_range_is_refused(overrides: dict, message: str) -> None:
    with pytest.raises(PayloadError, match=message):
        _record(**overrides)


def test_a_health_payload_with_tensors_or_unknown_fields_is_refused() -> None:
    body = _record().to_json()
    with pytest.raises(PayloadError, match="no tensors"):
        decode_health(encode_tensors({"x": np.zeros(1, np.float32)}, {"wildfed": json.dumps(body)}))
    with pytest.raises(PayloadError, match="unknown"):
        decode_health(encode_tensors({}, {"wildfed": json.dumps({**body, "species": ["Panthera leo"]})}))


def test_disk_free_is_rounded_down_to_whole_gib() -> None:
    assert round_disk_free(3 * DISK_FREE_STEP_BYTES - 1) == 2 * DISK_FREE_STEP_BYTES
    assert round_disk_free(DISK_FREE_STEP_BYTES) == DISK_FREE_STEP_BYTES
    assert round_disk_free(-5) == 0


def test_model_topics_and_their_filter() -> None:
    assert model_topic("fed", "s1") == "wildfed/v1/fed/site/s1/model"
    assert model_chunk_topic("fed", "s1", 3) == "wildfed/v1/fed/site/s1/model/3"
    assert model_filter("fed", "s1") == "wildfed/v1/fed/site/s1/model/#"
    assert parse_topic("wildfed/v1/fed/site/s1/model") == ("fed", "s1", "model")
    assert parse_topic("wildfed/v1/fed/site/s1/health") == ("fed", "s1", "health")
