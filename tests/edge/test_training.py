"""The local training loop, hand-worked on a linear fake backend."""

from __future__ import annotations

import numpy as np
import pytest

from shared.errors import PrivacyBudgetError
from shared.iucn import IUCNCategory as Cat
from shared.protocol import TrainingTask

from edge_sdk.backends.base import ParameterSpec, TrainingBackend
from edge_sdk.data.camtrap_dp import LocalDataset
from edge_sdk.training import train_locally


class FakeBackend(TrainingBackend):
    """d = 2; the gradient of example i is its two pixel values (so tests can hand-compute every step)."""

    def __init__(self) -> None:
        self.w = np.zeros(2, np.float32)

    @property
    def parameter_layout(self):
        return (ParameterSpec("w", (2,), 0),)

    def set_weights(self, weights):
        self.w = np.asarray(weights["w"], np.float32).copy()

    def get_weights(self):
        return {"w": self.w.copy()}

    def per_example_gradients(self, x, y):
        return np.asarray(x, np.float32).reshape(len(y), -1)

    def gradient(self, x, y):
        return self.per_example_gradients(x, y).mean(axis=0)

    def apply_gradient(self, flat_grad, learning_rate):
        self.w = self.w - learning_rate * flat_grad

    def predict(self, x):
        return np.zeros(len(x), np.int64)


class ZeroNoise:
    def random(self, size):
        return np.zeros(size)  # every eligible record is sampled

    def standard_normal(self, size):
        return np.zeros(size)


def dataset() -> LocalDataset:
    pixels = [(3, 4), (0, 1), (6, 8), (0, 0), (100, 100), (100, 100)]
    cats = [Cat.CR, Cat.CR, Cat.LC, Cat.LC, Cat.EN, Cat.EN]
    return LocalDataset(images=np.array(pixels, np.uint8).reshape(6, 1, 2), labels=np.zeros(6, np.int64),
                        categories=np.array([c.rank for c in cats], np.int8), media_ids=tuple("abcdef"))


def task(**kw) -> TrainingTask:
    base = dict(federation_id="f", round=1, model_hash="0" * 64, local_steps=1, expected_batch_size=2,
                learning_rate=0.5, clipping_norm=1.0, target_delta=1e-5, planned_rounds=10, privacy="ccdp",
                budgets={Cat.CR: 0.5, Cat.EN: 1.0, Cat.LC: 2.0}, halted=(Cat.EN,))
    return TrainingTask(**{**base, **kw})


def test_ccdp_step_hand_worked() -> None:
    # EN is halted (its 2 records are not sampled, but stay in the public count): N_site = 6, q = B / N_site = 2/6,
    # normaliser q * N_site = 2 (nothing that leaves the gateway depends on the halted category's count).
    # Clipped (C = 1): (3,4) -> (0.6,0.8); (0,1); (6,8) -> (0.6,0.8); (0,0). Sum (1.2, 2.6); / 2 = (0.6, 1.3).
    # One step at lr 0.5 from w = (1, -1): delta = -0.5 * (0.6, 1.3) = (-0.3, -0.65).
    result = train_locally(backend=FakeBackend(), dataset=dataset(), task=task(),
                           global_weights={"w": np.array([1.0, -1.0], np.float32)},
                           site_categories=[Cat.CR, Cat.EN, Cat.LC], randomness=ZeroNoise())
    np.testing.assert_allclose(result.delta["w"], [-0.3, -0.65], rtol=2e-5)  # 1e-5 clip margin
    assert result.sampling_rate == 2 / 6
    assert result.report.num_examples == 6 and result.report.local_steps == 1
    assert set(result.report.events) == {Cat.CR, Cat.LC}  # the halted category reports nothing
    # individualized DP-SGD, "sample": one noise multiplier; LC (the largest active budget) at the base rate, CR
    # at the lower rate its budget allows (ZeroNoise's uniforms 0 still take every record of rate > 0)
    events = result.report.events
    assert events[Cat.LC].sampling_rate == 2 / 6 and 0 < events[Cat.CR].sampling_rate < 2 / 6
    assert events[Cat.CR].noise_multiplier == events[Cat.LC].noise_multiplier
    for cat, event in events.items():
        assert event.steps == 1 and event.sampling_rate == result.sampling_rates[cat]
        assert event.noise_multiplier == result.noise_multipliers[cat]


def test_non_private_step_uses_realised_mean_and_reports_no_events() -> None:
    # All 4 eligible records sampled, mean gradient (9, 13)/4 = (2.25, 3.25); lr 0.5 -> delta (-1.125, -1.625).
    result = train_locally(backend=FakeBackend(), dataset=dataset(), task=task(privacy="none", budgets={}),
                           global_weights={"w": np.zeros(2, np.float32)}, site_categories=[Cat.CR, Cat.EN, Cat.LC],
                           randomness=ZeroNoise())
    np.testing.assert_allclose(result.delta["w"], [-1.125, -1.625])
    assert result.report.events == {}


def test_all_halted_site_does_not_train() -> None:
    with pytest.raises(PrivacyBudgetError, match="does not train"):
        train_locally(backend=FakeBackend(), dataset=dataset(), task=task(halted=(Cat.CR, Cat.EN, Cat.LC)),
                      global_weights={"w": np.zeros(2, np.float32)}, site_categories=[Cat.CR, Cat.EN, Cat.LC],
                      randomness=ZeroNoise())


class FixedNormals(ZeroNoise):
    """Uniforms 0 (every eligible record sampled); normals from a fixed list (to check where the noise goes)."""

    def __init__(self, normals):
        self.normals = list(normals)

    def standard_normal(self, size):
        n = int(np.prod(size))
        out, self.normals = self.normals[:n], self.normals[n:]
        return np.asarray(out + [0.0] * (n - len(out)), dtype=np.float64).reshape(size)


def test_count_release_is_noised_charged_and_leaves_room_for_it_in_the_calibration() -> None:
    import dp_accounting
    from dp_accounting import rdp

    from shared.privacy.events import DPSGDEvent

    # Prepare: labels 0,1,1,2 on the eligible CR/LC records (EN halted, its records 2 are not counted)
    data = dataset()
    data = LocalDataset(images=data.images, labels=np.array([0, 1, 1, 2, 2, 2], np.int64),
                        categories=data.categories, media_ids=data.media_ids)
    # the DP-SGD step draws its noise first (d = 2 normals), then the counts draw one normal per class (4 classes)
    result = train_locally(backend=FakeBackend(), dataset=data, task=task(count_noise_multiplier=60.0),
                           global_weights={"w": np.zeros(2, np.float32)}, site_categories=[Cat.CR, Cat.EN, Cat.LC],
                           randomness=FixedNormals([0.0, 0.0, 0.5, -1.0, 0.25, 2.0]), num_classes=4)
    # Assert: counts 1, 2, 1, 0 plus 60 x (0.5, -1, 0.25, 2)
    assert result.report.species_counts == {0: 31.0, 1: -58.0, 2: 16.0, 3: 120.0}
    assert result.report.count_events == {Cat.CR: DPSGDEvent(60.0, 1.0, 1), Cat.LC: DPSGDEvent(60.0, 1.0, 1)}
    # the steps were calibrated around the 10 planned count releases: together exactly within each budget
    plain = train_locally(backend=FakeBackend(), dataset=data, task=task(), global_weights={"w": np.zeros(2, np.float32)},
                          site_categories=[Cat.CR, Cat.EN, Cat.LC], randomness=ZeroNoise())
    assert result.noise_multipliers[Cat.LC] > plain.noise_multipliers[Cat.LC]
    for cat, budget in ((Cat.CR, 0.5), (Cat.LC, 2.0)):
        z, q = result.noise_multipliers[cat], result.sampling_rates[cat]
        acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
        acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), 10)
        acc.compose(dp_accounting.GaussianDpEvent(60.0), 10)
        assert budget * 0.995 <= acc.get_epsilon(1e-5) <= budget


def test_count_noise_that_alone_passes_the_budget_stops_training() -> None:
    with pytest.raises(PrivacyBudgetError, match="fixed releases alone"):
        train_locally(backend=FakeBackend(), dataset=dataset(), task=task(count_noise_multiplier=0.5),
                      global_weights={"w": np.zeros(2, np.float32)}, site_categories=[Cat.CR, Cat.EN, Cat.LC],
                      randomness=ZeroNoise(), num_classes=1)


class HeadFakeBackend(FakeBackend):
    """FakeBackend with a head-shaped parameter set: ``psi.bias`` (3 classes) beside ``w``; records the bias it
    trains at (the gradient of the bias is zero here, so only the re-parameterisation moves it)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = np.zeros(3, np.float32)
        self.seen_bias: list[np.ndarray] = []

    @property
    def parameter_layout(self):
        from edge_sdk.backends.base import ParameterSpec

        return (ParameterSpec("w", (2,), 0), ParameterSpec("psi.bias", (3,), 2))

    def set_weights(self, weights):
        self.w = np.asarray(weights["w"], np.float32).copy()
        self.bias = np.asarray(weights["psi.bias"], np.float32).copy()

    def get_weights(self):
        return {"w": self.w.copy(), "psi.bias": self.bias.copy()}

    def per_example_gradients(self, x, y):
        self.seen_bias.append(self.bias.copy())
        g = np.asarray(x, np.float32).reshape(len(y), -1)
        return np.concatenate([g, np.zeros((len(y), 3), np.float32)], axis=1)

    def apply_gradient(self, flat_grad, learning_rate):
        self.w = self.w - learning_rate * flat_grad[:2]


def test_logit_adjustment_trains_at_bias_plus_log_weight_and_hands_back_the_plain_delta() -> None:
    # classes 0 (CR), 1 (LC), 2 (EN, halted): LC is the anchor (q = 2/6), CR sampled at q_CR < q. The steps must
    # see bias + log(q_CR / q) on class 0, 0 on class 1 (the anchor) and 0 on class 2 (not active); the delta of
    # the bias is 0 (its gradient is 0 here), so the shift is taken off exactly.
    backend = HeadFakeBackend()
    bias0 = np.array([0.5, -0.25, 1.0], np.float32)
    result = train_locally(backend=backend, dataset=dataset(), task=task(),
                           global_weights={"w": np.zeros(2, np.float32), "psi.bias": bias0},
                           site_categories=[Cat.CR, Cat.EN, Cat.LC], randomness=ZeroNoise(),
                           class_categories={0: Cat.CR, 1: Cat.LC, 2: Cat.EN})
    q_cr, q = result.sampling_rates[Cat.CR], result.sampling_rates[Cat.LC]
    assert q == 2 / 6 and q_cr < q
    np.testing.assert_allclose(backend.seen_bias[0], bias0 + np.array([np.log(q_cr / q), 0.0, 0.0]), rtol=1e-6)
    np.testing.assert_array_equal(result.delta["psi.bias"], np.zeros(3, np.float32))
    # the events are those of the same plan without the adjustment (a public change of the loss only)
    plain = train_locally(backend=HeadFakeBackend(), dataset=dataset(), task=task(),
                          global_weights={"w": np.zeros(2, np.float32), "psi.bias": bias0},
                          site_categories=[Cat.CR, Cat.EN, Cat.LC], randomness=ZeroNoise())
    assert plain.report.events == result.report.events
    np.testing.assert_allclose(plain.delta["w"], result.delta["w"])


def test_class_reweighting_scales_each_class_row_by_its_weight_to_the_minus_p(tmp_path) -> None:
    # A real head (3 classes over 4 inputs) on 60 records: class 0 CR, class 1 LC (the largest budget: the anchor,
    # sampled at q), class 2 VU. The same seeded draw twice: without and with class_reweighting 0.5. Row k of the
    # delta must be the plain row times (q_c / q)^-0.5 (c = class k's category, q_c from the rates that ran); the
    # events must not change (post-processing).
    import warnings

    from edge_sdk.training import reweight_class_rows
    from shared.privacy.randomness import InsecureRandomnessWarning, SeededRandom
    from tests.gateway_backend import model_weights, training_backend

    class Records:
        def __init__(self):
            rng = np.random.default_rng(4)
            self.features = rng.standard_normal((60, 4)).astype(np.float32)
            self.labels = np.arange(60) % 3
            self.categories = np.array([Cat.CR.rank, Cat.LC.rank, Cat.VU.rank], np.int8)[self.labels]

        def __len__(self):
            return 60

    weights = model_weights("tiny-4")  # the head alone on 4-dimensional inputs, K = 3
    table = {0: Cat.CR, 1: Cat.LC, 2: Cat.VU}
    results = []
    for p in (0.0, 0.5):
        t = TrainingTask(federation_id="f", round=0, model_hash="0" * 64, local_steps=2, expected_batch_size=30,
                         learning_rate=0.5, clipping_norm=1.0, target_delta=1e-5, planned_rounds=4, privacy="ccdp",
                         budgets={Cat.CR: 0.5, Cat.VU: 1.0, Cat.LC: 2.0}, class_reweighting=p)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", InsecureRandomnessWarning)
            results.append(train_locally(backend=training_backend("tiny-4", tmp_path / f"p{p}"), dataset=Records(),
                                         task=t, global_weights=weights, site_categories=[Cat.CR, Cat.VU, Cat.LC],
                                         randomness=SeededRandom(9), class_categories=table))
    plain, rw = results
    assert plain.report.events == rw.report.events
    q = max(plain.sampling_rates.values())
    assert plain.sampling_rates[Cat.LC] == q and plain.sampling_rates[Cat.CR] < plain.sampling_rates[Cat.VU] < q
    for k, c in table.items():
        factor = (plain.sampling_rates[c] / q) ** -0.5
        np.testing.assert_allclose(rw.delta["psi.weight"][k], plain.delta["psi.weight"][k] * factor, rtol=1e-5)
        np.testing.assert_allclose(rw.delta["psi.bias"][k], plain.delta["psi.bias"][k] * factor, rtol=1e-5)
    # the helper by hand: weights 0.25 and 1, power 1 -> factors 4 and 1; other tensors untouched
    out = reweight_class_rows({"psi.weight": np.ones((2, 2), np.float32), "psi.bias": np.ones(2, np.float32),
                               "phi.0.weight": np.ones(3, np.float32)}, {Cat.CR: 0.25, Cat.LC: 1.0},
                              {0: Cat.CR, 1: Cat.LC}, 1.0)
    np.testing.assert_array_equal(out["psi.weight"], [[4, 4], [1, 1]])
    np.testing.assert_array_equal(out["psi.bias"], [4, 1])
    np.testing.assert_array_equal(out["phi.0.weight"], np.ones(3))
    with pytest.raises(ValueError, match="power"):
        reweight_class_rows(out, {Cat.CR: 0.25}, {0: Cat.CR}, 1.5)


def test_class_reweighting_is_a_ccdp_task_field_in_zero_one_and_round_trips() -> None:
    from shared.errors import PayloadError
    from shared.protocol import decode_task, encode_task

    base = dict(federation_id="f", round=0, model_hash="0" * 64, local_steps=1, expected_batch_size=8,
                learning_rate=0.5, clipping_norm=1.0, target_delta=1e-5, planned_rounds=2, privacy="ccdp",
                budgets={Cat.LC: 1.0})
    t = TrainingTask(**base, class_reweighting=0.5)
    assert t.to_json()["class_reweighting"] == 0.5
    assert "class_reweighting" not in TrainingTask(**base).to_json()  # off: left out, older gateways read it
    back, _ = decode_task(encode_task(t, {"w": np.zeros(2, np.float32)}))
    assert back.class_reweighting == 0.5
    for bad in (-0.1, 1.5, True, "0.5"):
        with pytest.raises(PayloadError, match="class_reweighting"):
            TrainingTask(**base, class_reweighting=bad)
    with pytest.raises(PayloadError, match="only for ccdp"):
        TrainingTask(**{**base, "privacy": "none", "budgets": {}}, class_reweighting=0.5)


class WideZeroBackend(FakeBackend):
    """d parameters whose per-example gradients are all zero: a CCDP step is then its noise alone."""

    def __init__(self, d: int) -> None:
        self.d = d
        self.w = np.zeros(d, np.float32)

    @property
    def parameter_layout(self):
        return (ParameterSpec("w", (self.d,), 0),)

    def per_example_gradients(self, x, y):
        return np.zeros((len(y), self.d), np.float32)


@pytest.mark.parametrize("d, cpus, ahead", [(70_000, 2, True), (70_000, 1, False), (20_000, 2, False)])
def test_a_large_models_noise_is_drawn_ahead_and_is_the_steps_gaussian(monkeypatch, d, cpus, ahead) -> None:
    from scipy import stats

    import edge_sdk.training as training
    import shared.privacy.noise_prefetch as noise_prefetch
    from shared.privacy.randomness import SecureRandom

    made = []

    class Recording(noise_prefetch.PrefetchedNormals):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(training, "PrefetchedNormals", Recording)
    monkeypatch.setattr(noise_prefetch, "_usable_cpus", lambda: cpus)
    result = train_locally(backend=WideZeroBackend(d), dataset=dataset(), task=task(local_steps=2),
                           global_weights={"w": np.zeros(d, np.float32)}, site_categories=[Cat.CR, Cat.EN, Cat.LC],
                           randomness=SecureRandom())
    # drawn ahead exactly for a model of at least PREFETCH_MIN_SIZE parameters on more than one CPU, and closed
    assert [m.prefetching for m in made] == ([False] if ahead else [])
    # two steps of pure noise: delta = -lr * (n1 + n2) * sigma / (q N_site), n1 + n2 ~ N(0, 2)
    scale = task().learning_rate * result.plan.noise_std / (result.sampling_rate * 6) * np.sqrt(2)
    z = -result.delta["w"].astype(np.float64) / scale
    assert stats.kstest(z, "norm").pvalue > 1e-6
