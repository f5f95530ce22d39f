"""One federated run of the radio-map experiment (:mod:`wildfed_sim.radiomap`, steps 2-5 of its protocol).

FedAvg over the clients through a defence (:func:`run_federation`), the gateways' own trainer per client, the ledger
recording each upload's DP event before the server uses it, and the two attackers: the ridge regression from a
released update to the site centre, fitted on shadow sites of the public tiles (:func:`fit_attacker`), and the
template attacker on each client's tile (:func:`template_candidates`, :func:`shadow_updates`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from shared.errors import ConfigError
from shared.models import radio_unet
from shared.protocol import RADIO_CATEGORY
from shared.radio import RadioMapSet

from edge_sdk.privacy.adaptive_noise import grouped_clipping_norms
from edge_sdk.privacy.noise_allocator import NoiseAllocator
from edge_sdk.privacy.randomness import SecureRandom
from edge_sdk.radio import RadioSiteTrainer, flat_weights

from wildfed_sim.radio_shadows import ShadowTraining, ShadowUpdates
from wildfed_sim.radiomap_data import ExperimentData, SiteData, make_site
from wildfed_sim.radiomap_model import validation_mse_db
from wildfed_sim.radiomap_settings import RadioMapSettings


# ------------------------------------------------------------------------------------------------ attacker
def fit_attacker(features: np.ndarray, centres: np.ndarray, sensitive: np.ndarray
                 ) -> tuple[Callable[[np.ndarray], np.ndarray], dict[str, Any]]:
    """Kernel ridge regression from released updates to site centres, trained on shadow sites.

    Args:
        features: float (n, d), the shadow sites' released updates.
        centres: float (n, 2), their centres (any unit; predictions come back in it).
        sensitive: bool (d,), the transmitter-sensitive coordinates.

    Kernel: k(x, x') = <x / s, x' / s> + mean diag, with s the per-coordinate root mean square over the shadows (a
    linear kernel on scaled features plus a constant, i.e. a linear model with an intercept; features are not
    centred, because centring on all n shadows makes each left-out update a combination of the others and leaks
    its target into the leave-one-out estimate). The feature set (all coordinates or the sensitive ones) and the
    ridge strength lambda (a grid of fractions of mean diag K) are chosen by leave-one-out squared error in closed
    form (e_i = r_i / (1 - H_ii), H = K (K + lambda I)^-1; Hastie et al. 2009, Eq. 7.52, exact for this smoother).

    Returns:
        (predict: float (m, d) -> float (m, 2), {"features", "ridge", "loo_rmse"} of the chosen fit).
    """
    x = np.asarray(features, dtype=np.float64)
    t = np.asarray(centres, dtype=np.float64)
    best: tuple[float, str, float, np.ndarray, np.ndarray, float, np.ndarray] | None = None
    for name, cols in (("all", np.ones(x.shape[1], dtype=bool)), ("sensitive", np.asarray(sensitive, bool))):
        sub = x[:, cols]
        rms = np.sqrt(np.mean(sub ** 2, axis=0))
        # floor: a coordinate that (almost) never moves in the shadows (a dead unit) must not blow up a new update
        rms = np.maximum(rms, 0.1 * float(np.median(rms)) or 1.0)
        z = sub / rms
        linear = z @ z.T
        offset = float(np.mean(np.diag(linear))) or 1.0
        k = linear + offset
        for ridge in (1e-3, 1e-2, 1e-1, 1.0, 10.0):
            inv = np.linalg.inv(k + ridge * offset * np.eye(len(k)))
            hat = k @ inv
            resid = (t - hat @ t) / (1.0 - np.diag(hat))[:, None]
            loo = float(np.mean((resid ** 2).sum(axis=1)))
            if best is None or loo < best[0]:
                best = (loo, name, ridge, cols, rms, offset, inv @ t)
    assert best is not None
    loo, name, ridge, cols, rms, offset, alpha = best
    train_z = x[:, cols] / rms

    def predict(new: np.ndarray) -> np.ndarray:
        z = np.asarray(new, dtype=np.float64)[:, cols] / rms
        return (z @ train_z.T + offset) @ alpha

    return predict, {"features": name, "ridge": ridge, "loo_rmse": math.sqrt(loo)}


# ---------------------------------------------------------------------------------------------- one run
def _trainer(settings: RadioMapSettings, defence: str, maps: RadioMapSet, allocator: NoiseAllocator | None,
             noise: Any, profile: np.ndarray | None = None) -> RadioSiteTrainer:
    """The gateway's trainer (edge_sdk.radio) with the experiment's settings (and, for grouped-clipping, the
    round's public clipping profile)."""
    import dataclasses

    trainer = RadioSiteTrainer(maps=maps, defence=defence, clipping_norm=settings.clipping_norm,
                               noise_multiplier=settings.noise_multiplier, floor_fraction=settings.floor_fraction,
                               local_epochs=settings.local_epochs, learning_rate=settings.local_lr,
                               batch_size=settings.batch_size, width=settings.width, allocator=allocator, noise=noise)
    if profile is not None:
        trainer.mechanism = dataclasses.replace(trainer.mechanism, clipping_profile=profile)
    return trainer


def _public_site(data: ExperimentData, n_maps: int, settings: RadioMapSettings, rng: np.random.Generator
                 ) -> SiteData:
    """A shadow (or proxy) site on a public tile drawn uniformly from ``rng``, at a centre the attacker (or the
    gateway) draws next."""
    tile = int(rng.integers(len(data.tiles.public)))
    return make_site(data.source, data.tiles.public, tile, n_maps, settings, rng)


def template_candidates(data: ExperimentData, client: int, settings: RadioMapSettings) -> np.ndarray:
    """float64 (n, 2): the template attacker's candidate centres on client ``client``'s tile: the outdoor pixels of
    a grid of step ``template_step_px`` (:func:`wildfed_sim.radio_attack.candidate_grid`) that have a transmitter
    pixel of the source within ``site_radius_m`` (all of them for COST 231, whose transmitters may be any outdoor
    pixel).

    Raises:
        ConfigError (field ``template_step_px``): no candidate is left (a sparse Sionna set; use a smaller step).
    """
    from wildfed_sim.radio_attack import candidate_grid

    grid = candidate_grid(data.tiles.clients.buildings[client], settings.template_step_px)
    allowed = data.source.positions(data.tiles.clients, client).astype(np.float64)
    radius_px = settings.site_radius_m / settings.metres_per_pixel
    near = (np.linalg.norm(grid[:, None, :] - allowed[None, :, :], axis=2) <= radius_px + 1e-9).any(axis=1)
    if not near.any():
        raise ConfigError(f"no template candidate on client {client}'s tile has a transmitter pixel of the "
                          f"{data.source.name} maps within {settings.site_radius_m} m", field="template_step_px",
                          fix="use a smaller --template-step-px, or a Sionna set with more transmitters per tile")
    return grid[near]


def shadow_updates(settings: RadioMapSettings, data: ExperimentData) -> ShadowUpdates:
    """The template attacker's shadow updates on the clients' tiles (``template_shadow``, replaying the gateways'
    local training with the experiment's settings); share one between the defences of a seed so that those with the
    same global model (all of them at round 1) reuse its cache."""
    training = ShadowTraining(maps_per_site=settings.maps_per_client, epochs=settings.local_epochs,
                              learning_rate=settings.local_lr, batch_size=settings.batch_size,
                              radius_px=settings.site_radius_m / settings.metres_per_pixel, width=settings.width,
                              pixel_stride=settings.template_pixel_stride)
    return ShadowUpdates(settings.template_shadow, training, data.source, data.tiles.clients)


def run_federation(settings: RadioMapSettings, data: ExperimentData, defence: str, seed: int, *,
                   initial: np.ndarray | None = None, ledger: Any = None, site_prefix: str = "", noise: Any = None,
                   on_round: Callable[[int], None] | None = None,
                   shadows: ShadowUpdates | None = None) -> dict[str, Any]:
    """One federated run of ``defence`` (module docstring, steps 2-5); ``shadows``: the template attacker's
    shadow updates (:func:`shadow_updates`; a fresh one when None).

    Returns:
        ``{"val_mse_db": [round 0..R] (held-out tiles of the city), "val_other_mse_db": [round 0..R] (the other
        city), "attack": [{"round", "rmse_m", "naive_rmse_m", "errors_m", ...}] (ridge), "template_attack":
        [{"round", "rmse_m", "errors_m", "uploads", "candidates"}] (per observed client), "allocator": [...],
        "shares": [...], ...}``.
    """
    import torch

    torch.manual_seed(seed)
    noise = noise if noise is not None else SecureRandom()
    allocator = NoiseAllocator(seed=seed) if defence == "adaptive" else None
    clients = [_trainer(settings, defence, site.maps, allocator, noise) for site in data.clients]
    model, layout = clients[0].model, clients[0].layout
    if initial is None:
        radio_unet.load_numpy_state(model, radio_unet.initial_weights(width=settings.width, seed=seed))
        initial = flat_weights(model)
    theta = np.asarray(initial, dtype=np.float64).copy()
    sensitive = np.isin(layout.index, [g for g, s in enumerate(layout.sensitive) if s])
    schedule = np.random.default_rng([seed, 17])         # client selection and batch order: same for all defences
    attack_rng = np.random.default_rng([seed, 19])       # shadow sites: same for all defences
    proxy_rng = np.random.default_rng([seed, 31])        # the allocator's public proxy sites
    mpp = settings.metres_per_pixel
    out: dict[str, Any] = {"val_mse_db": [validation_mse_db(model, theta, data.validation)],
                           "val_other_mse_db": [validation_mse_db(model, theta, data.validation_other)],
                           "attack": [], "allocator": [], "shares": [], "update_norms": [], "template_attack": [],
                           "clipping_norms": []}
    templates_of: dict[int, Any] = {}   # client -> its TemplateAttacker (candidates on the client's public tile)
    if settings.attacker in ("template", "both") and shadows is None:
        shadows = shadow_updates(settings, data)
    for r in range(1, settings.rounds + 1):
        active = np.sort(schedule.choice(settings.clients, size=settings.active, replace=False))
        batch_seeds = schedule.integers(2**32, size=settings.active)
        if allocator is not None and (r - 1) % settings.allocator_every == 0:
            # Public inputs only, so every gateway of the round would train the same allocator: train it once.
            proxies = [_public_site(data, settings.proxy_maps, settings, proxy_rng)
                       for _ in range(settings.proxy_sites)]
            stats = clients[0].refresh_allocator(theta, proxies=[(p.maps, p.centre_px) for p in proxies],
                                                 round_index=r, total_rounds=settings.rounds,
                                                 settings=settings.allocator, seed=int(proxy_rng.integers(2**31)))
            out["allocator"].append({"round": r, **stats})
        if defence == "grouped-clipping" and (r - 1) % settings.allocator_every == 0:
            # public proxies only, so every gateway of the round computes the same profile: compute it once
            proxies = [_public_site(data, settings.proxy_maps, settings, proxy_rng)
                       for _ in range(settings.proxy_sites)]
            profile = clients[0].refresh_clipping_profile(theta, proxies=[(p.maps, p.centre_px) for p in proxies],
                                                          seed=r)
            for c in clients[1:]:
                c.mechanism = clients[0].mechanism
            out["clipping_norms"].append({"round": r, "norms": grouped_clipping_norms(
                profile, settings.clipping_norm).tolist()})
        released, norms, shares = [], [], []
        for k, bs in zip(active, batch_seeds):
            upload, event = clients[k].train_round(theta, round_index=r, total_rounds=settings.rounds,
                                                   rng=np.random.default_rng(bs))
            if ledger is not None and event is not None:
                ledger.record_round(f"{site_prefix}client{k:02d}", r, {RADIO_CATEGORY: event})
            released.append(upload.update.astype(np.float64))
            norms.append(upload.norm_before_clipping)
            if upload.shares is not None:
                shares.append(upload.shares.tolist())
        out["update_norms"].append(float(np.median(norms)))
        if shares:
            out["shares"].append({"round": r, "mean": np.mean(shares, axis=0).tolist()})
        if settings.attacker in ("template", "both") and (r == 1 or r % settings.attack_every == 0):
            from wildfed_sim.radio_attack import TemplateAttacker

            assert shadows is not None
            mechanism = clients[0].mechanism   # this round's clipping (grouped-clipping: this round's profile)
            for k, u in zip(active, released):
                # The attacker knows client k's tile (public building data): noise-free shadow updates at every
                # candidate centre on it, from this round's global model, through the defence's clipping. The
                # shadows' draws are seeded by (seed, client, round): the same for every defence.
                attacker = templates_of.setdefault(int(k), TemplateAttacker(template_candidates(data, int(k), settings),
                                                                            layout.index))
                deltas = shadows.deltas(int(k), attacker.candidates, theta,
                                        np.random.default_rng([seed, 37, int(k), r]))
                attacker.observe(f"client{k:02d}", u, np.stack([mechanism.clipped(d) for d in deltas]))
            errs = {name: err for k, a in sorted(templates_of.items())
                    for name, err in a.errors_m({f"client{k:02d}": data.clients[k].centre_px}, mpp).items()}
            rmse = float(np.sqrt(np.mean(np.square(list(errs.values())))))
            out["template_attack"].append({"round": r, "rmse_m": rmse, "errors_m": errs,
                                           "shadows": settings.template_shadow,
                                           "shadows_computed": shadows.computed, "shadows_reused": shadows.reused,
                                           "uploads": {f"client{k:02d}": a.uploads[f"client{k:02d}"]
                                                       for k, a in sorted(templates_of.items())},
                                           "candidates": {f"client{k:02d}": int(len(a.candidates))
                                                          for k, a in sorted(templates_of.items())}})
        if settings.attacker != "template" and (r == 1 or r % settings.attack_every == 0):
            # The attacker runs the gateways' own code on shadow sites of the public tiles.
            sites = [_public_site(data, settings.maps_per_client, settings, attack_rng)
                     for _ in range(settings.shadow_sites)]
            site_updates = [_trainer(settings, defence, s.maps, allocator, noise,
                                     clients[0].mechanism.clipping_profile).train_round(
                theta, round_index=r, total_rounds=settings.rounds, rng=attack_rng)[0].update for s in sites]
            predict, info = fit_attacker(np.stack(site_updates), np.stack([s.centre_px for s in sites]),
                                         sensitive)
            truth = np.stack([data.clients[k].centre_px for k in active])
            errors = np.linalg.norm(predict(np.stack(released)) - truth, axis=1) * mpp
            naive = np.linalg.norm(np.stack([s.centre_px for s in sites]).mean(axis=0) - truth, axis=1) * mpp
            out["attack"].append({"round": r, "rmse_m": float(np.sqrt(np.mean(errors ** 2))),
                                  "naive_rmse_m": float(np.sqrt(np.mean(naive ** 2))),
                                  "errors_m": errors.tolist(), "naive_errors_m": naive.tolist(), **info})
        theta = theta + settings.server_lr * np.mean(released, axis=0)
        out["val_mse_db"].append(validation_mse_db(model, theta, data.validation))
        out["val_other_mse_db"].append(validation_mse_db(model, theta, data.validation_other))
        if on_round is not None:
            on_round(r)
    return out
