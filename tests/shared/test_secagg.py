"""Secure aggregation (shared/secagg/, Bonawitz et al. 2017): masks cancel exactly, dropped sites' masks are
recovered, one masked update reveals nothing, and the protocol refuses what it must.

The statistical tests use fresh OS randomness (there is no seeded mode on purpose), so they are tests at a tiny
significance level (1e-6 each) rather than golden values.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from scipy import stats

from shared.errors import ConfigError, PayloadError
from shared.secagg import (
    SHAMIR_PRIME,
    AdvertisedKeys,
    EncryptedShare,
    NotEnoughSharesError,
    RecoveryRequest,
    RecoveryShares,
    SecAggClient,
    SecAggError,
    SecAggParams,
    SecAggServer,
    Share,
    ShareAuthenticationError,
    dequantise_sum,
    expand_mask,
    max_power_of_two_scale,
    quantisation_error_bound,
    quantise,
    shamir_combine,
    shamir_split,
    unmask_sum,
)
from shared.secagg.derive import agree, pair_sign, pairwise_mask_key  # white-box: rebuild what a server could compute

ALPHA = 1e-6
SITES = ("site_a", "site_b", "site_c", "site_d", "site_e")


def make_params(n: int = 5, t: int = 3, d: int = 2_000, *, round: int = 7, federation: str = "fed-1",
                bound: float = 4.0, bits: int = 32) -> SecAggParams:
    sites = tuple(f"site_{i:02d}" for i in range(n)) if n != 5 else SITES
    scale = max_power_of_two_scale(num_sites=n, max_abs_value=bound, modulus_bits=bits)
    return SecAggParams(federation_id=federation, round=round, site_ids=sites, threshold=t, vector_length=d,
                        max_abs_value=bound, scale=scale, modulus_bits=bits)


def make_updates(params: SecAggParams, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {s: rng.normal(0.0, 1.0, params.vector_length).clip(-params.max_abs_value, params.max_abs_value)
            .astype(np.float32) for s in params.site_ids}


class Round:
    """Drives clients and a server through one round in memory, with sites dropping at chosen stages."""

    def __init__(self, params: SecAggParams) -> None:
        self.params = params
        self.clients = {s: SecAggClient(s, params) for s in params.site_ids}
        self.server = SecAggServer(params)

    def run(self, updates: dict[str, np.ndarray], *, drop_before_keys=(), drop_before_shares=(),
            drop_before_mask=(), drop_after_mask=(), drop_before_reveal=()
            ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Returns the unmasked integer sum and the masked updates the server received."""
        alive = [s for s in self.params.site_ids if s not in drop_before_keys]
        self.broadcast = self.server.collect_keys(self.clients[s].public_keys() for s in alive)
        alive = [s for s in alive if s not in drop_before_shares]
        self.outgoing = {s: self.clients[s].shares_for(self.broadcast) for s in alive}
        inbox = self.server.route_shares(self.outgoing)
        for s in alive:
            self.clients[s].receive_shares(inbox[s])
        alive = [s for s in alive if s not in drop_before_mask]
        computed = {s: self.clients[s].mask(updates[s]) for s in alive}
        self.masked = {s: y for s, y in computed.items() if s not in drop_after_mask}  # lost in transit
        for s, y in self.masked.items():
            self.server.add_masked(s, y)
        self.request = self.server.recovery_request()
        self.responses = [self.clients[s].reveal_for_recovery(self.request)
                          for s in self.request.survivors if s not in drop_before_reveal]
        return self.server.unmask_integer_sum(self.responses), self.masked


def quantised_sum(params: SecAggParams, updates: dict[str, np.ndarray], sites) -> np.ndarray:
    total = np.zeros(params.vector_length, dtype=params.dtype)
    for s in sites:
        total += quantise(updates[s], params)
    return total & params.dtype.type(params.modulus - 1)


# ------------------------------------------------------------------------------------------------ quantisation
def test_quantisation_bound_is_enforced_and_documented_scale_fits():
    # n * rint(B * scale) must stay below 2^(k-1).
    with pytest.raises(ConfigError, match="wrap"):
        SecAggParams(federation_id="f", round=0, site_ids=SITES, threshold=3, vector_length=4, max_abs_value=1.0,
                     scale=2.0 ** 31 / 5)
    scale = max_power_of_two_scale(num_sites=5, max_abs_value=1.0, modulus_bits=32)
    assert scale == 2.0 ** 28  # 5 * 2^28 < 2^31 <= 5 * 2^29
    SecAggParams(federation_id="f", round=0, site_ids=SITES, threshold=3, vector_length=4, max_abs_value=1.0,
                 scale=scale)


def test_quantise_then_dequantise_worst_case_sum_does_not_wrap():
    params = make_params(d=4)
    extreme = np.array([params.max_abs_value, -params.max_abs_value, 1e9, -1e9], dtype=np.float32)
    total = quantised_sum(params, {s: extreme for s in SITES}, SITES)
    got = dequantise_sum(total, params)
    np.testing.assert_array_equal(got, [5 * params.max_abs_value, -5 * params.max_abs_value] * 2)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-3.0, 3.0, width=32), min_size=5, max_size=5), st.sampled_from([16, 32, 64]))
def test_dequantised_sum_within_rounding_bound(values, bits):
    params = make_params(d=1, bound=3.0, bits=bits)
    updates = {s: np.array([v], dtype=np.float32) for s, v in zip(SITES, values)}
    got = dequantise_sum(quantised_sum(params, updates, SITES), params)[0]
    plain = math.fsum(float(v) for v in values)
    assert abs(got - plain) <= quantisation_error_bound(params, 5)


def test_quantise_rejects_nan_and_wrong_shape():
    params = make_params(d=3)
    with pytest.raises(SecAggError, match="non-finite"):
        quantise(np.array([0.0, np.nan, 1.0], dtype=np.float32), params)
    with pytest.raises(SecAggError, match="shape"):
        quantise(np.zeros(4, dtype=np.float32), params)


# -------------------------------------------------------------------------------------------------------- Shamir
def test_shamir_reconstructs_from_any_t_subset_and_detects_bad_shares():
    secret = bytes(range(32))
    shares = shamir_split(secret, threshold=3, xs=[1, 2, 3, 4, 5])
    for subset in ([1, 2, 3], [5, 3, 1], [2, 4, 5], [1, 2, 3, 4, 5]):
        assert shamir_combine([shares[x] for x in subset], threshold=3) == secret
    with pytest.raises(NotEnoughSharesError):
        shamir_combine([shares[1], shares[2]], threshold=3)
    bad = Share(4, (shares[4].y + 1) % SHAMIR_PRIME)
    with pytest.raises(SecAggError, match="inconsistent"):
        shamir_combine([shares[1], shares[2], shares[3], bad], threshold=3)  # extra share checked
    with pytest.raises(SecAggError, match="inconsistent"):
        shamir_combine([shares[1], shares[2], bad], threshold=3)  # exactly t: f(0) lands outside 2^256


def test_shamir_t_minus_one_shares_are_independent_of_the_secret():
    # With t = 2 one share is f(x) = s + a x, a uniform: same distribution for any s. Check the top byte is uniform
    # for two very different secrets (a 521-bit uniform value's low 64 bits are uniform).
    lows = {secret: [shamir_split(secret, threshold=2, xs=[1, 2])[1].y & 0xFF for _ in range(3000)]
            for secret in (bytes(32), b"\xff" * 32)}
    for values in lows.values():
        assert stats.chisquare(np.bincount(values, minlength=256)).pvalue > ALPHA


# ------------------------------------------------------------------------------------------------ correctness
def test_masks_cancel_exactly_without_dropouts():
    params = make_params()
    updates = make_updates(params)
    total, masked = Round(params).run(updates)
    np.testing.assert_array_equal(total, quantised_sum(params, updates, SITES))  # bit-exact
    assert all(not np.array_equal(y, quantise(updates[s], params)) for s, y in masked.items())
    plain = sum(updates[s].astype(np.float64) for s in SITES)
    err = np.max(np.abs(dequantise_sum(total, params) - plain))
    assert err <= quantisation_error_bound(params, 5)


@pytest.mark.parametrize("bits", [16, 64])
def test_masks_cancel_for_other_moduli(bits):
    params = make_params(d=500, bits=bits)
    updates = make_updates(params, seed=1)
    total, masked = Round(params).run(updates)
    assert total.dtype == (np.uint32 if bits <= 32 else np.uint64)
    assert all(int(y.max()) < 2 ** bits for y in masked.values())
    np.testing.assert_array_equal(total, quantised_sum(params, updates, SITES))


@pytest.mark.parametrize("dropped", [("site_b",), ("site_a", "site_e")])
def test_dropped_sites_masks_are_recovered(dropped):
    # The dropped sites masked their updates, but the masked vectors never reached the server.
    params = make_params()
    updates = make_updates(params, seed=2)
    rnd = Round(params)
    total, _ = rnd.run(updates, drop_after_mask=dropped)
    survivors = [s for s in SITES if s not in dropped]
    assert rnd.request == RecoveryRequest(tuple(survivors), tuple(dropped))
    np.testing.assert_array_equal(total, quantised_sum(params, updates, survivors))
    # Without the recovered pairwise masks the sum is garbage: the dropped sites' masks really were in it.
    assert not np.array_equal(rnd.server._sum, quantised_sum(params, updates, survivors))


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_any_dropout_pattern_within_tolerance_gives_the_survivors_exact_sum(data):
    params = make_params(n=6, t=4, d=64)
    updates = make_updates(params, seed=data.draw(st.integers(0, 2 ** 16)))
    lost = data.draw(st.lists(st.sampled_from(params.site_ids), max_size=2, unique=True))
    when = data.draw(st.sampled_from(["drop_before_mask", "drop_after_mask"]))
    survivors = [s for s in params.site_ids if s not in lost]
    silent = data.draw(st.lists(st.sampled_from(survivors), max_size=len(survivors) - params.threshold, unique=True))
    total, _ = Round(params).run(updates, **{when: tuple(lost)}, drop_before_reveal=tuple(silent))
    np.testing.assert_array_equal(total, quantised_sum(params, updates, survivors))


def test_dropouts_at_every_stage():
    # n = 9, t = 5: one site lost before keys (not in U1), one before sending shares (in U1, not U2), one before
    # masking (in U2, not U3: its pairwise masks are recovered), one survivor silent in round 4 (5 of 6 reveal).
    params = make_params(n=9, t=5)
    updates = make_updates(params, seed=3)
    s = params.site_ids
    total, _ = Round(params).run(updates, drop_before_keys=(s[0],), drop_before_shares=(s[3],),
                                 drop_before_mask=(s[6],), drop_before_reveal=(s[1],))
    np.testing.assert_array_equal(total, quantised_sum(params, updates, [s[1], s[2], s[4], s[5], s[7], s[8]]))


def test_one_call_server_matches_streaming_server():
    params = make_params(d=300)
    updates = make_updates(params, seed=4)
    rnd = Round(params)
    total, masked = rnd.run(updates, drop_before_mask=("site_c",))
    again = unmask_sum(params, advertised=rnd.broadcast.values(), outgoing_shares=rnd.outgoing,
                       masked_updates=masked, responses=rnd.responses)
    np.testing.assert_array_equal(again, dequantise_sum(total, params))


def test_fewer_than_t_shares_raises():
    params = make_params()
    updates = make_updates(params, seed=5)
    rnd = Round(params)
    with pytest.raises(NotEnoughSharesError, match="needed"):
        rnd.run(updates, drop_before_mask=("site_a",), drop_before_reveal=("site_b", "site_c"))  # 2 of 4 reveal
    with pytest.raises(NotEnoughSharesError, match="masked updates arrived"):
        Round(params).run(updates, drop_before_mask=("site_a", "site_b", "site_c"))  # |U3| = 2 < 3
    with pytest.raises(NotEnoughSharesError):
        Round(params).run(updates, drop_before_keys=("site_a", "site_b", "site_c"))  # |U1| = 2 < 3


# --------------------------------------------------------------------------------- one masked update is private
def masked_of(params: SecAggParams, plain: np.ndarray, site: str = "site_c") -> np.ndarray:
    rnd = Round(params)
    updates = {s: np.zeros(params.vector_length, dtype=np.float32) for s in params.site_ids}
    updates[site] = plain
    _, masked = rnd.run(updates)
    return masked[site]


def test_single_masked_update_is_uniform_and_uncorrelated_with_the_plain_one():
    params = make_params(d=1 << 16)
    plain = np.linspace(-params.max_abs_value, params.max_abs_value, params.vector_length).astype(np.float32)
    y = masked_of(params, plain)
    # Bytes of a uniform element of Z_2^32 are uniform: chi-square over 256 bins, 262144 bytes.
    assert stats.chisquare(np.bincount(y.view(np.uint8), minlength=256)).pvalue > ALPHA
    # Correlation with the plain values (as the centred integers the server would have to find) is ~ 0.
    centred = y.astype(np.int64) - (y >= 2 ** 31) * 2 ** 32
    r, pvalue = stats.pearsonr(centred.astype(np.float64), plain.astype(np.float64))
    assert abs(r) < 5 / np.sqrt(params.vector_length) and pvalue > ALPHA
    # The masked values do not carry the plain ones in their low bits either.
    q = quantise(plain, params)
    assert np.mean((y & 0xFF) == (q & 0xFF)) < 2 / 256


def test_two_very_different_updates_give_indistinguishable_masked_distributions():
    params = make_params(d=1 << 15)
    zeros = np.zeros(params.vector_length, dtype=np.float32)
    extreme = np.full(params.vector_length, params.max_abs_value, dtype=np.float32)
    y0, y1 = masked_of(params, zeros), masked_of(params, extreme)
    assert stats.ks_2samp(y0, y1).pvalue > ALPHA
    table = np.stack([np.bincount(y.view(np.uint8), minlength=256) for y in (y0, y1)])
    assert stats.chi2_contingency(table).pvalue > ALPHA
    uniform = stats.uniform(loc=0, scale=2 ** 32).cdf
    assert stats.kstest(y1.astype(np.float64), uniform).pvalue > ALPHA


def test_late_update_of_a_dropped_site_stays_hidden_by_its_self_mask():
    # Double masking (Bonawitz §4): the server learns a dropped site's pairwise masks; if the "dropped" update then
    # arrives late, removing those masks still leaves PRG(b_u) on it.
    params = make_params(d=1 << 14)
    updates = make_updates(params, seed=6)
    rnd = Round(params)
    late = "site_d"
    rnd.run(updates, drop_before_mask=(late,))
    late_masked = rnd.clients[late].mask(updates[late])
    with pytest.raises(SecAggError, match="after the recovery request"):
        rnd.server.add_masked(late, late_masked)
    # What the server can compute from the recovered key: late_masked minus all pairwise masks of `late`.
    shares = [r.mask_key_shares[late] for r in rnd.responses]
    private = X25519PrivateKey.from_private_bytes(shamir_combine(shares, threshold=params.threshold))
    residue = late_masked.copy()
    pk_late = rnd.broadcast[late].mask_public
    for v in params.site_ids:
        if v == late:
            continue
        pk_v = rnd.broadcast[v].mask_public
        mask = expand_mask(pairwise_mask_key(agree(private, pk_v), params, late, pk_late, v, pk_v),
                           params.vector_length, params.modulus_bits)
        residue = residue - mask if pair_sign(late, v) > 0 else residue + mask
    q = quantise(updates[late], params)
    assert not np.array_equal(residue, q)
    assert stats.chisquare(np.bincount((residue - q).view(np.uint8), minlength=256)).pvalue > ALPHA
    assert stats.chisquare(np.bincount(residue.view(np.uint8), minlength=256)).pvalue > ALPHA


# ---------------------------------------------------------------------------------------- binding and tampering
def test_pairwise_masks_are_bound_to_round_and_federation():
    base = make_params(d=64)
    updates = make_updates(base)

    def masked_with_fixed_keys(params: SecAggParams) -> dict[str, np.ndarray]:
        # Same key pairs and self-mask seeds in every variant, so only the HKDF context differs.
        rnd = Round(params)
        for s, client in rnd.clients.items():
            ref = reference.clients[s]
            client._channel_key, client._mask_key, client._self_seed = ref._channel_key, ref._mask_key, ref._self_seed
        return rnd.run(updates)[1]

    reference = Round(base)
    same = masked_with_fixed_keys(base)
    again = masked_with_fixed_keys(base)
    np.testing.assert_array_equal(same["site_a"], again["site_a"])  # deterministic given the keys
    for other in (make_params(d=64, round=8), make_params(d=64, federation="fed-2")):
        changed = masked_with_fixed_keys(other)
        for s in SITES:
            assert np.mean(changed[s] == same[s]) < 0.01


def test_tampered_or_readdressed_share_is_rejected():
    params = make_params(d=8)
    rnd = Round(params)
    broadcast = rnd.server.collect_keys(c.public_keys() for c in rnd.clients.values())
    outgoing = {s: c.shares_for(broadcast) for s, c in rnd.clients.items()}
    inbox = rnd.server.route_shares(outgoing)
    good = inbox["site_a"]["site_b"]
    flipped = bytearray(good.ciphertext)
    flipped[5] ^= 0x01
    with pytest.raises(ShareAuthenticationError):
        rnd.clients["site_a"].receive_shares({**inbox["site_a"], "site_b": EncryptedShare(
            good.sender, good.recipient, good.nonce, bytes(flipped))})
    # A share meant for site_c, relabelled as if site_b had sent it to site_a: wrong key and wrong AAD.
    stolen = inbox["site_c"]["site_b"]
    with pytest.raises(ShareAuthenticationError):
        rnd.clients["site_a"].receive_shares({**inbox["site_a"], "site_b": EncryptedShare(
            "site_b", "site_a", stolen.nonce, stolen.ciphertext)})
    # The untouched inbox still works afterwards (a failed receive changes nothing).
    rnd.clients["site_a"].receive_shares(inbox["site_a"])


def test_share_from_another_round_is_rejected():
    params, other = make_params(d=8, round=1), make_params(d=8, round=2)
    a, b = SecAggClient("site_a", params), SecAggClient("site_b", params)
    rest = [SecAggClient(s, params) for s in SITES[2:]]
    keys = {c.site_id: c.public_keys() for c in (a, b, *rest)}
    share = b.shares_for(keys)["site_a"]
    a_other = SecAggClient("site_a", other)
    a_other._channel_key = a._channel_key  # same channel key pair, different round
    a_other.shares_for({**keys, "site_a": a_other.public_keys()})
    with pytest.raises(ShareAuthenticationError):
        a_other.receive_shares({"site_b": share, **{c.site_id: c.shares_for(keys)["site_a"] for c in rest}})


# ------------------------------------------------------------------------------------------- protocol refusals
def test_client_never_reveals_both_shares_of_one_site():
    params = make_params(d=16)
    updates = make_updates(params)
    rnd = Round(params)
    rnd.run(updates, drop_before_mask=("site_e",))
    client = rnd.clients["site_a"]
    assert client.reveal_for_recovery(rnd.request) == rnd.responses[0]  # retransmission: same answer
    contradicting = RecoveryRequest(("site_a", "site_b", "site_c", "site_e"), ("site_d",))
    with pytest.raises(SecAggError, match="contradicts"):  # would hand out site_d's key and site_e's seed too
        client.reveal_for_recovery(contradicting)
    with pytest.raises(SecAggError, match="partition"):
        client.reveal_for_recovery(RecoveryRequest(("site_a", "site_b", "site_c"), ("site_d",)))
    with pytest.raises(SecAggError, match="dropped"):
        client.reveal_for_recovery(RecoveryRequest(("site_b", "site_c", "site_d"), ("site_a", "site_e")))


def test_client_masks_once_and_in_order():
    params = make_params(d=16)
    client = SecAggClient("site_a", params)
    with pytest.raises(SecAggError, match="receive_shares"):
        client.mask(np.zeros(16, dtype=np.float32))
    rnd = Round(params)
    rnd.run(make_updates(params))
    with pytest.raises(SecAggError, match="already masked"):
        rnd.clients["site_a"].mask(np.zeros(16, dtype=np.float32))


def test_server_rejects_duplicates_and_wrong_arrays():
    params = make_params(d=16)
    rnd = Round(params)
    clients = rnd.clients
    broadcast = rnd.server.collect_keys(c.public_keys() for c in clients.values())
    inbox = rnd.server.route_shares({s: c.shares_for(broadcast) for s, c in clients.items()})
    for s, c in clients.items():
        c.receive_shares(inbox[s])
    y = clients["site_a"].mask(np.zeros(16, dtype=np.float32))
    rnd.server.add_masked("site_a", y)
    with pytest.raises(SecAggError, match="twice"):
        rnd.server.add_masked("site_a", y)
    with pytest.raises(SecAggError, match="shape"):
        rnd.server.add_masked("site_b", y[:8])
    with pytest.raises(SecAggError, match="shape"):
        rnd.server.add_masked("site_b", y.astype(np.uint64))


def test_reconstructed_key_must_match_advertised_public_key():
    params = make_params(d=16)
    rnd = Round(params)
    rnd.run(make_updates(params), drop_before_mask=("site_e",))
    # Consistent shares of some other 32-byte secret in place of site_e's mask key: they interpolate fine, but the
    # key they give is not the one site_e advertised.
    xs = [params.x_coordinate(r.sender) for r in rnd.responses]
    fake = shamir_split(b"\x42" * 32, threshold=params.threshold, xs=xs)
    forged = [RecoveryShares(r.sender, {"site_e": fake[params.x_coordinate(r.sender)]}, r.self_mask_shares)
              for r in rnd.responses]
    server = SecAggServer(params)
    server.collect_keys(rnd.broadcast.values())
    server.route_shares(rnd.outgoing)
    for s, y in rnd.masked.items():
        server.add_masked(s, y)
    with pytest.raises(SecAggError, match="advertised public key"):
        server.unmask_integer_sum(forged)
    # One altered share among the honest ones is caught as inconsistent.
    bad = RecoveryShares(rnd.responses[0].sender, {"site_e": Share(1, 12345)}, rnd.responses[0].self_mask_shares)
    with pytest.raises(SecAggError, match="inconsistent"):
        server.unmask_integer_sum([bad, *rnd.responses[1:]])
    np.testing.assert_array_equal(server.unmask_integer_sum(rnd.responses), rnd.server.unmask_integer_sum(
        rnd.responses))


def test_params_validation():
    with pytest.raises(ConfigError, match="threshold"):
        make_params(n=5, t=2)  # not a majority
    with pytest.raises(ConfigError, match="threshold"):
        make_params(n=5, t=6)
    with pytest.raises(ConfigError, match="site_ids"):
        SecAggParams(federation_id="f", round=0, site_ids=("a", "a"), threshold=2, vector_length=1,
                     max_abs_value=1.0, scale=1.0)
    with pytest.raises(ConfigError, match="modulus_bits"):
        make_params(bits=8)
    p = SecAggParams(federation_id="f", round=0, site_ids=("b", "a", "c"), threshold=2, vector_length=1,
                     max_abs_value=1.0, scale=1.0)
    assert p.site_ids == ("a", "b", "c") and p.x_coordinate("a") == 1


# ------------------------------------------------------------------------------------------------- wire forms
def test_messages_round_trip_through_json_and_reject_unknown_fields():
    params = make_params(d=16)
    rnd = Round(params)
    rnd.run(make_updates(params), drop_before_mask=("site_b",))
    messages = [rnd.broadcast["site_a"], rnd.outgoing["site_a"]["site_c"], rnd.request, rnd.responses[0]]
    for message in messages:
        wire = json.dumps(message.to_json())
        assert type(message).from_json(json.loads(wire)) == message
        with pytest.raises(PayloadError):
            type(message).from_json({**json.loads(wire), "extra": 1})
    with pytest.raises(PayloadError):
        AdvertisedKeys.from_json({"type": "secagg_keys", "site_id": "a", "channel_public": "00",
                                  "mask_public": "00" * 32})
    share = Share(3, SHAMIR_PRIME - 1)
    assert Share.from_bytes(share.to_bytes()) == share
    with pytest.raises(PayloadError):
        Share.from_bytes(share.to_bytes()[:-1])
