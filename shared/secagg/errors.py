"""Secure aggregation's errors: what a step refuses (:class:`SecAggError`) and its two named cases."""

from __future__ import annotations

from shared.errors import WildFedError


class SecAggError(WildFedError):
    """A secure-aggregation step must be refused: a protocol message out of order or inconsistent, a reconstructed
    key that does not match its advertised public key, a second masking, a conflicting recovery request."""


class NotEnoughSharesError(SecAggError):
    """Fewer than ``threshold`` sites (or shares) are available to reconstruct a secret: the round cannot be
    unmasked and must be abandoned and re-run with a fresh :class:`SecAggParams` (a new round number)."""


class ShareAuthenticationError(SecAggError):
    """An encrypted share does not authenticate (AES-GCM tag): it was altered, re-addressed, or sent for another
    federation or round."""
