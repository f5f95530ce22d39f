"""Keys on disk (mode 0600), safetensors codec, topic layout."""

import os
import stat

import numpy as np
import pytest

from shared.codec import decode_tensors, encode_tensors, model_hash
from shared.errors import ConfigError, MalformedEnvelopeError, PayloadError
from shared.keys import (generate_signing_key, key_fingerprint, load_private_key, load_public_key,
                         save_private_key, save_public_key)
from shared.topics import parse_topic, task_topic, update_topic, updates_filter


def test_private_key_written_0600_and_reloads(tmp_path):
    key = generate_signing_key()
    path = save_private_key(key, tmp_path / "keys" / "site.pem")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = load_private_key(path)
    assert key_fingerprint(again.public_key()) == key_fingerprint(key.public_key())
    pub = save_public_key(key.public_key(), tmp_path / "site.pub")
    assert key_fingerprint(load_public_key(pub)) == key_fingerprint(key.public_key())


def test_loose_permissions_and_garbage_are_refused(tmp_path):
    path = save_private_key(generate_signing_key(), tmp_path / "k.pem")
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_private_key(path)
    bad = tmp_path / "bad.pub"
    bad.write_text("not a key")
    with pytest.raises(ConfigError, match="bad.pub"):
        load_public_key(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_private_key(tmp_path / "missing.pem")


def test_codec_round_trip_with_metadata():
    tensors = {"phi.w": np.arange(12, dtype=np.float32).reshape(3, 4), "n": np.array([5], dtype=np.int64)}
    data = encode_tensors(tensors, {"k": "v"})
    back, meta = decode_tensors(data)
    assert meta == {"k": "v"}
    assert set(back) == set(tensors)
    for name in tensors:
        assert back[name].dtype == tensors[name].dtype
        np.testing.assert_array_equal(back[name], tensors[name])


def test_model_hash_is_content_hash():
    a = {"x": np.zeros(3, np.float32), "y": np.ones(2, np.float32)}
    b = {"y": np.ones(2, np.float32), "x": np.zeros(3, np.float32)}
    assert model_hash(a) == model_hash(b)
    b["x"][0] = 1e-7
    assert model_hash(a) != model_hash(b)


@pytest.mark.parametrize("data", [b"", b"\x05\x00\x00\x00\x00\x00\x00\x00{}", b"\x02\x00\x00\x00\x00\x00\x00\x00[]",
                                  b"\xff" * 16])
def test_codec_rejects_garbage(data):
    with pytest.raises(PayloadError):
        decode_tensors(data)


def test_codec_refuses_pickle_like_objects():
    with pytest.raises(PayloadError):
        encode_tensors({"x": [1, 2, 3]})  # type: ignore[dict-item]


def test_topics():
    assert task_topic("fed", "s1") == "wildfed/v1/fed/site/s1/task"
    assert parse_topic(update_topic("fed", "s1")) == ("fed", "s1", "update")
    assert updates_filter("fed") == "wildfed/v1/fed/site/+/update"
    for bad in ["wildfed/v1/fed/site/s1", "other/v1/fed/site/s1/task", "wildfed/v1/fed/site/s 1/task"]:
        with pytest.raises(MalformedEnvelopeError):
            parse_topic(bad)
    with pytest.raises(MalformedEnvelopeError):
        task_topic("fed", "+")
