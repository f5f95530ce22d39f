"""The radio-map experiment's RadioUNet outside the federation's rounds (:mod:`wildfed_sim.radiomap`): the public
pretraining that gives the round-0 global model (cached), the local update it and the gateways share, and the
validation MSE in dB.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from shared.models import radio_unet
from shared.radio import RadioMapSet

from edge_sdk.radio import flat_weights, set_flat_weights, train_radio_maps

from wildfed_sim.radiomap_data import ExperimentData
from wildfed_sim.radiomap_settings import RadioMapSettings


def pretrain(settings: RadioMapSettings, data: ExperimentData, seed: int, cache_dir: Path | None = None,
             console: Any = None, on_epoch: Callable[[int], None] | None = None) -> np.ndarray:
    """float64 (d,): the round-0 global model, ``initial_weights(seed)`` trained centrally (Adam, lr ``pretrain_lr``,
    batch ``batch_size``) for ``pretrain_epochs`` on the public pretraining maps (other tiles than the
    federation's city); cached under ``cache_dir``. With a rich ``console``, a progress bar per epoch (about 4 s
    each on 2 idle cores)."""
    from safetensors.numpy import load_file, save_file

    model = radio_unet.build_model(width=settings.width)
    radio_unet.load_numpy_state(model, radio_unet.initial_weights(width=settings.width, seed=seed))
    theta = flat_weights(model)
    if settings.pretrain_epochs == 0:
        return theta
    key = json.dumps({"seed": seed, "city": settings.city, "width": settings.width, "epochs": settings.pretrain_epochs,
                      "tiles": list(data.tiles.public.ids), "maps": settings.pretrain_maps_per_tile,
                      "lr": settings.pretrain_lr, "source": data.source.key()}, sort_keys=True)
    path = cache_dir / f"seed{seed}-pretrained.safetensors" if cache_dir else None
    if path is not None and path.exists():
        try:
            stored = load_file(str(path))
            if bytes(stored["key"]).decode() == key:
                return stored["theta"].astype(np.float64)
        except Exception:  # noqa: BLE001 - a damaged cache is rebuilt, never trusted
            pass
    pretraining = settings_for_pretraining(settings)
    if console is None:
        theta = theta + local_update(model, theta, data.pretraining, pretraining, np.random.default_rng([seed, 29]),
                                     on_epoch=on_epoch)
    else:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("public pretraining, epoch"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, transient=True) as progress:
            bar = progress.add_task("pretraining", total=settings.pretrain_epochs)
            theta = theta + local_update(model, theta, data.pretraining, pretraining,
                                         np.random.default_rng([seed, 29]),
                                         on_epoch=lambda _: progress.advance(bar))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({"theta": theta.astype(np.float64), "key": np.frombuffer(key.encode(), dtype=np.uint8)},
                  str(tmp))
        tmp.replace(path)
    return theta


def settings_for_pretraining(settings: RadioMapSettings) -> RadioMapSettings:
    """The same local trainer, run for ``pretrain_epochs`` epochs."""
    from dataclasses import replace

    return replace(settings, local_epochs=settings.pretrain_epochs, local_lr=settings.pretrain_lr)

# ------------------------------------------------------------------------------------------- local training
def local_update(model: Any, global_flat: np.ndarray, maps: RadioMapSet, settings: RadioMapSettings,
                 rng: np.random.Generator, on_epoch: Callable[[int], None] | None = None) -> np.ndarray:
    """float64 (d,): the gateway's local training (:func:`edge_sdk.radio.train_radio_maps`) with the
    experiment's epochs, learning rate and batch size."""
    return train_radio_maps(model, global_flat, maps, epochs=settings.local_epochs, learning_rate=settings.local_lr,
                            batch_size=settings.batch_size, rng=rng, on_epoch=on_epoch)


def validation_mse_db(model: Any, flat: np.ndarray, maps: RadioMapSet) -> float:
    """10 log10 of stage 2's mean squared error on ``maps`` (normalised gain units), in dB."""
    import torch

    set_flat_weights(model, flat)
    with torch.no_grad():
        errors = []
        for start in range(0, len(maps), 50):
            _, fine = model(torch.from_numpy(maps.inputs[start:start + 50]))
            errors.append(((fine.numpy() - maps.targets[start:start + 50]) ** 2).reshape(-1))
    return float(10.0 * math.log10(float(np.concatenate(errors).mean())))
