"""A test of truth for CCDP: what a gateway's training actually does matches what the ledger
records, and the ledger's epsilon is dp-accounting's for those values.

One site with five IUCN categories runs 10,000 DP-SGD steps through the production path
(``edge_sdk.training.train_locally``, secure randomness) on a recording fake backend whose every per-example gradient
points along coordinate 0 with a huge norm (so each is clipped to its category's C_c) and is zero elsewhere. From
what the backend saw and received we measure, per category, the realised Poisson inclusion rate, the mean clipped
contribution, and the standard deviation of the released noise; they must match the q_c, C_c and sigma of the
events the ledger recorded (within sampling error), and the ledger's epsilon must equal a direct dp-accounting
computation from those events and the category's budget (within 1 %).
"""

from __future__ import annotations

import dp_accounting
import numpy as np
import pytest
from dp_accounting import rdp

from shared.iucn import CCDPBudget
from shared.iucn import IUCNCategory as Cat
from shared.privacy.randomness import SecureRandom
from shared.protocol import TrainingTask

from coordinator.ledger import PrivacyLedger
from coordinator.storage import Store
from edge_sdk.backends.base import ParameterSpec, TrainingBackend
from edge_sdk.data.camtrap_dp import LocalDataset
from edge_sdk.privacy.per_example import MaterialisedGradients
from edge_sdk.training import train_locally

D = 64
STEPS = 10_000
SIZES = {Cat.CR: 100, Cat.EN: 100, Cat.VU: 100, Cat.LC: 150, Cat.NE: 150}


class RecordingBackend(TrainingBackend):
    """d = 64. Record i's gradient is (1e6, 0, ..., 0); features column 0 holds i, so the backend sees which records
    each step sampled. ``apply_gradient`` records each released step and leaves the weights alone."""

    def __init__(self) -> None:
        self.included = np.zeros(sum(SIZES.values()), dtype=np.int64)
        self.steps: list[np.ndarray] = []

    @property
    def parameter_layout(self):
        return (ParameterSpec("w", (D,), 0),)

    def set_weights(self, weights):
        pass

    def get_weights(self):
        return {"w": np.zeros(D, np.float32)}

    def per_example_gradients(self, x, y):
        grads = np.zeros((len(y), D), np.float32)
        grads[:, 0] = 1e6
        return grads

    def per_example(self, x, y, *, input_sq_norms=None):
        self.included[np.asarray(x[:, 0]).astype(np.int64)] += 1
        return MaterialisedGradients(self.per_example_gradients(x, y))

    def gradient(self, x, y):  # pragma: no cover - private runs only
        raise AssertionError("a CCDP task never takes a non-private gradient")

    def apply_gradient(self, flat_grad, learning_rate):
        self.steps.append(np.asarray(flat_grad, dtype=np.float64).copy())

    def predict(self, x):  # pragma: no cover - not used
        return np.zeros(len(x), np.int64)


def site() -> LocalDataset:
    cats = np.concatenate([np.full(n, c.rank, np.int8) for c, n in SIZES.items()])
    n = cats.size
    features = np.zeros((n, 3), np.float32)
    features[:, 0] = np.arange(n)
    return LocalDataset(images=np.zeros((n, 1, 1), np.uint8), features=features, labels=np.zeros(n, np.int64),
                        categories=cats, media_ids=tuple(f"r{i}" for i in range(n)))


@pytest.mark.parametrize("variant", ["sample", "scale"])
def test_what_ran_is_what_the_ledger_records(tmp_path, variant: str) -> None:
    budgets = CCDPBudget.from_anchor(Cat.NE, 2.0, 1.0).table()
    data = site()
    n_site = len(data)
    task = TrainingTask(federation_id="truth", round=0, model_hash="0" * 64, local_steps=STEPS,
                        expected_batch_size=60, learning_rate=1.0, clipping_norm=0.5, target_delta=1e-5,
                        planned_rounds=1, privacy="ccdp", budgets=budgets, ccdp_variant=variant)
    backend = RecordingBackend()
    result = train_locally(backend=backend, dataset=data, task=task, global_weights={"w": np.zeros(D, np.float32)},
                           site_categories=list(SIZES), randomness=SecureRandom())
    ledger = PrivacyLedger(Store(f"sqlite:///{tmp_path / 'c.db'}", tmp_path / "data"), target_delta=1e-5)
    ledger.record_round("site-a", 0, result.report.events)

    q = 60 / n_site
    normaliser = q * n_site
    released = np.asarray(backend.steps) * normaliser  # (STEPS, D): clipped sum + noise, per step
    assert released.shape == (STEPS, D)
    cats = data.categories
    recorded = {c: ledger.events("site-a", c) for c in SIZES}
    sigma = None
    expected_signal = 0.0
    for c, n_c in SIZES.items():
        (event,) = recorded[c]
        assert event.steps == STEPS
        # realised inclusion rate of the category's records: binomial over n_c * STEPS trials
        rate = backend.included[cats == c.rank].sum() / (n_c * STEPS)
        sd = np.sqrt(event.sampling_rate * (1 - event.sampling_rate) / (n_c * STEPS))
        assert abs(rate - event.sampling_rate) < 5 * sd, (c, rate, event.sampling_rate)
        if variant == "scale":
            assert event.sampling_rate == pytest.approx(q, rel=1e-12)
        # the noise is one draw of sigma = z_c C_c for every category
        c_c = result.plan.clipping_norms[c]
        sigma_c = event.noise_multiplier * c_c
        sigma = sigma_c if sigma is None else sigma
        assert sigma_c == pytest.approx(sigma, rel=1e-9)
        expected_signal += event.sampling_rate * n_c * c_c
        # the ledger's epsilon is dp-accounting's for exactly these values, and it is the category's budget
        acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
        acc.compose(dp_accounting.PoissonSampledDpEvent(event.sampling_rate,
                                                        dp_accounting.GaussianDpEvent(event.noise_multiplier)), STEPS)
        independent = acc.get_epsilon(1e-5)
        assert ledger.spent("site-a", c) == pytest.approx(independent, rel=1e-9)
        assert budgets[c] * 0.99 <= independent <= budgets[c]
    if variant == "sample":
        assert len({e[0].noise_multiplier for e in recorded.values()}) == 1  # one noise multiplier
        assert recorded[Cat.CR][0].sampling_rate < recorded[Cat.VU][0].sampling_rate < q
    else:
        assert result.plan.clipping_norms[Cat.CR] < result.plan.clipping_norms[Cat.NE] == 0.5
    # the released noise: coordinates 1.. carry noise only; relative sd of the std estimate ~ 1/sqrt(2 * 630,000)
    noise = released[:, 1:]
    assert abs(noise.std() / sigma - 1) < 0.01
    assert abs(noise.mean()) < 5 * sigma / np.sqrt(noise.size)
    # coordinate 0 carries the clipped sum: each sampled record adds C_c (its gradient clipped from 1e6)
    signal = released[:, 0]
    var = sigma ** 2 + sum(result.plan.sampling_rates[c] * (1 - result.plan.sampling_rates[c]) * n_c *
                           result.plan.clipping_norms[c] ** 2 for c, n_c in SIZES.items())
    assert abs(signal.mean() - expected_signal) < 5 * np.sqrt(var / STEPS)
