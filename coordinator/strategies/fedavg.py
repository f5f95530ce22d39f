"""Federated averaging as a streaming weighted mean (McMahan et al. 2017, "Communication-Efficient Learning of
Deep Networks from Decentralized Data", Alg. 1: ``sum_k (n_k / n) * delta_k``).

The arithmetic is three pure functions on a :class:`RunningWeightedSum` (float64 accumulators, one array per
tensor name): :func:`new_running_sum`, :func:`add_weighted` and :func:`weighted_mean`. Memory is one model-sized
float64 buffer whatever the number of sites K. :func:`merge` combines partial sums of several ingest workers
(addition is associative). :class:`FedAvg` is the thin :class:`~coordinator.strategies.base.Strategy` around them.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from coordinator.strategies.base import Strategy, Tensors

__all__ = ["RunningWeightedSum", "new_running_sum", "add_weighted", "weighted_mean", "merge", "FedAvg"]


@dataclass
class RunningWeightedSum:
    """``sums[name] = sum_k w_k * delta_k[name]`` (float64) and ``total_weight = sum_k w_k``.

    ``dtypes`` keeps the template's dtypes so the mean is returned in them; ``count`` is K so far.
    """

    sums: dict[str, np.ndarray]
    dtypes: dict[str, np.dtype]
    total_weight: float = 0.0
    count: int = 0
    contributors: list[str] = field(default_factory=list)


def new_running_sum(template: Tensors) -> RunningWeightedSum:
    """Zeroed float64 accumulators with the names and shapes of ``template``."""
    return RunningWeightedSum(sums={k: np.zeros(np.shape(v), dtype=np.float64) for k, v in template.items()},
                              dtypes={k: np.asarray(v).dtype for k, v in template.items()})


# Elements of the float64 scratch that add_weighted scales one slice of a tensor into (512 KiB: it stays in a 1 MiB L2
# cache between the widening, the multiply and the add, so no model-sized temporary is written and read back). One
# scratch per thread, made once: a fresh 512 KiB buffer per call would be mapped and page-faulted anew every time,
# which costs more than the whole accumulation of a small (camera head) update.
_CHUNK = 1 << 16
_scratch = threading.local()


def _scratch_buffer() -> np.ndarray:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size != _CHUNK:
        buf = _scratch.buf = np.empty(_CHUNK, np.float64)
    return buf


def add_weighted(acc: RunningWeightedSum, delta: Tensors, weight: float) -> None:
    """In place: ``acc.sums += weight * delta``; ``acc.total_weight += weight``.

    Each element gets ``sums + fl64(weight * fl64(delta))``: ``delta`` is widened to float64 (exact for float32), the
    product rounded once in float64, then added into the float64 sum, bit for bit what
    ``sums += weight * delta.astype(np.float64)`` gives. The product goes through a small float64 scratch, one
    :data:`_CHUNK`-element slice at a time, instead of two model-sized temporaries per tensor.

    Raises:
        ValueError: ``weight`` not positive and finite, or ``delta``'s names/shapes differ from the accumulators
            (checked for every tensor before any is changed: a refused delta leaves ``acc`` as it was).
    """
    if not (weight > 0 and np.isfinite(weight)):
        raise ValueError(f"FedAvg weight must be positive and finite, got {weight!r}")
    if set(delta) != set(acc.sums):
        raise ValueError(f"delta tensor names differ from the model: missing {sorted(set(acc.sums) - set(delta))}, "
                         f"extra {sorted(set(delta) - set(acc.sums))}")
    pairs = []
    for name, buf in acc.sums.items():
        d = np.asarray(delta[name])
        if d.shape != buf.shape:
            raise ValueError(f"delta {name!r} has shape {d.shape}, model has {buf.shape}")
        pairs.append((buf, d))
    w = float(weight)
    scratch = _scratch_buffer()
    for buf, d in pairs:
        _add_scaled(buf, d, w, scratch)
    acc.total_weight += w
    acc.count += 1


def _add_scaled(buf: np.ndarray, d: np.ndarray, w: float, scratch: np.ndarray) -> None:
    """``buf += w * d`` in float64 through ``scratch`` (float64, 1-D, not empty), slice by slice; ``buf`` float64,
    same shape as ``d``."""
    if buf.size == 0:
        return
    if not buf.flags.c_contiguous:  # a flat view is needed to write back; never the case for new_running_sum's
        buf += w * d.astype(np.float64, copy=False)
        return
    flat, src = buf.reshape(-1), np.ravel(d)  # views (src is copied only if d is not contiguous)
    n, step = flat.size, scratch.size
    for start in range(0, n, step):
        b, s = (flat, src) if n <= step else (flat[start:start + step], src[start:start + step])
        tmp = scratch[:b.size]
        # the ufunc widens s to float64 (as astype(np.float64) does; exact for float32) before multiplying, so the
        # product is rounded in float64; widen and multiply are one pass over the slice
        np.multiply(s, w, out=tmp, dtype=np.float64)
        np.add(b, tmp, out=b)


def weighted_mean(acc: RunningWeightedSum) -> dict[str, np.ndarray]:
    """``sums / total_weight`` cast back to the template dtypes.

    Raises:
        ValueError: nothing was accumulated.
    """
    if acc.count == 0 or acc.total_weight <= 0:
        raise ValueError("no update was accumulated: nothing to average")
    return {k: (v / acc.total_weight).astype(acc.dtypes[k]) for k, v in acc.sums.items()}


def merge(a: RunningWeightedSum, b: RunningWeightedSum) -> RunningWeightedSum:
    """A new running sum equal to the sum of two partial sums (same names/shapes)."""
    out = RunningWeightedSum(sums={k: a.sums[k] + b.sums[k] for k in a.sums}, dtypes=dict(a.dtypes),
                             total_weight=a.total_weight + b.total_weight, count=a.count + b.count,
                             contributors=[*a.contributors, *b.contributors])
    return out


class FedAvg(Strategy):
    """Streaming FedAvg: the aggregate is ``sum_k N_k delta_k / sum_k N_k``."""

    def __init__(self) -> None:
        self._acc: RunningWeightedSum | None = None

    def begin_round(self, template: Tensors) -> None:
        """Zero the running sum for a model shaped like ``template``."""
        self._acc = new_running_sum(template)

    def accumulate(self, site_id: str, delta: Tensors, *, num_examples: int,
                   species_counts: Mapping[int, float] | None = None, noise_variance: float | None = None) -> None:
        """Add ``num_examples * delta`` to the running sum (see :func:`add_weighted`)."""
        if self._acc is None:
            raise ValueError("FedAvg.accumulate called before begin_round")
        add_weighted(self._acc, delta, float(num_examples))
        self._acc.contributors.append(site_id)

    def aggregate(self) -> dict[str, np.ndarray]:
        """The weighted mean delta of this round (see :func:`weighted_mean`)."""
        if self._acc is None:
            raise ValueError("FedAvg.aggregate called before begin_round")
        return weighted_mean(self._acc)

    @property
    def count(self) -> int:
        """Updates accumulated this round."""
        return 0 if self._acc is None else self._acc.count

    @property
    def running_sum(self) -> RunningWeightedSum | None:
        """The current accumulator (for merging partial sums across workers)."""
        return self._acc

    def absorb(self, partial: RunningWeightedSum) -> None:
        """Add a partial sum (e.g. the merge of the ingest workers' sums, ``coordinator.inbound.workers``) to this
        round's.

        Raises:
            ValueError: called before :meth:`begin_round`, or the partial's tensors differ from the template.
        """
        if self._acc is None:
            raise ValueError("FedAvg.absorb called before begin_round")
        if set(partial.sums) != set(self._acc.sums) or any(partial.sums[k].shape != v.shape
                                                           for k, v in self._acc.sums.items()):
            raise ValueError("partial sum tensors differ from the model")
        self._acc = merge(self._acc, partial)
