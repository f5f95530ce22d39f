"""The allocator network f_eta of the adaptive grouped-noise defence, and its training against a proxy attacker.

docs/radiomap.md, "The allocator and its training": a small network maps the upload statistics s_{k,r}
(:func:`edge_sdk.privacy.adaptive_noise.upload_statistics`) to softmax shares of the upload's noise budget, and is
trained against a proxy attacker (which regresses the transmitter coordinate from the update) with a task loss, the
attacker's loss (maximised) and an entropy term.

Network: one small MLP scores every group from that group's row of statistics (weights shared across groups,
so the same network serves any number of groups), ``F -> 16 -> 1`` with tanh, then a softmax over the groups:
145 parameters for F = 7. Its weights live in the gateway's model bundle (:meth:`NoiseAllocator.state`,
safetensors-ready float32 arrays).

Training (:func:`train_allocator`) uses public data only: public radio maps and the current global model, which
every gateway of the round holds. That is what keeps the adaptive defence's shares post-processing of the floor
release (:mod:`edge_sdk.privacy.adaptive_noise`, "Formal guarantee"): the site's records never enter eta. Per
training call:

1. proxy updates: for each pseudo-site j of the public set (maps whose transmitters cluster around a public centre
   t_j), U_j = -lr * gradient of the RadioUNet loss at the global model, clipped to C (one local step stands in for
   a round of local training);
2. each step draws the floor noise and the allocator's extra noise by reparameterisation,
   u~_j = U_j + sigma_floor eps1 + sqrt(sigma_g(eta)^2 - sigma_floor^2) eps2, with the statistics taken from the
   floor-noised U_j exactly as at upload time;
3. proxy attacker: linear kernel ridge regression from u~_j to t_j, its leave-one-out squared error in closed form
   (e_i = r_i / (1 - H_ii), H = K (K + lambda I)^-1; Hastie et al. 2009, Eq. 7.52 for linear smoothers), so it is
   refitted on every draw at no extra cost and differentiable in eta;
4. task loss: the RadioUNet's MSE on a public batch after the FedAvg step theta + mean_j u~_j;
5. objective (minimised with Adam): task - lambda_attack * attacker LOO error (in units of the map side squared)
   - lambda_entropy * mean entropy of the softmax shares.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from shared.models.radio_unet import GroupLayout

from edge_sdk.privacy.adaptive_noise import STATISTICS, clip_update, upload_statistics

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["NoiseAllocator", "AllocatorTraining", "train_allocator", "flat_gradient"]

_HIDDEN = 16


class NoiseAllocator:
    """f_eta: statistics float32 (G, F) -> softmax shares float64 (G,) (module docstring).

    Args:
        seed: initialisation seed (the allocator is trained on public data; its randomness is not privacy noise).
        state: weights from :meth:`state` to load instead of a fresh initialisation.

    Raises:
        ValueError: ``state`` has the wrong names or shapes.
    """

    def __init__(self, *, seed: int = 0, state: Mapping[str, np.ndarray] | None = None) -> None:
        import torch
        from torch import nn

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.net = nn.Sequential(nn.Linear(len(STATISTICS), _HIDDEN), nn.Tanh(), nn.Linear(_HIDDEN, 1))
        if state is not None:
            params = dict(self.net.named_parameters())
            if set(state) != {f"allocator.{n}" for n in params}:
                raise ValueError(f"allocator weights must be {sorted(f'allocator.{n}' for n in params)}, "
                                 f"got {sorted(state)}")
            with torch.no_grad():
                for name, p in params.items():
                    value = np.asarray(state[f"allocator.{name}"], dtype=np.float32)
                    if value.shape != tuple(p.shape):
                        raise ValueError(f"allocator.{name}: shape {value.shape}, expected {tuple(p.shape)}")
                    p.copy_(torch.from_numpy(value))

    def logits(self, stats: "torch.Tensor") -> "torch.Tensor":
        """float32 (..., G, F) -> (..., G) scores."""
        return self.net(stats).squeeze(-1)

    def __call__(self, stats: np.ndarray) -> np.ndarray:
        """Softmax shares float64 (G,) for one upload's statistics float32 (G, len(STATISTICS)).

        Raises:
            ValueError: wrong statistics shape.
        """
        import torch

        stats = np.asarray(stats, dtype=np.float32)
        if stats.ndim != 2 or stats.shape[1] != len(STATISTICS):
            raise ValueError(f"statistics must have shape (G, {len(STATISTICS)}), got {stats.shape}")
        with torch.no_grad():
            return torch.softmax(self.logits(torch.from_numpy(stats)).double(), dim=-1).numpy()

    def state(self) -> dict[str, np.ndarray]:
        """``{"allocator.<name>": float32 array}``: the weights for the gateway's model bundle."""
        return {f"allocator.{n}": p.detach().numpy().astype(np.float32, copy=True)
                for n, p in self.net.named_parameters()}


def flat_gradient(model: "torch.nn.Module", inputs: "torch.Tensor", targets: "torch.Tensor"
                  ) -> np.ndarray:
    """float64 (d,): gradient of mse(stage 1) + mse(stage 2) of a RadioUNet over a batch, in
    :func:`shared.protocol.canonical_flatten` order (parameter names sorted)."""
    import torch

    model.zero_grad(set_to_none=True)
    coarse, fine = model(inputs)
    loss = torch.nn.functional.mse_loss(coarse, targets) + torch.nn.functional.mse_loss(fine, targets)
    loss.backward()
    params = dict(model.named_parameters())
    return np.concatenate([params[n].grad.detach().numpy().reshape(-1).astype(np.float64) for n in sorted(params)])


@dataclass(frozen=True)
class AllocatorTraining:
    """Settings of :func:`train_allocator`.

    Attributes:
        steps: Adam steps per call (>= 1).
        learning_rate: Adam's step size for eta.
        lambda_attack: weight of the proxy attacker's LOO error (dimensionless; positions in map sides).
        lambda_entropy: weight of the shares' entropy (nats).
        proxy_learning_rate: the step the proxy update U_j = -lr * gradient stands for.
        ridge: the proxy attacker's ridge lambda as a fraction of mean(diag K).
    """

    steps: int = 12
    learning_rate: float = 0.05
    lambda_attack: float = 1.0
    lambda_entropy: float = 0.01
    proxy_learning_rate: float = 0.05
    ridge: float = 0.1

    def __post_init__(self) -> None:
        if type(self.steps) is not int or self.steps < 1:
            raise ValueError(f"steps must be a positive integer, got {self.steps!r}")
        for name in ("learning_rate", "proxy_learning_rate", "ridge"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        for name in ("lambda_attack", "lambda_entropy"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be non-negative, got {getattr(self, name)!r}")


def train_allocator(allocator: NoiseAllocator, *, model: "torch.nn.Module", layout: GroupLayout,
                    proxy_inputs: Sequence[np.ndarray], proxy_targets: Sequence[np.ndarray],
                    proxy_centres: np.ndarray, task_inputs: np.ndarray, task_targets: np.ndarray,
                    clipping_norm: float, noise_multiplier: float, floor_fraction: float, round_index: int,
                    total_rounds: int, settings: AllocatorTraining = AllocatorTraining(),
                    seed: int = 0) -> dict[str, float]:
    """Train ``allocator`` in place on public data at the global model ``model`` (module docstring, steps 1-5).

    Args:
        proxy_inputs, proxy_targets: per pseudo-site j, float32 (n_j, 2, H, W) inputs and (n_j, 1, H, W) targets
            of its public maps (at least 3 pseudo-sites).
        proxy_centres: float (J, 2), each pseudo-site's transmitter centre in map sides (0..1).
        task_inputs, task_targets: a public batch for the task loss, float32 (B, 2, H, W) / (B, 1, H, W).
        clipping_norm, noise_multiplier, floor_fraction: the mechanism's C, z, phi.
        round_index, total_rounds: r and R for the statistics.
        seed: seeds the training draws (public computation, not privacy noise).

    Returns:
        ``{"task": ..., "attack": ..., "entropy": ..., "sensitive_share": ...}`` of the last step.

    Raises:
        ValueError: fewer than 3 pseudo-sites or mismatched lengths.
    """
    import torch
    from torch.func import functional_call

    if len(proxy_inputs) != len(proxy_targets) or len(proxy_inputs) != len(proxy_centres) or len(proxy_inputs) < 3:
        raise ValueError("need at least 3 pseudo-sites with inputs, targets and a centre each")
    gen = torch.Generator().manual_seed(seed)
    params = {n: p.detach() for n, p in model.named_parameters()}
    names = sorted(params)
    shapes = [params[n].shape for n in names]
    sizes_t = [int(params[n].numel()) for n in names]
    theta = torch.cat([params[n].reshape(-1) for n in names]).double()

    updates = []
    for x, y in zip(proxy_inputs, proxy_targets):
        g = flat_gradient(model, torch.from_numpy(np.asarray(x)), torch.from_numpy(np.asarray(y)))
        updates.append(clip_update(-settings.proxy_learning_rate * g, clipping_norm)[0])
    model.zero_grad(set_to_none=True)
    u = torch.from_numpy(np.stack(updates))                                        # (J, d) float64
    centres = torch.as_tensor(np.asarray(proxy_centres, dtype=np.float64))
    centres = centres - centres.mean(dim=0)
    index = torch.from_numpy(layout.index)
    sizes = torch.from_numpy(layout.sizes.astype(np.float64))
    uniform = sizes / sizes.sum()
    budget = layout.dimension * (noise_multiplier * clipping_norm) ** 2
    floor = math.sqrt(floor_fraction) * noise_multiplier * clipping_norm
    x_task = torch.from_numpy(np.asarray(task_inputs))
    y_task = torch.from_numpy(np.asarray(task_targets))
    optimiser = torch.optim.Adam(allocator.net.parameters(), lr=settings.learning_rate)
    out: dict[str, float] = {}
    for _ in range(settings.steps):
        eps1 = torch.randn(u.shape, generator=gen, dtype=torch.float64)
        eps2 = torch.randn(u.shape, generator=gen, dtype=torch.float64)
        y = u + floor * eps1
        stats = torch.from_numpy(np.stack([
            upload_statistics(row.numpy(), layout, floor_std=floor, clipping_norm=clipping_norm,
                              round_index=round_index, total_rounds=total_rounds) for row in y]))
        shares = torch.softmax(allocator.logits(stats).double(), dim=-1)           # (J, G)
        a = floor_fraction * uniform + (1.0 - floor_fraction) * shares
        var = a * budget / sizes
        extra = torch.sqrt(torch.clamp(var - floor ** 2, min=1e-30))
        noisy = y + extra[:, index] * eps2                                          # (J, d)
        # proxy attacker: linear kernel ridge, leave-one-out error in closed form
        k = noisy @ noisy.T
        lam = settings.ridge * torch.diagonal(k).mean()
        hat = k @ torch.linalg.inv(k + lam * torch.eye(k.shape[0], dtype=k.dtype))
        resid = (centres - hat @ centres) / (1.0 - torch.diagonal(hat)).unsqueeze(1)
        attack = (resid ** 2).sum(dim=1).mean()
        # task loss after the FedAvg step with these noisy updates
        new = (theta + noisy.mean(dim=0)).float()
        pieces = torch.split(new, sizes_t)
        new_params = {n: piece.reshape(shape) for n, piece, shape in zip(names, pieces, shapes)}
        coarse, fine = functional_call(model, new_params, (x_task,))
        task = torch.nn.functional.mse_loss(coarse, y_task) + torch.nn.functional.mse_loss(fine, y_task)
        entropy = -(shares * torch.log(shares + 1e-12)).sum(dim=1).mean()
        loss = task.double() - settings.lambda_attack * attack - settings.lambda_entropy * entropy
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        sensitive = torch.tensor(layout.sensitive)
        out = {"task": float(task.detach()), "attack": float(attack.detach()),
               "entropy": float(entropy.detach()), "sensitive_share": float(a[:, sensitive].sum(dim=1).mean().detach())}
    model.zero_grad(set_to_none=True)
    return out
