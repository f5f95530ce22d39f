"""Shadow updates for the template attacker (:mod:`wildfed_sim.radio_attack`): the un-noised local update a site
centred at each candidate position would send, computed three ways.

The shadow update at a candidate p is a function of the round's global model theta and the candidate's maps only
(the gateway's training is deterministic given its maps and batch order), so the attacker may compute the
candidates together:

- ``sequential`` (the reference): for each candidate in turn, the gateway's own
  :func:`edge_sdk.radio.train_radio_maps` on ``maps_per_site`` maps with transmitters drawn within the site radius
  of p (:func:`wildfed_sim.radio_tiles.draw_site`). One small training run per candidate.
- ``batched``: the same maps, the same batch order and the same arithmetic (Adam with PyTorch's defaults, Kingma
  and Ba 2015, Alg. 1, as ``torch.optim.Adam`` computes it) for ``chunk`` candidates at once: their weights stacked
  on a leading axis and their per-candidate gradients from one ``torch.func.vmap(torch.func.grad(...))`` call. It
  returns the sequential deltas up to float rounding (``tests/sim/test_radio_shadows.py``).
- ``first-order``: no trajectory. Every candidate's maps are a sample of the transmitter pixels within the radius
  of p, so the attacker takes one gradient per transmitter pixel at theta, g_q (a pixel sub-grid of step
  ``pixel_stride`` that every candidate's disc shares with its neighbours), and gives candidate p the disc's mean
  mu_p and mean square q_p. It then replays Adam's arithmetic on the expected moments: a mini-batch of B maps has
  mean mu_p and E[g_B^2] = mu_p^2 + s_p^2 / B (s_p^2 = q_p - mu_p^2, transmitters drawn independently), so with
  m-hat_t ~ mu_p and v-hat_t the bias-corrected EMA of those second moments::

      delta_p = - lr * sum_t mu_p / (sqrt(v-hat_t) + eps)

  over the local steps t (their batch sizes from ``maps_per_site`` and ``batch_size``). A pixel shared by several
  discs is computed once, and no Adam step is taken, so the cost is one per-map gradient per sub-grid pixel of the
  tile instead of ``maps_per_site`` per candidate. How well it locates sites against ``sequential`` is measured,
  not assumed (docs/results/radiomap.md, "A cheaper attacker").

:class:`ShadowUpdates` caches each (tile, theta) result, so the defences that share a global model (every defence
at round 1, from the same pretrained model) compute it once; the defence's deterministic clipping
(:meth:`edge_sdk.privacy.adaptive_noise.AdaptiveGroupedNoise.clipped`) is applied by the caller afterwards.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from shared.errors import ConfigError
from shared.models import radio_unet

from edge_sdk.radio import set_flat_weights, train_radio_maps

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from wildfed_sim.radio_tiles import MapSource, TileSet

__all__ = ["SHADOWS", "ShadowTraining", "batched_local_deltas", "per_map_gradients", "adam_first_order_deltas",
           "disc_weights", "ShadowUpdates"]

SHADOWS = ("sequential", "batched", "first-order")
"""The ways of computing shadow updates (module docstring), the reference first."""

_BETAS = (0.9, 0.999)   # torch.optim.Adam's defaults, which edge_sdk.radio.train_radio_maps uses
_EPS = 1e-8


@dataclass(frozen=True)
class ShadowTraining:
    """The gateway's local training as the attacker replays it.

    Attributes:
        maps_per_site: maps of a shadow site (the clients' count). epochs, learning_rate, batch_size: the gateway's
            Adam training. radius_px: transmitters lie within this many pixels of the site centre. width: RadioUNet
            base width. pixel_stride: first-order only, the transmitter sub-grid step in pixels. chunk: candidates
            (batched) or maps (first-order) per vectorised call; it bounds memory, and first-order maps are made
            8 chunks at a time.

    Raises:
        ConfigError: a count below 1 or a rate or radius not positive, naming the field.
    """

    maps_per_site: int
    epochs: int
    learning_rate: float
    batch_size: int
    radius_px: float
    width: int = 8
    pixel_stride: int = 3
    chunk: int = 8

    def __post_init__(self) -> None:
        for name in ("maps_per_site", "epochs", "batch_size", "width", "pixel_stride", "chunk"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}", field=name)
        for name in ("learning_rate", "radius_px"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}", field=name)

    def batch_sizes(self) -> list[int]:
        """The mini-batch size of every local step, in order (the last batch of an epoch may be short)."""
        per_epoch = [min(self.batch_size, self.maps_per_site - s) for s in range(0, self.maps_per_site,
                                                                                   self.batch_size)]
        return per_epoch * self.epochs


def _functional(model: "torch.nn.Module", theta: np.ndarray) -> tuple[list[str], dict[str, "torch.Tensor"], Any]:
    """(parameter names in canonical_flatten order, theta as detached tensors by name, the loss function
    ``loss(params, x, y) = mse(stage 1) + mse(stage 2)`` of :func:`edge_sdk.radio.train_radio_maps`)."""
    import torch
    from torch.func import functional_call

    set_flat_weights(model, theta)
    names = sorted(n for n, _ in model.named_parameters())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        coarse, fine = functional_call(model, p, (x,))
        return torch.nn.functional.mse_loss(coarse, y) + torch.nn.functional.mse_loss(fine, y)

    return names, params, loss


def batched_local_deltas(model: "torch.nn.Module", theta: np.ndarray, inputs: np.ndarray, targets: np.ndarray,
                         orders: np.ndarray, *, learning_rate: float, batch_size: int) -> np.ndarray:
    """float64 (n, d): :func:`edge_sdk.radio.train_radio_maps` for n sites at once (module docstring, ``batched``).

    Args:
        model: a :func:`shared.models.radio_unet.build_model` RadioUNet (its weights are overwritten).
        theta: float (d,), the global model in canonical_flatten order.
        inputs: float32 (n, m, 2, H, W), site i's m maps. targets: float32 (n, m, 1, H, W).
        orders: int (n, epochs, m), site i's map order in each epoch (``rng.permutation(m)`` per epoch).
        learning_rate, batch_size: the gateway's Adam step and mini-batch.

    Raises:
        ValueError: shapes disagree.
    """
    import torch
    from torch.func import grad, vmap

    x_all, y_all, orders = torch.from_numpy(np.asarray(inputs, np.float32)), torch.from_numpy(
        np.asarray(targets, np.float32)), np.asarray(orders, dtype=np.int64)
    n, m = x_all.shape[:2]
    if y_all.shape[:2] != (n, m) or orders.ndim != 3 or orders.shape[0] != n or orders.shape[2] != m:
        raise ValueError(f"inputs {tuple(x_all.shape)}, targets {tuple(y_all.shape)} and orders {orders.shape} "
                         "must share (n sites, m maps)")
    names, start, loss = _functional(model, theta)
    params = {k: v.expand(n, *v.shape).clone() for k, v in start.items()}
    first = {k: torch.zeros_like(v) for k, v in params.items()}
    second = {k: torch.zeros_like(v) for k, v in params.items()}
    per_site_grad = vmap(grad(loss))
    site = torch.arange(n)[:, None]
    step = 0
    for epoch in range(orders.shape[1]):
        for s in range(0, m, batch_size):
            batch = torch.from_numpy(orders[:, epoch, s:s + batch_size])
            g = per_site_grad(params, x_all[site, batch], y_all[site, batch])
            step += 1
            c1, c2 = 1 - _BETAS[0] ** step, 1 - _BETAS[1] ** step
            with torch.no_grad():
                for k in names:
                    first[k].mul_(_BETAS[0]).add_(g[k], alpha=1 - _BETAS[0])
                    second[k].mul_(_BETAS[1]).addcmul_(g[k], g[k], value=1 - _BETAS[1])
                    denom = (second[k].sqrt() / math.sqrt(c2)).add_(_EPS)
                    params[k].addcdiv_(first[k], denom, value=-learning_rate / c1)
    flat = np.concatenate([params[k].reshape(n, -1).numpy().astype(np.float64) for k in names], axis=1)
    return flat - np.asarray(theta, dtype=np.float64)[None, :]   # as train_radio_maps: float32 weights - theta


def per_map_gradients(model: "torch.nn.Module", theta: np.ndarray, inputs: np.ndarray, targets: np.ndarray, *,
                      chunk: int = 8) -> np.ndarray:
    """float32 (P, d): the gradient at theta of each map's own loss mse(stage 1) + mse(stage 2) (a batch of one),
    in canonical_flatten order, ``chunk`` maps per vectorised call (``torch.func.vmap`` over ``grad``; on one CPU
    thread 8 maps per call cost what a batch of 16 costs per map in ordinary training, 32 or 64 cost 1.5x more).

    Args:
        inputs: float32 (P, 2, H, W). targets: float32 (P, 1, H, W).
    """
    import torch
    from torch.func import grad, vmap

    names, params, loss = _functional(model, theta)
    per_map = vmap(grad(loss), in_dims=(None, 0, 0))
    out = []
    for s in range(0, len(inputs), int(chunk)):
        x = torch.from_numpy(np.asarray(inputs[s:s + chunk], np.float32))[:, None]
        y = torch.from_numpy(np.asarray(targets[s:s + chunk], np.float32))[:, None]
        g = per_map(params, x, y)
        out.append(np.concatenate([g[k].reshape(len(x), -1).numpy() for k in names], axis=1))
    return np.concatenate(out, axis=0)


def adam_first_order_deltas(mean_grad: np.ndarray, mean_square: np.ndarray, *, batch_sizes: list[int],
                            learning_rate: float) -> np.ndarray:
    """float64 (n, d): Adam's local update replayed on expected moments (module docstring, ``first-order``).

    Args:
        mean_grad: float (n, d), mu_p, the mean per-map gradient over candidate p's transmitter pixels.
        mean_square: float (n, d), q_p, the mean of the squared per-map gradients there.
        batch_sizes: the batch size of every local step (:meth:`ShadowTraining.batch_sizes`).
        learning_rate: Adam's step size.
    """
    mu = np.asarray(mean_grad, dtype=np.float64)
    spread = np.maximum(np.asarray(mean_square, dtype=np.float64) - mu ** 2, 0.0)
    delta = np.zeros_like(mu)
    ema_inverse_batch = 0.0
    for t, b in enumerate(batch_sizes, start=1):
        ema_inverse_batch = _BETAS[1] * ema_inverse_batch + (1 - _BETAS[1]) / b
        inverse_batch = ema_inverse_batch / (1 - _BETAS[1] ** t)     # bias-corrected EMA of 1 / B
        delta -= learning_rate * mu / (np.sqrt(mu ** 2 + spread * inverse_batch) + _EPS)
    return delta


def disc_weights(candidates: np.ndarray, pixels: np.ndarray, radius_px: float) -> np.ndarray:
    """float64 (n, P): row p averages the pixels within ``radius_px`` of candidate p (a row of zeros when none is).

    Args:
        candidates: float (n, 2) centres. pixels: int or float (P, 2) transmitter pixels, (row, col).
    """
    near = np.linalg.norm(np.asarray(candidates, float)[:, None, :] - np.asarray(pixels, float)[None, :, :],
                          axis=2) <= radius_px + 1e-9
    counts = near.sum(axis=1, keepdims=True)
    return near / np.maximum(counts, 1)


def _subgrid_pixels(allowed: np.ndarray, candidates: np.ndarray, radius_px: float, stride: int) -> np.ndarray:
    """int64 (P, 2): the allowed pixels on the sub-grid of step ``stride`` (rows and columns multiples of it, so
    the sub-grid of a multiple of the step is a subset) within the radius of some candidate, plus every allowed pixel
    of a disc that holds no sub-grid pixel."""
    allowed = np.asarray(allowed, dtype=np.int64)
    near = np.linalg.norm(np.asarray(candidates, float)[:, None, :] - allowed[None, :, :], axis=2) <= radius_px + 1e-9
    on_grid = np.all(allowed % stride == 0, axis=1)
    keep = (near & on_grid[None, :]).any(axis=0)
    for row in near:
        if not (row & on_grid).any():
            keep |= row
    return allowed[keep]


class ShadowUpdates:
    """Raw shadow deltas (before the defence's clipping) at every candidate of a site's tile, by one of
    :data:`SHADOWS`, cached by (tile, candidates, theta): every entry at the first global model it is asked about
    (the pretrained model that every defence of a seed starts from; at most one entry per client tile, about 19 MB
    each on munich tiles) and the ``cache_entries`` most recent others. Deltas are stored and returned rounded to
    float32, so every defence sees the same ones.

    Args:
        kind: one of :data:`SHADOWS`.
        training: the gateway's training as replayed.
        source, tiles: where the maps come from and the tiles the sites sit on
            (:mod:`wildfed_sim.radio_tiles`).

    Raises:
        ConfigError: an unknown ``kind`` (field ``template_shadow``).
    """

    def __init__(self, kind: str, training: ShadowTraining, source: "MapSource", tiles: "TileSet", *,
                 cache_entries: int = 6) -> None:
        if kind not in SHADOWS:
            raise ConfigError(f"unknown shadow kind {kind!r}", field="template_shadow",
                              fix=f"use one of {', '.join(SHADOWS)}")
        self.kind, self.training, self.source, self.tiles = kind, training, source, tiles
        self.model = radio_unet.build_model(width=training.width)
        self._cache: OrderedDict[tuple[Any, ...], np.ndarray] = OrderedDict()
        self._entries = int(cache_entries)
        self._pixel_maps_of: dict[tuple[Any, ...], tuple[np.ndarray, Any]] = {}
        self._first_theta: str | None = None
        self._pinned: dict[tuple[Any, ...], np.ndarray] = {}
        self.computed = 0   # deltas computed (cache misses x candidates), for the run's record
        self.reused = 0     # deltas served from the cache

    def deltas(self, tile: int, candidates: np.ndarray, theta: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """float64 (n, d): the shadow delta of a site centred at each candidate on ``tiles[tile]``, from ``theta``.

        ``rng`` draws the shadow sites' transmitters and batch orders (``sequential``, ``batched``; unused by
        ``first-order``). A cache hit returns the stored deltas without drawing from it.
        """
        cand = np.asarray(candidates, dtype=np.float64)
        theta = np.asarray(theta, dtype=np.float64)
        digest = hashlib.sha256(theta.tobytes()).hexdigest()
        key = (int(tile), hashlib.sha256(cand.tobytes()).hexdigest(), digest)
        self._first_theta = self._first_theta or digest
        stored = self._pinned.get(key)
        if stored is None and key in self._cache:
            self._cache.move_to_end(key)
            stored = self._cache[key]
        if stored is not None:
            self.reused += len(cand)
            return stored.astype(np.float64)
        out = getattr(self, "_" + self.kind.replace("-", "_"))(int(tile), cand, theta, rng).astype(np.float32)
        self.computed += len(cand)
        if digest == self._first_theta:
            self._pinned[key] = out
        else:
            self._cache[key] = out
            while len(self._cache) > self._entries:
                self._cache.popitem(last=False)
        return out.astype(np.float64)

    def forget_deltas(self) -> None:
        """Drop the stored deltas (the tiles' maps stay): the next call computes again, as after a new model."""
        self._cache.clear()
        self._pinned.clear()

    def _draw(self, tile: int, cand: np.ndarray, rng: np.random.Generator) -> tuple[Any, np.ndarray]:
        """The maps of every candidate's site (drawn as :func:`wildfed_sim.radio_tiles.draw_site` draws them, in
        candidate order) and each site's batch orders, int (n, epochs, m), drawn after its maps as the gateway's
        training draws them."""
        from wildfed_sim.radio_tiles import draw_site

        t, maps, orders = self.training, [], []
        for c in cand:
            site, _ = draw_site(self.source, self.tiles, tile, t.maps_per_site, radius_px=t.radius_px, rng=rng,
                                centre=c)
            maps.append(site)
            orders.append([rng.permutation(t.maps_per_site) for _ in range(t.epochs)])
        return maps, np.asarray(orders, dtype=np.int64)

    def _sequential(self, tile: int, cand: np.ndarray, theta: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        from wildfed_sim.radio_tiles import draw_site

        t, out = self.training, []
        for c in cand:   # draw_site then train_radio_maps, as the attacker of the first measurements did
            site, _ = draw_site(self.source, self.tiles, tile, t.maps_per_site, radius_px=t.radius_px, rng=rng,
                                centre=c)
            out.append(train_radio_maps(self.model, theta, site, epochs=t.epochs, learning_rate=t.learning_rate,
                                        batch_size=t.batch_size, rng=rng))
        return np.stack(out)

    def _batched(self, tile: int, cand: np.ndarray, theta: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        t = self.training
        maps, orders = self._draw(tile, cand, rng)
        out = []
        for s in range(0, len(cand), t.chunk):
            part = maps[s:s + t.chunk]
            out.append(batched_local_deltas(self.model, theta, np.stack([m.inputs for m in part]),
                                            np.stack([m.targets for m in part]), orders[s:s + t.chunk],
                                            learning_rate=t.learning_rate, batch_size=t.batch_size))
        return np.concatenate(out, axis=0)

    def _pixel_maps(self, tile: int, cand: np.ndarray) -> tuple[np.ndarray, Any]:
        """The sub-grid pixels of ``cand``'s discs and their maps, which depend on the tile only: made once per
        (tile, candidates) and kept (about 15 MB per munich tile at stride 3) for the later attack rounds."""
        key = (int(tile), hashlib.sha256(cand.tobytes()).hexdigest())
        if key not in self._pixel_maps_of:
            t = self.training
            pixels = _subgrid_pixels(self.source.positions(self.tiles, tile), cand, t.radius_px, t.pixel_stride)
            specs = np.concatenate([np.full((len(pixels), 1), tile, dtype=np.int64), pixels], axis=1)
            self._pixel_maps_of[key] = (pixels, self.source.maps(self.tiles, specs))
        return self._pixel_maps_of[key]

    def _first_order(self, tile: int, cand: np.ndarray, theta: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        from scipy.sparse import csr_matrix

        t = self.training
        pixels, maps = self._pixel_maps(tile, cand)
        weights = csr_matrix(disc_weights(cand, pixels, t.radius_px))   # a disc holds ~9 of a tile's ~260 pixels
        mean = square = 0.0
        for s in range(0, len(pixels), 8 * t.chunk):
            g = per_map_gradients(self.model, theta, maps.inputs[s:s + 8 * t.chunk], maps.targets[s:s + 8 * t.chunk],
                                  chunk=t.chunk).astype(np.float64)
            w = weights[:, s:s + 8 * t.chunk]
            mean, square = mean + w @ g, square + w @ (g * g)
        return adam_first_order_deltas(np.asarray(mean), np.asarray(square), batch_sizes=t.batch_sizes(),
                                       learning_rate=t.learning_rate)
