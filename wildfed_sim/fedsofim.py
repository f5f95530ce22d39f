"""DP-FedSOFIM vs DP-FedGD on real images (issue 6, "Experiment (real images)"; DESIGN.md Seeds "DP-FedSOFIM").

The seed's setting: a frozen feature extractor, only the last linear layer federated, full-batch DP gradient descent
on every client in every round.

Protocol (per seed; the seed fixes the data splits only, privacy noise is never seeded):

1. Animal-MNIST (10,000 images) -> stratified train (80 %) / held-out test (20 %) split
   (:func:`wildfed_sim.animal_mnist.split_holdout`).
2. Public split: :func:`wildfed_sim.demo.balanced_public_split` takes ``public_per_class`` training
   images of every class (default 100, i.e. 1,000 images). No client holds them. The frozen backbone is the
   public ImageNet EfficientNet-Lite0 (issue 18); a linear head trained on the public split's embeddings,
   non-privately (:func:`wildfed_sim.evaluation.train_centralised`, ``pretrain_*`` settings), is reported as the
   public-data reference (``public_model_test_accuracy``); the federation does not start from it.
3. Validation split: ``val_per_class`` further training images per class (default 70), for tuning only; no client
   holds them either, and the test split is never used for tuning.
4. Clients: the remaining training images, shuffled and cut into K near-equal IID shards (sizes differ by at most 1).
5. The backbone maps every image to its 1280-d embedding once (:func:`wildfed_sim.embeddings.embed_grayscale`,
   cached), exactly as a gateway does. The federated model is the head ``psi`` (weight (10, 1280), bias (10,):
   d = 12,810, the demo's head-only model), started at zero.
6. Round t, client k (N_k records): per-example gradient of the cross-entropy of the linear head,
   ``g_i = (softmax(W x_i + b) - onehot(y_i)) outer [x_i, 1]`` (:class:`LinearHeadGradients`), clipped to L2 norm
   C, summed, Gaussian noise N(0, (z C)^2 I_d) added from a :class:`shared.privacy.randomness.SecureRandom`, divided
   by N_k: the project's :class:`edge_sdk.privacy.ccdp.CCDPMechanism` with one category (a uniform budget; the
   category label is only the ledger key). Sampling rate q = 1 (full batch), one step per round; z is calibrated
   for T rounds with :func:`shared.privacy.accounting.calibrate_noise_multiplier` (RDP), and every client's
   ``DPSGDEvent(z, 1.0, 1)`` of every round is recorded in a :class:`coordinator.ledger.PrivacyLedger` (SQLite in
   the output folder) before the server uses the update.
7. Server: ``G_t = sum_k N_k g~_k / sum_k N_k`` (the N_k are public shard sizes), ``avg_delta = -G_t`` (the delta
   of one local SGD step with step 1), then DP-FedGD = :class:`coordinator.optimizers.server_sgd.ServerSGD` (eta)
   or DP-FedSOFIM = :class:`coordinator.optimizers.fedsofim.DPFedSOFIM` (eta, beta, rho). Both are
   post-processing: the ledger charges nothing for them.

Metrics: test accuracy after every round (round 0 = the zero head, 10 %); final accuracy = the test accuracy after
round T, mean and sample std over seeds; rounds for DP-FedSOFIM (and for DP-FedGD itself) to first reach DP-FedGD's
final accuracy of the same seed (:func:`rounds_to_reach`); the largest dip of the seed-mean curve below its running
maximum and whether the curve recovers (:func:`largest_dip`).

Deviation from the product's transport: the clients are simulated in one process (the same mechanism, optimizer and
ledger code, no MQTT): 100 gateway processes with a broker do not fit the 2-core machine this ran on.

Output (``out_dir``): ``fedsofim.json`` (settings, tuning, every run's curve and spend, summary), ``fedsofim.md``
(the table), ``fedsofim.png`` (test accuracy per round, one panel per (K, eps)), ``ledger.db`` (the ledger).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shared.errors import ConfigError
from shared.iucn import IUCNCategory
from shared.privacy.events import DPSGDEvent

from edge_sdk.privacy.per_example import PerExampleGradients

__all__ = [
    "LinearHeadGradients", "HeadData", "head_residuals", "per_example_head_gradients", "flatten_head",
    "unflatten_head", "accuracy", "client_private_gradient", "server_pseudo_gradient", "make_optimizer",
    "run_federation",
    "rounds_to_reach", "largest_dip", "mean_std", "summarise", "markdown_table", "FedSofimSettings",
    "FedSofimResult", "prepare_seed", "tune", "run_fedsofim_experiment", "fedsofim_command", "OPTIMIZERS",
    "UNIFORM_CATEGORY",
]

UNIFORM_CATEGORY = IUCNCategory.LC
"""The one category every record is in (uniform budget): only the ledger key, it changes nothing else."""
OPTIMIZERS = ("dp-fedgd", "dp-fedsofim")
WEIGHT, BIAS = "psi.weight", "psi.bias"


# ------------------------------------------------------------------------------------------- the linear head
@dataclass(frozen=True, eq=False)
class HeadData:
    """Frozen features and labels. features: float32 (N, F); labels: int64 (N,) in 0..C-1."""

    features: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def head_residuals(weight: np.ndarray, bias: np.ndarray, features: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """``softmax(x_i W^T + b) - onehot(y_i)``: the gradient of the cross-entropy w.r.t. the logits.

    Args:
        weight: (C, F); bias: (C,); features: (B, F); labels: int (B,).

    Returns:
        float64 (B, C).
    """
    logits = np.asarray(features, np.float64) @ np.asarray(weight, np.float64).T + np.asarray(bias, np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(labels)), np.asarray(labels, np.int64)] -= 1.0
    return p


class LinearHeadGradients(PerExampleGradients):
    """The per-example gradients of a linear head under cross-entropy, never materialised.

    For example i with residual r_i = softmax - onehot (C,) and feature x_i (F,), the gradient is ``r_i x_i^T``
    w.r.t. the weight (C, F) and ``r_i`` w.r.t. the bias, i.e. the outer product ``r_i (x) [x_i, 1]``, flattened
    as ``[weight.ravel(), bias]`` (d = C F + C). Its L2 norm is ``||r_i|| * sqrt(||x_i||^2 + 1)`` (the Frobenius
    norm of an outer product), and ``sum_i w_i g_i = [(w * R)^T X, sum_i w_i r_i]`` (ghost clipping for one
    linear layer, Goodfellow 2015).

    Args:
        residuals: (B, C); features: (B, F).
    """

    def __init__(self, residuals: np.ndarray, features: np.ndarray) -> None:
        self.residuals = np.asarray(residuals, dtype=np.float64)
        self.features = np.asarray(features, dtype=np.float64)
        if self.residuals.ndim != 2 or self.features.ndim != 2 or len(self.residuals) != len(self.features):
            raise ValueError(f"residuals (B, C) and features (B, F) must share B, got {self.residuals.shape} and "
                             f"{self.features.shape}")
        self.norms = (np.linalg.norm(self.residuals, axis=1)
                      * np.sqrt(np.einsum("ij,ij->i", self.features, self.features) + 1.0))

    def weighted_sum(self, weights: np.ndarray) -> np.ndarray:
        """float32 (K, C F + C) = weights (K, B) @ G (B, C F + C)."""
        weights = np.asarray(weights, dtype=np.float64)
        out = []
        for w in weights:
            wr = self.residuals * w[:, None]                       # (B, C)
            out.append(np.concatenate([(wr.T @ self.features).ravel(), wr.sum(axis=0)]))
        return np.asarray(out, dtype=np.float32).reshape(len(weights), -1)


def per_example_head_gradients(weight: np.ndarray, bias: np.ndarray, features: np.ndarray,
                               labels: np.ndarray) -> np.ndarray:
    """The materialised per-example gradients, float64 (B, C F + C) in ``[weight.ravel(), bias]`` order
    (the reference :class:`LinearHeadGradients` is tested against)."""
    r = head_residuals(weight, bias, features, labels)
    x = np.asarray(features, np.float64)
    return np.concatenate([(r[:, :, None] * x[:, None, :]).reshape(len(r), -1), r], axis=1)


def flatten_head(weights: dict[str, np.ndarray]) -> np.ndarray:
    """``{psi.weight (C, F), psi.bias (C,)}`` -> (C F + C,) in ``[weight.ravel(), bias]`` order."""
    return np.concatenate([np.asarray(weights[WEIGHT]).ravel(), np.asarray(weights[BIAS]).ravel()])


def unflatten_head(flat: np.ndarray, num_classes: int, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """Inverse of :func:`flatten_head`."""
    flat = np.asarray(flat)
    cf = flat.shape[0] - num_classes
    return {WEIGHT: flat[:cf].reshape(num_classes, cf // num_classes).astype(dtype),
            BIAS: flat[cf:].astype(dtype)}


def accuracy(weights: dict[str, np.ndarray], data: HeadData) -> float:
    """Top-1 accuracy of the head on ``data`` (fraction in [0, 1])."""
    logits = data.features @ np.asarray(weights[WEIGHT]).T + np.asarray(weights[BIAS])
    return float(np.mean(np.argmax(logits, axis=1) == data.labels))


def client_private_gradient(mechanism: Any, weights: dict[str, np.ndarray], data: HeadData) -> np.ndarray:
    """One client's released gradient: ``(sum_i clip_C(g_i) + N(0, (z C)^2 I)) / N_k``, float32 (C F + C,).

    ``mechanism`` is a :class:`~edge_sdk.privacy.ccdp.CCDPMechanism` with the one category
    :data:`UNIFORM_CATEGORY` and ``expected_batch_size = N_k`` (q = 1).
    """
    r = head_residuals(weights[WEIGHT], weights[BIAS], data.features, data.labels)
    cats = np.full(len(data), UNIFORM_CATEGORY.rank, dtype=np.int64)
    return mechanism.privatize(LinearHeadGradients(r, data.features), cats)


def server_pseudo_gradient(grads: Sequence[np.ndarray], sizes: Sequence[int]) -> np.ndarray:
    """``G = sum_k N_k g_k / sum_k N_k`` (float64): the server's average of the released client gradients."""
    sizes_arr = np.asarray(sizes, dtype=np.float64)
    return (sizes_arr[:, None] * np.asarray(grads, dtype=np.float64)).sum(axis=0) / sizes_arr.sum()


def make_optimizer(name: str, hp: dict[str, float]) -> Any:
    """``dp-fedgd`` -> ServerSGD(eta); ``dp-fedsofim`` -> DPFedSOFIM(eta, beta, rho)."""
    from coordinator.optimizers.fedsofim import DPFedSOFIM
    from coordinator.optimizers.server_sgd import ServerSGD

    if name == "dp-fedgd":
        return ServerSGD(server_lr=hp["eta"])
    if name == "dp-fedsofim":
        return DPFedSOFIM(learning_rate=hp["eta"], beta=hp["beta"], rho=hp["rho"])
    raise ConfigError(f"unknown optimizer {name!r}", field="optimizer", fix=f"use one of {OPTIMIZERS}")


def run_federation(*, optimizer: Any, clients: Sequence[HeadData], evaluate_on: dict[str, HeadData], rounds: int,
                   clipping_norm: float, noise_multiplier: float, noise: Any, num_classes: int,
                   ledger: Any = None, site_prefix: str = "", on_round: Callable[[], None] | None = None
                   ) -> dict[str, list[float]]:
    """Federate the zero-initialised head for ``rounds`` full-batch DP rounds (module docstring, steps 6-7).

    Args:
        optimizer: a server optimizer (``.step(weights, avg_delta)``).
        clients: each client's features and labels.
        evaluate_on: ``{name: data}`` evaluated after every round (and at round 0).
        noise: the noise source (:class:`~shared.privacy.randomness.SecureRandom` in every reported run).
        ledger: a :class:`~coordinator.ledger.PrivacyLedger`; each client's ``DPSGDEvent(z, 1.0, 1)`` of a round is
            recorded (committed) before the server step uses it. ``None`` only for tuning runs (not reported).
        site_prefix: the ledger's site ids are ``f"{site_prefix}client{k:03d}"``.

    Returns:
        ``{name: [accuracy after round 0..rounds]}`` (rounds + 1 values each).
    """
    from edge_sdk.privacy.ccdp import CCDPMechanism

    feat_dim = clients[0].features.shape[1]
    weights = {WEIGHT: np.zeros((num_classes, feat_dim), np.float32), BIAS: np.zeros(num_classes, np.float32)}
    mechanisms = [CCDPMechanism(clipping_norms={UNIFORM_CATEGORY: clipping_norm},
                                noise_std=float(noise_multiplier) * clipping_norm,
                                expected_batch_size=float(len(c)), noise=noise) for c in clients]
    sizes = [len(c) for c in clients]
    event = DPSGDEvent(float(noise_multiplier), 1.0, 1)
    curves: dict[str, list[float]] = {name: [accuracy(weights, d)] for name, d in evaluate_on.items()}
    for t in range(1, rounds + 1):
        grads = [client_private_gradient(m, weights, c) for m, c in zip(mechanisms, clients)]
        if ledger is not None:
            for k in range(len(clients)):
                ledger.record_round(f"{site_prefix}client{k:03d}", t, {UNIFORM_CATEGORY: event})
        g = server_pseudo_gradient(grads, sizes)
        avg_delta = unflatten_head(-g, num_classes)
        weights = optimizer.step(weights, avg_delta)
        for name, d in evaluate_on.items():
            curves[name].append(accuracy(weights, d))
        if on_round is not None:
            on_round()
    return curves


# ------------------------------------------------------------------------------------------------ metrics
def rounds_to_reach(curve: Sequence[float], target: float) -> int | None:
    """The first round r (index into ``curve``, round 0 = initial model) with ``curve[r] >= target``; None if
    never."""
    for r, v in enumerate(curve):
        if v >= target:
            return r
    return None


def largest_dip(curve: Sequence[float], recover_tol: float = 0.005) -> dict[str, Any]:
    """The largest drop of ``curve`` below its running maximum.

    Returns:
        ``{"depth": max_t (max_{s<=t} c_s - c_t), "peak_round": s of that running max, "dip_round": t,
        "recovered_round": first round after t with c >= peak - recover_tol, or None}``. depth 0 -> rounds None.
    """
    c = np.asarray(curve, dtype=np.float64)
    run_max = np.maximum.accumulate(c)
    drop = run_max - c
    t = int(np.argmax(drop))
    depth = float(drop[t])
    if depth <= 0:
        return {"depth": 0.0, "peak_round": None, "dip_round": None, "recovered_round": None}
    peak_round = int(np.flatnonzero(c[:t + 1] == run_max[t])[0])
    after = np.flatnonzero(c[t + 1:] >= run_max[t] - recover_tol)
    return {"depth": depth, "peak_round": peak_round, "dip_round": t,
            "recovered_round": int(t + 1 + after[0]) if after.size else None}


def mean_std(values: Sequence[float | None]) -> dict[str, Any]:
    """``{"mean", "std" (sample; 0 for one value), "n"}`` over the values that are not None."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
            "n": len(vals)}


def summarise(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (clients, epsilon): both optimizers' final test accuracy (mean ± std over seeds), the paired
    difference, rounds to reach DP-FedGD's final accuracy of the same seed, the dips of the seed-mean curves and
    the ledger's spend (max over clients and seeds).

    Args:
        runs: rows with keys ``clients``, ``epsilon``, ``seed``, ``optimizer``, ``test`` (curve),
            ``spent_epsilon``, ``noise_multiplier``.
    """
    keys = sorted({(r["clients"], r["epsilon"]) for r in runs})
    out = []
    for k, eps in keys:
        by = {(r["optimizer"], r["seed"]): r for r in runs if r["clients"] == k and r["epsilon"] == eps}
        seeds = sorted({s for _, s in by})
        entry: dict[str, Any] = {"clients": k, "epsilon": eps}
        for opt in OPTIMIZERS:
            curves = [by[(opt, s)]["test"] for s in seeds if (opt, s) in by]
            entry[opt] = {"final": mean_std([c[-1] for c in curves]),
                          "final_last10": mean_std([float(np.mean(c[-10:])) for c in curves]),
                          "mean_curve": np.mean(curves, axis=0).tolist() if curves else [],
                          "std_curve": (np.std(curves, axis=0, ddof=1).tolist() if len(curves) > 1
                                        else [0.0] * len(curves[0]) if curves else []),
                          "dip": largest_dip(np.mean(curves, axis=0)) if curves else None,
                          "spent_epsilon": max((by[(opt, s)]["spent_epsilon"] for s in seeds if (opt, s) in by
                                                and by[(opt, s)]["spent_epsilon"] is not None), default=None),
                          "noise_multiplier": next((by[(opt, s)]["noise_multiplier"] for s in seeds
                                                    if (opt, s) in by), None)}
        paired = [s for s in seeds if all((o, s) in by for o in OPTIMIZERS)]
        diffs = [by[("dp-fedsofim", s)]["test"][-1] - by[("dp-fedgd", s)]["test"][-1] for s in paired]
        diffs10 = [float(np.mean(by[("dp-fedsofim", s)]["test"][-10:]) - np.mean(by[("dp-fedgd", s)]["test"][-10:]))
                   for s in paired]
        entry["delta_final"] = mean_std(diffs)
        entry["delta_last10"] = mean_std(diffs10)
        # Rounds to reach DP-FedGD's final accuracy of the same seed ("" suffix), and, less sensitive to the noise
        # of one round, the mean of its last 10 rounds ("_last10" suffix).
        for suffix, target_of in (("", lambda c: c[-1]), ("_last10", lambda c: float(np.mean(c[-10:])))):
            r_gd, r_so, earlier, not_reached = [], [], [], 0
            for s in paired:
                gd, so = by[("dp-fedgd", s)]["test"], by[("dp-fedsofim", s)]["test"]
                a, b = rounds_to_reach(gd, target_of(gd)), rounds_to_reach(so, target_of(gd))
                r_gd.append(a)
                r_so.append(b)
                if b is None:
                    not_reached += 1
                else:
                    earlier.append(a - b)
            entry["rounds_gd" + suffix] = mean_std(r_gd)
            entry["rounds_sofim" + suffix] = mean_std(r_so)
            entry["rounds_earlier" + suffix] = mean_std(earlier)
            entry["rounds_per_seed" + suffix] = {"dp-fedgd": r_gd, "dp-fedsofim": r_so}
            entry["sofim_not_reached" + suffix] = not_reached
        out.append(entry)
    return out


def _pct(stat: dict[str, Any], signed: bool = False) -> str:
    if stat["mean"] is None:
        return "-"
    fmt = "{:+.1f}" if signed else "{:.1f}"
    return f"{fmt.format(100 * stat['mean'])} ± {100 * stat['std']:.1f}"


def _num(stat: dict[str, Any], signed: bool = False) -> str:
    if stat["mean"] is None:
        return "-"
    fmt = "{:+.1f}" if signed else "{:.1f}"
    return f"{fmt.format(stat['mean'])} ± {stat['std']:.1f}"


def _dip(d: dict[str, Any] | None) -> str:
    if not d or d["depth"] < 0.005:
        return "none"
    rec = f"back r{d['recovered_round']}" if d["recovered_round"] is not None else "not back"
    return f"-{100 * d['depth']:.1f} r{d['peak_round']}→r{d['dip_round']}, {rec}"


HEADERS = ["K", "eps (target / ledger)", "z", "DP-FedGD acc %", "DP-FedSOFIM acc %", "Δ (pts, paired)",
           "Δ last-10 mean (pts)", "rounds GD→its final", "rounds SOFIM→GD final", "rounds earlier",
           "rounds earlier (last-10 target)", "dip GD", "dip SOFIM"]


def _cells(e: dict[str, Any]) -> list[str]:
    gd, so = e["dp-fedgd"], e["dp-fedsofim"]
    spent = max(x for x in (gd["spent_epsilon"], so["spent_epsilon"], -1.0) if x is not None)
    miss = f" ({e['sofim_not_reached']} seed(s) never)" if e["sofim_not_reached"] else ""
    miss10 = f" ({e['sofim_not_reached_last10']} never)" if e.get("sofim_not_reached_last10") else ""
    return [str(e["clients"]), f"{e['epsilon']:g} / {spent:.3f}" if spent >= 0 else f"{e['epsilon']:g} / -",
            f"{gd['noise_multiplier']:.2f}" if gd["noise_multiplier"] else "-",
            _pct(gd["final"]), _pct(so["final"]), _pct(e["delta_final"], signed=True),
            _pct(e["delta_last10"], signed=True), _num(e["rounds_gd"]), _num(e["rounds_sofim"]) + miss,
            _num(e["rounds_earlier"], signed=True), _num(e["rounds_earlier_last10"], signed=True) + miss10,
            _dip(gd["dip"]), _dip(so["dip"])]


def markdown_table(summary: Sequence[dict[str, Any]]) -> str:
    """The summary as a GitHub-flavoured Markdown table."""
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(_cells(e)) + " |" for e in summary]
    return "\n".join(lines) + "\n"


def _plot(summary: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({e["clients"] for e in summary})
    epss = sorted({e["epsilon"] for e in summary})
    fig, axes = plt.subplots(len(ks), len(epss), figsize=(3.2 * len(epss), 2.8 * len(ks)), squeeze=False,
                             sharey=True)
    for e in summary:
        ax = axes[ks.index(e["clients"])][epss.index(e["epsilon"])]
        for opt, colour in zip(OPTIMIZERS, ("tab:blue", "tab:red")):
            m, s = np.asarray(e[opt]["mean_curve"]), np.asarray(e[opt]["std_curve"])
            if m.size == 0:
                continue
            x = np.arange(m.size)
            ax.plot(x, 100 * m, color=colour, lw=1.2, label=opt.upper().replace("DP-FED", "DP-Fed"))
            ax.fill_between(x, 100 * (m - s), 100 * (m + s), color=colour, alpha=0.2, lw=0)
        ax.set_title(f"K={e['clients']}, eps={e['epsilon']:g}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.set_xlabel("round", fontsize=8)
        ax.set_ylabel("test accuracy %", fontsize=8)
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -------------------------------------------------------------------------------------------- the experiment
@dataclass
class FedSofimSettings:
    """The experiment's settings (see the module docstring). Learning rates etc. are used as given when
    ``tune`` is False; with ``tune`` they are replaced by the best of :func:`tune`'s grid."""

    seeds: tuple[int, ...] = (0, 1, 2)
    clients: tuple[int, ...] = (20, 100)
    epsilons: tuple[float, ...] = (0.5, 1.0, 2.0, 5.0, 10.0)
    rounds: int = 100
    target_delta: float = 1e-5
    clipping_norm: float = 1.0
    public_per_class: int = 100
    val_per_class: int = 70
    test_fraction: float = 0.2
    pretrain_epochs: int = 30
    pretrain_batch_size: int = 64
    pretrain_learning_rate: float = 0.1
    fedgd_eta: float = 1.0
    sofim_eta: float = 1.0
    sofim_beta: float = 0.9
    sofim_rho: float = 1.0
    tune: bool = True
    tune_clients: int = 20
    tune_epsilon: float = 1.0
    tune_repeats: int = 2
    out_dir: Path | None = None

    def __post_init__(self) -> None:
        checks = [("seeds", bool(self.seeds), "e.g. --seeds 0,1,2"),
                  ("clients", bool(self.clients) and all(isinstance(k, int) and k >= 1 for k in self.clients),
                   "positive integers, e.g. --clients 20,100"),
                  ("epsilons", bool(self.epsilons) and all(0 < e < math.inf for e in self.epsilons),
                   "positive numbers, e.g. --epsilons 0.5,1,2,5,10"),
                  ("rounds", isinstance(self.rounds, int) and self.rounds >= 1, "e.g. --rounds 100"),
                  ("target_delta", 0 < self.target_delta < 1, "e.g. 1e-5"),
                  ("clipping_norm", self.clipping_norm > 0, "e.g. 1.0"),
                  ("public_per_class", self.public_per_class >= 1, "e.g. 100"),
                  ("val_per_class", self.val_per_class >= 1, "e.g. 70"),
                  ("pretrain_epochs", self.pretrain_epochs >= 1, "e.g. 30"),
                  ("tune_repeats", self.tune_repeats >= 1, "e.g. 2")]
        for name, ok, fix in checks:
            if not ok:
                raise ConfigError(f"{name} = {getattr(self, name)!r} is out of range", field=name, fix=fix)

    def hyper_parameters(self) -> dict[str, dict[str, float]]:
        """``{optimizer: {eta, [beta, rho]}}``."""
        return {"dp-fedgd": {"eta": self.fedgd_eta},
                "dp-fedsofim": {"eta": self.sofim_eta, "beta": self.sofim_beta, "rho": self.sofim_rho}}


@dataclass
class FedSofimResult:
    """What :func:`run_fedsofim_experiment` produced."""

    out_dir: Path
    runs: list[dict[str, Any]] = field(default_factory=list)
    summary: list[dict[str, Any]] = field(default_factory=list)
    tuning: dict[str, Any] = field(default_factory=dict)
    seeds_info: dict[int, dict[str, Any]] = field(default_factory=dict)
    elapsed_s: float = 0.0


@dataclass(frozen=True, eq=False)
class SeedData:
    """One seed's frozen features: the client pool, the validation and the test split, and facts about them."""

    pool: HeadData
    val: HeadData
    test: HeadData
    info: dict[str, Any]

    def clients(self, k: int, seed: int) -> list[HeadData]:
        """The pool shuffled (``default_rng([seed, k, 0x434C49])``) and cut into ``k`` near-equal IID shards."""
        if k > len(self.pool):
            raise ConfigError(f"{k} clients for {len(self.pool)} records", field="clients",
                              fix="use fewer clients")
        order = np.random.default_rng([seed, k, 0x434C49]).permutation(len(self.pool))
        return [HeadData(self.pool.features[i], self.pool.labels[i]) for i in np.array_split(order, k)]


def prepare_seed(settings: FedSofimSettings, seed: int) -> SeedData:
    """Steps 1-5 of the protocol for one seed: splits, the public-split reference head, backbone embeddings."""
    from wildfed_sim.animal_mnist import NUM_CLASSES, fetch_animal_mnist, split_holdout
    from wildfed_sim.demo import balanced_public_split
    from wildfed_sim.evaluation import train_centralised

    t0 = time.monotonic()
    train, test = split_holdout(fetch_animal_mnist(), settings.test_fraction, seed=seed)
    public = balanced_public_split(train.labels, settings.public_per_class, seed=seed)
    rest = np.setdiff1d(np.arange(len(train)), public)
    rng = np.random.default_rng([seed, 0x56414C])
    val = np.sort(np.concatenate([rng.choice(rest[train.labels[rest] == c], settings.val_per_class, replace=False)
                                  for c in range(NUM_CLASSES)]))
    pool = np.setdiff1d(rest, val)
    from wildfed_sim.embeddings import embed_grayscale

    features = embed_grayscale(train.images, train.source_indices)  # the frozen public backbone, cached
    weights = train_centralised(features[public], train.labels[public], num_classes=NUM_CLASSES,
                                epochs=settings.pretrain_epochs, batch_size=settings.pretrain_batch_size,
                                learning_rate=settings.pretrain_learning_rate, seed=seed)

    def data(images: np.ndarray, labels: np.ndarray, sources: np.ndarray) -> HeadData:
        return HeadData(embed_grayscale(images, sources), np.asarray(labels, np.int64))

    test_data = data(test.images, test.labels, test.source_indices)
    info = {"train": len(train), "test": len(test), "public": int(len(public)), "val": int(len(val)),
            "client_pool": int(len(pool)),
            "public_model_test_accuracy": accuracy({WEIGHT: weights["psi.weight"], BIAS: weights["psi.bias"]},
                                                   test_data),
            "prepare_s": time.monotonic() - t0}
    return SeedData(pool=HeadData(features[pool], np.asarray(train.labels[pool], np.int64)),
                    val=HeadData(features[val], np.asarray(train.labels[val], np.int64)), test=test_data, info=info)


TUNING_GRID: dict[str, list[dict[str, float]]] = {
    "dp-fedgd": [{"eta": eta} for eta in (0.1, 0.3, 1.0, 3.0, 10.0)],
    "dp-fedsofim": [{"eta": lr * rho, "beta": beta, "rho": rho}
                    for lr in (0.1, 0.3, 1.0, 3.0, 10.0) for rho in (0.1, 1.0) for beta in (0.9, 0.99)],
}
"""Tried in :func:`tune`. For DP-FedSOFIM the grid is over eta / rho (the step orthogonal to M, the analogue of
DP-FedGD's eta), rho and beta; eta = (eta / rho) * rho."""


def tune(settings: FedSofimSettings, data: SeedData, seed: int, console: Any = None,
         progress: Any = None) -> dict[str, Any]:
    """Pick each optimizer's hyper-parameters on ONE setting (``tune_clients``, ``tune_epsilon``) by validation
    accuracy (mean over the last 10 rounds, then over ``tune_repeats`` runs with fresh noise); the test split is
    not looked at. Tuning runs draw SecureRandom noise like every run but are not recorded in the ledger: the
    privacy cost of tuning is not accounted, as in the seed (docs/fedsofim.md, "Hyper-parameters and tuning")."""
    from shared.privacy.accounting import calibrate_noise_multiplier
    from shared.privacy.randomness import SecureRandom

    z = calibrate_noise_multiplier(target_epsilon=settings.tune_epsilon, target_delta=settings.target_delta,
                                   sampling_rate=1.0, steps=settings.rounds)
    clients = data.clients(settings.tune_clients, seed)
    tried: dict[str, list[dict[str, Any]]] = {}
    best: dict[str, dict[str, float]] = {}
    task = progress.add_task("tuning", total=sum(len(g) for g in TUNING_GRID.values()) * settings.tune_repeats
                             ) if progress is not None else None
    for opt, grid in TUNING_GRID.items():
        tried[opt] = []
        for hp in grid:
            scores = []
            for _ in range(settings.tune_repeats):
                curves = run_federation(optimizer=make_optimizer(opt, hp), clients=clients,
                                        evaluate_on={"val": data.val}, rounds=settings.rounds,
                                        clipping_norm=settings.clipping_norm, noise_multiplier=z,
                                        noise=SecureRandom(), num_classes=10)
                scores.append(float(np.mean(curves["val"][-10:])))
                if task is not None:
                    progress.advance(task)
            tried[opt].append({**hp, "val_accuracy_last10": float(np.mean(scores)), "runs": scores})
        best[opt] = {k: v for k, v in max(tried[opt], key=lambda r: r["val_accuracy_last10"]).items()
                     if k in ("eta", "beta", "rho")}
    if console is not None:
        console.log(f"tuning on K={settings.tune_clients}, eps={settings.tune_epsilon:g} (z={z:.2f}): best {best}")
    return {"clients": settings.tune_clients, "epsilon": settings.tune_epsilon, "seed": seed,
            "noise_multiplier": z, "tried": tried, "best": best}


def _caption(settings: FedSofimSettings, result: FedSofimResult) -> str:
    hp = settings.hyper_parameters()
    info = next(iter(result.seeds_info.values()), {})
    return (f"Frozen public EfficientNet-Lite0 embeddings (a reference head trained non-privately for "
            f"{settings.pretrain_epochs} epochs on a balanced "
            f"public split of {settings.public_per_class} training images per class ({info.get('public', '?')} "
            f"images, held by no client); linear head (d = 12,810) federated from zero over "
            f"{info.get('client_pool', '?')} records in IID shards; {settings.rounds} rounds of full-batch DP "
            f"gradient descent per client (q = 1, clip C = {settings.clipping_norm:g}, Gaussian noise z "
            f"calibrated by RDP for {settings.rounds} rounds, delta = {settings.target_delta:g}); DP-FedGD eta = "
            f"{hp['dp-fedgd']['eta']:g}; DP-FedSOFIM eta = {hp['dp-fedsofim']['eta']:g}, beta = "
            f"{hp['dp-fedsofim']['beta']:g}, rho = {hp['dp-fedsofim']['rho']:g}. Accuracy on the held-out "
            f"test split ({info.get('test', '?')} images) after the last round, mean ± sample std over seeds "
            f"{list(settings.seeds)}; Δ paired by seed. eps ledger = RDP spend recorded in the ledger, max over "
            f"clients and runs. Rounds: first round at which a curve reaches DP-FedGD's final accuracy of the "
            f"same seed; earlier = GD's rounds minus SOFIM's (mean over the seeds where SOFIM reaches it); last-10 target: "
            f"the same with the mean of GD's last 10 rounds as the target; Δ last-10 mean: paired difference of "
            f"the mean accuracy over the last 10 rounds. Dip: the largest drop of the seed-mean curve below "
            f"its running maximum (points, peak round → dip round), and the round it is back within 0.5 points.")


def _write(settings: FedSofimSettings, result: FedSofimResult) -> None:
    result.summary = summarise(result.runs)
    settings_json = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()}
    (result.out_dir / "fedsofim.json").write_text(json.dumps(
        {"settings": settings_json, "hyper_parameters": settings.hyper_parameters(), "tuning": result.tuning,
         "seeds": {str(k): v for k, v in result.seeds_info.items()}, "runs": result.runs,
         "summary": result.summary, "elapsed_s": result.elapsed_s}, indent=1))
    (result.out_dir / "fedsofim.md").write_text("# DP-FedSOFIM vs DP-FedGD on Animal-MNIST (frozen public "
                                                f"backbone, linear head)\n\n{_caption(settings, result)}\n\n"
                                                + markdown_table(result.summary)
                                                + f"\nWall time: {result.elapsed_s:.0f} s.\n")
    if result.summary:
        _plot(result.summary, result.out_dir / "fedsofim.png",
              f"DP-FedGD vs DP-FedSOFIM, Animal-MNIST linear head, test accuracy per round "
              f"(mean ± std over {len(settings.seeds)} seeds)")


def run_fedsofim_experiment(settings: FedSofimSettings, console: Any = None) -> FedSofimResult:
    """Run the grid: per seed, prepare the features, (first seed, if ``tune``) tune, then every (K, eps,
    optimizer) with the ledger; write fedsofim.json/.md/.png after every (K, eps, seed)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from wildfed_sim.demo import new_run_dir
    from coordinator.ledger import PrivacyLedger
    from coordinator.storage import Store
    from shared.privacy.accounting import calibrate_noise_multiplier
    from shared.privacy.randomness import SecureRandom

    console = console or Console()
    t0 = time.monotonic()
    out_dir = new_run_dir(settings.out_dir, "fedsofim")
    result = FedSofimResult(out_dir=out_dir)
    store = Store(f"sqlite:///{out_dir / 'ledger.db'}", out_dir / "data")
    ledger = PrivacyLedger(store, target_delta=settings.target_delta)
    z_of = {eps: calibrate_noise_multiplier(target_epsilon=eps, target_delta=settings.target_delta,
                                            sampling_rate=1.0, steps=settings.rounds) for eps in settings.epsilons}
    console.log("noise multipliers (RDP, q = 1, T = %d): %s" % (settings.rounds,
                                                              {e: round(z, 3) for e, z in z_of.items()}))
    client_rounds = len(settings.seeds) * len(settings.epsilons) * len(OPTIMIZERS) * sum(settings.clients)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("client-rounds", total=client_rounds * settings.rounds)
        for seed in settings.seeds:
            data = prepare_seed(settings, seed)
            result.seeds_info[seed] = data.info
            console.log(f"seed {seed}: {data.info}")
            if settings.tune and not result.tuning:
                result.tuning = tune(settings, data, seed, console=console, progress=progress)
                best = result.tuning["best"]
                settings.fedgd_eta = best["dp-fedgd"]["eta"]
                settings.sofim_eta = best["dp-fedsofim"]["eta"]
                settings.sofim_beta = best["dp-fedsofim"]["beta"]
                settings.sofim_rho = best["dp-fedsofim"]["rho"]
            hp = settings.hyper_parameters()
            for k in settings.clients:
                clients = data.clients(k, seed)
                for eps in settings.epsilons:
                    for opt in OPTIMIZERS:
                        run_t0 = time.monotonic()
                        prefix = f"K{k}/eps{eps:g}/seed{seed}/{opt}/"
                        curves = run_federation(
                            optimizer=make_optimizer(opt, hp[opt]), clients=clients,
                            evaluate_on={"test": data.test, "val": data.val}, rounds=settings.rounds,
                            clipping_norm=settings.clipping_norm, noise_multiplier=z_of[eps],
                            noise=SecureRandom(), num_classes=10, ledger=ledger, site_prefix=prefix,
                            on_round=lambda: progress.advance(task, k))
                        spent = max(ledger.spent(f"{prefix}client{i:03d}", UNIFORM_CATEGORY) for i in range(k))
                        result.runs.append({"clients": k, "epsilon": eps, "seed": seed, "optimizer": opt,
                                            "hyper_parameters": hp[opt], "noise_multiplier": z_of[eps],
                                            "spent_epsilon": spent, "test": curves["test"], "val": curves["val"],
                                            "elapsed_s": time.monotonic() - run_t0})
                    result.elapsed_s = time.monotonic() - t0
                    _write(settings, result)
    store.dispose()
    result.elapsed_s = time.monotonic() - t0
    _write(settings, result)
    table = Table(title="DP-FedGD vs DP-FedSOFIM (test accuracy after the last round, mean ± std over seeds)",
                  caption=_caption(settings, result))
    for i, h in enumerate(HEADERS):
        table.add_column(h, justify="left" if i < 2 else "right")
    for entry in result.summary:
        table.add_row(*_cells(entry))
    console.print(table)
    console.log(f"written {out_dir / 'fedsofim.json'}, .md, .png ({result.elapsed_s:.0f} s in all)")
    return result


# --------------------------------------------------------------------------------------------------- the CLI
def _parse_list(text: str, kind: type, name: str, example: str) -> tuple:
    try:
        values = tuple(kind(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise ConfigError(f"--{name} {text!r} is not a comma-separated list of {kind.__name__}s", field=name,
                          fix=f"e.g. --{name} {example}") from None
    if not values:
        raise ConfigError(f"--{name} is empty", field=name, fix=f"e.g. --{name} {example}")
    return values


def _opt(default: Any, help: str, *names: str) -> Any:
    import typer

    return typer.Option(default, *names, help=help)


def fedsofim_command(
    seeds: str = _opt("0,1,2", "comma-separated seeds (data splits, pretraining; noise is never seeded)"),
    clients: str = _opt("20,100", "comma-separated client counts K"),
    epsilons: str = _opt("0.5,1,2,5,10", "comma-separated target epsilons (each client's records, delta below)"),
    rounds: int = _opt(100, "federated rounds T (one full-batch DP step per client per round)"),
    out: Path | None = _opt(None, "output folder (default runs/fedsofim-<UTC time>)"),
    target_delta: float = _opt(1e-5, "delta of every guarantee"),
    clipping_norm: float = _opt(1.0, "L2 clipping norm C of per-example head gradients"),
    public_per_class: int = _opt(100, "public pretraining images per class (held by no client)"),
    val_per_class: int = _opt(70, "validation images per class (tuning only; held by no client)"),
    pretrain_epochs: int = _opt(30, "epochs of the non-private reference head on the public split's embeddings"),
    tune_: bool = _opt(True, "tune eta (and beta, rho) on one setting by validation accuracy first; otherwise "
                       "use the values below", "--tune/--no-tune"),
    tune_clients: int = _opt(20, "K of the tuning setting"),
    tune_epsilon: float = _opt(1.0, "epsilon of the tuning setting"),
    fedgd_eta: float = _opt(1.0, "DP-FedGD server learning rate (with --no-tune)"),
    sofim_eta: float = _opt(1.0, "DP-FedSOFIM eta (with --no-tune)"),
    sofim_beta: float = _opt(0.9, "DP-FedSOFIM beta (with --no-tune)"),
    sofim_rho: float = _opt(1.0, "DP-FedSOFIM rho (with --no-tune)"),
) -> None:
    """DP-FedSOFIM vs DP-FedGD: frozen public EfficientNet-Lite0 backbone, linear head federated with full-batch DP
    gradient descent per client, K clients x epsilons x seeds, ledger-accounted. Writes fedsofim.json, .md, .png.
    The default grid (with tuning) took about 22 minutes on 2 busy cores."""
    from rich.console import Console

    settings = FedSofimSettings(
        seeds=_parse_list(seeds, int, "seeds", "0,1,2"), clients=_parse_list(clients, int, "clients", "20,100"),
        epsilons=_parse_list(epsilons, float, "epsilons", "0.5,1,2,5,10"), rounds=rounds,
        target_delta=target_delta, clipping_norm=clipping_norm, public_per_class=public_per_class,
        val_per_class=val_per_class, pretrain_epochs=pretrain_epochs, tune=tune_, tune_clients=tune_clients,
        tune_epsilon=tune_epsilon, fedgd_eta=fedgd_eta, sofim_eta=sofim_eta, sofim_beta=sofim_beta,
        sofim_rho=sofim_rho, out_dir=out)
    run_fedsofim_experiment(settings, console=Console())
