"""Buffered asynchronous aggregation (FedBuff: Nguyen et al., "Federated Learning with Buffered Asynchronous
Aggregation", AISTATS 2022, Alg. 1), pure numpy and without I/O.

Instead of rounds with a deadline, the coordinator keeps a buffer. Each update it accepts is a delta trained from
the model version the gateway fetched; its *staleness* is ``t = current_version - base_version``, the number of
server steps taken since. Once the buffer holds K updates, it releases

    aggregate = sum_i s(t_i) * w_i * delta_i / sum_i w_i

and empties; the caller takes the server step (``coordinator.optimizers``, e.g.
:class:`~coordinator.optimizers.server_sgd.ServerSGD`: ``theta <- theta + server_lr * aggregate``), which makes
the next version.

Normalisation. With ``weighting="uniform"`` every w_i is 1 and the denominator is K: exactly FedBuff's
``Delta-bar / K`` with ``Delta-bar = sum_i s(t_i) delta_i`` (Alg. 1, lines 9-11; the server learning rate eta_g
is applied by the caller). With ``weighting="examples"`` w_i is the update's number of examples n_i and the
denominator is sum_i n_i: FedAvg's n_k / n weights (McMahan et al. 2017, Alg. 1) inside the buffer, so that with
K equal to the number of sites and no staleness one buffer is exactly one synchronous FedAvg round. With
``weighting="fixed"`` w_i is n_i too but the denominator is fixed, ``K * reference_weight`` (the mean declared
capacity of the sites, say): the fixed-denominator estimator of DP-FedAvg (McMahan et al., "Learning
Differentially Private Recurrent Language Models", ICLR 2018, Sec. 2), unbiased for FedAvg's mean when the K
updates are a uniform draw of sites. It matters when site sizes differ a lot and K is small: under "examples" a
buffer that happens to hold only small sites is normalised to a full step, and under local DP their updates are
the noisiest (noise / (q n_i)). No denominator is sum_i s(t_i) w_i: renormalising by the staleness weights would
undo them whenever every update in the buffer is equally stale; FedBuff lets stale updates shrink the step, and so
does this module.

The buffer keeps a running float64 sum, never the K updates (as the round strategies do,
``coordinator.strategies.base``), so its memory does not grow with K.

Staleness weights s(t) (:class:`StalenessWeight`):

* ``constant``: s(t) = 1 (FedAsync's constant function; Xie et al., "Asynchronous Federated Optimization",
  2019, Sec. 5.2).
* ``polynomial`` with exponent a: s(t) = (1 + t)^-a (FedAsync's polynomial function, ibid.); a = 0.5, the
  default, is FedBuff's ``1 / sqrt(1 + staleness)`` (Nguyen et al. 2022, Sec. 5, "staleness scaling").
* ``hinge`` with a, b: s(t) = 1 for t <= b, else 1 / (a (t - b) + 1) (FedAsync's hinge function, ibid.).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from shared.errors import ConfigError

__all__ = ["StalenessWeight", "Offer", "StalenessBuffer", "STALENESS_KINDS", "WEIGHTINGS"]

#: the staleness functions :class:`StalenessWeight` knows
STALENESS_KINDS = ("constant", "polynomial", "hinge")
#: the weightings :class:`StalenessBuffer` knows (module docstring, "Normalisation")
WEIGHTINGS = ("uniform", "examples", "fixed")


@dataclass(frozen=True)
class StalenessWeight:
    """The staleness weight s(t) of an update t server steps old (module docstring for the formulas and sources).

    Args:
        kind: ``"constant"``, ``"polynomial"`` or ``"hinge"``.
        a: the exponent (polynomial, >= 0; default 0.5 = FedBuff's 1/sqrt(1+t)) or the slope (hinge, >= 0).
        b: the hinge's knee, in versions (>= 0); ignored by the other kinds.

    Raises:
        ConfigError: an unknown kind, or a or b negative or not finite.
    """

    kind: str = "polynomial"
    a: float = 0.5
    b: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in STALENESS_KINDS:
            raise ConfigError(f"unknown staleness weight {self.kind!r}", field="staleness.kind",
                              fix=f"use one of {', '.join(STALENESS_KINDS)}")
        for name in ("a", "b"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ConfigError(f"staleness.{name} must be a finite number >= 0, got {value!r}",
                                  field=f"staleness.{name}", fix="e.g. a: 0.5 (FedBuff), b: 0")

    def __call__(self, staleness: int) -> float:
        """s(t) in (0, 1] for a staleness t >= 0 (versions).

        Raises:
            ValueError: ``staleness`` negative (an update cannot start from a version the server has not made).
        """
        t = int(staleness)
        if t < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        if self.kind == "constant":
            return 1.0
        if self.kind == "polynomial":
            return float((1.0 + t) ** -self.a)
        return 1.0 if t <= self.b else 1.0 / (self.a * (t - self.b) + 1.0)


@dataclass(frozen=True)
class Offer:
    """What :meth:`StalenessBuffer.offer` did with one update.

    Attributes:
        accepted: the update is in the buffer (or in ``aggregate``).
        reason: why it was refused (``"too_stale"``, ``"future_version"``, ``"bad_weight"``); None when accepted.
        staleness: t = the buffer's version - the update's base version (may be negative for ``future_version``).
        scale: s(t) applied to it (0.0 when refused).
        aggregate: ``{name: float32 array}`` when this update filled the buffer (the buffer is then empty and its
            version one higher), else None.
    """

    accepted: bool
    reason: str | None
    staleness: int
    scale: float
    aggregate: dict[str, np.ndarray] | None = None


class StalenessBuffer:
    """FedBuff's server buffer (module docstring): K accepted updates in, one staleness-weighted aggregate out.

    Args:
        template: ``{name: array}`` with the model's names and shapes (e.g. the global weights).
        size: K >= 1, updates per aggregate.
        max_staleness: the oldest accepted update, in versions (>= 0); an older one is refused as ``too_stale``.
        staleness: the weight s(t) (default FedBuff's 1/sqrt(1+t)).
        weighting: ``"uniform"`` (FedBuff: divide by K), ``"examples"`` (FedAvg's n_i / sum n_i) or ``"fixed"``
            (n_i / (K * reference_weight)).
        reference_weight: the fixed denominator's weight per update (``"fixed"`` only; > 0).
        version: the model version the buffer starts at (e.g. the stored one after a restart).

    Raises:
        ConfigError: size < 1, max_staleness < 0, an unknown weighting, or ``"fixed"`` without a positive
            reference_weight.
    """

    def __init__(self, template: Mapping[str, np.ndarray], *, size: int, max_staleness: int,
                 staleness: StalenessWeight | None = None, weighting: str = "uniform",
                 reference_weight: float | None = None, version: int = 0) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"buffer size K must be an integer >= 1, got {size!r}", field="buffer.size",
                              fix="e.g. size: 4")
        if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
            raise ConfigError(f"max_staleness must be an integer >= 0, got {max_staleness!r}",
                              field="buffer.max_staleness", fix="e.g. max_staleness: 10")
        if weighting not in WEIGHTINGS:
            raise ConfigError(f"unknown weighting {weighting!r}", field="buffer.weighting",
                              fix=f"use one of {', '.join(WEIGHTINGS)}")
        positive = isinstance(reference_weight, (int, float)) and 0 < reference_weight < math.inf
        if weighting == "fixed" and not positive:
            raise ConfigError(f"weighting fixed needs a positive reference_weight, got {reference_weight!r}",
                              field="buffer.reference_weight", fix="use the sites' mean declared capacity")
        self.reference_weight = reference_weight
        self.size = size
        self.max_staleness = max_staleness
        self.staleness = staleness or StalenessWeight()
        self.weighting = weighting
        self.version = int(version)
        self._shapes = {k: np.shape(v) for k, v in template.items()}
        self._dtypes = {k: np.asarray(v).dtype for k, v in template.items()}
        self._sum: dict[str, np.ndarray] = {}
        self._weight_sum = 0.0
        self._count = 0
        self._reset()

    def __len__(self) -> int:
        """Updates held now (0 .. K-1 between calls)."""
        return self._count

    def _reset(self) -> None:
        self._sum = {k: np.zeros(s, dtype=np.float64) for k, s in self._shapes.items()}
        self._weight_sum = 0.0
        self._count = 0

    def offer(self, delta: Mapping[str, np.ndarray], *, base_version: int, weight: float = 1.0) -> Offer:
        """Add one update trained from ``base_version``; return what happened (refusals are returned, not raised).

        Args:
            delta: ``{name: float32 array}`` (the template's names and shapes), local minus global.
            base_version: the model version the gateway trained from.
            weight: n_i, the update's number of examples (``weighting="examples"``; > 0); ignored with
                ``"uniform"``.

        Returns:
            :class:`Offer`; its ``aggregate`` is set when this update was the K-th.

        Raises:
            ValueError: ``delta`` has other names or shapes than the template, or a non-finite value (a caller's
                bug: ingest checks updates before they get here).
        """
        t = self.version - int(base_version)
        if t < 0:
            return Offer(False, "future_version", t, 0.0)
        if t > self.max_staleness:
            return Offer(False, "too_stale", t, 0.0)
        w = 1.0 if self.weighting == "uniform" else float(weight)
        if not 0 < w < math.inf:
            return Offer(False, "bad_weight", t, 0.0)
        if set(delta) != set(self._shapes):
            raise ValueError(f"delta names differ from the model: {sorted(set(delta) ^ set(self._shapes))}")
        arrays = {k: np.asarray(v, dtype=np.float64) for k, v in delta.items()}
        for k, a in arrays.items():
            if a.shape != self._shapes[k]:
                raise ValueError(f"delta {k!r} has shape {a.shape}, model has {self._shapes[k]}")
            if not np.all(np.isfinite(a)):
                raise ValueError(f"delta {k!r} has a non-finite value")
        scale = self.staleness(t)
        for k, a in arrays.items():
            self._sum[k] += (scale * w) * a
        self._weight_sum += w
        self._count += 1
        if self._count < self.size:
            return Offer(True, None, t, scale)
        return Offer(True, None, t, scale, self.flush())

    def flush(self) -> dict[str, np.ndarray] | None:
        """Release what the buffer holds now, normalised by the weights it holds (uniform: their count; fixed: their
        count times ``reference_weight``), and empty it (its version one higher); None when it is empty.
        :meth:`offer` calls it at K; a caller may call it to drain a partial buffer when no further update can
        come (every site's budget spent)."""
        if self._count == 0:
            return None
        norm = self._count * self.reference_weight if self.weighting == "fixed" else self._weight_sum
        out = {k: (s / norm).astype(self._dtypes[k]) for k, s in self._sum.items()}
        self.version += 1
        self._reset()
        return out
