"""The hyper-parameter grids of the DP-FedSOFIM experiment (:mod:`wildfed_sim.fedsofim`) and their search.

:class:`Axis` (one axis, widenable by a decade beyond an edge), :func:`grid_points`, :func:`tune_grids` (every
method's grid maximised separately, widened while its best point lies on an edge) and the first grids
(:data:`GRIDS`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from wildfed_sim.fedsofim_head import CEILING


# --------------------------------------------------------------------------------------------------- tuning
@dataclass(frozen=True)
class Axis:
    """One hyper-parameter axis of a tuning grid.

    Args:
        name: the hyper-parameter (a key of the grid point). values: the first grid, ascending.
        factor: the ratio between neighbouring values when the axis is widened (> 1); None: never widened.
        per_widening: values added beyond an edge per widening; ``factor ** per_widening`` is one decade.
    """

    name: str
    values: tuple[float, ...]
    factor: float | None = None
    per_widening: int = 1

    def widened(self, edge: str) -> tuple["Axis", list[float]]:
        """This axis with ``per_widening`` more values beyond ``edge`` (``"low"`` or ``"high"``), and those."""
        if self.factor is None:
            raise ValueError(f"axis {self.name} is not widenable")
        sign = -1 if edge == "low" else 1
        at = self.values[0] if edge == "low" else self.values[-1]
        added = [float(f"{at * self.factor ** (sign * j):.6g}") for j in range(1, self.per_widening + 1)]
        return replace(self, values=tuple(sorted(set(self.values) | set(added)))), added


def _log_axis(name: str, lo: int, hi: int, per_decade: int, widen: bool = True) -> Axis:
    """Axis ``10^lo .. 10^hi`` with ``per_decade`` points per decade (rounded to 6 significant digits)."""
    vals = tuple(float(f"{v:.6g}") for v in np.logspace(lo, hi, (hi - lo) * per_decade + 1))
    return Axis(name, vals, 10 ** (1 / per_decade) if widen else None, per_decade)


def grid_points(axes: Sequence[Axis]) -> list[dict[str, float]]:
    """The Cartesian product of the axes' values, as ``{name: value}`` dicts (first axis slowest)."""
    return [dict(zip((a.name for a in axes), combo)) for combo in itertools.product(*(a.values for a in axes))]


def _key(point: Mapping[str, float]) -> tuple:
    return tuple(sorted(point.items()))


def tune_grids(score: Callable[[list[tuple[str, dict[str, float]]]], list[float]],
               grids: Mapping[str, Sequence[Axis]], *, max_widenings: int = 2) -> dict[str, dict[str, Any]]:
    """Maximise ``score`` over each method's grid separately, widening a grid while its best point lies on an edge.

    Each pass scores every (method, point) not scored yet in one call of ``score`` (so a caller can batch them),
    then, for every method, each widenable axis on whose lowest or highest value the method's best point lies is
    extended by one decade beyond that edge (:meth:`Axis.widened`), at most ``max_widenings`` times per edge.
    It stops when no grid grows. NaN scores rank lowest; ties go to the point met first.

    Args:
        score: ``[(method, point), ...] -> [score, ...]`` (higher is better).
        grids: ``{method: axes}``. max_widenings: >= 0.

    Returns:
        ``{method: {"best": point, "best_score", "tried": [{**point, "score"}], "widened": [{"axis", "edge",
        "added"}], "on_edge": [axes whose edge the best point still lies on, widenable or not], "axes":
        {name: final values}}}``.
    """
    axes = {m: list(a) for m, a in grids.items()}
    scores: dict[str, dict[tuple, float]] = {m: {} for m in grids}
    points: dict[str, dict[tuple, dict[str, float]]] = {m: {} for m in grids}
    widened: dict[str, list[dict[str, Any]]] = {m: [] for m in grids}
    count: dict[tuple[str, str, str], int] = {}
    best: dict[str, dict[str, float]] = {}
    pending = list(grids)
    while pending:
        todo = [(m, pt) for m in pending for pt in grid_points(axes[m]) if _key(pt) not in scores[m]]
        if todo:
            for (m, pt), s in zip(todo, score(todo)):
                scores[m][_key(pt)], points[m][_key(pt)] = float(s), pt
        grown = []
        for m in pending:
            current = [_key(pt) for pt in grid_points(axes[m])]
            k = max(current, key=lambda key: -math.inf if math.isnan(scores[m][key]) else scores[m][key])
            best[m] = points[m][k]
            for i, ax in enumerate(axes[m]):
                if ax.factor is None or len(ax.values) < 2:
                    continue
                for edge, at in (("low", ax.values[0]), ("high", ax.values[-1])):
                    if best[m][ax.name] == at and count.get((m, ax.name, edge), 0) < max_widenings:
                        axes[m][i], added = axes[m][i].widened(edge)
                        count[(m, ax.name, edge)] = count.get((m, ax.name, edge), 0) + 1
                        widened[m].append({"axis": ax.name, "edge": edge, "added": added})
                        grown.append(m)
        pending = sorted(set(grown), key=list(grids).index)
    result = {}
    for m in grids:
        b = best[m]
        on_edge = [a.name for a in axes[m] if len(a.values) > 1 and b[a.name] in (a.values[0], a.values[-1])]
        result[m] = {"best": b, "best_score": scores[m][_key(b)],
                     "tried": [{**points[m][k], "score": s} for k, s in scores[m].items()],
                     "widened": widened[m], "on_edge": on_edge, "axes": {a.name: list(a.values) for a in axes[m]}}
    return result


GRIDS: dict[str, tuple[Axis, ...]] = {
    "dp-fedgd": (_log_axis("eta", -1, 1, 4),),
    "dp-fedavgm": (_log_axis("eta_eff", -1, 1, 2), Axis("momentum", (0.5, 0.7, 0.8, 0.9, 0.95))),
    "dp-fedadam": (_log_axis("eta", -3, -1, 2), _log_axis("tau", -5, -1, 1), Axis("beta1", (0.9,)),
                   Axis("beta2", (0.99,))),
    "dp-fedsofim": (_log_axis("eta_over_rho", -1, 1, 2), _log_axis("rho", -4, 0, 1), Axis("beta", (0.9,))),
    "dp-fedsofim-m": (_log_axis("eta_over_rho", -1, 1, 2), _log_axis("rho", -4, 0, 1), Axis("beta", (0.9,))),
    CEILING: (_log_axis("eta", -1, 1, 4),),
}
"""The first grids (25 points for each method with two axes; DP-FedGD and the ceiling have one axis, eta over two
decades at quarter-decade spacing, 9 points). Step sizes, rho and tau widen by one decade per edge hit; the server
momentum of DP-FedAvgM and the betas stay fixed lists (beta = 0.9 for DP-FedSOFIM, as the seed; Reddi et al.'s
beta1 = 0.9, beta2 = 0.99 for FedAdam)."""
