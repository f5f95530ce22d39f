"""A radio base-station gateway's round: RadioUNet local training, then the adaptive grouped-noise upload.

The gateway kind ``radio_base_station`` (``firmware_configs/radio-base-station.yaml``: torch on CPU, 2 threads,
micro-batch 16) learns a radio map with its neighbours without revealing where its transmitters are (docs/radiomap.md).
:class:`RadioSiteTrainer` is its front door, built from that profile with keyword-only privacy settings:

1. :func:`train_radio_maps`: ``local_epochs`` of Adam on mse(stage 1) + mse(stage 2) of
   :mod:`shared.models.radio_unet` over the site's maps (:class:`shared.radio.RadioMapSet`), from the global model;
2. :meth:`RadioSiteTrainer.refresh_allocator`: before upload, the allocator f_eta is (re)trained on *public* data
   only (the public city raster and proxy sites on it, the global model;
   :func:`edge_sdk.privacy.noise_allocator.train_allocator`) and written to the gateway's model store
   (``allocator.safetensors`` beside the cached artifacts), from which a restarted gateway reloads it;
3. :meth:`RadioSiteTrainer.train_round`: the delta goes through
   :class:`edge_sdk.privacy.adaptive_noise.AdaptiveGroupedNoise` and comes back with the DP event the ledger
   records (None for the defences without a guarantee).

The upload's wire format and the round protocol are the camera federation's (a flat float32 delta in
:func:`shared.protocol.canonical_flatten` order). Noise comes from a
:class:`~shared.privacy.randomness.SecureRandom` unless a source is injected.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shared.errors import PayloadError
from shared.models import radio_unet
from shared.privacy.events import DPSGDEvent
from shared.profiles import GatewayKind, GatewayProfile, load_profile
from shared.protocol import (RADIO_CATEGORY, RadioTask, TrainingTask, UpdateReport, canonical_flatten,
                             canonical_unflatten)
from shared.radio import PathLossModel, RadioMapGeometry, RadioMapSet, site_maps

from edge_sdk.privacy.adaptive_noise import AdaptiveGroupedNoise, PrivatisedUpload
from edge_sdk.privacy.noise_allocator import AllocatorTraining, NoiseAllocator, train_allocator
from edge_sdk.privacy.randomness import RandomSource, SecureRandom

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["train_radio_maps", "flat_weights", "set_flat_weights", "RadioSiteTrainer", "ALLOCATOR_FILE",
           "read_city_artifact", "proxy_sites", "run_radio_task", "RADIO_CATEGORY"]

ALLOCATOR_FILE = "allocator.safetensors"


def flat_weights(model: "torch.nn.Module") -> np.ndarray:
    """float64 (d,): the model's parameters in canonical_flatten order (names sorted)."""
    params = dict(model.named_parameters())
    return np.concatenate([params[n].detach().numpy().reshape(-1).astype(np.float64) for n in sorted(params)])


def set_flat_weights(model: "torch.nn.Module", flat: np.ndarray) -> None:
    """Copy a (d,) vector in canonical_flatten order into the model's parameters (cast to float32).

    Raises:
        ValueError: the vector's length is not the model's parameter count.
    """
    import torch

    params = dict(model.named_parameters())
    flat = np.asarray(flat)
    if flat.shape != (sum(p.numel() for p in params.values()),):
        raise ValueError(f"weights must have shape ({sum(p.numel() for p in params.values())},), got {flat.shape}")
    offset = 0
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            p.copy_(torch.from_numpy(flat[offset:offset + p.numel()].reshape(p.shape).astype(np.float32)))
            offset += p.numel()


def train_radio_maps(model: "torch.nn.Module", global_flat: np.ndarray, maps: RadioMapSet, *, epochs: int,
                     learning_rate: float, batch_size: int, rng: np.random.Generator,
                     on_epoch: Callable[[int], None] | None = None) -> np.ndarray:
    """float64 (d,): local minus global weights after ``epochs`` of Adam (``learning_rate``) on
    mse(stage 1) + mse(stage 2) over ``maps``, mini-batches of ``batch_size`` in an order drawn from ``rng``
    (RadioUNet's loss, Levie et al. 2021, Sec. III, both stages in one pass). ``on_epoch(e)`` is called after
    epoch e (1-based), e.g. for a progress bar.

    Raises:
        ValueError: epochs or batch_size below 1, or weights of the wrong length.
    """
    import torch

    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be >= 1, got {epochs}, {batch_size}")
    set_flat_weights(model, global_flat)
    optimiser = torch.optim.Adam(model.parameters(), lr=learning_rate)
    x_all, y_all = torch.from_numpy(maps.inputs), torch.from_numpy(maps.targets)
    for epoch in range(1, epochs + 1):
        order = rng.permutation(len(maps))
        for start in range(0, len(order), batch_size):
            batch = torch.from_numpy(order[start:start + batch_size])
            coarse, fine = model(x_all[batch])
            loss = (torch.nn.functional.mse_loss(coarse, y_all[batch])
                    + torch.nn.functional.mse_loss(fine, y_all[batch]))
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
        if on_epoch is not None:
            on_epoch(epoch)
    return flat_weights(model) - np.asarray(global_flat, dtype=np.float64)


@dataclass
class RadioSiteTrainer:
    """One base-station site's training and upload (module docstring).

    Attributes:
        maps: the site's private radio maps.
        defence: one of :data:`edge_sdk.privacy.adaptive_noise.DEFENCES`.
        clipping_norm, noise_multiplier, floor_fraction: the mechanism's C (L2), z and phi.
        local_epochs, learning_rate: local Adam training.
        batch_size: mini-batch (the profile's ``training.microbatch_size``).
        width: RadioUNet base width.
        model_store: folder for ``allocator.safetensors`` (None: in memory only).
        allocator: the allocator (adaptive only); loaded from ``model_store`` when a file is there.
        noise: privacy randomness (default :class:`SecureRandom`).

    Raises:
        ValueError: as :class:`AdaptiveGroupedNoise`, or a stored allocator file that does not load.
    """

    maps: RadioMapSet
    defence: str
    clipping_norm: float
    noise_multiplier: float
    floor_fraction: float = 0.5
    local_epochs: int = 1
    learning_rate: float = 5e-4
    batch_size: int = 16
    width: int = 8
    model_store: Path | None = None
    allocator: NoiseAllocator | None = None
    noise: RandomSource = field(default_factory=SecureRandom)

    def __post_init__(self) -> None:
        self.model = radio_unet.build_model(width=self.width)
        self.layout = radio_unet.parameter_groups(self.model)
        if self.defence == "adaptive" and self.allocator is None:
            self.allocator = self._load_allocator() or NoiseAllocator()
        self.mechanism = AdaptiveGroupedNoise(
            layout=self.layout, defence=self.defence, clipping_norm=self.clipping_norm,
            noise_multiplier=self.noise_multiplier, floor_fraction=self.floor_fraction,
            allocator=self.allocator if self.defence == "adaptive" else None)

    @classmethod
    def for_task(cls, task: TrainingTask, *, maps: RadioMapSet, model_store: Path | None,
                 noise: RandomSource) -> RadioSiteTrainer:
        """A trainer with a radio task's settings (``local_steps`` = epochs, ``expected_batch_size`` = mini-batch,
        ``learning_rate``, ``clipping_norm``, and the task's ``radio`` part).

        Raises:
            PayloadError: the task has no radio part. ValueError: as :class:`AdaptiveGroupedNoise`.
        """
        if task.radio is None:
            raise PayloadError("not a radio task")
        return cls(maps=maps, defence=task.radio.defence, clipping_norm=float(task.clipping_norm),
                   noise_multiplier=float(task.radio.noise_multiplier), floor_fraction=float(task.radio.floor_fraction),
                   local_epochs=task.local_steps, learning_rate=float(task.learning_rate),
                   batch_size=task.expected_batch_size, width=task.radio.width, model_store=model_store, noise=noise)

    def matches(self, task: TrainingTask) -> bool:
        """Whether this trainer was built for the same settings as ``task`` (else build a new one)."""
        r = task.radio
        return r is not None and (self.defence, self.clipping_norm, self.noise_multiplier, self.floor_fraction,
                                  self.local_epochs, self.learning_rate, self.batch_size, self.width) == (
            r.defence, task.clipping_norm, r.noise_multiplier, r.floor_fraction, task.local_steps,
            task.learning_rate, task.expected_batch_size, r.width)

    @classmethod
    def from_profile(cls, profile: GatewayProfile | str = "radio-base-station", **kwargs: Any) -> RadioSiteTrainer:
        """A trainer with the profile's micro-batch and thread count (torch.set_num_threads); keyword arguments
        as the attributes.

        Raises:
            ConfigError: the profile does not load or is not a ``radio_base_station``.
        """
        import torch

        from shared.errors import ConfigError

        if not isinstance(profile, GatewayProfile):
            profile = load_profile(profile)
        if profile.kind is not GatewayKind.RADIO_BASE_STATION:
            raise ConfigError(f"profile {profile.name!r} is a {profile.kind.value}, not a radio base station",
                              field="kind", fix="use the radio-base-station profile (firmware_configs/)")
        torch.set_num_threads(profile.threads)
        kwargs.setdefault("batch_size", profile.training.microbatch_size)
        return cls(**kwargs)

    def _allocator_path(self) -> Path | None:
        return None if self.model_store is None else Path(self.model_store) / ALLOCATOR_FILE

    def _load_allocator(self) -> NoiseAllocator | None:
        from safetensors.numpy import load_file

        path = self._allocator_path()
        if path is None or not path.exists():
            return None
        try:
            return NoiseAllocator(state=load_file(str(path)))
        except Exception as exc:  # noqa: BLE001 - a damaged local file: say which and how to recover
            raise ValueError(f"{path}: the stored allocator does not load ({exc}); delete the file to start from a "
                             "fresh allocator, which the next round retrains on public data") from exc

    def refresh_allocator(self, global_flat: np.ndarray, *, proxies: list[tuple[RadioMapSet, np.ndarray]],
                          round_index: int, total_rounds: int, settings: AllocatorTraining = AllocatorTraining(),
                          seed: int = 0) -> dict[str, float]:
        """Retrain the allocator on public proxy sites at the global model and store it (module docstring, 2).

        Args:
            global_flat: float (d,), the global model.
            proxies: public (maps, centre in pixels) pairs on the public city raster (>= 3).
            round_index, total_rounds: r and R.

        Returns:
            :func:`train_allocator`'s last-step losses.

        Raises:
            ValueError: not the adaptive defence, or fewer than 3 proxies.
        """
        from safetensors.numpy import save_file

        if self.allocator is None:
            raise ValueError(f"the {self.defence} defence has no allocator to train")
        set_flat_weights(self.model, global_flat)
        size = proxies[0][0].inputs.shape[-1] if proxies else 1
        stats = train_allocator(
            self.allocator, model=self.model, layout=self.layout,
            proxy_inputs=[m.inputs for m, _ in proxies], proxy_targets=[m.targets for m, _ in proxies],
            proxy_centres=np.stack([c for _, c in proxies]) / size if proxies else np.zeros((0, 2)),
            task_inputs=np.concatenate([m.inputs[:2] for m, _ in proxies]) if proxies else np.zeros(0),
            task_targets=np.concatenate([m.targets[:2] for m, _ in proxies]) if proxies else np.zeros(0),
            clipping_norm=self.clipping_norm, noise_multiplier=self.noise_multiplier,
            floor_fraction=self.floor_fraction, round_index=round_index, total_rounds=total_rounds,
            settings=settings, seed=seed)
        path = self._allocator_path()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            save_file(self.allocator.state(), str(tmp))
            os.replace(tmp, path)
        return stats

    def refresh_clipping_profile(self, global_flat: np.ndarray, *, proxies: list[tuple[RadioMapSet, np.ndarray]],
                                 seed: int = 0) -> np.ndarray:
        """The grouped-clipping defence's public profile (:func:`edge_sdk.privacy.adaptive_noise.clipping_profile`):
        this site's own local training run on each public proxy site's maps from the global model, the median of
        each group's update norm; installed in the mechanism and returned (float64 (G,)). Public inputs only, and
        the proxies' randomness is public, so every gateway of a round computes the same profile.

        Raises:
            ValueError: not the grouped-clipping defence, or no proxy.
        """
        import dataclasses

        from edge_sdk.privacy.adaptive_noise import clipping_profile

        if self.defence != "grouped-clipping":
            raise ValueError(f"the {self.defence} defence has no clipping profile")
        if not proxies:
            raise ValueError("the clipping profile needs at least one public proxy site")
        rng = np.random.default_rng([seed, 41])
        updates = np.stack([train_radio_maps(self.model, global_flat, maps, epochs=self.local_epochs,
                                             learning_rate=self.learning_rate, batch_size=self.batch_size, rng=rng)
                            for maps, _ in proxies])
        profile = clipping_profile(updates, self.layout)
        self.mechanism = dataclasses.replace(self.mechanism, clipping_profile=profile)
        return profile

    def local_delta(self, global_flat: np.ndarray, *, rng: np.random.Generator) -> np.ndarray:
        """float64 (d,): the un-noised local update (never leaves the gateway)."""
        return train_radio_maps(self.model, global_flat, self.maps, epochs=self.local_epochs,
                                learning_rate=self.learning_rate, batch_size=self.batch_size, rng=rng)

    def train_round(self, global_flat: np.ndarray, *, round_index: int, total_rounds: int,
                    rng: np.random.Generator) -> tuple[PrivatisedUpload, DPSGDEvent | None]:
        """Train locally and privatise: (the upload, its DP event for the ledger or None)."""
        delta = self.local_delta(global_flat, rng=rng)
        upload = self.mechanism.privatise(delta, round_index=round_index, total_rounds=total_rounds,
                                          noise=self.noise)
        return upload, self.mechanism.dp_event()


def read_city_artifact(data: bytes) -> np.ndarray:
    """The task's public city raster: safetensors bytes with ``buildings`` uint8 (H, W) -> bool (H, W).

    Raises:
        PayloadError: not safetensors, no ``buildings``, wrong dtype/shape, or no outdoor pixel.
    """
    from safetensors.numpy import load

    try:
        tensors = load(bytes(data))
    except Exception as exc:  # noqa: BLE001 - whatever the parser says, the artifact is bad
        raise PayloadError(f"the city artifact is not safetensors: {exc}") from exc
    city = tensors.get("buildings")
    if city is None or city.dtype != np.uint8 or city.ndim != 2 or city.shape[0] % 4 or city.shape[1] % 4:
        raise PayloadError("the city artifact must hold 'buildings', uint8 (H, W) with H, W multiples of 4")
    city = city.astype(bool)
    if city.all():
        raise PayloadError("the city artifact has no outdoor pixel")
    return city


def proxy_sites(city: np.ndarray, radio: RadioTask, *, round_index: int) -> list[tuple[RadioMapSet, np.ndarray]]:
    """The allocator's public proxy sites on the task's city raster: ``radio.proxy_sites`` sites of
    ``radio.proxy_maps`` maps (:func:`shared.radio.site_maps`). Their randomness is public and seeded by the round,
    so every gateway of a round draws the same proxies."""
    rng = np.random.default_rng([round_index, 101])
    geometry = RadioMapGeometry(size_px=int(city.shape[0]), metres_per_pixel=radio.metres_per_pixel)
    model = PathLossModel(max_walls=radio.max_walls)
    return [site_maps(city[None], 0, radio.proxy_maps, radius_m=radio.site_radius_m, rng=rng, model=model,
                      geometry=geometry) for _ in range(radio.proxy_sites)]


def run_radio_task(trainer: RadioSiteTrainer, task: TrainingTask, weights: dict[str, np.ndarray],
                   artifacts: dict[str, bytes], *, rng: np.random.Generator
                   ) -> tuple[UpdateReport, dict[str, np.ndarray]]:
    """One radio round at a gateway: refresh the allocator (adaptive) or the clipping profile (grouped-clipping)
    when due, from public inputs only; train; privatise.

    Args:
        trainer: the site's trainer, built for this task's settings.
        task: a task with ``radio`` set; ``local_steps`` is the number of epochs.
        weights: the global RadioUNet (float32 arrays by name).
        artifacts: the task's artifact files (the city raster among them).
        rng: the local mini-batch order (not privacy noise).

    Returns:
        (the report: N = number of maps, the event under NE or none; the released delta by parameter name).

    Raises:
        PayloadError: no radio part, a bad city artifact, or weights that are not this RadioUNet.
    """
    radio = task.radio
    if radio is None:
        raise PayloadError("not a radio task")
    if set(weights) != set(dict(trainer.model.named_parameters())):
        raise PayloadError("the task's weights are not the RadioUNet this site trains (names differ)")
    flat = canonical_flatten(weights).astype(np.float64)
    if flat.shape != (trainer.layout.dimension,):
        raise PayloadError(f"the task's weights have {flat.size} values, the RadioUNet {trainer.layout.dimension}")
    if trainer.allocator is not None and (task.round - 1) % radio.allocator_every == 0:
        city = read_city_artifact(artifacts.get(radio.city_artifact, b""))
        trainer.refresh_allocator(flat, proxies=proxy_sites(city, radio, round_index=task.round),
                                  round_index=task.round, total_rounds=task.planned_rounds, seed=task.round)
    if trainer.defence == "grouped-clipping" and ((task.round - 1) % radio.allocator_every == 0
                                                  or trainer.mechanism.clipping_profile is None):
        city = read_city_artifact(artifacts.get(radio.city_artifact, b""))
        trainer.refresh_clipping_profile(flat, proxies=proxy_sites(city, radio, round_index=task.round),
                                         seed=task.round)
    upload, event = trainer.train_round(flat, round_index=task.round, total_rounds=task.planned_rounds, rng=rng)
    delta = canonical_unflatten(upload.update.astype(np.float32), weights)
    report = UpdateReport(num_examples=len(trainer.maps), local_steps=task.local_steps,
                          events={RADIO_CATEGORY: event} if event is not None else {})
    return report, delta
