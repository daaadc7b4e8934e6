"""Accounting against independent references: Opacus' accountants, Google's dp-accounting, closed forms, quadrature."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import dp_accounting
import numpy as np
import pytest
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.analysis.rdp import get_privacy_spent
from scipy import integrate

from fedaudit.privacy.accounting import (
    _PRV_EPS_ERROR,  # PRV's stated epsilon error
    ACCOUNTANTS,
    RDP_ORDERS,
    AccountingError,
    PrivacyLedger,
    SGMEvent,
    calibrate_noise_multiplier,
    compose,
    compute_epsilon,
    compute_rdp,
    epsilon_per_round,
    round_events,
)

DELTA = 1e-5
ORDERS = np.asarray(RDP_ORDERS)
INTEGER = ORDERS == np.round(ORDERS)

# (sigma, q, T, M): one client making T queries in each of the M rounds it takes part in.
RUNS = [
    (1.0, 0.02, 50, 20),
    (0.8, 0.01, 100, 30),
    (2.0, 0.1, 5, 100),
    (1.1, 0.0256, 200, 15),
]


def _run_events(sigma: float, q: float, t: int, m: int) -> list[SGMEvent]:
    return compose(round_events(noise_multiplier=sigma, sample_rate=q, queries_per_round=t) * m)


def _dp_accounting(sigma: float, q: float, t: int, m: int, orders: np.ndarray) -> dp_accounting.rdp.RdpAccountant:
    """The same run written as dp-accounting events: M rounds of T queries at q, composed round by round."""
    accountant = dp_accounting.rdp.RdpAccountant(orders=list(orders))
    sgm = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    for _ in range(m):
        accountant.compose(dp_accounting.SelfComposedDpEvent(sgm, t))
    return accountant


def _quadrature_rdp(sigma: float, q: float, alpha: float) -> float:
    """RDP of one SGM step by numerical integration of E_{z~N(0,s^2)}[(mu(z)/mu0(z))^alpha] (Mironov et al. 2019)."""

    def integrand(z: float) -> float:
        log_ratio = np.logaddexp(math.log1p(-q), math.log(q) + (2 * z - 1) / (2 * sigma**2))
        return math.exp(alpha * log_ratio - z * z / (2 * sigma**2)) / (sigma * math.sqrt(2 * math.pi))

    value, _ = integrate.quad(integrand, -np.inf, np.inf, epsabs=0, epsrel=1e-13, limit=1000)
    return math.log(value) / (alpha - 1)


@pytest.mark.parametrize(
    ("sigma", "q", "steps"), [(1.0, 0.02, 1000), (0.6, 0.004, 5000), (4.0, 0.3, 40), (1.3, 1.0, 25), (2.5, 0.5, 1)]
)
def test_single_rate_matches_opacus_rdp_accountant(sigma: float, q: float, steps: int) -> None:
    opacus = RDPAccountant()
    for _ in range(min(steps, 50)):
        opacus.step(noise_multiplier=sigma, sample_rate=q)
    opacus.history = [(sigma, q, steps)]
    ours = compute_epsilon([SGMEvent(noise_multiplier=sigma, sample_rate=q, steps=steps)], delta=DELTA)
    assert ours == pytest.approx(opacus.get_epsilon(delta=DELTA), rel=1e-9)


def test_stepped_history_matches_opacus_rdp_accountant() -> None:
    opacus = RDPAccountant()
    events = []
    for _ in range(3):
        for sigma, q, steps in [(1.0, 0.01, 1), (1.0, 0.1, 9)]:
            events.append(SGMEvent(noise_multiplier=sigma, sample_rate=q, steps=steps))
            for _ in range(steps):
                opacus.step(noise_multiplier=sigma, sample_rate=q)
    assert compute_epsilon(events, delta=DELTA) == pytest.approx(opacus.get_epsilon(delta=DELTA), rel=1e-9)


def test_a_process_that_never_imported_opacus_gets_opacus_rdp_epsilon() -> None:
    """The RDP accountant loads Opacus' analysis from its file, without Opacus' package import (its privacy engine
    and torch.distributed); this test process imported Opacus, so the file-loaded path runs in a fresh one."""
    histories = [[(1.0, 0.02, 1000)], [(0.8, 0.01, 300), (2.0, 0.1, 40)]]
    script = (
        "import json, sys\n"
        "from fedaudit.privacy.accounting import SGMEvent, compute_epsilon\n"
        f"histories = {histories!r}\n"
        "eps = [compute_epsilon([SGMEvent(noise_multiplier=s, sample_rate=q, steps=n) for s, q, n in h], "
        f"delta={DELTA!r}) for h in histories]\n"
        "print(json.dumps({'eps': eps, 'opacus': sorted(m for m in sys.modules if m.split('.')[0] == 'opacus')}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    result = json.loads(done.stdout)
    assert result["opacus"] == []
    for history, eps in zip(histories, result["eps"]):
        opacus = RDPAccountant()
        opacus.history = list(history)
        assert eps == pytest.approx(opacus.get_epsilon(delta=DELTA), rel=1e-12)


def test_an_opacus_that_keeps_its_rdp_analysis_elsewhere_is_imported_as_a_package(monkeypatch, tmp_path) -> None:
    import types

    from fedaudit.privacy import accounting

    accounting._opacus_rdp.cache_clear()
    monkeypatch.delitem(sys.modules, "opacus.accountants.analysis.rdp")
    elsewhere = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(accounting.importlib.util, "find_spec", lambda name: elsewhere)
    try:
        assert accounting._opacus_rdp().__name__ == "opacus.accountants.analysis.rdp"
    finally:
        accounting._opacus_rdp.cache_clear()


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")  # Opacus' own PRV at q = 1
@pytest.mark.parametrize(("sigma", "q", "steps"), [(1.0, 0.02, 1000), (2.0, 0.1, 50), (1.0, 1.0, 10)])
def test_single_rate_matches_opacus_prv_accountant(sigma: float, q: float, steps: int) -> None:
    opacus = PRVAccountant()
    opacus.history = [(sigma, q, steps)]
    ours = compute_epsilon(
        [SGMEvent(noise_multiplier=sigma, sample_rate=q, steps=steps)], delta=DELTA, accountant="prv"
    )
    assert ours == pytest.approx(opacus.get_epsilon(delta=DELTA), rel=1e-9)


def test_prv_matches_opacus_on_a_heterogeneous_history() -> None:
    events = [
        SGMEvent(noise_multiplier=1.0, sample_rate=0.002, steps=10),
        SGMEvent(noise_multiplier=1.0, sample_rate=0.02, steps=490),
        SGMEvent(noise_multiplier=1.5, sample_rate=0.05, steps=30),
    ]
    opacus = PRVAccountant()
    opacus.history = [(e.noise_multiplier, e.sample_rate, e.steps) for e in events]
    assert compute_epsilon(events, delta=DELTA, accountant="prv") == pytest.approx(
        opacus.get_epsilon(delta=DELTA), rel=1e-9
    )


@pytest.mark.parametrize(("sigma", "q", "t", "m"), RUNS)
def test_rdp_curve_matches_dp_accounting(sigma: float, q: float, t: int, m: int) -> None:
    ours = compute_rdp(_run_events(sigma, q, t, m))
    theirs = _dp_accounting(sigma, q, t, m, ORDERS).rdp
    # Integer orders: both libraries evaluate the same finite binomial sum.
    np.testing.assert_allclose(ours[INTEGER], theirs[INTEGER], rtol=1e-9, atol=0)
    # Fractional orders: dp-accounting 0.6 sums |binom(alpha, i)| terms of Mironov et al.'s series, an upper
    # bound; Opacus keeps the signs and is exact (see the quadrature test), so ours may only be lower.
    assert np.all(ours[~INTEGER] <= theirs[~INTEGER] * (1 + 1e-12))


@pytest.mark.parametrize(("sigma", "q"), [(2.0, 0.1), (1.0, 0.02), (1.0, 0.5), (0.8, 0.005)])
def test_fractional_orders_match_numerical_integration(sigma: float, q: float) -> None:
    alphas = [1.1, 1.5, 2.7, 4.3, 7.9, 10.5]
    ours = compute_rdp([SGMEvent(noise_multiplier=sigma, sample_rate=q, steps=1)])
    for alpha in alphas:
        (index,) = np.flatnonzero(np.isclose(ORDERS, alpha))
        assert ours[index] == pytest.approx(_quadrature_rdp(sigma, q, alpha), rel=1e-6)


@pytest.mark.parametrize(("sigma", "q", "t", "m"), RUNS)
def test_epsilon_matches_dp_accounting(sigma: float, q: float, t: int, m: int) -> None:
    events = _run_events(sigma, q, t, m)
    # On integer orders the RDP curves agree and both libraries use Balle et al.'s conversion
    # eps = rdp + log1p(-1/a) - log(delta * a) / (a - 1), so epsilons must agree tightly.
    on_integers = _dp_accounting(sigma, q, t, m, ORDERS[INTEGER]).get_epsilon(DELTA)
    ours_on_integers, _ = get_privacy_spent(orders=ORDERS[INTEGER], rdp=compute_rdp(events)[INTEGER], delta=DELTA)
    assert ours_on_integers == pytest.approx(on_integers, rel=1e-9)
    # On all orders dp-accounting's fractional-order bound can only make its epsilon larger.
    on_all = _dp_accounting(sigma, q, t, m, ORDERS).get_epsilon(DELTA)
    ours = compute_epsilon(events, delta=DELTA)
    assert on_all * 0.99 <= ours <= on_all * (1 + 1e-12)


@pytest.mark.parametrize(("sigma", "steps"), [(0.7, 3), (1.0, 100), (5.0, 1000)])
def test_full_sampling_is_the_gaussian_closed_form(sigma: float, steps: int) -> None:
    events = [SGMEvent(noise_multiplier=sigma, sample_rate=1.0, steps=steps)]
    expected = ORDERS * steps / (2 * sigma**2)
    np.testing.assert_allclose(compute_rdp(events), expected, rtol=1e-15)
    closed = np.min(expected + np.log1p(-1 / ORDERS) - np.log(DELTA * ORDERS) / (ORDERS - 1))
    assert compute_epsilon(events, delta=DELTA) == pytest.approx(closed, rel=1e-12)


def test_round_events_charge_every_query_at_the_batch_rate() -> None:
    assert round_events(noise_multiplier=1.0, sample_rate=0.02, queries_per_round=50) == [
        SGMEvent(noise_multiplier=1.0, sample_rate=0.02, steps=50)
    ]
    assert round_events(noise_multiplier=1.0, sample_rate=0.02, queries_per_round=1) == [
        SGMEvent(noise_multiplier=1.0, sample_rate=0.02, steps=1)
    ]


def test_compose_merges_equal_mechanisms_in_first_seen_order() -> None:
    a = SGMEvent(noise_multiplier=1.0, sample_rate=0.1, steps=2)
    b = SGMEvent(noise_multiplier=1.0, sample_rate=0.2, steps=3)
    c = SGMEvent(noise_multiplier=2.0, sample_rate=0.1, steps=0)
    assert compose([b, a, c, b, a]) == [
        SGMEvent(noise_multiplier=1.0, sample_rate=0.2, steps=6),
        SGMEvent(noise_multiplier=1.0, sample_rate=0.1, steps=4),
    ]


def test_no_steps_is_zero_and_no_noise_is_infinite() -> None:
    assert compute_epsilon([], delta=DELTA) == 0.0
    no_noise = [
        SGMEvent(noise_multiplier=1.0, sample_rate=0.1, steps=5),
        SGMEvent(noise_multiplier=0.0, sample_rate=0.1, steps=1),
    ]
    for accountant in ACCOUNTANTS:
        assert compute_epsilon(no_noise, delta=DELTA, accountant=accountant) == math.inf


def test_epsilon_per_round_is_strictly_increasing_and_ends_at_the_composition() -> None:
    curve = epsilon_per_round(noise_multiplier=1.0, sample_rate=0.0256, queries_per_round=200, rounds=15)
    assert len(curve) == 15
    assert all(b > a for a, b in zip(curve, curve[1:]))
    assert curve[-1] == compute_epsilon(_run_events(1.0, 0.0256, 200, 15), delta=DELTA)
    prv = epsilon_per_round(noise_multiplier=1.0, sample_rate=0.05, queries_per_round=20, rounds=4, accountant="prv")
    assert all(b > a for a, b in zip(prv, prv[1:]))


def test_more_noise_and_fewer_rounds_give_less_epsilon() -> None:
    def final(sigma: float, rounds: int) -> float:
        return epsilon_per_round(noise_multiplier=sigma, sample_rate=0.02, queries_per_round=50, rounds=rounds)[-1]

    by_noise = [final(sigma, 20) for sigma in (0.7, 1.0, 1.5, 3.0)]
    assert all(b < a for a, b in zip(by_noise, by_noise[1:]))
    by_rounds = [final(1.0, m) for m in (20, 10, 2)]
    assert all(b < a for a, b in zip(by_rounds, by_rounds[1:]))


@pytest.mark.parametrize(
    ("sigma", "q", "t", "m", "accountant"),
    [
        (1.0, 0.0256, 200, 15, "rdp"),
        (0.7, 0.01, 100, 30, "rdp"),
        (3.0, 0.1, 10, 50, "rdp"),
        (1.0, 0.05, 20, 5, "prv"),
    ],
)
def test_calibration_round_trip(sigma: float, q: float, t: int, m: int, accountant: str) -> None:
    def eps(s: float) -> float:
        return compute_epsilon(_run_events(s, q, t, m), delta=DELTA, accountant=accountant)

    target = eps(sigma)
    calibrated = calibrate_noise_multiplier(
        target_epsilon=target, sample_rate=q, queries_per_round=t, rounds=m, accountant=accountant
    )
    assert calibrated == pytest.approx(sigma, rel=1e-2)
    assert eps(calibrated) <= target
    assert eps(calibrated * (1 - 2e-3)) > target


def test_unreachable_or_invalid_targets_raise() -> None:
    # With Opacus' orders (max 63) RDP epsilon never drops below ~0.103 at delta = 1e-5.
    with pytest.raises(AccountingError, match="unreachable"):
        calibrate_noise_multiplier(target_epsilon=0.1, sample_rate=0.01, queries_per_round=10, rounds=5)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(AccountingError):
            calibrate_noise_multiplier(target_epsilon=bad, sample_rate=0.01, queries_per_round=10, rounds=5)


def test_prv_calibration_reaches_below_the_rdp_floor() -> None:
    kwargs = {"sample_rate": 0.02, "queries_per_round": 10, "rounds": 5}
    sigma = calibrate_noise_multiplier(target_epsilon=0.05, accountant="prv", **kwargs)
    assert compute_epsilon(_run_events(sigma, 0.02, 10, 5), delta=DELTA, accountant="prv") <= 0.05


def test_prv_is_close_to_and_tighter_than_rdp() -> None:
    events = [SGMEvent(noise_multiplier=1.0, sample_rate=0.02, steps=1000)]
    rdp = compute_epsilon(events, delta=DELTA)
    prv = compute_epsilon(events, delta=DELTA, accountant="prv")
    assert 0.5 * rdp <= prv <= 1.05 * rdp


def test_prv_refuses_a_grid_that_would_exhaust_memory() -> None:
    with pytest.raises(AccountingError, match="accountant='rdp'"):
        compute_epsilon([SGMEvent(noise_multiplier=0.1, sample_rate=0.5, steps=1000)], delta=DELTA, accountant="prv")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"noise_multiplier": -1.0, "sample_rate": 0.1, "steps": 1},
        {"noise_multiplier": math.nan, "sample_rate": 0.1, "steps": 1},
        {"noise_multiplier": math.inf, "sample_rate": 0.1, "steps": 1},
        {"noise_multiplier": 1.0, "sample_rate": 0.0, "steps": 1},
        {"noise_multiplier": 1.0, "sample_rate": 1.5, "steps": 1},
        {"noise_multiplier": 1.0, "sample_rate": 0.1, "steps": -1},
        {"noise_multiplier": 1.0, "sample_rate": 0.1, "steps": 1.5},
        {"noise_multiplier": 1.0, "sample_rate": 0.1, "steps": True},
        {"noise_multiplier": "1", "sample_rate": 0.1, "steps": 1},
    ],
)
def test_bad_events_raise(kwargs: dict) -> None:
    with pytest.raises(AccountingError):
        SGMEvent(**kwargs)


def test_bad_arguments_raise() -> None:
    event = SGMEvent(noise_multiplier=1.0, sample_rate=0.1, steps=1)
    for delta in (0.0, 1.0, -1e-5, math.nan):
        with pytest.raises(AccountingError, match="delta"):
            compute_epsilon([event], delta=delta)
    with pytest.raises(AccountingError, match="accountant"):
        compute_epsilon([event], delta=DELTA, accountant="gdp")
    with pytest.raises(AccountingError):
        compute_epsilon([(1.0, 0.1, 1)], delta=DELTA)  # type: ignore[list-item]
    with pytest.raises(AccountingError, match="sample_rate"):
        round_events(noise_multiplier=1.0, sample_rate=0.0, queries_per_round=5)
    with pytest.raises(AccountingError, match="queries_per_round"):
        round_events(noise_multiplier=1.0, sample_rate=0.1, queries_per_round=0)
    with pytest.raises(AccountingError, match="rounds"):
        epsilon_per_round(noise_multiplier=1.0, sample_rate=0.1, queries_per_round=5, rounds=0)


def test_event_dict_round_trip() -> None:
    event = SGMEvent(noise_multiplier=np.float64(1.1), sample_rate=0.0256, steps=np.int64(7))
    assert event.to_dict() == {"noise_multiplier": 1.1, "sample_rate": 0.0256, "steps": 7}
    assert SGMEvent.from_dict(json.loads(json.dumps(event.to_dict()))) == event
    with pytest.raises(AccountingError):
        SGMEvent.from_dict({"noise_multiplier": 1.0, "sample_rate": 0.1})


def _new_ledger(accountant: str = "rdp") -> PrivacyLedger:
    return PrivacyLedger(accountant=accountant, delta=DELTA, noise_multiplier=1.0, max_grad_norm=1.0)


def _fed_round(sizes: dict[int, int], *, batch: int = 32, t: int = 20) -> dict[int, list[SGMEvent]]:
    return {k: round_events(noise_multiplier=1.0, sample_rate=batch / n, queries_per_round=t) for k, n in sizes.items()}


def test_ledger_reports_the_worst_client() -> None:
    sizes = {0: 2000, 1: 640, 2: 1500}
    ledger = _new_ledger()
    for _ in range(5):
        ledger.record_round(_fed_round(sizes))
    small = epsilon_per_round(noise_multiplier=1.0, sample_rate=32 / 640, queries_per_round=20, rounds=5)
    assert ledger.worst_client == 1
    assert ledger.epsilon_per_round == pytest.approx(small, rel=1e-12)
    assert ledger.epsilon == ledger.epsilon_per_round[-1]
    assert ledger.rounds == 5
    summary = ledger.to_dict()
    assert summary["worst_client"] == 1
    assert summary["entries"] == [e.to_dict() for e in _run_events(1.0, 32 / 640, 20, 5)]
    assert summary["per_client"]["0"]["epsilon"] < summary["per_client"]["1"]["epsilon"]


def test_ledger_clients_missing_from_a_round_add_nothing() -> None:
    ledger = _new_ledger()
    assert ledger.epsilon == 0.0 and ledger.worst_client is None
    first = ledger.record_round(_fed_round({0: 640, 1: 2000}))
    assert ledger.record_round(_fed_round({1: 2000})) == first
    assert ledger.record_round({}) == first
    assert ledger.record_round(_fed_round({0: 640})) > first
    assert ledger.to_dict()["per_client"]["0"]["entries"] == [e.to_dict() for e in _run_events(1.0, 32 / 640, 20, 2)]


@pytest.mark.parametrize("accountant", ACCOUNTANTS)
def test_ledger_resumes_exactly_from_its_dict(accountant: str) -> None:
    rounds = [
        _fed_round({0: 640, 1: 2000}, t=5),
        _fed_round({1: 2000}, t=5),
        _fed_round({0: 640, 2: 300}, t=5),
        _fed_round({0: 640, 1: 2000, 2: 300}, t=5),
    ]
    uninterrupted = _new_ledger(accountant)
    for events in rounds:
        uninterrupted.record_round(events)
    interrupted = _new_ledger(accountant)
    for events in rounds[:2]:
        interrupted.record_round(events)
    stored = json.loads(json.dumps(interrupted.to_dict()))
    resumed = PrivacyLedger.from_dict(stored)
    assert resumed.to_dict() == stored
    for events in rounds[2:]:
        resumed.record_round(events)
    assert resumed.epsilon_per_round == uninterrupted.epsilon_per_round
    assert resumed.to_dict() == uninterrupted.to_dict()


def test_ledger_rejects_bad_input_and_stays_unchanged() -> None:
    for kwargs in ({"accountant": "moments"}, {"delta": 1.0}, {"noise_multiplier": -1.0}, {"max_grad_norm": 0.0}):
        with pytest.raises(AccountingError):
            PrivacyLedger(
                **{"accountant": "rdp", "delta": DELTA, "noise_multiplier": 1.0, "max_grad_norm": 1.0, **kwargs}
            )
    ledger = _new_ledger()
    ledger.record_round(_fed_round({0: 640}))
    before = ledger.to_dict()
    event = SGMEvent(noise_multiplier=1.0, sample_rate=0.1, steps=1)
    for bad in ([event], {-1: [event]}, {"0": [event]}, {0: [(1.0, 0.1, 1)]}, {0: event}, {0: [event], 1: [None]}):
        with pytest.raises(AccountingError):
            ledger.record_round(bad)  # type: ignore[arg-type]
    assert ledger.to_dict() == before


def test_ledger_rejects_malformed_or_inconsistent_dicts() -> None:
    ledger = _new_ledger()
    ledger.record_round(_fed_round({0: 640, 1: 2000}))
    good = ledger.to_dict()
    missing = {k: v for k, v in good.items() if k != "history"}
    wrong_rounds = {**good, "rounds": 2}
    tampered = json.loads(json.dumps(good))
    tampered["per_client"]["0"]["entries"][0]["steps"] = 0
    bad_index = json.loads(json.dumps(good))
    bad_index["history"]["rounds"][0]["0"] = 7
    for bad in (missing, wrong_rounds, tampered, bad_index, "privacy.json"):
        with pytest.raises(AccountingError):
            PrivacyLedger.from_dict(bad)  # type: ignore[arg-type]


def test_rdp_orders_are_opacus_default_alphas_and_importing_the_ledger_does_not_load_opacus() -> None:
    """The orders are written out so that SGMEvent (every ClientApp process imports it) does not load Opacus."""
    import subprocess
    import sys

    from opacus.accountants import RDPAccountant

    from fedaudit.privacy.accounting import RDP_ORDERS

    assert list(RDP_ORDERS) == [float(a) for a in RDPAccountant.DEFAULT_ALPHAS]
    probe = "import sys, fedaudit.privacy.accounting, fedaudit.engine.simulation; print('opacus' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "False"


@pytest.mark.parametrize("q", [1e-5, 1e-3, 0.01, 0.0256, 0.1, 0.3, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("sigma", [0.3, 0.7, 1.0, 1.5, 3.0, 10.0, 100.0])
def test_one_step_rdp_is_opacus_series_at_every_order(q: float, sigma: float) -> None:
    """fedaudit sums the fractional orders' series with numpy (Opacus' loop, a term per Python step, was 0.8 s per
    sigma and q): every order against Opacus' own compute_rdp, to 1e-9 relative (the last digits of log A_alpha,
    divided by alpha - 1 = 0.1 at the lowest order) or, for RDP values so small that
    both are float rounding of the same series (A_alpha within 1e-6 of 1), 1e-11 absolute; the integer orders are
    Opacus' function itself."""
    from opacus.accountants.analysis.rdp import compute_rdp as opacus_rdp

    from fedaudit.privacy.accounting import _rdp_one_step

    ours = _rdp_one_step(sigma, q)
    theirs = np.asarray(opacus_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(RDP_ORDERS)))
    assert np.all(np.abs(ours - theirs) <= 1e-9 * np.abs(theirs) + 1e-11), np.max(np.abs(ours - theirs) / theirs)
    assert np.array_equal(ours[INTEGER], theirs[INTEGER])
    for steps in (1, 1000, 100_000):  # what a ledger states: the epsilon of many steps
        ours_eps, _ = get_privacy_spent(orders=list(RDP_ORDERS), rdp=ours * steps, delta=DELTA)
        theirs_eps, _ = get_privacy_spent(orders=list(RDP_ORDERS), rdp=theirs * steps, delta=DELTA)
        assert ours_eps == pytest.approx(theirs_eps, rel=1e-9)


@pytest.mark.parametrize("sigma, delta", [(1.0, 0.5), (20.0, 0.01), (5.0, 0.1), (1.0, 0.999999)])
@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_epsilon_is_never_below_zero_at_a_large_delta(sigma: float, delta: float, accountant: str) -> None:
    """The (epsilon, delta) conversion goes below 0 where delta is large (a run printed epsilon -0.499 at delta 0.5,
    and a policy passed it); every mechanism is (0, delta)-DP there, as dp-accounting says. PRV's own search finds no
    epsilon near delta 1 (it raised a RuntimeError)."""
    event = SGMEvent(noise_multiplier=sigma, sample_rate=0.1, steps=10)
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(sigma)), 10)
    assert rdp.get_epsilon(delta) == 0.0  # the independent library's answer
    epsilon = compute_epsilon([event], delta=delta, accountant=accountant)
    if accountant == "rdp":
        assert epsilon == 0.0
    else:  # PRV's answer is an upper bound within its own error
        assert 0.0 <= epsilon <= _PRV_EPS_ERROR
