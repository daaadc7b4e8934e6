"""Record-level privacy accounting for federated DP: RDP, PRV, calibration and the run's ledger.

A client that takes part in a round answers T DP queries, each a Sampled
Gaussian Mechanism (SGM) with noise multiplier sigma and Poisson rate
q = B / N_k. Client sampling amplifies nothing: the server knows which clients
it selected, so a record is charged for every round its client takes part in
(docs/accounting.md). Over the M_k rounds client k takes part in::

    RDP(alpha) = M_k * T * rdp_SGM(alpha | q, sigma)

Mechanisms are small immutable :class:`SGMEvent` records (noise multiplier,
sample rate, steps), in the style of Google's dp-accounting; the arithmetic
is Opacus': per-order RDP from ``opacus.accountants.analysis.rdp.compute_rdp``
on ``RDPAccountant.DEFAULT_ALPHAS``, converted to (epsilon, delta) with
Balle et al. 2020 (``get_privacy_spent``), or numerical composition with
``opacus.accountants.PRVAccountant``.

Example:
    >>> events = round_events(noise_multiplier=1.0, sample_rate=0.02, queries_per_round=50)
    >>> eps = compute_epsilon(compose(events * 20), delta=1e-5)
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import numbers
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from fedaudit.errors import UserError
from fedaudit.registry import ACCOUNTANTS

if TYPE_CHECKING:
    from opacus.accountants.analysis.prv import Domain

# Opacus is imported where epsilon is computed, not here: its package import takes about 1-2.6 s and 70 MB (it loads
# its privacy engine and torch.distributed), and every Flower ClientApp process (one per message) and most commands
# import this module for SGMEvent alone. The RDP accountant (the default) does not import the package at all: it
# runs Opacus' RDP analysis module loaded from its file (:func:`_opacus_rdp`).

UNITS = ("record", "client")  # what a ledger's epsilon protects (the configuration's --dp-level)


def update_noise_multiplier(noise_multiplier: float, count_noise: float) -> float:
    """Adaptive clipping's noise multiplier of the clipped updates' sum, sigma_Delta = (z^-2 - (2 sigma_b)^-2)^-1/2:
    released with the count of updates under C (each centred to +-1/2, noise sigma_b), the two queries together are
    one Gaussian mechanism of noise multiplier z (Andrew et al., NeurIPS 2021, Theorem 1), which the ledger charges.

    Raises:
        AccountingError: the count's noise leaves nothing for the updates (z >= 2 sigma_b).
    """
    z, b = _check_noise_multiplier(noise_multiplier), _check_real("count_noise", count_noise)
    if not 0 < z < 2 * b:
        raise AccountingError(
            f"Adaptive clipping needs the noise multiplier ({z:g}) below twice the count's noise ({2 * b:g}): raise "
            "--count-noise or lower the noise multiplier."
        )
    return (z**-2 - (2 * b) ** -2) ** -0.5


__all__ = [
    "ACCOUNTANTS",
    "RDP_ORDERS",
    "AccountingError",
    "SGMEvent",
    "round_events",
    "compose",
    "compute_rdp",
    "compute_epsilon",
    "epsilon_per_round",
    "calibrate_noise_multiplier",
    "PrivacyLedger",
]


RDP_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(12, 64)])
"""Opacus' RDP orders (``RDPAccountant.DEFAULT_ALPHAS``, tested equal): 1.1..10.9 in steps of 0.1, then 12..63."""

_ORDERS = np.asarray(RDP_ORDERS)

_PRV_EPS_ERROR = 0.01
"""Opacus' default accuracy of the PRV epsilon (its delta error is delta / 1000)."""

_PRV_MAX_GRID = 10_000_000
"""Largest PRV discretisation grid we let Opacus allocate (about 200 bytes a point, so ~2 GB)."""

_CALIBRATION_RTOL = 1e-3
_SIGMA_MIN = 1e-3
_SIGMA_MAX = 1e6


class AccountingError(UserError):
    """Bad accounting input a user can cause (out-of-range sigma, q, steps, delta, unreachable target)."""


def _check_real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise AccountingError(f"{name} must be a real number, got {value!r}.")
    return float(value)


def _check_int(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise AccountingError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return int(value)


def _check_fraction(name: str, value: Any) -> float:
    """A probability in (0, 1]: sample rates and client fractions."""
    x = _check_real(name, value)
    if not 0.0 < x <= 1.0:
        raise AccountingError(f"{name} must be in (0, 1], got {value!r}.")
    return x


def _check_delta(delta: Any) -> float:
    x = _check_real("delta", delta)
    if not 0.0 < x < 1.0:
        raise AccountingError(f"delta must be in (0, 1), got {delta!r}.")
    return x


def _check_accountant(accountant: Any) -> str:
    if not isinstance(accountant, str) or accountant not in ACCOUNTANTS:
        raise AccountingError(f"accountant must be one of {', '.join(map(repr, ACCOUNTANTS))}, got {accountant!r}.")
    return accountant


def _check_noise_multiplier(value: Any) -> float:
    x = _check_real("noise_multiplier", value)
    if not 0.0 <= x < math.inf:
        raise AccountingError(f"noise_multiplier must be finite and >= 0 (0 means no privacy), got {value!r}.")
    return x


@dataclass(frozen=True)
class SGMEvent:
    """``steps`` applications of the Sampled Gaussian Mechanism with one noise multiplier and sample rate.

    ``noise_multiplier == 0`` is allowed and means no privacy (epsilon is infinite);
    fields are normalised to ``float``/``int`` so events compare and serialise exactly.
    """

    noise_multiplier: float
    sample_rate: float
    steps: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_multiplier", _check_noise_multiplier(self.noise_multiplier))
        object.__setattr__(self, "sample_rate", _check_fraction("sample_rate", self.sample_rate))
        object.__setattr__(self, "steps", _check_int("steps", self.steps, minimum=0))

    def to_dict(self) -> dict[str, float | int]:
        """JSON-ready form: ``{"noise_multiplier": s, "sample_rate": q, "steps": n}``."""
        return {"noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate, "steps": self.steps}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SGMEvent:
        """Inverse of :meth:`to_dict`; raises :class:`AccountingError` on a malformed entry."""
        if not isinstance(d, Mapping) or set(d) != {"noise_multiplier", "sample_rate", "steps"}:
            raise AccountingError(f"An SGM event needs exactly noise_multiplier, sample_rate and steps, got {d!r}.")
        return cls(noise_multiplier=d["noise_multiplier"], sample_rate=d["sample_rate"], steps=d["steps"])

    def _key(self) -> tuple[float, float, int]:
        return (self.noise_multiplier, self.sample_rate, self.steps)


def round_events(*, noise_multiplier: float, sample_rate: float, queries_per_round: int) -> list[SGMEvent]:
    """One round of a client that takes part: ``[SGMEvent(sigma, q, T)]``.

    There is no discount for client sampling: whoever sees the updates knows
    which clients sent them, so the selection hides nothing (docs/accounting.md).
    """
    sigma = _check_noise_multiplier(noise_multiplier)
    q = _check_fraction("sample_rate", sample_rate)
    t = _check_int("queries_per_round", queries_per_round, minimum=1)
    return [SGMEvent(noise_multiplier=sigma, sample_rate=q, steps=t)]


def compose(events: Iterable[SGMEvent]) -> list[SGMEvent]:
    """Merge events with equal (noise multiplier, sample rate) by summing steps, in first-seen order.

    Zero-step events contribute nothing and are dropped.
    """
    steps: dict[tuple[float, float], int] = {}
    for event in events:
        if not isinstance(event, SGMEvent):
            raise AccountingError(f"Expected SGMEvent objects, got {type(event).__name__}.")
        key = (event.noise_multiplier, event.sample_rate)
        steps[key] = steps.get(key, 0) + event.steps
    return [SGMEvent(noise_multiplier=s, sample_rate=q, steps=n) for (s, q), n in steps.items() if n > 0]


_OPACUS_RDP = "opacus.accountants.analysis.rdp"


@lru_cache(maxsize=1)
def _opacus_rdp() -> ModuleType:
    """Opacus' RDP analysis module, the same file and code as ``opacus.accountants.analysis.rdp``.

    It needs only numpy and scipy.special, but importing it by name runs Opacus' package import first, which loads
    Opacus' privacy engine and torch.distributed (about 70 MB of memory and 1 s in every process that computes an
    epsilon). Where Opacus is already imported, its own module is used.
    """
    if _OPACUS_RDP in sys.modules:
        return sys.modules[_OPACUS_RDP]
    package = importlib.util.find_spec("opacus")
    if package is None or not package.submodule_search_locations:
        raise AccountingError("Opacus is not installed; fedaudit's accountants need it (pip install opacus).")
    path = Path(next(iter(package.submodule_search_locations))) / "accountants" / "analysis" / "rdp.py"
    spec = importlib.util.spec_from_file_location("fedaudit.privacy._opacus_rdp", path) if path.is_file() else None
    if spec is None or spec.loader is None:  # an Opacus that keeps it elsewhere: its own package import
        return _opacus(_OPACUS_RDP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@lru_cache(maxsize=4096)
def _rdp_one_step(noise_multiplier: float, sample_rate: float) -> np.ndarray:
    """Opacus' RDP of one SGM step at every order in :data:`RDP_ORDERS` (cached, read-only).

    Integer orders and the closed cases (q = 0 or 1, sigma = 0) are Opacus' own functions; the 90 fractional orders
    are Opacus' series (Mironov et al. 2019, Section 3.3) term by term, all orders' terms at once with numpy instead
    of one Python step a term (benchmarks/accounting.py: 3 to 12 times faster a curve, which every DP run pays per
    client and a calibration per step of its search). Equal to Opacus to 1e-9 relative (tested over a grid).
    """
    opacus = _opacus_rdp()
    if sample_rate in (0.0, 1.0) or noise_multiplier == 0:
        rdp = opacus.compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=list(RDP_ORDERS))
        curve = np.asarray(rdp, dtype=np.float64)
    else:
        curve = np.empty(len(RDP_ORDERS))
        integer = _ORDERS == np.round(_ORDERS)
        curve[integer] = [opacus._compute_rdp(sample_rate, noise_multiplier, a) for a in _ORDERS[integer]]
        fractional = _ORDERS[~integer]
        curve[~integer] = _log_a_fractional(sample_rate, noise_multiplier, fractional) / (fractional - 1)
    curve.setflags(write=False)
    return curve


_SERIES_BLOCK = 64  # terms of the fractional orders' series evaluated at once, for every order not yet ended
_SERIES_LIMIT = 1 << 16  # more terms than this: Opacus' own loop decides


def _log_a_fractional(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """log A_alpha of the sampled Gaussian mechanism at fractional orders: Opacus'
    ``_compute_log_a_for_frac_alpha`` (the same terms, each order's up to and including its first whose two parts
    are both below e^-30: from a few dozen to a few thousand), a block of terms of every order not yet ended at a
    time, its signed sums in log space taken at once with the largest term factored out, so that log1p keeps what
    A_alpha adds to it. An order whose sum is not positive falls back to Opacus' loop."""
    from scipy import special

    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    scale = math.sqrt(2) * sigma
    terms: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = [[] for _ in alphas]
    active = np.arange(len(alphas))
    for start in range(0, _SERIES_LIMIT, _SERIES_BLOCK):
        alpha = alphas[active][:, None]
        i = np.arange(start, start + _SERIES_BLOCK, dtype=np.float64)[None, :]
        coef = special.binom(alpha, i)
        log_coef = np.log(np.abs(coef))
        j = alpha - i
        log_e0 = special.log_ndtr(-((i - z0) / scale) * 2**0.5)  # log(erfc(x) / 2), as Opacus' terms
        log_e1 = special.log_ndtr(-((z0 - j) / scale) * 2**0.5)
        log_s0 = log_coef + i * math.log(q) + j * math.log(1 - q) + (i * i - i) / (2 * sigma**2) + log_e0
        log_s1 = log_coef + j * math.log(q) + i * math.log(1 - q) + (j * j - j) / (2 * sigma**2) + log_e1
        small = np.maximum(log_s0, log_s1) < -30
        ended = small.any(axis=1)
        ends = np.where(ended, small.argmax(axis=1) + 1, _SERIES_BLOCK)
        sign = np.where(coef > 0, 1.0, -1.0)
        for row, order in enumerate(active):
            end = ends[row]
            terms[order].append((log_s0[row, :end], log_s1[row, :end], sign[row, :end]))
        active = active[~ended]
        if not active.size:
            break
    log_a = np.empty(len(alphas))
    for k, parts in enumerate(terms):
        log_a[k] = math.nan if k in active else _signed_log_sum(parts)
        if not math.isfinite(log_a[k]):
            log_a[k] = _opacus_rdp()._compute_log_a_for_frac_alpha(q, sigma, float(alphas[k]))
    return log_a


def _signed_log_sum(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> float:
    """log(A0 + A1) from the log terms of A0's and A1's signed series (NaN where a sum is not positive)."""
    sign = np.concatenate([p[2] for p in parts])
    logs = []
    for index in (0, 1):
        series = np.concatenate([p[index] for p in parts])
        at = int(np.argmax(series))
        if sign[at] < 0 or not math.isfinite(series[at]):
            return math.nan
        rest = np.delete(sign * np.exp(series - series[at]), at)  # the largest term is 1: log1p keeps the rest
        total = float(np.sum(rest))
        if not total > -1:
            return math.nan
        logs.append(float(series[at]) + math.log1p(total))
    low, high = min(logs), max(logs)
    return high + math.log1p(math.exp(low - high))  # Opacus' _log_add


def _rdp_of(history: tuple[tuple[float, float, int], ...]) -> np.ndarray:
    if not history:
        return np.zeros_like(_ORDERS)
    curves = np.stack([_rdp_one_step(s, q) for s, q, _ in history])
    steps = np.array([n for _, _, n in history], dtype=np.float64)
    return steps @ curves


def _rdp_to_epsilon(rdp: np.ndarray, delta: float) -> float:
    """Balle et al. 2020 conversion, exactly Opacus' ``get_privacy_spent`` over :data:`RDP_ORDERS`, at least 0 (at a
    large delta the conversion goes below 0, and every mechanism is (0, delta)-DP there)."""
    with warnings.catch_warnings():
        # Opacus warns when the optimum sits at an end of its own fixed orders; the orders are part of the spec.
        warnings.filterwarnings("ignore", message="Optimal order is the", category=UserWarning)
        eps, _ = _opacus_rdp().get_privacy_spent(orders=list(RDP_ORDERS), rdp=rdp, delta=delta)
    return max(0.0, float(eps))


def _opacus(module: str) -> ModuleType:
    """One of Opacus' modules, imported without the logging set-up its package import makes: Opacus calls
    ``logging.basicConfig`` on import, which would give the root logger a handler and turn a notebook's own later
    ``logging.basicConfig(...)`` into a no-op."""
    handlers, level = list(logging.root.handlers), logging.root.level
    try:
        return importlib.import_module(module)
    finally:
        logging.root.handlers[:] = handlers
        logging.root.setLevel(level)


def _prv_domain(history: tuple[tuple[float, float, int], ...], delta: float) -> Domain:
    """The grid Opacus' PRVAccountant discretises on (``compute_safe_domain_size``, mesh), from our cached RDP."""
    Domain = _opacus("opacus.accountants.analysis.prv").Domain  # noqa: N806 (Opacus' class)

    delta_error = delta / 1000
    total = sum(n for _, _, n in history)
    half_width = _rdp_to_epsilon(_rdp_of(history), delta_error / 4)
    for s, q, _ in history:
        half_width = max(half_width, _rdp_to_epsilon(_rdp_one_step(s, q), delta_error / (8 * total)))
    half_width = max(half_width, _PRV_EPS_ERROR) + 3
    mesh = _PRV_EPS_ERROR / math.sqrt(total * math.log(12 / delta_error) / 2)
    return Domain.create_aligned(-half_width, half_width, mesh)


def _prv_accountant(domain: Domain) -> Any:
    """Opacus' PRVAccountant on a precomputed domain: Opacus would recompute (uncached) the RDP curves for it."""
    PRVAccountant = _opacus("opacus.accountants").PRVAccountant  # noqa: N806 (Opacus' class)

    class PRVAccountantWithDomain(PRVAccountant):
        def _get_domain(self, prvs: Any, num_self_compositions: Any, eps_error: float, delta_error: float) -> Domain:
            return domain

    return PRVAccountantWithDomain()


@lru_cache(maxsize=1024)
def _epsilon_cached(history: tuple[tuple[float, float, int], ...], delta: float, accountant: str) -> float:
    """Epsilon of a composed history by the registry's ``accountant``; cached so that identical clients cost one
    computation."""
    if not history:
        return 0.0
    if any(s == 0.0 for s, _, _ in history):
        return math.inf
    return ACCOUNTANTS[accountant].epsilon(history, delta)


def rdp_epsilon(history: tuple[tuple[float, float, int], ...], delta: float) -> float:
    """Epsilon of ``(noise_multiplier, sample_rate, steps)`` compositions by RDP (Opacus' orders and conversion)."""
    return _rdp_to_epsilon(_rdp_of(history), delta)


def prv_epsilon(history: tuple[tuple[float, float, int], ...], delta: float) -> float:
    """Epsilon of ``(noise_multiplier, sample_rate, steps)`` compositions by Opacus' PRV accountant, on a grid sized
    for this history (a history whose grid would be too large is an :class:`AccountingError`)."""
    domain = _prv_domain(history, delta)
    if domain.size > _PRV_MAX_GRID:
        raise AccountingError(
            f"PRV accounting of this history needs a grid of {domain.size:.2g} points (over {_PRV_MAX_GRID:.0e}) "
            f"because epsilon is very large (RDP gives {_rdp_to_epsilon(_rdp_of(history), delta):.3g}); "
            "use accountant='rdp'."
        )
    prv = _prv_accountant(domain)
    prv.history = list(history)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.filterwarnings("ignore", message="Optimal order is the", category=UserWarning)
        try:
            return max(0.0, float(prv.get_epsilon(delta=delta, eps_error=_PRV_EPS_ERROR, delta_error=delta / 1000)))
        except RuntimeError as exc:  # Opacus' search finds no epsilon: at a delta near 1, where RDP gives 0
            if _rdp_to_epsilon(_rdp_of(history), delta) == 0.0:
                return 0.0
            raise AccountingError(
                f"PRV accounting finds no epsilon at delta {delta:g} for this history; use accountant='rdp'."
            ) from exc


def _history_key(events: Iterable[SGMEvent]) -> tuple[tuple[float, float, int], ...]:
    return tuple(e._key() for e in compose(events))


def compute_rdp(events: Sequence[SGMEvent]) -> np.ndarray:
    """RDP of the composition of ``events`` at every order in :data:`RDP_ORDERS` (may contain ``inf``)."""
    history = _history_key(events)
    if any(s == 0.0 for s, _, _ in history):
        return np.full_like(_ORDERS, np.inf)
    return _rdp_of(history)


def compute_epsilon(events: Sequence[SGMEvent], *, delta: float, accountant: str = "rdp") -> float:
    """Epsilon at ``delta`` of the composition of ``events``: 0.0 for no steps, ``inf`` if any sigma is 0.

    Args:
        events: Sampled Gaussian Mechanism steps, in any order (they are composed first).
        delta: the delta of (epsilon, delta)-DP, in (0, 1).
        accountant: a name of :data:`fedaudit.registry.ACCOUNTANTS` (``rdp`` or ``prv``).

    Returns:
        The smallest epsilon the accountant certifies.

    Raises:
        AccountingError: an invalid event, delta or accountant, or a PRV grid too large to compute.

    Example:
        >>> eps = compute_epsilon([SGMEvent(noise_multiplier=1.0, sample_rate=0.02, steps=1000)], delta=1e-5)
    """
    delta = _check_delta(delta)
    accountant = _check_accountant(accountant)
    return _epsilon_cached(_history_key(events), delta, accountant)


def _rounds_events(
    *, noise_multiplier: float, sample_rate: float, queries_per_round: int, rounds: int
) -> list[SGMEvent]:
    """The composed events of ``rounds`` identical rounds."""
    one = round_events(noise_multiplier=noise_multiplier, sample_rate=sample_rate, queries_per_round=queries_per_round)
    return [
        SGMEvent(noise_multiplier=e.noise_multiplier, sample_rate=e.sample_rate, steps=e.steps * rounds) for e in one
    ]


def epsilon_per_round(
    *,
    noise_multiplier: float,
    sample_rate: float,
    queries_per_round: int,
    rounds: int,
    delta: float = 1e-5,
    accountant: str = "rdp",
) -> list[float]:
    """Epsilon after rounds 1..M of one client that takes part in every one of them.

    Args:
        noise_multiplier: sigma of every query.
        sample_rate: q = B / N_k, the Poisson rate within a round.
        queries_per_round: T, the DP queries (local steps) per round.
        rounds: M, the rounds the client takes part in.
        delta: the delta of (epsilon, delta)-DP.
        accountant: ``rdp`` or ``prv``.

    Returns:
        M epsilons, one after each round (see docs/accounting.md).

    Raises:
        AccountingError: an argument out of range.

    Example:
        >>> curve = epsilon_per_round(noise_multiplier=1.0, sample_rate=0.0256, queries_per_round=200, rounds=15)
    """
    rounds = _check_int("rounds", rounds, minimum=1)
    delta = _check_delta(delta)
    accountant = _check_accountant(accountant)
    return [
        compute_epsilon(
            _rounds_events(
                noise_multiplier=noise_multiplier,
                sample_rate=sample_rate,
                queries_per_round=queries_per_round,
                rounds=m,
            ),
            delta=delta,
            accountant=accountant,
        )
        for m in range(1, rounds + 1)
    ]


def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    sample_rate: float,
    queries_per_round: int,
    rounds: int,
    delta: float = 1e-5,
    accountant: str = "rdp",
) -> float:
    """Smallest noise multiplier (to ~1e-3 relative) whose epsilon after ``rounds`` rounds is <= ``target_epsilon``.

    Root finding on a bracket grown as needed (Brent's method, then bisection to
    the tolerance). The returned sigma was evaluated and meets the target (it
    errs on the noisy side, never above the budget). For PRV the search starts
    from the RDP answer, and a sigma whose PRV grid would be too large counts
    as over budget.

    Args:
        target_epsilon: the budget after the last round.
        sample_rate, queries_per_round, rounds, delta, accountant: as for
            :func:`epsilon_per_round`.

    Returns:
        sigma.

    Raises:
        AccountingError: if the target is not positive or is unreachable; with RDP
            over Opacus' finite orders, epsilon cannot go below
            ``min_alpha log((alpha-1)/alpha) - (log delta + log alpha)/(alpha-1)``
            (about 0.10 at delta = 1e-5) however large sigma is.

    Example:
        >>> sigma = calibrate_noise_multiplier(target_epsilon=8.0, sample_rate=0.02, queries_per_round=50, rounds=20)
    """
    target = _check_real("target_epsilon", target_epsilon)
    if not 0.0 < target < math.inf:
        raise AccountingError(f"target_epsilon must be positive and finite, got {target_epsilon!r}.")
    q = _check_fraction("sample_rate", sample_rate)
    t = _check_int("queries_per_round", queries_per_round, minimum=1)
    m = _check_int("rounds", rounds, minimum=1)
    delta = _check_delta(delta)
    accountant = _check_accountant(accountant)

    def epsilon_at(sigma: float, how: str) -> float:
        events = _rounds_events(noise_multiplier=sigma, sample_rate=q, queries_per_round=t, rounds=m)
        try:
            return compute_epsilon(events, delta=delta, accountant=how)
        except AccountingError:
            return math.inf

    def rdp_solution() -> float:
        floor = _rdp_to_epsilon(np.zeros_like(_ORDERS), delta)
        if target <= floor:
            raise AccountingError(
                f"--target-epsilon {target:g} is unreachable with RDP accounting at --delta {delta:g}: "
                f"epsilon never goes below {floor:.4f} however much noise is added."
            )
        return _solve_sigma(lambda s: epsilon_at(s, "rdp"), target=target, start=1.0, factor=2.0)

    if accountant == "rdp":
        return rdp_solution()
    try:
        # PRV is tighter than RDP, so its sigma sits a little below the RDP one: start there, narrowly.
        start, factor = rdp_solution(), 1.1
    except AccountingError:
        start, factor = 1.0, 2.0
    return _solve_sigma(lambda s: epsilon_at(s, "prv"), target=target, start=start, factor=factor)


def calibrate_events(
    events_at: Callable[[float], Sequence[SGMEvent]],
    *,
    target_epsilon: float,
    delta: float = 1e-5,
    accountant: str = "rdp",
) -> float:
    """Smallest noise multiplier (to ~1e-3 relative) whose whole history ``events_at(sigma)`` has epsilon <=
    ``target_epsilon``: :func:`calibrate_noise_multiplier` for histories that are not rounds of equal DP-SGD steps
    (Fedssyn's generator training, then the rounds of its inner algorithm). ``events_at`` must be monotone: more
    noise, less epsilon."""
    target = _check_real("target_epsilon", target_epsilon)
    if not 0.0 < target < math.inf:
        raise AccountingError(f"target_epsilon must be positive and finite, got {target_epsilon!r}.")
    delta = _check_delta(delta)
    accountant = _check_accountant(accountant)

    def epsilon_at(sigma: float, how: str) -> float:
        try:
            return compute_epsilon(compose(events_at(sigma)), delta=delta, accountant=how)
        except AccountingError:
            return math.inf

    floor = _rdp_to_epsilon(np.zeros_like(_ORDERS), delta)
    if target <= floor and accountant == "rdp":
        raise AccountingError(
            f"--target-epsilon {target:g} is unreachable with RDP accounting at --delta {delta:g}: "
            f"epsilon never goes below {floor:.4f} however much noise is added."
        )
    try:
        sigma = _solve_sigma(lambda s: epsilon_at(s, "rdp"), target=target, start=1.0, factor=2.0)
    except AccountingError:
        if accountant == "rdp":
            raise
        sigma = None
    if accountant == "rdp":
        return sigma
    start, factor = (1.0, 2.0) if sigma is None else (sigma, 1.1)  # PRV sits a little below RDP: start there
    return _solve_sigma(lambda s: epsilon_at(s, "prv"), target=target, start=start, factor=factor)


def _solve_sigma(epsilon_at: Callable[[float], float], *, target: float, start: float, factor: float) -> float:
    """Smallest evaluated sigma with eps(sigma) <= target, within ``_CALIBRATION_RTOL`` of a sigma above target.

    Grows a geometric bracket from ``start`` (the step factor squares after every
    miss), then runs Brent's method (``scipy.optimize.brentq``) on
    log eps(exp x) - log target, which needs far fewer evaluations than plain
    bisection; a final geometric bisection guarantees the bracket width even if
    eps is not exactly monotone (PRV's numerical error).
    """
    seen: dict[float, float] = {}

    def eps(sigma: float) -> float:
        if sigma not in seen:
            seen[sigma] = epsilon_at(sigma)
        return seen[sigma]

    hi = start
    if eps(hi) <= target:
        lo = hi / factor
        while eps(lo) <= target:
            hi = lo
            if hi <= _SIGMA_MIN:
                return hi
            factor *= factor
            lo = max(hi / factor, _SIGMA_MIN / 2)
    else:
        lo = hi
        while eps(hi) > target:
            if hi >= _SIGMA_MAX:
                raise AccountingError(
                    f"--target-epsilon {target:g} is unreachable: even --noise-multiplier {hi:g} gives "
                    f"epsilon {eps(hi):.4g}."
                )
            lo = hi
            hi = min(hi * factor, _SIGMA_MAX)
            factor *= factor

    def log_ratio(x: float) -> float:
        return math.log(min(max(eps(math.exp(x)), 1e-300), 1e300) / target)

    from scipy.optimize import brentq  # noqa: PLC0415 - 0.3 s to import, and only calibration needs it

    brentq(log_ratio, math.log(lo), math.log(hi), xtol=math.log1p(_CALIBRATION_RTOL) / 4, maxiter=200)
    hi = min(s for s, e in seen.items() if e <= target)
    lo = max(s for s, e in seen.items() if e > target and s < hi)
    while hi / lo - 1 > _CALIBRATION_RTOL:
        mid = math.sqrt(lo * hi)
        if eps(mid) <= target:
            hi = mid
        else:
            lo = mid
    return hi


class PrivacyLedger:
    """Per-client histories of SGM events, round by round; epsilon is the max over clients.

    Its ``unit`` says what a client's epsilon protects: one of the client's records (record-level DP-SGD: the
    client's queries at rate B / N_k in the rounds it took part in) or the client's data as a whole (client-level
    DP: every client is charged every round, one query at the server's sampling rate q).

    The run reports the worst-case client (the largest epsilon: often the smallest N_k,
    hence the largest q), so it never reports less than it spent. The per-round,
    per-client history is kept so that :meth:`to_dict`/:meth:`from_dict` round
    trips exactly and a resumed run continues the same accounting.

    Example:
        >>> ledger = PrivacyLedger(accountant="rdp", delta=1e-5, noise_multiplier=1.0, max_grad_norm=1.0)
        >>> eps = ledger.record_round({0: round_events(noise_multiplier=1.0, sample_rate=0.02, queries_per_round=50)})
    """

    def __init__(
        self,
        *,
        accountant: str,
        delta: float,
        noise_multiplier: float | None,
        max_grad_norm: float | None,
        unit: str = "record",
        max_update_norm: float | None = None,
    ) -> None:
        if unit not in UNITS:
            raise AccountingError(f"A ledger's unit is one of {', '.join(UNITS)}, got {unit!r}.")
        self.unit = unit  # what one client id's epsilon protects: one of its records, or the client as a whole
        self.max_update_norm = None if max_update_norm is None else _check_real("max_update_norm", max_update_norm)
        self.accountant = _check_accountant(accountant)
        self.delta = _check_delta(delta)
        self.noise_multiplier = None if noise_multiplier is None else _check_noise_multiplier(noise_multiplier)
        if max_grad_norm is not None:
            max_grad_norm = _check_real("max_grad_norm", max_grad_norm)
            if not 0.0 < max_grad_norm < math.inf:
                raise AccountingError(f"max_grad_norm must be positive and finite, got {max_grad_norm!r}.")
        self.max_grad_norm = max_grad_norm
        self._history: list[dict[int, tuple[SGMEvent, ...]]] = []
        self._composed: dict[int, list[SGMEvent]] = {}
        self._client_epsilon: dict[int, float] = {}
        self._epsilon_per_round: list[float] = []

    def record_round(self, events_by_client: Mapping[int, Sequence[SGMEvent]]) -> float:
        """Append one round (client id -> its SGM events) and return epsilon after it.

        Clients absent from the round add nothing. The ledger is unchanged if
        the input is invalid or the epsilon cannot be computed.
        """
        if not isinstance(events_by_client, Mapping):
            raise AccountingError(f"A round must map client ids to SGM events, got {type(events_by_client).__name__}.")
        round_: dict[int, tuple[SGMEvent, ...]] = {}
        for client, events in events_by_client.items():
            k = _check_int("client id", client, minimum=0)
            if isinstance(events, (str, bytes)) or not isinstance(events, Iterable):
                raise AccountingError(
                    f"Client {k}'s events must be a sequence of SGMEvent, got {type(events).__name__}."
                )
            round_[k] = tuple(compose(events))
        composed = {k: compose([*self._composed.get(k, []), *events]) for k, events in round_.items()}
        updated = {
            k: _epsilon_cached(_history_key(events), self.delta, self.accountant) for k, events in composed.items()
        }
        self._history.append(round_)
        self._composed.update(composed)
        self._client_epsilon.update(updated)
        epsilon = max(self._client_epsilon.values(), default=0.0)
        self._epsilon_per_round.append(epsilon)
        return epsilon

    @property
    def rounds(self) -> int:
        """Rounds recorded so far."""
        return len(self._history)

    def rounds_charged(self, client: int) -> int:
        """The rounds in which ``client`` was charged (the rounds it took part in)."""
        return sum(1 for round_ in self._history if client in round_)

    @property
    def epsilon_per_round(self) -> list[float]:
        """Epsilon (max over clients) after each recorded round."""
        return list(self._epsilon_per_round)

    @property
    def epsilon(self) -> float:
        """Epsilon spent so far: 0.0 before any DP step, ``inf`` if any step had noise multiplier 0."""
        return self._epsilon_per_round[-1] if self._epsilon_per_round else 0.0

    @property
    def worst_client(self) -> int | None:
        """The client with the largest epsilon (the smallest id on ties), or None before any client."""
        if not self._client_epsilon:
            return None
        return min(self._client_epsilon, key=lambda k: (-self._client_epsilon[k], k))

    def to_dict(self) -> dict[str, Any]:
        """privacy.json: metadata, the worst client's composed entries, epsilon per round, per client, history.

        ``history`` stores each distinct per-round event list once
        (``event_lists``) and each round as ``{client: index}``; it is what
        :meth:`from_dict` resumes from.
        """
        lists: list[tuple[SGMEvent, ...]] = []
        index: dict[tuple[SGMEvent, ...], int] = {}
        rounds: list[dict[str, int]] = []
        for round_ in self._history:
            row: dict[str, int] = {}
            for k, events in round_.items():
                if events not in index:
                    index[events] = len(lists)
                    lists.append(events)
                row[str(k)] = index[events]
            rounds.append(row)
        worst = self.worst_client
        return {
            "unit": self.unit,
            "accountant": self.accountant,
            "delta": self.delta,
            "noise_multiplier": self.noise_multiplier,
            "max_grad_norm": self.max_grad_norm,
            "max_update_norm": self.max_update_norm,
            "entries": [e.to_dict() for e in self._composed.get(worst, [])] if worst is not None else [],
            "epsilon_per_round": list(self._epsilon_per_round),
            "worst_client": worst,
            "per_client": {
                str(k): {"entries": [e.to_dict() for e in self._composed[k]], "epsilon": self._client_epsilon[k]}
                for k in sorted(self._composed)
            },
            "rounds": self.rounds,
            "history": {
                "event_lists": [[e.to_dict() for e in events] for events in lists],
                "rounds": rounds,
            },
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PrivacyLedger:
        """Rebuild a ledger written by :meth:`to_dict`, ready to record further rounds (resume).

        Stored epsilons are kept as written (no recomputation); the stored
        per-client entries must match the replayed history.
        """
        required = {
            "accountant",
            "delta",
            "noise_multiplier",
            "max_grad_norm",
            "epsilon_per_round",
            "per_client",
            "rounds",
            "history",
        }
        if not isinstance(d, Mapping) or not required <= set(d):
            missing = sorted(required - set(d)) if isinstance(d, Mapping) else sorted(required)
            raise AccountingError(f"The privacy ledger is missing {', '.join(missing)}; it cannot be resumed.")
        ledger = cls(
            accountant=d["accountant"],
            delta=d["delta"],
            noise_multiplier=d["noise_multiplier"],
            max_grad_norm=d["max_grad_norm"],
            unit=d.get("unit", "record"),  # ledgers written before client-level DP are record-level
            max_update_norm=d.get("max_update_norm"),
        )
        try:
            lists = [tuple(SGMEvent.from_dict(e) for e in events) for events in d["history"]["event_lists"]]
            for round_ in d["history"]["rounds"]:
                ledger._history.append(
                    {
                        _check_int("client id", int(k), minimum=0): lists[_check_int("event list index", i, minimum=0)]
                        for k, i in round_.items()
                    }
                )
            eps_rounds = [float(e) for e in d["epsilon_per_round"]]
            client_eps = {int(k): float(v["epsilon"]) for k, v in d["per_client"].items()}
            stored = {int(k): [SGMEvent.from_dict(e) for e in v["entries"]] for k, v in d["per_client"].items()}
        except AccountingError:
            raise
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise AccountingError(
                f"The privacy ledger's history is malformed ({exc!r}); it cannot be resumed."
            ) from exc
        for round_ in ledger._history:
            for k, events in round_.items():
                ledger._composed[k] = compose([*ledger._composed.get(k, []), *events])
        if not (d["rounds"] == len(ledger._history) == len(eps_rounds)):
            raise AccountingError(
                f"The privacy ledger says {d['rounds']} rounds but holds {len(ledger._history)} rounds of history "
                f"and {len(eps_rounds)} epsilons; it is inconsistent."
            )
        if stored != ledger._composed or set(client_eps) != set(ledger._composed):
            raise AccountingError(
                "The privacy ledger's per-client entries do not match its history; it is inconsistent."
            )
        ledger._client_epsilon = client_eps
        ledger._epsilon_per_round = eps_rounds
        return ledger

    def truncated(self, rounds: int) -> PrivacyLedger:
        """The ledger as it stood after its first ``rounds`` rounds, replayed from its history.

        A run's manifest.json is written last in a round, so an interruption just before it
        leaves privacy.json one round ahead of the manifest; resume re-runs that round and
        must not charge it twice. The replay recomputes the epsilons, so they are those the
        accountant gives now for exactly those rounds.
        """
        if rounds >= self.rounds:
            return self
        return self._replay(rounds)

    def replayed(self) -> PrivacyLedger:
        """The ledger recomputed from its own history: every epsilon as the accountant gives it now (the stored ones
        are kept as written by :meth:`from_dict`; an integrity check compares the two)."""
        return self._replay(self.rounds)

    def at_delta(self, delta: float) -> PrivacyLedger:
        """The same history accounted at another ``delta``: every epsilon as the accountant gives it there (a run
        with the noise in shares that gets more rounds leaves less of --delta to the accountant)."""
        return self if delta == self.delta else self._replay(self.rounds, delta)

    @property
    def client_epsilons(self) -> dict[int, float]:
        """Epsilon spent by each client charged so far."""
        return dict(self._client_epsilon)

    def _replay(self, rounds: int, delta: float | None = None) -> PrivacyLedger:
        replay = PrivacyLedger(
            accountant=self.accountant,
            delta=self.delta if delta is None else delta,
            noise_multiplier=self.noise_multiplier,
            max_grad_norm=self.max_grad_norm,
            unit=self.unit,
            max_update_norm=self.max_update_norm,
        )
        for round_ in self._history[: max(rounds, 0)]:
            replay.record_round(round_)
        return replay

    def __repr__(self) -> str:
        return (
            f"PrivacyLedger(accountant={self.accountant!r}, delta={self.delta!r}, rounds={self.rounds}, "
            f"epsilon={self.epsilon!r}, worst_client={self.worst_client!r})"
        )
