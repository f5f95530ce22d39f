"""The SOFTWARE payload (shared.software): files carried byte for byte, every file checked against the signed
listing, and nothing but a well-formed release decoded."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from shared.codec import decode_tensors, encode_tensors
from shared.errors import PayloadError
from shared.software import (METADATA_KEY, SoftwareRelease, WheelFile, decode_software, encode_software,
                             sdk_wheel_version)

SDK = "wildfed-0.2.0-py3-none-any.whl"
DEP = "numpy-2.1.0-cp311-cp311-manylinux_2_17_x86_64.whl"


def _release(**files: bytes) -> tuple[SoftwareRelease, bytes]:
    return encode_software(federation_id="fed-a", issued=1_700_000_000, confirm_within_s=600,
                           wheels=files or {DEP: b"dependency bytes", SDK: b"sdk wheel bytes \x00\xff"})


def test_wheel_versions_are_read_from_pep_427_names() -> None:
    assert sdk_wheel_version(SDK) == "0.2.0"
    assert sdk_wheel_version("wildfed-1.0rc1-py3-none-any.whl") == "1.0rc1"
    assert sdk_wheel_version(DEP) is None and sdk_wheel_version("wildfed.tar.gz") is None


def test_a_release_round_trips_with_the_sdk_wheel_first_and_hashes_of_the_bytes() -> None:
    release, payload = _release()
    assert release.version == "0.2.0" and [w.name for w in release.wheels] == [SDK, DEP]
    assert release.sdk_wheel.sha256 == hashlib.sha256(b"sdk wheel bytes \x00\xff").hexdigest()
    decoded, files = decode_software(payload)
    assert decoded == release
    assert files == {SDK: b"sdk wheel bytes \x00\xff", DEP: b"dependency bytes"}


def _tampered(payload: bytes, edit) -> bytes:
    tensors, meta = decode_tensors(payload)
    body = json.loads(meta[METADATA_KEY])
    tensors, body = edit(tensors, body)
    return encode_tensors(tensors, {METADATA_KEY: json.dumps(body)})


@pytest.mark.parametrize("edit, message", [
    (lambda t, b: ({**t, f"wheels/{SDK}": np.frombuffer(b"other sdk bytes \x00\xff", np.uint8)}, b), "SHA-256"),
    (lambda t, b: ({k: v for k, v in t.items() if DEP not in k}, b), "differ from the release's listing"),
    (lambda t, b: (t, {**b, "channel": "beta"}), "unknown fields"),
    (lambda t, b: (t, {k: v for k, v in b.items() if k != "issued"}), "fields missing"),
    (lambda t, b: (t, {**b, "version": "0.3.0"}), "first wheel must be the SDK wheel wildfed-0.3.0"),
    (lambda t, b: (t, {**b, "confirm_within_s": 0}), "confirm_within_s"),
    (lambda t, b: (t, {**b, "wheels": [{**b["wheels"][0], "name": "../evil.whl"}, b["wheels"][1]]}),
     "not a plain .whl file name"),
    (lambda t, b: ({**t, f"wheels/{DEP}": np.frombuffer(b"dependency bytes", np.uint8).astype(np.int16)}, b),
     "not a uint8 vector"),
])
def test_a_release_that_differs_from_its_listing_is_refused(edit, message) -> None:
    _, payload = _release()
    with pytest.raises(PayloadError, match=message):
        decode_software(_tampered(payload, edit))


def test_a_release_holds_exactly_one_sdk_wheel() -> None:
    with pytest.raises(PayloadError, match="exactly one SDK wheel"):
        _release(**{DEP: b"x"})
    with pytest.raises(PayloadError, match="exactly one SDK wheel"):
        _release(**{SDK: b"x", "wildfed-0.3.0-py3-none-any.whl": b"y"})
    with pytest.raises(PayloadError, match="size must be a positive integer"):
        WheelFile(SDK, "0" * 64, 0)
