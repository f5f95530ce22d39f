"""Secure aggregation, one site's side of one round (Bonawitz et al. 2017, Fig. 4, user side)."""

from __future__ import annotations

import secrets
from collections.abc import Mapping

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from shared.secagg.derive import (agree, channel_key, expand_mask, pair_sign, pairwise_mask_key, self_mask_key,
                                  share_aad)
from shared.secagg.errors import NotEnoughSharesError, SecAggError, ShareAuthenticationError
from shared.secagg.messages import (GCM_NONCE_BYTES, AdvertisedKeys, EncryptedShare, RecoveryRequest, RecoveryShares,
                                    check_advertised)
from shared.secagg.params import SecAggParams
from shared.secagg.quantise import modulus_mask, quantise
from shared.secagg.shamir import SECRET_BYTES, SHARE_BYTES, Share, shamir_split


class SecAggClient:
    """One site's side of one round (Fig. 4, user side). Holds the round's secrets: create a new client for every
    round and never reuse one (masking twice with the same masks would reveal the difference of two updates).

    Call in order: :meth:`public_keys`, :meth:`shares_for`, :meth:`receive_shares`, :meth:`mask`,
    :meth:`reveal_for_recovery` (the last may be called again with the same request, e.g. on retransmission).
    """

    def __init__(self, site_id: str, params: SecAggParams) -> None:
        self.site_id = site_id
        self.params = params
        self._x = params.x_coordinate(site_id)
        self._channel_key = X25519PrivateKey.generate()
        self._mask_key = X25519PrivateKey.generate()
        self._self_seed = secrets.token_bytes(SECRET_BYTES)
        self._advertised: dict[str, AdvertisedKeys] | None = None
        self._held_mask_key: dict[str, Share] = {}  # owner -> my share of owner's mask private key
        self._held_self: dict[str, Share] = {}  # owner -> my share of owner's self-mask seed
        self._participants: tuple[str, ...] | None = None  # U2
        self._masked = False
        self._revealed: dict[str, str] = {}  # owner -> "mask_key" | "self_mask"

    def public_keys(self) -> AdvertisedKeys:
        """Round 0: this site's public keys."""
        raw = serialization.Encoding.Raw, serialization.PublicFormat.Raw
        return AdvertisedKeys(self.site_id, self._channel_key.public_key().public_bytes(*raw),
                              self._mask_key.public_key().public_bytes(*raw))

    def shares_for(self, advertised: Mapping[str, AdvertisedKeys]) -> dict[str, EncryptedShare]:
        """Round 1: Shamir-share this site's mask private key and self-mask seed among U1 (the sites in
        ``advertised``, t-out-of-|U1|) and encrypt each other site's pair of shares to it.

        Args:
            advertised: ``{site_id: AdvertisedKeys}`` for U1 as the server broadcast it; must contain this site's
                own keys unchanged.

        Returns:
            ``{recipient: EncryptedShare}`` for every other site of U1 (this site keeps its own shares).

        Raises:
            NotEnoughSharesError: |U1| < t. SecAggError: called twice, own keys altered, duplicate keys.
        """
        if self._advertised is not None:
            raise SecAggError("shares_for was already called in this round")
        keys = check_advertised(self.params, advertised)
        if keys.get(self.site_id) != self.public_keys():
            raise SecAggError("the broadcast key list does not hold this site's own keys unchanged")
        self._advertised = keys
        raw = serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        xs = [self.params.x_coordinate(site) for site in sorted(keys)]
        key_shares = shamir_split(self._mask_key.private_bytes(*raw), threshold=self.params.threshold, xs=xs)
        seed_shares = shamir_split(self._self_seed, threshold=self.params.threshold, xs=xs)
        self._held_mask_key[self.site_id] = key_shares[self._x]
        self._held_self[self.site_id] = seed_shares[self._x]
        out = {}
        for site in sorted(keys):
            if site == self.site_id:
                continue
            x = self.params.x_coordinate(site)
            key = channel_key(agree(self._channel_key, keys[site].channel_public), self.params, self.site_id, site)
            nonce = secrets.token_bytes(GCM_NONCE_BYTES)
            plaintext = key_shares[x].to_bytes() + seed_shares[x].to_bytes()
            ciphertext = AESGCM(key).encrypt(nonce, plaintext, share_aad(self.params, self.site_id, site))
            out[site] = EncryptedShare(self.site_id, site, nonce, ciphertext)
        return out

    def receive_shares(self, shares: Mapping[str, EncryptedShare]) -> None:
        """Round 2, first half: decrypt the shares the server forwarded (one per other site of U2, keyed by sender)
        and fix U2 = the senders plus this site.

        Raises:
            ShareAuthenticationError: a ciphertext fails AES-GCM authentication (altered, re-addressed, replayed
                from another round). NotEnoughSharesError: |U2| < t. SecAggError: out of order, unknown sender.
        """
        if self._advertised is None or self._participants is not None:
            raise SecAggError("receive_shares must follow shares_for, once")
        received_key: dict[str, Share] = {}
        received_self: dict[str, Share] = {}
        for sender, message in shares.items():
            if message.sender != sender or message.recipient != self.site_id:
                raise SecAggError(f"share from {message.sender!r} to {message.recipient!r} filed under {sender!r}")
            if sender == self.site_id or sender not in self._advertised:
                raise SecAggError(f"share from {sender!r}, which is not another site of U1")
            key = channel_key(agree(self._channel_key, self._advertised[sender].channel_public), self.params,
                               sender, self.site_id)
            try:
                plaintext = AESGCM(key).decrypt(message.nonce, message.ciphertext,
                                                share_aad(self.params, sender, self.site_id))
            except (InvalidTag, ValueError):
                raise ShareAuthenticationError(
                    f"share from {sender!r} does not authenticate; drop {sender!r} from this round") from None
            key_share = Share.from_bytes(plaintext[:SHARE_BYTES])
            self_share = Share.from_bytes(plaintext[SHARE_BYTES:])
            if key_share.x != self._x or self_share.x != self._x:
                raise SecAggError(f"share from {sender!r} is for another x-coordinate")
            received_key[sender], received_self[sender] = key_share, self_share
        participants = tuple(sorted({*received_key, self.site_id}))
        if len(participants) < self.params.threshold:
            raise NotEnoughSharesError(f"only {len(participants)} sites sent shares, threshold is "
                                       f"{self.params.threshold}; abandon this round")
        self._held_mask_key.update(received_key)
        self._held_self.update(received_self)
        self._participants = participants

    @property
    def participants(self) -> tuple[str, ...]:
        """U2 as this site sees it (after :meth:`receive_shares`)."""
        if self._participants is None:
            raise SecAggError("U2 is known only after receive_shares")
        return self._participants

    def mask(self, update: np.ndarray, integer_noise: np.ndarray | None = None) -> np.ndarray:
        """Round 2: ``y_u = Q(x_u) + n_u + PRG(b_u) + sum_{v in U2 \\ {u}} Delta_{u,v} PRG(s_{u,v}) mod 2^k``.

        Args:
            update: float vector of shape ``(vector_length,)`` (the flattened, clipped update).
            integer_noise: int64 ``(vector_length,)`` noise ``n_u`` added to the quantised update before masking
                (distributed DP: this site's share of the Skellam noise, ``shared.privacy.distributed``), or None.

        Returns:
            ``params.dtype`` array of shape ``(vector_length,)``: uniformly distributed on ``Z_{2^k}^d`` given the
            server's view, whatever ``update`` is.

        Raises:
            SecAggError: before :meth:`receive_shares`, or a second call.
        """
        if self._participants is None:
            raise SecAggError("mask must follow receive_shares")
        if self._masked:
            raise SecAggError("this client already masked an update; masks are one-time pads, use a new round")
        p, d, k = self.params, self.params.vector_length, self.params.modulus_bits
        y = quantise(update, p)
        if integer_noise is not None:
            n = np.asarray(integer_noise)
            if n.shape != (d,) or not np.issubdtype(n.dtype, np.integer):
                raise SecAggError(f"integer_noise must be an integer vector of shape ({d},), got {n.dtype} {n.shape}")
            y += (n.astype(np.int64).view(np.uint64) & np.uint64(p.modulus - 1)).astype(p.dtype)
        self._masked = True
        y += expand_mask(self_mask_key(self._self_seed, p, self.site_id), d, k)
        mine = self._advertised[self.site_id].mask_public
        for v in self._participants:
            if v == self.site_id:
                continue
            theirs = self._advertised[v].mask_public
            key = pairwise_mask_key(agree(self._mask_key, theirs), p, self.site_id, mine, v, theirs)
            if pair_sign(self.site_id, v) > 0:
                y += expand_mask(key, d, k)
            else:
                y -= expand_mask(key, d, k)
        return y & modulus_mask(p)

    def reveal_for_recovery(self, request: RecoveryRequest) -> RecoveryShares:
        """Round 4: for each dropped site, this site's share of its mask private key; for each survivor, this
        site's share of its self-mask seed. Never both for one site, across any number of requests.

        Raises:
            NotEnoughSharesError: |U3| < t (the paper's abort). SecAggError: not masked yet, this site not among the
                survivors, sets that are not a partition of U2, or a request that contradicts an earlier one.
        """
        if not self._masked:
            raise SecAggError("reveal_for_recovery must follow mask")
        survivors, dropped = set(request.survivors), set(request.dropped)
        if survivors & dropped or survivors | dropped != set(self._participants) \
                or len(survivors) != len(request.survivors) or len(dropped) != len(request.dropped):
            raise SecAggError("recovery request is not a partition of U2 into survivors and dropped sites")
        if self.site_id not in survivors:
            raise SecAggError("recovery request lists this site as dropped, but it sent its masked update")
        if len(survivors) < self.params.threshold:
            raise NotEnoughSharesError(f"only {len(survivors)} survivors, threshold is {self.params.threshold}")
        wanted = {site: "mask_key" for site in dropped} | {site: "self_mask" for site in survivors}
        conflicts = sorted(s for s, kind in wanted.items() if self._revealed.get(s, kind) != kind)
        if conflicts:
            raise SecAggError(f"recovery request contradicts an earlier one for {conflicts}: revealing both shares "
                              "of a site would unmask its update")
        self._revealed.update(wanted)
        return RecoveryShares(self.site_id,
                              {s: self._held_mask_key[s] for s in sorted(dropped)},
                              {s: self._held_self[s] for s in sorted(survivors)})
