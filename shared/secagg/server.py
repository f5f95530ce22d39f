"""Secure aggregation, the aggregator's side of one round (Bonawitz et al. 2017, Fig. 4, server side): the running
masked sum, the recovery request, and the unmasking from the survivors' shares."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from shared.secagg.derive import agree, expand_mask, pair_sign, pairwise_mask_key, self_mask_key
from shared.secagg.errors import NotEnoughSharesError, SecAggError
from shared.secagg.messages import AdvertisedKeys, EncryptedShare, RecoveryRequest, RecoveryShares, check_advertised
from shared.secagg.params import SecAggParams
from shared.secagg.quantise import dequantise_sum, modulus_mask
from shared.secagg.shamir import Share, shamir_combine


class SecAggServer:
    """The aggregator's side of one round (Fig. 4, server side). Holds only public keys, opaque ciphertexts and a
    running masked sum mod ``2^k`` (never K updates at once).

    Call in order: :meth:`collect_keys`, :meth:`route_shares`, :meth:`add_masked` per arriving site,
    :meth:`recovery_request`, :meth:`unmask_sum` (or :meth:`unmask_integer_sum`).
    """

    def __init__(self, params: SecAggParams) -> None:
        self.params = params
        self._advertised: dict[str, AdvertisedKeys] | None = None
        self._participants: tuple[str, ...] | None = None
        self._received: list[str] = []
        self._sum = np.zeros(params.vector_length, dtype=params.dtype)
        self._request: RecoveryRequest | None = None

    def collect_keys(self, advertised: Iterable[AdvertisedKeys]) -> dict[str, AdvertisedKeys]:
        """Round 0 -> 1: fix U1 and return the key list to broadcast.

        Raises:
            NotEnoughSharesError: |U1| < t. SecAggError: a site twice, an unknown site, repeated keys.
        """
        keys: dict[str, AdvertisedKeys] = {}
        for entry in advertised:
            if entry.site_id in keys:
                raise SecAggError(f"site {entry.site_id!r} advertised keys twice")
            keys[entry.site_id] = entry
        self._advertised = check_advertised(self.params, keys)
        return dict(self._advertised)

    def route_shares(self, outgoing: Mapping[str, Mapping[str, EncryptedShare]]
                     ) -> dict[str, dict[str, EncryptedShare]]:
        """Round 1 -> 2: fix U2 = the senders, and regroup ``{sender: {recipient: share}}`` into
        ``{recipient: {sender: share}}`` for the recipients in U2 (a sender must address every other site of U1).

        Raises:
            NotEnoughSharesError: |U2| < t. SecAggError: out of order, unknown sender, missing recipients.
        """
        if self._advertised is None or self._participants is not None:
            raise SecAggError("route_shares must follow collect_keys, once")
        participants = tuple(sorted(outgoing))
        if len(participants) < self.params.threshold:
            raise NotEnoughSharesError(f"only {len(participants)} sites sent shares, threshold is "
                                       f"{self.params.threshold}; abandon this round")
        inbox: dict[str, dict[str, EncryptedShare]] = {site: {} for site in participants}
        for sender, messages in outgoing.items():
            if sender not in self._advertised:
                raise SecAggError(f"shares from {sender!r}, which did not advertise keys")
            if set(messages) != set(self._advertised) - {sender}:
                raise SecAggError(f"{sender!r} must send one share to every other site of U1")
            for recipient, message in messages.items():
                if message.sender != sender or message.recipient != recipient:
                    raise SecAggError(f"share filed under {sender!r} -> {recipient!r} is addressed otherwise")
                if recipient in inbox:
                    inbox[recipient][sender] = message
        self._participants = participants
        return inbox

    def add_masked(self, site_id: str, masked: np.ndarray) -> None:
        """Round 2: add one site's masked update to the running sum mod ``2^k``.

        Raises:
            SecAggError: the site is not in U2, sent twice, arrived after the recovery request was issued
                (a late site is treated as dropped), or the array has the wrong dtype/shape/range.
        """
        if self._participants is None:
            raise SecAggError("add_masked must follow route_shares")
        if self._request is not None:
            raise SecAggError(f"masked update of {site_id!r} arrived after the recovery request; it stays dropped")
        if site_id not in self._participants:
            raise SecAggError(f"site {site_id!r} is not in U2 (it sent no shares)")
        if site_id in self._received:
            raise SecAggError(f"site {site_id!r} sent its masked update twice")
        y = np.asarray(masked)
        if y.dtype != self.params.dtype or y.shape != (self.params.vector_length,):
            raise SecAggError(f"masked update must be {self.params.dtype} of shape ({self.params.vector_length},), "
                              f"got {y.dtype} {y.shape}")
        if self.params.modulus_bits not in (32, 64) and np.any(y > modulus_mask(self.params)):
            raise SecAggError(f"masked update has values >= 2^{self.params.modulus_bits}")
        self._received.append(site_id)
        self._sum += y
        self._sum &= modulus_mask(self.params)

    def recovery_request(self) -> RecoveryRequest:
        """Round 4: close collection and name U3 (survivors) and U2 \\ U3 (dropped). Idempotent.

        Raises:
            NotEnoughSharesError: |U3| < t: the round cannot be unmasked.
        """
        if self._participants is None:
            raise SecAggError("recovery_request must follow route_shares")
        if self._request is None:
            survivors = tuple(sorted(self._received))
            if len(survivors) < self.params.threshold:
                raise NotEnoughSharesError(f"only {len(survivors)} masked updates arrived, threshold is "
                                           f"{self.params.threshold}; abandon this round")
            self._request = RecoveryRequest(survivors, tuple(s for s in self._participants if s not in survivors))
        return self._request

    def unmask_integer_sum(self, responses: Iterable[RecoveryShares]) -> np.ndarray:
        """Round 4: reconstruct the dropped sites' mask private keys and the survivors' self-mask seeds from the
        survivors' shares, remove the masks, and return ``sum_{u in U3} Q(x_u) mod 2^k`` (``params.dtype``).

        Raises:
            NotEnoughSharesError: fewer than t shares for some secret (names it).
            SecAggError: a response from a site not in U3 or sent twice, a share for a site outside the request, a
                share at the wrong x, inconsistent shares, or a key that does not match its advertised public key.
        """
        request = self.recovery_request()
        p, d, k = self.params, self.params.vector_length, self.params.modulus_bits
        key_shares: dict[str, list[Share]] = {site: [] for site in request.dropped}
        seed_shares: dict[str, list[Share]] = {site: [] for site in request.survivors}
        seen: set[str] = set()
        for response in responses:
            if response.sender not in request.survivors or response.sender in seen:
                raise SecAggError(f"recovery shares from {response.sender!r}: not a survivor, or sent twice")
            seen.add(response.sender)
            x = p.x_coordinate(response.sender)
            for target, collected, shares in (("dropped", key_shares, response.mask_key_shares),
                                              ("survivors", seed_shares, response.self_mask_shares)):
                for owner, share in shares.items():
                    if owner not in collected:
                        raise SecAggError(f"{response.sender!r} sent a share for {owner!r}, not among the {target}")
                    if share.x != x:
                        raise SecAggError(f"{response.sender!r} sent a share at x = {share.x}, its own is {x}")
                    collected[owner].append(share)
        for kind, collected in (("mask key", key_shares), ("self-mask seed", seed_shares)):
            for owner, shares in collected.items():
                if len(shares) < p.threshold:
                    raise NotEnoughSharesError(
                        f"{len(shares)} shares of the {kind} of {owner!r}, {p.threshold} needed; wait for more "
                        "survivors' recovery shares or abandon the round")
        total = self._sum.copy()
        for u in request.survivors:
            seed = shamir_combine(seed_shares[u], threshold=p.threshold)
            total -= expand_mask(self_mask_key(seed, p, u), d, k)
        raw = serialization.Encoding.Raw, serialization.PublicFormat.Raw
        for v in request.dropped:
            private = X25519PrivateKey.from_private_bytes(shamir_combine(key_shares[v], threshold=p.threshold))
            pk_v = self._advertised[v].mask_public
            if private.public_key().public_bytes(*raw) != pk_v:
                raise SecAggError(f"reconstructed mask key of {v!r} does not match its advertised public key")
            for u in request.survivors:
                pk_u = self._advertised[u].mask_public
                mask = expand_mask(pairwise_mask_key(agree(private, pk_u), p, u, pk_u, v, pk_v), d, k)
                # survivor u added Delta_{u,v} PRG(s_{u,v}); take it back out.
                if pair_sign(u, v) > 0:
                    total -= mask
                else:
                    total += mask
        return total & modulus_mask(p)

    def unmask_sum(self, responses: Iterable[RecoveryShares]) -> np.ndarray:
        """:meth:`unmask_integer_sum`, dequantised: float64 ``sum_{u in U3} x_u`` (clipped), shape ``(d,)``, within
        :func:`quantisation_error_bound` ``(params, len(U3))`` per coordinate."""
        return dequantise_sum(self.unmask_integer_sum(responses), self.params)

    @property
    def survivors(self) -> tuple[str, ...]:
        """The sites whose masked update has been added so far (sorted)."""
        return tuple(sorted(self._received))


def unmask_sum(params: SecAggParams, *, advertised: Iterable[AdvertisedKeys],
               outgoing_shares: Mapping[str, Mapping[str, EncryptedShare]], masked_updates: Mapping[str, np.ndarray],
               responses: Iterable[RecoveryShares]) -> np.ndarray:
    """One-call server side for a round whose messages are all at hand (tests, offline replays): drives a
    :class:`SecAggServer` through keys, share routing, masked updates and recovery. Returns the float64 sum over
    the sites in ``masked_updates`` (see :meth:`SecAggServer.unmask_sum`)."""
    server = SecAggServer(params)
    server.collect_keys(advertised)
    server.route_shares(outgoing_shares)
    for site, values in masked_updates.items():
        server.add_masked(site, values)
    return server.unmask_sum(responses)
