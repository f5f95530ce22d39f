"""Envelope: sign/verify round trip, tamper detection, wrong key, strict parsing; the format-2 payload digest (a BLAKE3
hash list) against a computation by hand with the ``blake3`` library, and the refusal of format 1."""

import json
import struct

import blake3
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shared.envelope
from shared.envelope import (DOMAIN, Envelope, EnvelopeHeader, MessageKind, payload_digest, payload_digest_from_leaves,
                             payload_leaves, seal, verify)
from shared.errors import MalformedEnvelopeError, SignatureError, UnsupportedVersionError
from shared.keys import generate_signing_key

KEY = generate_signing_key()
OTHER = generate_signing_key()


CONTEXT = "WildFed 2025-06-01 12:00:00 envelope payload digest v2"  # spelled out: the test does not import it


def _by_hand(payload: bytes, piece: int) -> str:
    """The format-2 payload digest written out with the blake3 library: leaves over ``piece``-byte pieces, then
    derive_key over the piece size (8 bytes, big-endian) and the leaves."""
    leaves = [blake3.blake3(payload[i:i + piece]).digest() for i in range(0, len(payload), piece)]
    return blake3.blake3(piece.to_bytes(8, "big") + b"".join(leaves), derive_key_context=CONTEXT).hexdigest()


def make(payload: bytes = b"payload-bytes") -> Envelope:
    return seal(private_key=KEY, federation_id="fed-1", site_id="site_01", round=3, base_model_hash="ab" * 32,
                kind=MessageKind.UPDATE, sequence=7, payload=payload, timestamp=1_700_000_000_000)


def test_round_trip_verifies_and_preserves_fields():
    env = make()
    back = Envelope.from_bytes(env.to_bytes())
    verify(back, KEY.public_key())
    assert back == env
    assert back.header.payload_digest == _by_hand(b"payload-bytes", 256 * 1024)
    assert back.header.piece_size == 256 * 1024 and back.header.format_version == 2
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


# ---- format 2: the payload digest ------------------------------------------------------------------------------
def test_leaves_and_digest_of_a_payload_not_a_multiple_of_the_piece_size_match_a_computation_by_hand():
    # Prepare: 2,561 bytes in pieces of 1,024 -> pieces of 1,024, 1,024 and 513 bytes
    payload = bytes(range(256)) * 10 + b"x"
    # Execute
    leaves = payload_leaves(payload, 1024)
    # Assert
    assert leaves == [blake3.blake3(payload[:1024]).digest(), blake3.blake3(payload[1024:2048]).digest(),
                      blake3.blake3(payload[2048:]).digest()]
    assert len(payload[2048:]) == 513
    expected = blake3.blake3(b"\x00\x00\x00\x00\x00\x00\x04\x00" + b"".join(leaves),
                             derive_key_context=CONTEXT).hexdigest()
    assert payload_digest_from_leaves(leaves, 1024) == expected == payload_digest(payload, 1024)
    env = make_sized(payload, 1024)
    assert env.header.payload_digest == expected and env.header.payload_length == 2561
    verify(Envelope.from_bytes(env.to_bytes()), KEY.public_key())


def make_sized(payload: bytes, piece_size: int) -> Envelope:
    return seal(private_key=KEY, federation_id="fed-1", site_id="site_01", round=3, base_model_hash="ab" * 32,
                kind=MessageKind.UPDATE, sequence=7, payload=payload, timestamp=1_700_000_000_000,
                piece_size=piece_size)


def test_an_empty_payload_has_no_leaves_and_the_digest_of_the_piece_size_alone():
    env = make_sized(b"", 1024)
    assert payload_leaves(b"", 1024) == []
    assert env.header.payload_digest == blake3.blake3(struct.pack(">Q", 1024), derive_key_context=CONTEXT).hexdigest()
    back = Envelope.from_bytes(env.to_bytes())
    verify(back, KEY.public_key())
    assert back.payload == b"" and back.header.payload_length == 0


def test_the_piece_size_is_part_of_the_digest_and_signed():
    payload = b"z" * 5000
    a, b = make_sized(payload, 1024), make_sized(payload, 2048)
    assert a.header.payload_digest == _by_hand(payload, 1024) != b.header.payload_digest == _by_hand(payload, 2048)
    # a header that claims another piece size no longer verifies (the signature covers it)
    forged = Envelope(header=EnvelopeHeader(**{**a.header.__dict__, "piece_size": 2048,
                                               "payload_digest": b.header.payload_digest}),
                      signature=a.signature, payload=payload)
    with pytest.raises(SignatureError):
        verify(forged, KEY.public_key())


@pytest.mark.parametrize("piece_size", [1000, 512, 0, 3 * 1024, 1 << 31, 1024.0, True])
def test_a_piece_size_that_is_not_a_power_of_two_in_range_is_refused_naming_the_field(piece_size):
    with pytest.raises(MalformedEnvelopeError, match="piece_size"):
        make_sized(b"abc", piece_size)


def test_an_altered_piece_fails_verification():
    payload = bytes(4096)
    env = make_sized(payload, 1024)
    altered = bytearray(payload)
    altered[3000] = 1  # inside the third piece
    with pytest.raises(SignatureError, match="digest"):
        verify(Envelope(header=env.header, signature=env.signature, payload=bytes(altered)), KEY.public_key())


def test_seal_and_verify_hash_each_payload_byte_once(monkeypatch):
    # Prepare: count the bytes that go through the one function that hashes payload bytes
    hashed: list[int] = []
    real = shared.envelope.hash_piece
    monkeypatch.setattr(shared.envelope, "hash_piece", lambda piece: (hashed.append(len(piece)), real(piece))[1])
    payload = bytes(range(256)) * 40 + b"tail"  # 10,244 bytes: 10 full pieces of 1 KiB and one of 4 bytes
    # Execute / Assert
    env = make_sized(payload, 1024)
    assert hashed == [1024] * 10 + [4]
    hashed.clear()
    verify(Envelope.from_bytes(env.to_bytes()), KEY.public_key())
    assert sum(hashed) == len(payload) == 10_244


def _v1_wire() -> bytes:
    """A format-1 envelope as the previous release wrote it: the header names payload_sha256."""
    import hashlib

    payload = b"payload-bytes"
    header = {"base_model_hash": "", "federation_id": "f", "format_version": 1, "kind": "update",
              "payload_length": len(payload), "payload_sha256": hashlib.sha256(payload).hexdigest(), "round": 0,
              "sequence": 0, "site_id": "s", "timestamp": 1_700_000_000_000}
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return b"WFE1" + len(raw).to_bytes(4, "big") + raw + b"\x00" * 64 + payload


def test_a_format_1_envelope_is_refused_naming_the_version_and_the_fix():
    with pytest.raises(UnsupportedVersionError, match="format_version 1 is retired") as info:
        Envelope.from_bytes(_v1_wire())
    assert "same WildFed release" in str(info.value) and info.value.reason == "unsupported_version"
    assert isinstance(info.value, MalformedEnvelopeError)  # receivers that refuse malformed envelopes refuse it


def test_a_newer_format_is_refused_as_newer():
    env = make()
    header = env.header.canonical_bytes().replace(b'"format_version":2', b'"format_version":3')
    wire = b"WFE1" + len(header).to_bytes(4, "big") + header + env.signature + env.payload
    with pytest.raises(UnsupportedVersionError, match="format_version 3 is newer"):
        Envelope.from_bytes(wire)


def test_readdress_keeps_the_payload_and_its_digest_and_signs_the_new_site():
    """One task payload for many sites: ``readdress`` changes the site and timestamp, re-signs, and keeps
    the payload object and its leaves; the result verifies (its digest recomputed here by hand) and nothing else in
    the header moves."""
    payload = bytes(range(256)) * 40  # 10,240 bytes: 3 pieces of 4 KiB
    first = seal(private_key=KEY, federation_id="fed-1", site_id="site_01", round=3, base_model_hash="ab" * 32,
                 kind=MessageKind.TASK, sequence=3, payload=payload, timestamp=1_700_000_000_000, piece_size=4096)
    other = shared.envelope.readdress(first, private_key=KEY, site_id="site_02", timestamp=1_700_000_000_123)
    assert other.payload is first.payload and other.leaves == first.leaves
    assert list(other.leaves) == [blake3.blake3(payload[i:i + 4096]).digest() for i in (0, 4096, 8192)]
    assert other.header.site_id == "site_02" and other.header.timestamp == 1_700_000_000_123
    assert other.header.payload_digest == _by_hand(payload, 4096)
    moved = {k for k, v in vars(other.header).items() if v != vars(first.header)[k]}
    assert moved == {"site_id", "timestamp"}
    verify(Envelope.from_bytes(other.to_bytes()), KEY.public_key())
    with pytest.raises(SignatureError):
        verify(Envelope.from_bytes(other.to_bytes()), OTHER.public_key())
    with pytest.raises(MalformedEnvelopeError):
        shared.envelope.readdress(first, private_key=KEY, site_id="no/slashes")


def test_head_bytes_is_the_wire_form_without_the_payload():
    env = make(b"x" * 100)
    assert env.to_bytes() == env.head_bytes() + b"x" * 100
    assert env.wire_length == len(env.to_bytes()) == len(env.head_bytes()) + 100
    assert Envelope.from_bytes(env.head_bytes()).payload == b""  # the head parses on its own, payload empty


def test_immutable_view_never_aliases_a_writable_buffer():
    """bytes and read-only views of bytes are viewed in place; a bytearray is copied, so changing it afterwards
    changes nothing seen through the view."""
    data = b"abcdef"
    assert shared.envelope.immutable_view(data).obj is data
    buf = bytearray(b"abcdef")
    view = shared.envelope.immutable_view(buf)
    buf[0] = ord("z")
    assert bytes(view) == b"abcdef" and view.readonly


def test_canonical_bytes_are_the_sorted_compact_json_of_the_fields_and_follow_replace():
    """The header's canonical encoding, kept once computed, equals the encoding written out by hand from the
    fields, and a header made by ``dataclasses.replace`` (another round) gets its own encoding, not the cached one."""
    import dataclasses
    import json as _json

    header = make().header
    by_hand = ('{"base_model_hash":"' + "ab" * 32 + '","federation_id":"fed-1","format_version":2,"kind":"update",'
               f'"payload_digest":"{header.payload_digest}","payload_length":13,"piece_size":262144,"round":3,'
               '"sequence":7,"site_id":"site_01","timestamp":1700000000000}').encode()
    assert header.canonical_bytes() == by_hand
    assert header.canonical_bytes() is header.canonical_bytes()  # computed once
    other = dataclasses.replace(header, round=4)
    assert _json.loads(other.canonical_bytes())["round"] == 4 and other.canonical_bytes() != by_hand
    assert other == dataclasses.replace(header, round=4) and set(vars(header)) == set(header.__dataclass_fields__)
