"""Publishing one signed envelope, retained, on a site's topic: whole, or as a signed manifest and its chunks.

Model releases (:mod:`coordinator.model_delivery`) and SDK versions (:mod:`coordinator.software_delivery`) reach a
gateway the same way: a broker retains one message per topic, so an envelope larger than ``chunk_size_bytes``
goes as its chunks on ``<topic>/0``, ``<topic>/1``, ... (each retained) and then its manifest, signed by the
coordinator, on ``<topic>`` (``shared.transfer``): the chunks first, so a manifest never names chunks that are not
retained yet. Chunk topics left over from a larger earlier envelope are cleared (an empty retained message, which
a broker does not deliver).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared.envelope import Envelope
from shared.transfer import seal_manifest, split

from coordinator.transport import Transport

__all__ = ["publish_retained"]


def publish_retained(transport: Transport, envelope: Envelope, *, topic: str, chunk_topic: Callable[[int], str],
                     chunk_size_bytes: int, signing_key: Ed25519PrivateKey, previous_chunks: int = 0) -> int:
    """Publish ``envelope`` retained on ``topic`` (module docstring).

    Args:
        transport: the coordinator's transport (QoS 1 publishes).
        envelope: the sealed envelope.
        topic: its topic; ``chunk_topic(i)`` the topic of chunk ``i``.
        chunk_size_bytes: above this wire length the envelope is chunked.
        signing_key: the coordinator's key (signs the manifest).
        previous_chunks: the number of chunk topics the envelope published before on ``topic`` used (cleared
            where this one uses fewer).

    Returns:
        The number of chunk topics this envelope uses (0 when it went whole).

    Raises:
        TransportError: a publish failed.
    """
    publish: Callable[..., Any] = transport.publish
    if envelope.wire_length <= chunk_size_bytes:
        publish(topic, envelope.to_bytes(), qos=1, retain=True)
        chunks = 0
    else:
        manifest, pieces = split(envelope)
        for chunk in pieces:
            publish(chunk_topic(chunk.index), chunk.to_bytes(), qos=1, retain=True)
        publish(topic, seal_manifest(private_key=signing_key, manifest=manifest).to_bytes(), qos=1, retain=True)
        chunks = len(pieces)
    for index in range(chunks, previous_chunks):
        publish(chunk_topic(index), b"", qos=1, retain=True)
    return chunks
