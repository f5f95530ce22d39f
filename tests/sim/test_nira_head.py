"""The NIRA-vs-baselines experiment's parts: the numpy head against the torch model, one fine-tuning
step against torch autograd, the species mask on a hand-worked federation, NIRA with one cluster against FedAvg
through the in-process replay, and the tuning choice on hand-made rows."""

from __future__ import annotations

import numpy as np
import pytest

from shared.iucn import IUCNCategory as Cat
from shared.models.kinds import model_spec

from wildfed_sim.demo_sim import SimConfig, SimFederation, SimSite, simulate
from wildfed_sim.nira_sim import METHODS, _choose, _strategy, fine_tune_head, head_logits, score_sites


@pytest.mark.parametrize("width", [0, 8])
def test_numpy_logits_equal_the_torch_head_model(width):
    import torch

    spec = model_spec("head", 4, adapter_width=width)
    weights = spec.initial_weights(3)
    rng = np.random.default_rng(0)
    weights = {k: (v + rng.normal(scale=0.1, size=v.shape)).astype(np.float32) for k, v in weights.items()}
    x = rng.normal(size=(5, 1280)).astype(np.float32)
    model = spec.build()
    model.load_state_dict({k: torch.as_tensor(v) for k, v in weights.items()})
    with torch.no_grad():
        expected = model(torch.as_tensor(x)).numpy()
    np.testing.assert_allclose(head_logits(weights, x), expected, rtol=1e-4, atol=1e-4)


def test_one_fine_tuning_step_is_gradient_descent_on_the_mean_cross_entropy():
    import torch

    rng = np.random.default_rng(1)
    x = rng.normal(size=(7, 1280)).astype(np.float32)
    y = np.array([0, 1, 2, 0, 1, 2, 2])
    w0 = {"psi.weight": rng.normal(scale=0.01, size=(3, 1280)).astype(np.float32),
          "psi.bias": rng.normal(size=3).astype(np.float32)}
    out = fine_tune_head(w0, x, y, steps=1)
    # torch autograd in the centred parametrisation the function uses: logits (x - mu) W^T + b_c with
    # b_c = b + W mu an independent variable (the same logits as x W^T + b), then folded back: b = b_c - W mu
    xt = torch.as_tensor(x, dtype=torch.float64)
    mu = xt.mean(0)
    w = torch.as_tensor(w0["psi.weight"], dtype=torch.float64).requires_grad_()
    bc = (torch.as_tensor(w0["psi.bias"], dtype=torch.float64) + w.detach() @ mu).requires_grad_()
    loss = torch.nn.functional.cross_entropy((xt - mu) @ w.T + bc, torch.as_tensor(y))
    gw, gb = torch.autograd.grad(loss, (w, bc))
    hc = (xt - mu).numpy()
    step = 1.0 / (0.5 * (np.max(np.sum(hc * hc, axis=1)) + 1.0))  # 1 / L, L = max_i (||h_i - mu||^2 + 1) / 2
    w1 = w.detach().numpy() - step * gw.numpy()
    b1 = bc.detach().numpy() - step * gb.numpy() - w1 @ mu.numpy()
    np.testing.assert_allclose(out["psi.weight"], w1, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(out["psi.bias"], b1, rtol=1e-4, atol=1e-5)
    # and many steps lower the loss the site sees
    def ce(wts):
        z = head_logits(wts, x)
        z = z - z.max(1, keepdims=True)
        return float(np.mean(np.log(np.exp(z).sum(1)) - z[np.arange(7), y]))
    assert ce(fine_tune_head(w0, x, y, steps=50)) < ce(out) < ce(w0)


def _federation():
    # 3 classes on a 1280-d one-hot code: class c's images are e_c; the test set has 2 images per class
    def onehot(labels):
        x = np.zeros((len(labels), 1280), np.float32)
        x[np.arange(len(labels)), labels] = 1.0
        return x

    a_labels, b_labels = np.array([0, 0, 1]), np.array([2, 2, 1])
    sites = (SimSite("site-00", onehot(a_labels), a_labels, np.full(3, Cat.LC.rank, np.int8), (Cat.LC,), (0, 1)),
             SimSite("site-01", onehot(b_labels), b_labels, np.full(3, Cat.LC.rank, np.int8), (Cat.LC,), (1, 2)))
    test = np.array([0, 0, 1, 1, 2, 2])
    return SimFederation(sites, onehot(test), test, onehot(np.array([0, 1, 2])), (Cat.LC, Cat.LC, Cat.EN))


def test_the_species_mask_scores_argmax_over_the_sites_own_classes():
    fed = _federation()
    # a model that predicts class 2 for everything, except class 0's images which it gets right
    w = np.zeros((3, 1280), np.float32)
    w[0, 0] = 5.0
    model = {"psi.weight": w, "psi.bias": np.array([0.0, 0.0, 1.0], np.float32)}
    plain = score_sites(fed, {"site-00": model, "site-01": model}, "plain")
    # site-00 (classes 0, 1): class 0 right, class 1 wrong -> macro 0.5; site-01 (1, 2): class 1 wrong, 2 right -> 0.5
    assert plain["macro"] == pytest.approx(0.5)
    # site-00 weights by its records: 2 of class 0 (right), 1 of class 1 (wrong) -> 2/3; site-01: 1 wrong, 2 right
    assert plain["site_mean"] == pytest.approx(2 / 3)
    # CR/EN: only site-01 holds class 2 (EN), right -> 1.0
    assert plain["cr_en"] == pytest.approx(1.0)
    masked = score_sites(fed, {"site-00": model, "site-01": model}, "mask")
    # site-00 masked to {0, 1}: class-1 images now score logits (0, 0) over {0, 1}: argmax 0 -> still wrong
    # site-01 masked to {1, 2}: class-1 images: bias 1 on class 2 -> wrong; the same: macro 0.5
    assert masked["macro"] == pytest.approx(0.5)
    model2 = {"psi.weight": w, "psi.bias": np.array([0.0, 0.5, 1.0], np.float32)}
    # with class 1 second-most likely, the mask turns site-00's class-1 images right (class 2 is not its species)
    assert score_sites(fed, {"site-00": model2, "site-01": model2}, "mask")["macro"] == pytest.approx((1.0 + 0.5) / 2)


def test_nira_with_one_cluster_and_no_merging_is_fedavg():
    fed = _federation()
    config = SimConfig(privacy="none", rounds=2, local_steps=2, expected_batch_size=3, learning_rate=0.5,
                       centre=False, logit_adjustment=False)
    fedavg = simulate(fed, config, seed=0)
    # both sites list class 1 (LC); class 2 (EN) is left out of the lists: Jaccard {0,1} vs {1} = 0.5 -> one cluster
    # at the cut 0.7
    nira = _strategy(fed, {"embedding_merging": False})
    out = simulate(fed, config, seed=0, strategy=nira)
    assert list(nira.assignment().clusters.values()) == [("site-00", "site-01")]
    for site in ("site-00", "site-01"):
        for k, v in fedavg["weights"].items():
            np.testing.assert_allclose(out["site_models"][site][k], v, rtol=1e-5, atol=1e-7)


def test_each_method_chooses_its_best_point_and_fine_tuning_steps_on_the_tuning_rows():
    def row(training, seed, point, plain, ft25, ft100):
        scores = {"plain": {"macro": plain}, "mask": {"macro": plain + 0.1},
                  "fine-tune:25": {"macro": ft25}, "fine-tune:100": {"macro": ft100}}
        return {"training": training, "seed": seed, "point": list(point), "scores": scores}

    rows = [row("fedavg", 101, (1.0, 0), 0.5, 0.6, 0.9), row("fedavg", 103, (1.0, 0), 0.7, 0.6, 0.5),  # ft100 0.7
            row("fedavg", 101, (2.0, 0), 0.8, 0.6, 0.6), row("fedavg", 103, (2.0, 0), 0.8, 0.7, 0.6)]  # plain 0.8
    by_name = {m.name: m for m in METHODS}
    assert _choose(rows, by_name["fedavg"]) == {"point": [2.0, 0], "fine_tune_steps": None,
                                                "tuning_macro": pytest.approx(0.8), "candidates": 2}
    ft = _choose(rows, by_name["fedavg+fine-tune"])
    # candidates: (1, ft25) 0.6, (1, ft100) 0.7, (2, ft25) 0.65, (2, ft100) 0.6
    assert (ft["point"], ft["fine_tune_steps"], ft["candidates"]) == ([1.0, 0], 100, 4)
    assert ft["tuning_macro"] == pytest.approx(0.7)
