"""Can a category's records learn anything under their noise? An upper bound on signal against the noise, in
numbers, for ``check-config`` and the training log.

In one DP-SGD step (individualized, :mod:`edge_sdk.privacy.ccdp`) the records of category c are sampled at rate
q_c and each contributes a gradient clipped to norm C_c; one Gaussian draw of standard deviation sigma per
coordinate is added to the sum. Over T steps:

- the records' **signal** is at most ``T q_c n_c C_c`` in norm (every clipped gradient of full norm and all of them
  pointing the same way: an upper bound, real gradients disagree);
- the **noise** has norm about ``sigma sqrt(T d)`` (d trained parameters; the norm of a d-dimensional Gaussian is
  sigma sqrt(d) to within a few percent for d in the thousands).

Their ratio ``sqrt(T) q_c n_c C_c / (sigma sqrt(d))`` is the best case. Below 1 the noise outweighs everything
the category's records could contribute even in that best case: they cannot teach the model their species (the
model will still name them if other sites teach it). This is the bound behind "21 records under sigma 16.65
learn nothing": with q = 1, C = 1, T = 10 and d = 12,810, the ratio is sqrt(10) 21 / (16.65 x 113.2) = 0.035.
The product warns below :data:`WARN_BELOW` (1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from shared.iucn import IUCNCategory

__all__ = ["WARN_BELOW", "CategorySignal", "signal_to_noise"]

#: The best-case ratio below which a category's records are reported as unable to learn.
WARN_BELOW = 1.0


@dataclass(frozen=True)
class CategorySignal:
    """One category's best-case signal against its noise over a training horizon.

    Attributes:
        category: the IUCN category.
        records: n_c.
        sampling_rate: q_c. clipping_norm: C_c. noise_std: sigma (per coordinate, units of the clipped sum).
        steps: T. parameters: d.
        signal: ``T q_c n_c C_c``. noise: ``sigma sqrt(T d)``. ratio: signal / noise.
    """

    category: IUCNCategory
    records: int
    sampling_rate: float
    clipping_norm: float
    noise_std: float
    steps: int
    parameters: int
    signal: float
    noise: float
    ratio: float

    @property
    def learns(self) -> bool:
        """False when even the best case is below :data:`WARN_BELOW`."""
        return self.ratio >= WARN_BELOW

    def describe(self) -> str:
        """One line: the numbers and the verdict."""
        verdict = "can learn" if self.learns else "cannot learn: the noise outweighs every record even in the best case"
        return (f"{self.category.value}: {self.records} record(s), q={self.sampling_rate:.3g}, "
                f"C={self.clipping_norm:.3g}, sigma={self.noise_std:.3g}, {self.steps} step(s), d={self.parameters}: "
                "best-case signal "
                f"{self.signal:.3g} vs noise {self.noise:.3g} (ratio {self.ratio:.3g}): {verdict}")


def signal_to_noise(counts: Mapping[IUCNCategory, int], *, sampling_rates: Mapping[IUCNCategory, float],
                    clipping_norms: Mapping[IUCNCategory, float], noise_std: float, steps: int,
                    parameters: int) -> list[CategorySignal]:
    """The best-case ratio of every category in ``sampling_rates`` (module docstring).

    Args:
        counts: records per category (a category absent here has 0).
        sampling_rates, clipping_norms: q_c and C_c per category.
        noise_std: sigma, > 0.
        steps: T, the training horizon in steps (>= 1).
        parameters: d, the number of trained parameters (>= 1).

    Raises:
        ValueError: non-positive sigma, steps or parameters.
    """
    if noise_std <= 0 or steps < 1 or parameters < 1:
        raise ValueError(f"noise_std, steps and parameters must be positive, got {noise_std}, {steps}, {parameters}")
    out = []
    for category in sorted(sampling_rates, key=lambda c: c.rank):
        n = int(counts.get(category, 0))
        q, c = float(sampling_rates[category]), float(clipping_norms[category])
        signal = steps * q * n * c
        noise = noise_std * math.sqrt(steps * parameters)
        out.append(CategorySignal(category, n, q, c, noise_std, steps, parameters, signal, noise, signal / noise))
    return out
