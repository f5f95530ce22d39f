"""Privacy accounting and noise calibration, delegated to Google's dp-accounting library.

Neighbouring relation: add or remove one record (``NeighboringRelation.ADD_OR_REMOVE_ONE``), the unit of privacy
of docs/privacy.md. Two accountants are offered: ``"rdp"`` (Rényi DP, Mironov 2017; the moments accountant of Abadi et
al. 2016 generalised) and ``"pld"`` (privacy loss distributions, Koskela et al. 2020 / Doroshenko et al. 2022),
which is tighter. The ledger and calibration use ``"rdp"`` by default so that calibrated noise and recorded spend
come from the same accountant.

dp-accounting's RDP accountant logs an absl warning "_compute_log_a_frac failed to converge ... Excluding this order
from the epsilon computation" for every fractional Rényi order whose series does not converge (common during
calibration, which tries small noise multipliers). The library excludes those orders either way, so the result is
unchanged; the warnings are dropped, but only while :func:`epsilon_spent` or :func:`calibrate_noise_multiplier`
runs (a filter on the ``absl`` logger, installed once, that is active only inside our calls), so other code's
absl logging, and every other absl message during our calls, is untouched.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import dp_accounting
from dp_accounting import pld, rdp

from shared.errors import ConfigError
from shared.privacy.events import DPSGDEvent
from shared.privacy.skellam import SkellamRdpAccountant

__all__ = ["AccountantName", "make_accountant", "epsilon_spent", "calibrate_noise_multiplier",
           "calibrated_noise_multiplier", "calibrate_sampling_rate", "calibrated_sampling_rate"]

AccountantName = Literal["rdp", "pld"]
_NEIGHBOURS = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE

_NON_CONVERGENCE = "_compute_log_a_frac failed to converge"
_QUIET = contextvars.ContextVar("wildfed_quiet_rdp_convergence", default=False)


class _DropNonConvergence(logging.Filter):
    """Drops dp-accounting's "_compute_log_a_frac failed to converge" record, and only while :data:`_QUIET`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_QUIET.get() and isinstance(record.msg, str) and record.msg.startswith(_NON_CONVERGENCE))


_FILTER = _DropNonConvergence()
logging.getLogger("absl").addFilter(_FILTER)  # idempotent: addFilter ignores a filter already present


@contextlib.contextmanager
def _quiet_non_convergence() -> Iterator[None]:
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)


def make_accountant(accountant: AccountantName = "rdp") -> dp_accounting.PrivacyAccountant:
    """A fresh dp-accounting accountant for the add-or-remove-one relation: ``"rdp"`` is dp-accounting's
    ``RdpAccountant`` at its default orders, extended to the Skellam mechanism's events
    (:class:`shared.privacy.skellam.SkellamRdpAccountant`: every other event is composed by dp-accounting's own code);
    ``"pld"`` is ``PLDAccountant`` (which does not take Skellam events).

    Raises:
        ConfigError: unknown accountant name.
    """
    if accountant == "rdp":
        return SkellamRdpAccountant(neighboring_relation=_NEIGHBOURS)
    if accountant == "pld":
        return pld.PLDAccountant(neighboring_relation=_NEIGHBOURS)
    raise ConfigError(f"unknown accountant {accountant!r}", field="accountant", fix="use 'rdp' or 'pld'")


def _search_accountant(accountant: AccountantName) -> dp_accounting.PrivacyAccountant:
    """The accountant calibration searches with: for ``"rdp"``, dp-accounting's RDP accountant on the integer
    orders of its default order list only (their RDP of the subsampled Gaussian has a closed form; the fractional
    orders' series make a call about 6x slower). A minimum over fewer orders is never smaller, so a value found
    within budget with it is within budget for the full accountant too (every result is then checked with
    :func:`make_accountant`'s full one); the two differed by about 0.02 % of epsilon in the settings tried."""
    if accountant == "rdp":
        return SkellamRdpAccountant(orders=_INTEGER_ORDERS, neighboring_relation=_NEIGHBOURS)
    return make_accountant(accountant)


_INTEGER_ORDERS = [float(o) for o in rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS if float(o).is_integer()]


def _search_epsilon(events: Sequence[DPSGDEvent], target_delta: float, accountant: AccountantName) -> float:
    """:func:`epsilon_spent` with :func:`_search_accountant` (an upper bound of it)."""
    acc = _search_accountant(accountant)
    with _quiet_non_convergence():
        acc.compose(dp_accounting.ComposedDpEvent([e.to_dp_event() for e in events if e.steps > 0]))
        return float(acc.get_epsilon(target_delta))


def _illinois(g: Callable[[float], float], lo: float, g_lo: float, hi: float, g_hi: float, tol: float) -> float:
    """The Illinois variant of regula falsi (Dowell & Jarratt 1971) for an increasing ``g`` with ``g(lo) <= 0 <
    g(hi)``: returns a point x with ``g(x) <= 0`` (computed there) and ``-g(x) <= tol`` or a bracket narrower than
    ``tol``. Here g is a log-epsilon gap along a log parameter, close to linear, so a few calls suffice."""
    side, gap = 0, -g_lo  # gap: the true -g(lo) (Illinois halves the stored end values)
    for _ in range(60):
        if gap <= tol or hi - lo <= tol:
            break
        x = hi - g_hi * (hi - lo) / (g_hi - g_lo)
        x = min(max(x, lo + 1e-3 * (hi - lo)), hi - 1e-3 * (hi - lo))  # stay strictly inside the bracket
        g_x = g(x)
        if g_x > 0:
            hi, g_hi = x, g_x
            if side == 1:
                g_lo /= 2.0
            side = 1
        else:
            lo, g_lo, gap = x, g_x, -g_x
            if side == -1:
                g_hi /= 2.0
            side = -1
    return lo


def _polish(g: Callable[[float], float], x: float, x_max: float, tol: float) -> float:
    """From ``x`` with ``g(x) <= 0`` (the fast search's answer, feasible for the full accountant too), move up towards
    the full accountant's root: bracket it within ``(x, x_max]`` and run :func:`_illinois` on the full ``g``."""
    g_x = g(x)
    if -g_x <= tol or x >= x_max:
        return x
    hi = min(x_max, x + 1.5 * (-g_x) + tol)  # g is about linear with slope >= ~1 in these coordinates
    g_hi = g(hi)
    while g_hi <= 0:
        if hi >= x_max:
            return hi
        x, g_x = hi, g_hi
        hi = min(x_max, hi + 2.0 * (-g_hi) + tol)
        g_hi = g(hi)
    return _illinois(g, x, g_x, hi, g_hi, tol)


def _check_calibration(target_epsilon: float, target_delta: float, rate: float, rate_name: str, steps: int) -> None:
    """The arguments both calibrations share: epsilon positive and finite, delta in (0, 1), the (largest) rate
    ``rate_name`` in (0, 1], steps a positive integer.

    Raises:
        ConfigError: the first that is out of range.
    """
    if not (isinstance(target_epsilon, (int, float)) and 0 < target_epsilon < math.inf):
        raise ConfigError(f"target_epsilon must be positive and finite, got {target_epsilon!r}",
                          field="target_epsilon", fix="give each category a positive budget")
    _check_delta(target_delta)
    if not (0 < rate <= 1):
        raise ConfigError(f"{rate_name} must be in (0, 1], got {rate!r}", field="sampling_rate",
                          fix="use expected_batch_size <= number of records")
    if type(steps) is not int or steps < 1:
        raise ConfigError(f"steps must be a positive integer, got {steps!r}", field="steps")


def _check_delta(target_delta: float) -> None:
    if not (isinstance(target_delta, (int, float)) and 0 < target_delta < 1):
        raise ConfigError(f"target_delta must be in (0, 1), got {target_delta!r}", field="target_delta",
                          fix="use a delta well below 1/N, e.g. 1e-5")


def _check_fixed_floor(fixed: Sequence[DPSGDEvent], target_epsilon: float, target_delta: float,
                       accountant: AccountantName) -> None:
    """Raises ConfigError (field ``count_noise_multiplier``) when the fixed releases alone spend the budget."""
    floor = epsilon_spent(fixed, target_delta=target_delta, accountant=accountant)
    if floor >= target_epsilon:
        raise ConfigError(f"the fixed releases alone spend eps={floor:.4g} >= the budget {target_epsilon:.4g}",
                          field="count_noise_multiplier",
                          fix="raise the noise of the fixed releases (e.g. NIRA's count_noise_multiplier) or "
                              "use public N_k weights")


def epsilon_spent(events: Sequence[DPSGDEvent], *, target_delta: float,
                  accountant: AccountantName = "rdp") -> float:
    """Epsilon of the composition of ``events`` at ``target_delta`` (per record, under add/remove-one).

    Returns 0.0 for no events or only zero-step events.

    Raises:
        ConfigError: bad delta or accountant name.
        dp_accounting.UnsupportedEventError: the accountant cannot interpret an event (never skipped).
    """
    _check_delta(target_delta)
    acc = make_accountant(accountant)
    dp_events = [e.to_dp_event() for e in events if e.steps > 0]
    if not dp_events:
        return 0.0
    with _quiet_non_convergence():
        acc.compose(dp_accounting.ComposedDpEvent(dp_events))
        return float(acc.get_epsilon(target_delta))


def calibrate_noise_multiplier(*, target_epsilon: float, target_delta: float, sampling_rate: float, steps: int,
                               accountant: AccountantName = "rdp", tol: float = 1e-4,
                               fixed_events: Sequence[DPSGDEvent] = ()) -> float:
    """Smallest noise multiplier z (within ``tol``) such that ``steps`` Poisson-subsampled Gaussian steps at
    rate ``sampling_rate``, composed with ``fixed_events`` (other releases about the same records whose noise is
    already fixed, e.g. NIRA's noisy species counts), are (``target_epsilon``, ``target_delta``)-DP under the chosen
    accountant.

    Uses ``dp_accounting.calibrate_dp_mechanism`` (Brent's method) and then checks the result with a fresh
    accountant, raising z until it is inside the budget: the returned value never overspends.

    Raises:
        ConfigError: epsilon not positive, delta not in (0,1), q not in (0,1], steps < 1, or ``fixed_events``
            alone already spend at least ``target_epsilon``.
    """
    _check_calibration(target_epsilon, target_delta, sampling_rate, "sampling_rate", steps)
    fixed = [e for e in fixed_events if e.steps > 0]
    if fixed:
        _check_fixed_floor(fixed, target_epsilon, target_delta, accountant)

    def event(z: float) -> dp_accounting.DpEvent:
        if not fixed:
            return DPSGDEvent(z, sampling_rate, steps).to_dp_event()
        return dp_accounting.ComposedDpEvent([DPSGDEvent(z, sampling_rate, steps).to_dp_event(),
                                              *(e.to_dp_event() for e in fixed)])

    with _quiet_non_convergence():
        z = float(dp_accounting.calibrate_dp_mechanism(
            lambda: _search_accountant(accountant), event, target_epsilon, target_delta,
            bracket_interval=dp_accounting.LowerEndpointAndGuess(0.05, 1.0), tol=tol))
    if accountant == "rdp":  # the search's accountant only over-estimates: lower z to the full accountant's root
        def g(x: float) -> float:  # x = -log z; epsilon grows with x
            eps = epsilon_spent([DPSGDEvent(math.exp(-x), sampling_rate, steps), *fixed], target_delta=target_delta,
                                accountant=accountant)
            return math.log(max(eps, 1e-300)) - math.log(target_epsilon)

        z = math.exp(-_polish(g, -math.log(z), -math.log(0.05), tol / max(z, 1e-12)))
    # Never return a value outside the budget, whatever side of the root the search ended on.
    while epsilon_spent([DPSGDEvent(z, sampling_rate, steps), *fixed], target_delta=target_delta,
                        accountant=accountant) > target_epsilon:
        z += tol
    return z


@functools.lru_cache(maxsize=1024)
def calibrated_noise_multiplier(target_epsilon: float, target_delta: float, sampling_rate: float, steps: int,
                                accountant: AccountantName = "rdp",
                                fixed_events: tuple[DPSGDEvent, ...] = ()) -> float:
    """:func:`calibrate_noise_multiplier`, memoised on its (hashable) arguments: the gateway calibrates the same
    (budget, delta, q, steps) every round and the coordinator every Global DP round; each call is a root search
    through the accountant (tens of milliseconds).

    Raises:
        ConfigError: as :func:`calibrate_noise_multiplier`.
    """
    return calibrate_noise_multiplier(target_epsilon=target_epsilon, target_delta=target_delta,
                                      sampling_rate=sampling_rate, steps=steps, accountant=accountant,
                                      fixed_events=fixed_events)


def calibrate_sampling_rate(*, target_epsilon: float, target_delta: float, noise_multiplier: float, steps: int,
                            max_rate: float, accountant: AccountantName = "rdp", rtol: float = 1e-3,
                            fixed_events: Sequence[DPSGDEvent] = ()) -> float:
    """Largest Poisson sampling rate q <= ``max_rate`` (within a relative ``rtol``) such that ``steps`` steps of
    ``PoissonSampled(q, Gaussian(noise_multiplier))``, composed with ``fixed_events``, are (``target_epsilon``,
    ``target_delta``)-DP under the chosen accountant.

    This is the "Sample" calibration of individualized DP-SGD (Boenisch et al., NeurIPS 2023, "Have it your way",
    Sec. 4.1): one noise multiplier for every record, and each privacy group's records sampled at the rate its
    budget allows. The root is bracketed in log q (the privacy loss grows with q) and found by the Illinois variant
    of regula falsi on dp-accounting's epsilon (a handful of accountant calls; ``calibrate_dp_mechanism`` bisects
    and needs a dozen or more), stopping at a rate whose epsilon is within a relative ``rtol`` of the budget from below:
    every rate returned has been checked with a fresh accountant, so it never overspends.

    Returns:
        q in (0, max_rate]; ``max_rate`` itself when it already fits the budget.

    Raises:
        ConfigError: epsilon not positive, delta not in (0,1), z not positive, max_rate not in (0,1], steps < 1,
            or ``fixed_events`` alone already spend at least ``target_epsilon`` (no rate > 0 fits).
    """
    _check_calibration(target_epsilon, target_delta, max_rate, "max_rate", steps)
    if not (isinstance(noise_multiplier, (int, float)) and 0 < noise_multiplier < math.inf):
        raise ConfigError(f"noise_multiplier must be positive and finite, got {noise_multiplier!r}",
                          field="noise_multiplier")
    fixed = [e for e in fixed_events if e.steps > 0]

    def spent(q: float) -> float:  # the search's (integer-order) epsilon: an upper bound of the ledger's
        return _search_epsilon([DPSGDEvent(float(noise_multiplier), q, steps), *fixed], target_delta, accountant)

    def ledger_spent(q: float) -> float:
        return epsilon_spent([DPSGDEvent(float(noise_multiplier), q, steps), *fixed], target_delta=target_delta,
                             accountant=accountant)

    at_max = spent(float(max_rate))
    if at_max <= target_epsilon:
        return float(max_rate)
    if fixed:
        _check_fixed_floor(fixed, target_epsilon, target_delta, accountant)
    # Bracket [lo, hi] in x = log q with spent(lo) <= target < spent(hi), then the Illinois variant of regula falsi
    # (Dowell & Jarratt 1971) on g(x) = log spent(e^x) - log target: the privacy loss is close to a power of q, so g
    # is close to linear in x and this needs a few accountant calls where bisection needs a dozen or more.
    def g(x: float) -> float:
        return math.log(max(spent(math.exp(x)), 1e-300)) - math.log(target_epsilon)

    hi, g_hi = math.log(max_rate), math.log(at_max) - math.log(target_epsilon)
    lo = hi - g_hi  # the power-law guess with exponent 1: eps proportional to q
    g_lo = g(lo)
    while g_lo > 0:  # not yet feasible: move the lower end down (the old lower end is an upper end)
        hi, g_hi = lo, g_lo
        lo -= max(2.0 * g_lo, math.log(4.0))
        if lo < math.log(max_rate) - 460:  # pragma: no cover - e^-460 always fits a budget the fixed releases fit
            raise ConfigError(f"no sampling rate fits eps={target_epsilon:.4g} at z={noise_multiplier:.4g}",
                              field="target_epsilon")
        g_lo = g(lo)
    lo = _illinois(g, lo, g_lo, hi, g_hi, rtol)

    def g_full(x: float) -> float:  # the ledger's accountant: the fast one only over-estimates
        return math.log(max(ledger_spent(math.exp(x)), 1e-300)) - math.log(target_epsilon)

    lo = _polish(g_full, lo, math.log(max_rate), rtol)
    # lo is feasible by construction (every value stored at lo was computed there and is <= 0 before halving)
    q = math.exp(lo)
    while ledger_spent(q) > target_epsilon:  # pragma: no cover - never a rate outside the budget (the ledger's)
        q *= 1.0 - rtol
    return q


@functools.lru_cache(maxsize=1024)
def calibrated_sampling_rate(target_epsilon: float, target_delta: float, noise_multiplier: float, steps: int,
                             max_rate: float, accountant: AccountantName = "rdp",
                             fixed_events: tuple[DPSGDEvent, ...] = ()) -> float:
    """:func:`calibrate_sampling_rate`, memoised on its (hashable) arguments (the gateway plans the same rates
    every round; each call is a root search through the accountant).

    Raises:
        ConfigError: as :func:`calibrate_sampling_rate`.
    """
    return calibrate_sampling_rate(target_epsilon=target_epsilon, target_delta=target_delta,
                                   noise_multiplier=noise_multiplier, steps=steps, max_rate=max_rate,
                                   accountant=accountant, fixed_events=fixed_events)
