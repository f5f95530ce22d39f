"""The Rényi DP of the multi-dimensional Skellam mechanism as a dp-accounting event, and the RDP accountant that
composes it.

Source: Agarwal, Kairouz and Liu, "The Skellam Mechanism for Differentially Private Federated Learning", NeurIPS
2021, Theorem 3.5. Written in the per-coordinate variance ``mu`` of the noise (``Poisson(mu/2) - Poisson(mu/2)`` in
every coordinate, the form of the authors' reference implementation, google-research/federated
``distributed_dp/accounting_utils.py``): an integer-valued query whose add/remove-one sensitivity is at most ``D2``
in L2 and ``D1`` in L1, released with that noise, is ``(alpha, eps(alpha))``-RDP at every integer order
``alpha > 1`` with::

    eps(alpha) = alpha D2^2 / (2 mu) + min(((2 alpha - 1) D2^2 + 6 D1) / (4 mu^2), 3 D1 / (2 mu))

The first term is the Gaussian mechanism's RDP at the same variance; the second is at most ``3 D1 / (2 mu)``.

dp-accounting has no Skellam event. :class:`SkellamDpEvent` is one (a ``dp_accounting.DpEvent``), and
:class:`SkellamRdpAccountant` is dp-accounting's ``RdpAccountant`` extended through its composition hook
(``_maybe_compose``) to compose it: at each order alpha it adds ``count * eps(ceil(alpha))`` to the RDP curve (a
fractional order is bounded by the next integer order, since Rényi divergence is non-decreasing in the order: van
Erven and Harremoës, IEEE Trans. Inf. Theory 2014, Thm 3). Every other event is dp-accounting's own code at
dp-accounting's default orders, so a composition without Skellam events is exactly ``RdpAccountant``'s. The
conversion to (eps, delta) is dp-accounting's ``compute_epsilon``.

Orders: dp-accounting's defaults jump from 63 to 128, 256, 512 and 1024, and a Skellam composition's best order
falls in those gaps for epsilon below about 0.2 at delta = 1e-5, where the default orders overstate the bound by up
to 6 % (at the product's sensitivities). A Skellam release is therefore also evaluated at every integer order to 300 and every 4th to 1024
(:data:`SKELLAM_ORDERS`); those orders count for a composition of Skellam releases only (once any other event is
composed, the minimum is over the accountant's own orders). The printed epsilon of Skellam releases is then the minimum of the bound over every integer
order to within 0.01 % (``tests/shared/test_skellam_rdp.py`` checks 1 %).
"""

from __future__ import annotations

import functools

import math
from collections.abc import Sequence
from typing import Optional

import attr
import dp_accounting
import numpy as np
from dp_accounting import rdp

_ErrorDetails = dp_accounting.PrivacyAccountant.CompositionErrorDetails

__all__ = ["skellam_rdp", "SkellamDpEvent", "SkellamRdpAccountant", "SKELLAM_ORDERS"]


def skellam_rdp(orders: np.ndarray | float, variance: float, l2_sensitivity: float,
                l1_sensitivity: float) -> np.ndarray:
    """Theorem 3.5's RDP bound of one release (module docstring), at each order of ``orders``.

    Args:
        orders: Rényi orders, each > 1 (float array or scalar); a fractional order takes the bound of the next
            integer order. variance: mu > 0 per coordinate. l2_sensitivity: D2 > 0. l1_sensitivity: D1 >= D2
            (all in the integer units of the released vector).

    Returns:
        float64 array of ``orders``' shape: eps(ceil(alpha)) for each alpha.

    Raises:
        ValueError: an order <= 1, or a parameter out of range.
    """
    alpha = np.ceil(np.asarray(orders, dtype=np.float64))
    if np.any(np.asarray(orders, dtype=np.float64) <= 1.0):
        raise ValueError(f"Skellam RDP needs orders > 1, got {orders!r}")
    mu, d2, d1 = float(variance), float(l2_sensitivity), float(l1_sensitivity)
    if not (0 < mu < math.inf and 0 < d2 < math.inf and d2 <= d1 < math.inf):
        raise ValueError(f"need variance > 0 and 0 < l2 <= l1 sensitivity, got {mu!r}, {d2!r}, {d1!r}")
    second = np.minimum(((2.0 * alpha - 1.0) * d2 * d2 + 6.0 * d1) / (4.0 * mu * mu), 3.0 * d1 / (2.0 * mu))
    return alpha * d2 * d2 / (2.0 * mu) + second


@attr.s(frozen=True, slots=True, auto_attribs=True)
class SkellamDpEvent(dp_accounting.DpEvent):
    """One release of the multi-dimensional Skellam mechanism: symmetric Skellam noise of per-coordinate variance
    ``variance`` added to an integer query of add/remove-one sensitivity ``l2_sensitivity`` (L2) and
    ``l1_sensitivity`` (L1). Composed by :class:`SkellamRdpAccountant`; other dp-accounting accountants do not
    support it (they raise ``UnsupportedEventError``, never skip it)."""

    variance: float
    l2_sensitivity: float
    l1_sensitivity: float


#: the orders a Skellam release is evaluated at besides the accountant's: every integer to 300, then every 4th to
#: 1024 (the best order of a Skellam composition at delta = 1e-5 passes 64 as epsilon falls below about 0.2)
SKELLAM_ORDERS = tuple(float(a) for a in (*range(2, 301), *range(304, 1025, 4)))


@functools.lru_cache(maxsize=1024)
def _subsampled_gaussian_rdp(q: float, noise_multiplier: float, orders: tuple[float, ...]) -> np.ndarray:
    """dp-accounting's RDP of the Poisson-subsampled Gaussian at ``orders`` (read-only array; cached)."""
    curve = np.asarray(rdp.rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian(
        q=q, noise_multiplier=noise_multiplier, orders=np.array(orders)), dtype=np.float64)
    curve.setflags(write=False)
    return curve


class SkellamRdpAccountant(rdp.RdpAccountant):
    """dp-accounting's ``RdpAccountant`` that also composes :class:`SkellamDpEvent` by Theorem 3.5 (module
    docstring). Same constructor and methods.

    Every other event is composed by ``RdpAccountant`` itself at the accountant's orders (dp-accounting's default
    orders when ``orders`` is None), so a composition without Skellam events gives exactly ``RdpAccountant``'s
    numbers. Skellam releases are evaluated at those orders and, with the default orders, also at
    :data:`SKELLAM_ORDERS`, where the composition's RDP is known only while every event composed is a Skellam
    release: once any other event is composed they are dropped (the other event's RDP is not computed there), and
    the minimum is over the accountant's own orders.
    """

    def __init__(self, orders: Optional[Sequence[float]] = None,
                 neighboring_relation: dp_accounting.NeighboringRelation =
                 dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE) -> None:
        super().__init__(orders=orders, neighboring_relation=neighboring_relation)
        own = [float(a) for a in self._orders]
        extra = sorted(set(SKELLAM_ORDERS) - set(own)) if orders is None else []
        self._all_orders = np.array(own + extra)  # the accountant's orders first, then the extra Skellam orders
        self._skellam_rdp = np.zeros(len(self._all_orders))
        self._other_events = False  # an event other than a Skellam release was composed (with a positive count)

    def _maybe_compose(self, event: dp_accounting.DpEvent, count: int,
                       do_compose: bool) -> Optional[_ErrorDetails]:
        if (do_compose and isinstance(event, dp_accounting.PoissonSampledDpEvent)
                and type(event.event) is dp_accounting.GaussianDpEvent
                and self._neighboring_relation is dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
                and 0 <= event.sampling_probability <= 1 and event.event.noise_multiplier >= 0):
            # the library's own RDP curve of the subsampled Gaussian, memoised: a ledger composes the same (q, z)
            # round after round, and each curve costs ~0.1 s at the fractional orders
            self._rdp += count * _subsampled_gaussian_rdp(float(event.sampling_probability),
                                                          float(event.event.noise_multiplier),
                                                          tuple(float(a) for a in self._orders))
            self._other_events = self._other_events or count > 0
            return None
        if isinstance(event, SkellamDpEvent):
            try:
                curve = skellam_rdp(self._all_orders, event.variance, event.l2_sensitivity, event.l1_sensitivity)
            except ValueError as exc:
                return _ErrorDetails(invalid_event=event, error_message=str(exc))
            if do_compose:
                self._skellam_rdp += count * curve
            return None
        result = super()._maybe_compose(event, count, do_compose)  # composite events come back here per sub-event
        composite = isinstance(event, (dp_accounting.ComposedDpEvent, dp_accounting.SelfComposedDpEvent,
                                       dp_accounting.NoOpDpEvent))
        if do_compose and result is None and count > 0 and not composite:
            self._other_events = True
        return result

    def _curve(self) -> tuple[np.ndarray, np.ndarray]:
        """(orders, RDP) of the whole composition: the accountant's orders, then the extra Skellam orders while only
        Skellam releases were composed (after any other event they would hold infinity, so they are left out)."""
        n = len(self._orders)
        if self._other_events:
            return self._all_orders[:n], self._rdp + self._skellam_rdp[:n]
        return self._all_orders, np.concatenate([self._rdp, np.zeros(len(self._all_orders) - n)]) + self._skellam_rdp

    def get_epsilon_and_optimal_order(self, target_delta: float) -> tuple[float, float]:
        """dp-accounting's ``compute_epsilon`` of :meth:`_curve`."""
        return rdp.rdp_privacy_accountant.compute_epsilon(*self._curve(), target_delta)

    def get_epsilon(self, target_delta: float) -> float:
        """Epsilon of the composition at ``target_delta``."""
        return self.get_epsilon_and_optimal_order(target_delta)[0]

    def get_delta_and_optimal_order(self, target_epsilon: float) -> tuple[float, float]:
        """dp-accounting's ``compute_delta`` of :meth:`_curve`."""
        return rdp.rdp_privacy_accountant.compute_delta(*self._curve(), target_epsilon)

    def get_delta(self, target_epsilon: float) -> float:
        """Delta of the composition at ``target_epsilon``."""
        return self.get_delta_and_optimal_order(target_epsilon)[0]

    @property
    def rdp(self) -> np.ndarray:
        """The composition's RDP at :attr:`orders` (a copy)."""
        return self._curve()[1].copy()

    @property
    def orders(self) -> np.ndarray:
        """The orders the composition is evaluated at: the accountant's, then (Skellam releases only) the extra
        Skellam orders."""
        return self._curve()[0].copy()
