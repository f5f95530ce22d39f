"""The empirical privacy audit (wildfed_sim.audit, ``wildfed audit``): the one-run bound against closed
forms and a hand-worked case, detection of a mechanism with its noise off, no bound above the claim for the real
mechanism, and clear CLI errors.

The audit runs here are seeded (``seed=``) for reproducibility, so their noise is predictable (the audit warns with
InsecureRandomnessWarning, asserted below); the audited code path is otherwise the gateway's own.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from shared.iucn import CCDPBudget, IUCNCategory

from wildfed_sim.audit import (
    AuditSettings,
    epsilon_lower_bound,
    guess_sizes,
    membership_guesses,
    one_run_p_value,
    run_audit,
)
from wildfed_sim.cli import app

runner = CliRunner()
DELTA = 1e-5


# --------------------------------------------------------------------------------------------- the bound
@pytest.mark.parametrize(("r", "beta"), [(1, 0.5), (10, 0.05), (60, 0.05), (200, 0.01)])
def test_all_correct_without_delta_solves_the_binomial_closed_form(r, beta):
    # Prepare: with v = r and delta = 0 the p-value is p^r, p = e^eps / (1 + e^eps); p^r = beta gives
    # p = beta^(1/r) and eps = ln(p / (1 - p)).
    p = beta ** (1.0 / r)
    expected = math.log(p / (1.0 - p))
    # Execute
    got = epsilon_lower_bound(num_canaries=r, num_guesses=r, num_correct=r, delta=0.0, beta=beta)
    # Assert
    assert got == pytest.approx(expected, abs=1e-6)
    assert got <= expected + 1e-12  # never above the exact root


def test_p_value_with_delta_matches_a_hand_worked_case():
    # Prepare: m = r = 4 guesses, v = 4 correct, eps = 1, delta = 0.01, from the definition with math.comb:
    # f(k) = P[Bin(4, p) >= k]; p-value = f(4) + 2 m delta max_i (f(4 - i) - f(4)) / i.
    m, r, v, eps, delta = 4, 4, 4, 1.0, 0.01
    p = math.e / (1.0 + math.e)

    def f(k):
        return sum(math.comb(r, j) * p ** j * (1 - p) ** (r - j) for j in range(max(k, 0), r + 1))

    alpha = max((f(v - i) - f(v)) / i for i in range(1, m + 1))
    expected = f(v) + 2 * m * delta * alpha
    # Execute
    got = one_run_p_value(num_canaries=m, num_guesses=r, num_correct=v, epsilon=eps, delta=delta)
    # Assert: hand value p^4 = 0.28804..., and the delta term is strictly positive
    assert f(v) == pytest.approx(p ** 4)
    assert got == pytest.approx(expected, rel=1e-12)
    assert got > p ** 4


def test_bound_is_zero_at_chance_and_delta_only_lowers_it():
    assert epsilon_lower_bound(num_canaries=100, num_guesses=60, num_correct=30, delta=DELTA) == 0.0
    assert epsilon_lower_bound(num_canaries=100, num_guesses=0, num_correct=0, delta=DELTA) == 0.0
    no_delta = epsilon_lower_bound(num_canaries=100, num_guesses=60, num_correct=55, delta=0.0)
    with_delta = epsilon_lower_bound(num_canaries=100, num_guesses=60, num_correct=55, delta=1e-3)
    assert 0 < with_delta < no_delta


def test_bound_rejects_impossible_counts():
    with pytest.raises(ValueError, match="num_correct"):
        epsilon_lower_bound(num_canaries=10, num_guesses=5, num_correct=6, delta=DELTA)
    with pytest.raises(ValueError, match="beta"):
        epsilon_lower_bound(num_canaries=10, num_guesses=5, num_correct=5, delta=DELTA, beta=1.0)


def test_guesses_take_the_extremes_and_abstain_in_between():
    scores = np.array([0.3, -1.0, 2.0, 0.0, 5.0, -0.5])
    assert guess_sizes(6, 0.7) == (2, 2)  # floor(0.7 * 6 / 2)
    guesses = membership_guesses(scores, k_plus=2, k_minus=2)
    assert guesses.tolist() == [0, -1, 1, 0, 1, -1]


# ------------------------------------------------------------------------------------------- the audits
def synthetic_site(n: int, seed: int = 0):
    """n records as the head model takes them: synthetic backbone embeddings float32 (n, 1280) in [0, 6] (the
    ReLU6-pooled range), noise in [0, 1) plus a class-dependent block of 128 channels at 4; classes 0-9,
    categories from the demo table."""
    from wildfed_sim.animal_mnist import SPECIES_TABLE

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n).astype(np.int64)
    features = rng.random((n, 1280)).astype(np.float32)
    for i, k in enumerate(labels):
        features[i, 128 * int(k):128 * (int(k) + 1)] += 3.0
    ranks = np.asarray([SPECIES_TABLE[int(k)].iucn.rank for k in labels], dtype=np.int8)
    return features, labels, ranks


SMALL = dict(canaries_per_category=80, rounds=4, local_steps=10, expected_batch_size=96, learning_rate=0.5,
             clipping_norm=1.0, target_delta=DELTA, guess_fraction=0.6,
             budget=CCDPBudget.from_anchor(IUCNCategory.VU, 1.0, 1.0))


def audit(*, break_noise: bool, seed: int):
    from edge_sdk.privacy.randomness import InsecureRandomnessWarning

    images, labels, ranks = synthetic_site(200)
    settings = AuditSettings(**SMALL, break_noise=break_noise, seed=seed)
    with pytest.warns(InsecureRandomnessWarning):  # a seeded audit says loudly that its noise is predictable
        return run_audit(settings, features=images, labels=labels, categories=ranks, threads=2)


@pytest.fixture(scope="module")
def noise_off():
    return audit(break_noise=True, seed=11)


@pytest.fixture(scope="module")
def real():
    return audit(break_noise=False, seed=11)


def claims_from_dp_accounting(result):
    """Each category's epsilon composed with dp-accounting directly from z, q and the steps run."""
    import dp_accounting
    from dp_accounting import rdp

    out = {}
    steps = result.settings.rounds * result.settings.local_steps
    for row in result.rows:
        acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
        acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            row.sampling_rate, dp_accounting.GaussianDpEvent(row.noise_multiplier)), steps))
        out[row.category] = acc.get_epsilon(DELTA)
    return out


def test_noise_off_is_caught_in_every_category(noise_off):
    budgets = SMALL["budget"].table()
    assert [r.category for r in noise_off.rows] == list(IUCNCategory)
    assert noise_off.num_active == 200 + 6 * 80
    assert noise_off.sampling_rate == pytest.approx(SMALL["expected_batch_size"] / (200 + 6 * 80))
    claims = claims_from_dp_accounting(noise_off)
    for row in noise_off.rows:
        # the claim is the ledger's epsilon for the steps run, at most the budget it was calibrated to
        assert row.claimed_epsilon == pytest.approx(claims[row.category], rel=1e-9)
        assert row.claimed_epsilon <= budgets[row.category] + 1e-9
        assert row.guesses == 2 * math.floor(0.6 * 80 / 2)
        # the bound is the one of its own counts, and it is above the claim
        assert row.lower_bound == pytest.approx(epsilon_lower_bound(
            num_canaries=80, num_guesses=row.guesses, num_correct=row.correct, delta=DELTA), abs=1e-12)
        assert row.lower_bound > row.claimed_epsilon, row
        assert row.exceeds_claim


def test_real_mechanism_stays_at_or_below_its_claim(real, noise_off):
    # Same canaries, same sampling (same seed), noise on: the only difference is the mechanism's Gaussian noise.
    assert np.array_equal(real.design.included, noise_off.design.included)
    assert np.array_equal(real.design.coordinates, noise_off.design.coordinates)
    for row in real.rows:
        assert row.lower_bound <= row.claimed_epsilon, row
        assert not row.exceeds_claim
    # noise changes the scores: the canaries' coordinates moved differently
    assert not np.allclose(real.scores, noise_off.scores)


@pytest.mark.slow  # 7-17 s on the shared 2-core machine
def test_real_mechanism_with_power_still_stays_below_its_claim():
    # Prepare: one category only (so a canary sees only its own category's noise), a large budget (little noise),
    # more canaries: here the audit detects *some* leakage (bound > 0), so "bound <= claim" is not vacuous.
    from edge_sdk.privacy.randomness import InsecureRandomnessWarning

    images, labels, ranks = synthetic_site(200)
    ranks[:] = IUCNCategory.NE.rank
    settings = AuditSettings(**{**SMALL, "budget": CCDPBudget.uniform(4.0), "categories": (IUCNCategory.NE,),
                                "canaries_per_category": 200, "guess_fraction": 0.3}, seed=2)
    # Execute
    with pytest.warns(InsecureRandomnessWarning):
        result = run_audit(settings, features=images, labels=labels, categories=ranks, threads=2)
    # Assert
    (row,) = result.rows
    assert row.claimed_epsilon == pytest.approx(claims_from_dp_accounting(result)[IUCNCategory.NE], rel=1e-9)
    assert 0 < row.lower_bound <= row.claimed_epsilon, row
    assert row.guesses == 60  # 2 * floor(0.3 * 200 / 2)
    # the ceiling is the bound of 60 correct out of 60: what perfect guessing could certify at most
    assert row.ceiling == pytest.approx(epsilon_lower_bound(num_canaries=200, num_guesses=60, num_correct=60,
                                                            delta=DELTA), abs=1e-12)


def test_in_canaries_score_higher_than_out_canaries_without_noise(noise_off):
    # A sampled "in" canary moves its weight down by lr C / (q N_active) per sampling; "out" ones only drift.
    inc = noise_off.design.included
    unit = SMALL["learning_rate"] * SMALL["clipping_norm"] / SMALL["expected_batch_size"]
    assert np.median(noise_off.scores[inc]) > 2 * unit
    assert abs(np.median(noise_off.scores[~inc])) < unit


# --------------------------------------------------------------------------------------------------- CLI
@pytest.mark.parametrize(("args", "message"), [
    (["--canaries-per-category", "1"], "canaries_per_category"),
    (["--categories", "CR,XX"], "not an IUCN category"),
    (["--confidence", "1.5"], "confidence"),
    (["--guess-fraction", "0"], "guess_fraction"),
    (["--accountant", "moments"], "accountant"),
    (["--rounds", "0"], "rounds"),
])
def test_cli_rejects_bad_input_with_one_clear_line(tmp_path, args, message):
    result = runner.invoke(app, ["audit", "--out", str(tmp_path / "run"), *args])
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and message in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "run").exists()  # nothing written, no data loaded


def test_cli_refuses_a_non_empty_output_folder(tmp_path):
    (tmp_path / "old.txt").write_text("keep me")
    result = runner.invoke(app, ["audit", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "not empty" in result.output
    assert (tmp_path / "old.txt").read_text() == "keep me"


@pytest.mark.slow
def test_cli_runs_on_animal_mnist_and_writes_audit_json(tmp_path):
    out = tmp_path / "run"
    from edge_sdk.privacy.randomness import InsecureRandomnessWarning

    with pytest.warns(InsecureRandomnessWarning):
        result = runner.invoke(app, ["audit", "--out", str(out), "--canaries-per-category", "20", "--rounds", "1",
                                     "--local-steps", "3", "--site-records", "100", "--categories", "CR,LC",
                                     "--seed", "3", "--break-noise"])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "audit.json").read_text())
    assert data["noise_broken"] is True and data["seeded"] is True
    assert [c["category"] for c in data["categories"]] == ["CR", "LC"]
    lines = (out / "canaries.csv").read_text().splitlines()
    assert lines[0] == "category,coordinate,included,score" and len(lines) == 1 + 40
