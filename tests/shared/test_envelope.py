"""Envelope: sign/verify round trip, tamper detection, wrong key, strict parsing."""

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.envelope import DOMAIN, Envelope, MessageKind, seal, verify
from shared.errors import MalformedEnvelopeError, SignatureError
from shared.keys import generate_signing_key

KEY = generate_signing_key()
OTHER = generate_signing_key()


def make(payload: bytes = b"payload-bytes") -> Envelope:
    return seal(private_key=KEY, federation_id="fed-1", site_id="site_01", round=3, base_model_hash="ab" * 32,
                kind=MessageKind.UPDATE, sequence=7, payload=payload, timestamp=1_700_000_000_000)


def test_round_trip_verifies_and_preserves_fields():
    env = make()
    back = Envelope.from_bytes(env.to_bytes())
    verify(back, KEY.public_key())
    assert back == env
    assert back.header.payload_sha256 == hashlib.sha256(b"payload-bytes").hexdigest()
    assert back.header.payload_length == len(b"payload-bytes")
    # The signature is an ordinary Ed25519 signature over domain + canonical header: a second check by hand.
    KEY.public_key().verify(back.signature, DOMAIN + back.header.canonical_bytes())


def test_every_flipped_byte_fails():
    wire = make(b"\x00\x01tensors").to_bytes()
    for i in range(len(wire)):
        tampered = bytearray(wire)
        tampered[i] ^= 0x01
        with pytest.raises((SignatureError, MalformedEnvelopeError)):
            verify(Envelope.from_bytes(bytes(tampered)), KEY.public_key())


def test_wrong_key_fails():
    with pytest.raises(SignatureError):
        verify(make(), OTHER.public_key())


def test_truncated_and_appended_payload_fail():
    wire = make().to_bytes()
    with pytest.raises(SignatureError):
        verify(Envelope.from_bytes(wire[:-1]), KEY.public_key())
    with pytest.raises(SignatureError):
        verify(Envelope.from_bytes(wire + b"x"), KEY.public_key())


@pytest.mark.parametrize("data", [b"", b"WFE1", b"XXXX\x00\x00\x00\x02{}" + b"\x00" * 64,
                                  b"WFE1\xff\xff\xff\xff", b"WFE1\x00\x00\x00\x02{}" + b"\x00" * 64])
def test_malformed_bytes_are_rejected(data):
    with pytest.raises(MalformedEnvelopeError):
        Envelope.from_bytes(data)


@pytest.mark.parametrize("field,value", [("site_id", "../etc"), ("site_id", "a/b"), ("federation_id", ""),
                                         ("round", -1), ("sequence", 1.5), ("base_model_hash", "xyz")])
def test_bad_header_fields_are_rejected(field, value):
    kwargs = dict(private_key=KEY, federation_id="f", site_id="s", round=0, base_model_hash="",
                  kind="task", sequence=0, payload=b"")
    kwargs[field] = value
    with pytest.raises(MalformedEnvelopeError):
        seal(**kwargs)


def test_non_canonical_header_is_rejected():
    env = make()
    header = env.header.canonical_bytes().replace(b",", b", ", 1)
    wire = b"WFE1" + len(header).to_bytes(4, "big") + header + env.signature + env.payload
    with pytest.raises(MalformedEnvelopeError):
        Envelope.from_bytes(wire)


@settings(max_examples=50, deadline=None)
@given(payload=st.binary(max_size=512), round_=st.integers(0, 2**40), seq=st.integers(0, 2**40),
       kind=st.sampled_from(list(MessageKind)))
def test_round_trip_property(payload, round_, seq, kind):
    env = seal(private_key=KEY, federation_id="f", site_id="s", round=round_, base_model_hash="",
               kind=kind, sequence=seq, payload=payload)
    back = Envelope.from_bytes(env.to_bytes())
    verify(back, KEY.public_key())
    assert back.payload == payload and back.header.kind is kind


def test_from_bytes_keeps_a_view_of_the_wire_bytes_not_a_copy():
    # Prepare: an update-sized payload
    payload = bytes(range(256)) * 4096
    wire = make(payload).to_bytes()
    # Execute
    back = Envelope.from_bytes(wire)
    # Assert: the payload is a read-only view into ``wire`` itself, equal to the payload and verifiable
    assert isinstance(back.payload, memoryview) and back.payload.readonly
    assert back.payload.obj is wire
    assert np.shares_memory(np.frombuffer(wire, np.uint8), np.frombuffer(back.payload, np.uint8))
    assert back.payload == payload and back == make(payload) and hash(back) == hash(make(payload))
    verify(back, KEY.public_key())
    assert Envelope.from_bytes(back.to_bytes()) == back  # it re-encodes


def test_from_bytes_of_a_read_only_view_of_bytes_does_not_copy_either():
    wire = b"transport framing|" + make().to_bytes()
    back = Envelope.from_bytes(memoryview(wire)[len(b"transport framing|"):])
    assert back.payload.obj is wire and back.payload == b"payload-bytes"
    verify(back, KEY.public_key())


@pytest.mark.parametrize("mutable", [bytearray, lambda b: memoryview(bytearray(b)),
                                     lambda b: memoryview(bytearray(b)).toreadonly()])
def test_from_bytes_copies_a_buffer_its_owner_can_still_change(mutable):
    # Prepare
    buffer = mutable(make().to_bytes())
    # Execute: parse, then the owner overwrites its buffer (e.g. a reused receive buffer)
    back = Envelope.from_bytes(buffer)
    owner = buffer.obj if isinstance(buffer, memoryview) else buffer
    owner[-len(b"payload-bytes"):] = b"X" * len(b"payload-bytes")
    # Assert: the envelope kept what it parsed
    assert back.payload == b"payload-bytes"
    verify(back, KEY.public_key())
