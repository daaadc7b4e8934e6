"""Conformance of a canary run's DP queries: is what was released the mechanism that the ledger charged for?

A canary run records every DP query of every client (fedaudit.instruments.queries): its batch, sigma, C, B and q, and a
few whole queries (the point, the batch, the gradient canaries drawn and the released noisy sum S + N). :func:`verify`
tests the run against the Sampled Gaussian Mechanism the privacy ledger charged for, with code that shares nothing with
the code it checks (no import of ``fedaudit.privacy``; its own per-example loop; Google's dp-accounting):

- **log**: the logs are complete and consistent (one entry per query in every array, finite values, kept queries
  that fit the model and their metadata). Exact.
- **noise**: for every kept query the clean clipped sum is recomputed one example at a time, and the residual
  r = released - clean must be N(0, (sigma C)^2 I): mean, variance (chi-square), shape (Kolmogorov-Smirnov) and
  independence between queries (a noise draw reused across steps correlates their residuals).
- **clipping**: the residual has no component along the clipped-away part of the gradient (the sum of unclipped
  per-example gradients minus the clipped ones); a query that does not clip is shifted by its norm.
- **sampling**: the records (and canaries) drawn per query are Binomial(N, q) at the rate the ledger charges that
  query (its round's events, in order), from the records it samples (N_k, computed here from the run; for Fedssyn
  floor(rho N_k) in the generation round and N_k + n~ after it), in mean and dispersion (a fixed batch size has
  almost none); the recorded rate is that rate; and each round's participants are ceil(p K) clients chosen
  uniformly.
- **secrecy**: the noise and the sample of every kept query are tested against every stream the run's public
  material can produce, and, where the clients' secrets are at hand, traced to them
  (:mod:`fedaudit.attacks.conformance.secrecy`).
- **ledger**: what each client's recorded queries spend, with no amplification by client sampling (the server sees
  who took part), must not exceed what the ledger says: exact RDP at dp-accounting's orders for an RDP ledger, and
  dp-accounting's PLD (optimistic, a lower bound) for any ledger (see :class:`Spend`). Every round's recorded
  queries must also be covered by that round's charge (steps, sigma, q), and the ledger must agree with itself and
  with the run. Exact.

Each check has a p-value (exact checks: 0 or 1) and the family-wise level is split over the checks (Bonferroni), and
over the sub-tests within a check, so that a correct run is flagged with probability at most ``level``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any

import dp_accounting
import numpy as np
import torch
import torch.nn.functional as F
from dp_accounting.pld import privacy_loss_distribution
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import special, stats
from torch import nn
from torch.func import functional_call

from fedaudit.attacks import AttackError
from fedaudit.attacks.conformance.secrecy import KeptQuery, PublicMaterial, secrecy
from fedaudit.instruments.canaries import GRADIENT_CANARY_NORM, LAYOUTS, canary_directions
from fedaudit.models import build_model
from fedaudit.registry import ALGORITHMS
from fedaudit.rundir import RunDirectory, RunError

CHECKS = ("log", "noise", "clipping", "sampling", "secrecy", "ledger")
PLD_INTERVAL = 1e-3  # dp-accounting's PLD discretisation: about 0.1 s a client
LEDGER_RTOL = 1e-3  # a ledger may be this much (relative) below the recorded spend: different code, same arithmetic
MAX_GRID = 2_000_000  # points of the numerical integral of a fractional-order RDP (reached only for sigma < 0.01)
RATE_RTOL = 1e-9  # the recorded sampling rate must be the charged one to this relative error
NORMALITY_SAMPLE = 100_000  # residual coordinates the normality test looks at (drawn with the seed)
ZERO_NOISE_TOLERANCE = 1e-4  # with sigma C = 0, |released - clean| per unit of C and per example (float32 sums)
SPAN_LIMIT = 512  # examples of a kept query whose gradients span the subspace the clipping check projects on
_META = ("records", "canaries", "noise_multiplier", "max_grad_norm", "batch", "rate")
_KEPT = ("step", "params", "released", "x", "y", "canaries")  # and "index", which runs before client secrets lack
_KEPT_KEY = re.compile(r"^kept(\d+)/(.+)$")
_NO_LOG = "was trained without the query log; train with --dp --canaries N"


@dataclass(frozen=True)
class Check:
    """One conformance check: a statistical test (or an exact one: p-value 0 or 1) and what it found."""

    name: str
    passed: bool
    p_value: float | None  # None: nothing to test (no kept query)
    n: int  # what was tested: kept queries, queries, clients or logs
    statistic: float | None
    sentence: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Verification:
    """Every check of a run, at family-wise ``level`` split evenly over the checks (``per_check_level`` each)."""

    checks: list[Check]
    level: float
    per_check_level: float

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def check(self, name: str) -> Check:
        """The check called ``name`` (a :class:`KeyError` if there is none)."""
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "level": self.level,
            "per_check_level": self.per_check_level,
            "checks": [check.to_dict() for check in self.checks],
        }


@dataclass(frozen=True)
class Spend:
    """What a composition of Poisson-subsampled Gaussian queries spends at one delta (add/remove neighbours).

    ``rdp`` is exact RDP at dp-accounting's default orders (a superset of any usual accountant's), converted to
    epsilon as dp-accounting converts it: its A_alpha comes from the binomial expansion at integer orders and from
    a numerical integral at fractional ones, because dp-accounting 0.6's series at fractional orders over-estimates
    A_alpha (it sums the terms' absolute values, and gives up on some orders at large q), so that its epsilon,
    ``rdp_dp_accounting``, can exceed an exact accountant's by a few per cent.
    """

    rdp: float  # exact RDP at dp-accounting's orders: what an RDP ledger must not be below
    rdp_dp_accounting: float  # dp-accounting's RdpAccountant: an upper bound, conservative at fractional orders
    pld: float  # dp-accounting's PLDAccountant (pessimistic discretisation): an upper bound
    pld_lower: float  # dp-accounting's PLD, optimistic discretisation: a lower bound, by up to PLD_INTERVAL a query


def recorded_spend(queries: Mapping[tuple[float, float], int], delta: float) -> Spend:
    """The epsilon at ``delta`` of ``count`` queries at each (noise multiplier, sampling rate), composed with no
    amplification beyond each query's own Poisson sampling. A noise multiplier of 0 spends an infinite epsilon."""
    groups = _groups(queries)
    rdp_dp_accounting, pld = _dp_accounting_spend(groups, delta)
    return Spend(
        rdp=_rdp_spend(groups, delta),
        rdp_dp_accounting=rdp_dp_accounting,
        pld=pld,
        pld_lower=_pld_lower_spend(groups, delta),
    )


def recorded_rdp(queries: Mapping[tuple[float, float], int], delta: float) -> float:
    """:attr:`Spend.rdp` alone (a fraction of a second), for the ledger check of every client."""
    return _rdp_spend(_groups(queries), delta)


def recorded_pld_lower(queries: Mapping[tuple[float, float], int], delta: float) -> float:
    """:attr:`Spend.pld_lower` alone, for the ledger check of every client of a PLD ledger."""
    return _pld_lower_spend(_groups(queries), delta)


def _groups(queries: Mapping[tuple[float, float], int]) -> tuple[tuple[float, float, int], ...]:
    return tuple(sorted((float(s), float(q), int(n)) for (s, q), n in queries.items() if n > 0))


def _degenerate(groups: tuple[tuple[float, float, int], ...]) -> float | None:
    """The spend of no query (0) or of one without noise (infinite); None otherwise."""
    if not groups:
        return 0.0
    return math.inf if any(sigma == 0 for sigma, _, _ in groups) else None


@lru_cache(maxsize=256)
def _rdp_spend(groups: tuple[tuple[float, float, int], ...], delta: float) -> float:
    known = _degenerate(groups)
    return known if known is not None else _exact_rdp_epsilon(groups, delta)


@lru_cache(maxsize=256)
def _dp_accounting_spend(groups: tuple[tuple[float, float, int], ...], delta: float) -> tuple[float, float]:
    """dp-accounting's RdpAccountant and pessimistic PLDAccountant epsilons (about 3 s for a client's queries)."""
    known = _degenerate(groups)
    if known is not None:
        return known, known
    event = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), n
            )
            for sigma, q, n in groups
        ]
    )
    with _quiet_absl():
        rdp = dp_accounting.rdp.RdpAccountant()
        rdp.compose(event)
        pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=PLD_INTERVAL)
        pld.compose(event)
        return float(rdp.get_epsilon(delta)), float(pld.get_epsilon(delta))


@lru_cache(maxsize=256)
def _pld_lower_spend(groups: tuple[tuple[float, float, int], ...], delta: float) -> float:
    """dp-accounting's PLD with the optimistic discretisation: a lower bound on the spend."""
    known = _degenerate(groups)
    if known is not None:
        return known
    with _quiet_absl():
        lower = None
        for sigma, q, n in groups:
            one = privacy_loss_distribution.from_gaussian_mechanism(
                standard_deviation=sigma,
                sampling_prob=q,
                pessimistic_estimate=False,
                value_discretization_interval=PLD_INTERVAL,
                use_connect_dots=False,  # connect-the-dots is pessimistic only
            ).self_compose(n)
            lower = one if lower is None else lower.compose(one)
        return float(lower.get_epsilon_for_delta(delta))


def _exact_rdp_epsilon(groups: tuple[tuple[float, float, int], ...], delta: float) -> float:
    """Epsilon at ``delta`` from the exact RDP of the composition at dp-accounting's default orders, converted with
    Balle et al. 2020 (Proposition 12) as dp-accounting does (an order whose RDP is below the KL bound gives 0)."""
    orders = np.asarray(rdp_privacy_accountant.DEFAULT_RDP_ORDERS, dtype=float)
    rdp = np.zeros(len(orders))
    integer = orders == np.round(orders)
    for sigma, q, n in groups:
        if q >= 1:  # the Gaussian mechanism: A_alpha = exp(alpha (alpha - 1) / (2 sigma^2))
            log_a = orders * (orders - 1) / (2 * sigma**2)
        else:
            log_a = np.empty(len(orders))
            log_a[integer] = [_log_a_integer(q, sigma, int(a)) for a in orders[integer]]
            log_a[~integer] = _log_a_integral(q, sigma, orders[~integer])
        rdp += n * log_a / (orders - 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        epsilon = rdp + np.log1p(-1 / orders) - np.log(delta * orders) / (orders - 1)
    epsilon = np.where(delta**2 + np.expm1(-rdp) > 0, 0.0, epsilon)
    epsilon = np.where(orders > 1.01, epsilon, np.inf)
    return max(0.0, float(np.min(epsilon)))


def _log_a_integer(q: float, sigma: float, alpha: int) -> float:
    """log A_alpha, A_alpha = E_{z ~ N(0, sigma^2)}[((1 - q) + q exp((2z - 1) / (2 sigma^2)))^alpha], for an integer
    alpha and q < 1: the binomial expansion sum_i C(alpha, i) q^i (1 - q)^(alpha - i) exp((i^2 - i) / (2 sigma^2))."""
    i = np.arange(alpha + 1, dtype=float)
    terms = (
        special.gammaln(alpha + 1)
        - special.gammaln(i + 1)
        - special.gammaln(alpha - i + 1)
        + i * math.log(q)
        + (alpha - i) * math.log1p(-q)
        + (i * i - i) / (2 * sigma**2)
    )
    return float(special.logsumexp(terms))


def _log_a_integral(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """log A_alpha for fractional alphas and q < 1 by the trapezoid rule, in logs. The integrand is analytic in a
    strip of half-width pi sigma^2 around the real line and decays like a Gaussian centred at 0 or alpha, so a step
    of min(sigma / 20, sigma^2 / 4) over [-12 sigma, alpha + 12 sigma] is exact to double precision (tested against
    Opacus' series to 1e-8 relative); the grid stops at MAX_GRID points."""
    low, high = -12 * sigma, float(alphas.max()) + 12 * sigma
    step = max(min(sigma / 20, sigma**2 / 4), (high - low) / MAX_GRID)
    z = np.arange(low, high + step, step)
    mixture = np.logaddexp(math.log1p(-q), math.log(q) + (2 * z - 1) / (2 * sigma**2))
    base = -(z**2) / (2 * sigma**2) - math.log(sigma * math.sqrt(2 * math.pi)) + math.log(step)
    return np.array([float(special.logsumexp(base + alpha * mixture)) for alpha in alphas])


@contextlib.contextmanager
def _quiet_absl() -> Iterator[None]:
    """dp-accounting warns through absl for every order it drops; the result says what matters. absl's first
    warning would also give the root logger a handler (``logging.basicConfig``), and a notebook's own later
    ``logging.basicConfig(...)`` would then do nothing: the root logger is put back as it was."""
    logger = logging.getLogger("absl")
    level, handlers, root_level = logger.level, list(logging.root.handlers), logging.root.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
        logging.root.handlers[:] = handlers
        logging.root.setLevel(root_level)


# --- reading the run -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Run:
    """What the checks need to know about the run besides its logs and ledger."""

    seed: int
    model: nn.Module  # float64, for the reference loop
    shapes: dict[str, torch.Size]
    dimension: int
    input_shape: tuple[int, ...]
    num_classes: int
    sizes: tuple[int, ...]  # N_k, the clients' own records
    held: np.ndarray  # canaries in each client's data
    canary_client: np.ndarray
    canary_included: np.ndarray
    kind: str
    layout: str  # where gradient canaries' directions lie (fedaudit.instruments.canaries.LAYOUTS)
    rounds: int
    selected: int  # ceil(p K): clients per round
    fraction: float  # ceil(p K) / K
    fedssyn: tuple[float, int] | None = None  # Fedssyn's rho and n~: its queries sample other populations
    records_at_sites: bool = False  # --dataset sites: no whole query is kept (it would hold a site's records)
    setup_rounds: int = 0  # leading rounds every client takes part in (Fedssyn's generation round)
    public: PublicMaterial | None = None  # what anyone holding the run knows of its randomness

    def populations(self, round_number: int, client: int, events: int) -> list[int]:
        """The number of records each of a round's ``events`` samples from: the client's own N_k; for Fedssyn the
        floor(rho N_k) records its generator is given in round 1 (class counts and generator steps alike), and its
        records plus its dealt share after that."""
        own = self.sizes[client]
        if self.fedssyn is None:
            return [own] * events
        rho, dealt = self.fedssyn
        return [max(1, int(rho * own)) if round_number == 1 else own + dealt] * events


@dataclass(frozen=True)
class _Kept:
    """One whole kept query."""

    round: int
    client: int
    step: int
    params: torch.Tensor
    released: torch.Tensor
    x: torch.Tensor
    y: torch.Tensor
    canaries: np.ndarray
    sigma: float
    clip: float
    rate: float = 1.0
    index: np.ndarray | None = None  # the positions of the records it drew (None: a run that did not keep them)
    device: str | None = None  # where its noise was drawn, "cpu" or "cuda" (None: a run that did not say)
    threads: int | None = None  # on a GPU, the most threads its generators spread a draw over (None: not said)

    @property
    def label(self) -> str:
        return f"round {self.round}, client {self.client}, step {self.step}"


@dataclass(frozen=True)
class _Log:
    """One client's log of one round (only logs whose metadata are consistent)."""

    round: int
    client: int
    meta: dict[str, np.ndarray]
    kept: list[_Kept]

    @property
    def queries(self) -> int:
        return len(self.meta["rate"])


@dataclass(frozen=True)
class _Logs:
    logs: list[_Log]
    participants: dict[int, list[int]]  # round -> clients with a log
    problems: list[str]
    kept_seen: int  # kept queries found, well-formed or not


@dataclass(frozen=True)
class _Ledger:
    accountant: str
    delta: float
    epsilon_per_round: list[float]
    per_client: dict[int, tuple[float, list[tuple[float, float, int]]]]  # epsilon, entries (sigma, q, steps)
    rounds: list[dict[int, list[tuple[float, float, int]]]]


def _read_run(run: RunDirectory) -> tuple[_Run, _Ledger]:
    """The run's facts and ledger; a run without DP, canaries or its query log is an :class:`AttackError`."""
    try:
        manifest = run.read_manifest()
        privacy = run.read_privacy()
        if (
            not manifest.dp
            or privacy is None
            or not isinstance(privacy, dict)
            or privacy.get("noise_multiplier") is None
        ):
            raise AttackError(f"{run.path} was trained without DP, so it has no DP query to verify.")
        config = run.read_run_config()
        arrays = run.read_canaries()
    except RunError as exc:
        raise AttackError(str(exc)) from exc
    if not run.queries_dir.is_dir() or arrays is None:
        raise AttackError(f"{run.path} {_NO_LOG}.")
    if manifest.rounds_done < 1:
        raise AttackError(f"{run.path} has no completed round to verify.")
    for number in range(1, manifest.rounds_done + 1):
        if not run.queries.path(number).is_file():
            raise AttackError(f"{run.path} {_NO_LOG} (round {number} has none).")
    try:
        kind = str(arrays["kind"])
        client = np.asarray(arrays["client"], dtype=np.int64)
        included = np.asarray(arrays["included"], dtype=np.int64)
        layout = str(arrays["layout"]) if "layout" in arrays else "model"
    except (KeyError, ValueError, TypeError) as exc:
        raise AttackError(f"{run.canaries_path} is not a canary file this fedaudit reads.") from exc
    if layout not in LAYOUTS:
        raise AttackError(f"{run.canaries_path} lays its canaries out as {layout!r}, which this fedaudit cannot read.")
    if client.shape != included.shape or client.ndim != 1:
        raise AttackError(f"{run.canaries_path} holds arrays of different lengths.")
    spec = manifest.model.spec
    model = build_model(spec).to(torch.float64)
    shapes = {name: p.shape for name, p in model.named_parameters() if p.requires_grad}
    sizes = tuple(manifest.clients.num_examples)
    num_clients = len(sizes)
    selected = max(1, math.ceil(round(config.federated.client_fraction * num_clients, 9)))
    selected = min(selected, num_clients)
    held = np.array([int(((client == k) & (included == 1)).sum()) for k in range(num_clients)], dtype=np.int64)
    fs = config.fedssyn
    fedssyn = None
    generation_rounds = ALGORITHMS[config.federated.algorithm].generation_rounds
    if generation_rounds:  # Fedssyn: its generation round samples rho N_k records, later rounds N_k plus its share
        if fs.synthetic_per_client is None:
            raise AttackError(f"{run.config_path} does not say how many records Fedssyn dealt each client.")
        fedssyn = (float(fs.generator_fraction), int(fs.synthetic_per_client))
    facts = _Run(
        seed=int(config.seed),
        model=model,
        shapes=shapes,
        dimension=sum(int(s.numel()) for s in shapes.values()),
        input_shape=tuple(spec.input_shape),
        num_classes=int(spec.num_classes),
        sizes=sizes,
        held=held,
        canary_client=client,
        canary_included=included,
        kind=kind,
        layout=layout,
        rounds=manifest.rounds_done,
        selected=selected,
        fraction=selected / num_clients,
        fedssyn=fedssyn,
        setup_rounds=generation_rounds,
        records_at_sites=str(config.data.dataset).strip().lower() == "sites",
        public=PublicMaterial(
            seeds=tuple(dict.fromkeys(s for s in (config.seed, config.privacy.noise_seed) if s is not None)),
            run_id=None if manifest.randomness is None else manifest.randomness.run_id,
            source=manifest.randomness_source,
            shapes=shapes,
            secure=bool(config.privacy.secure_noise),
            noise_seed=config.privacy.noise_seed,
            secrets=run.secrets_path,
            device="cuda" if manifest.device.startswith("cuda") else "cpu",
        ),
    )
    return facts, _read_ledger(privacy, str(run.privacy_path))


def _read_ledger(privacy: dict[str, Any], where: str) -> _Ledger:
    """privacy.json's numbers; a ledger whose structure is broken is an :class:`AttackError` naming the problem."""

    def entry(e: Any) -> tuple[float, float, int]:
        return float(e["noise_multiplier"]), float(e["sample_rate"]), int(e["steps"])

    def index(i: Any) -> int:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(f"event list index {i!r}")
        return i

    try:
        lists = [[entry(e) for e in events] for events in privacy["history"]["event_lists"]]
        ledger = _Ledger(
            accountant=str(privacy["accountant"]),
            delta=float(privacy["delta"]),
            epsilon_per_round=[float(e) for e in privacy["epsilon_per_round"]],
            per_client={
                int(k): (float(v["epsilon"]), [entry(e) for e in v["entries"]])
                for k, v in privacy["per_client"].items()
            },
            rounds=[{int(k): lists[index(i)] for k, i in row.items()} for row in privacy["history"]["rounds"]],
        )
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise AttackError(
            f"{where} is malformed ({type(exc).__name__}: {exc}), so the ledger cannot be verified."
        ) from exc
    if not 0 < ledger.delta < 1:
        raise AttackError(f"{where} has delta {ledger.delta!r}, which is not in (0, 1).")
    return ledger


def _read_logs(run: RunDirectory, facts: _Run) -> _Logs:
    """Every round's logs, checked entry by entry: a malformed log is left out and named as a problem."""
    logs: list[_Log] = []
    participants: dict[int, list[int]] = {}
    problems: list[str] = []
    kept_seen = 0
    for number in range(1, facts.rounds + 1):
        try:
            by_client = run.queries.load(number)
        except RunError as exc:
            raise AttackError(str(exc)) from exc
        participants[number] = sorted(by_client)
        for client, tensors in sorted(by_client.items()):
            where = f"client {client}'s log of round {number}"
            if client >= len(facts.sizes):
                problems.append(f"round {number} holds a log of client {client}, which the run does not have")
                continue
            meta, problem = _meta(tensors, where)
            if problem:
                problems.append(problem)
                continue
            kept: list[_Kept] = []
            indices: set[int] = set()
            for name in tensors:
                match = _KEPT_KEY.match(name)
                if name.startswith("kept") and match is None:
                    problems.append(f"{where} holds an entry {name!r} that is not a kept query")
                elif match is not None:
                    indices.add(int(match.group(1)))
            kept_seen += len(indices)
            for j in sorted(indices):
                query, problem = _kept(tensors, j, meta, facts, number, client, where)
                if problem:
                    problems.append(problem)
                else:
                    kept.append(query)
            logs.append(_Log(round=number, client=client, meta=meta, kept=kept))
    return _Logs(logs=logs, participants=participants, problems=problems, kept_seen=kept_seen)


def _meta(tensors: Mapping[str, torch.Tensor], where: str) -> tuple[dict[str, np.ndarray], str | None]:
    """The per-query arrays of one log, or the first inconsistency found in them."""
    meta: dict[str, np.ndarray] = {}
    for key in (*_META, "projected"):
        if key not in tensors:
            if key == "projected":  # logs of earlier versions projected every query
                continue
            return meta, f"{where} has no {key!r} array"
        tensor = tensors[key]
        if tensor.dim() != 1 or tensor.is_complex():
            return meta, f"{where} has a {key!r} entry of shape {tuple(tensor.shape)}, not one value per query"
        meta[key] = tensor.to(torch.float64).numpy()
    lengths = {key: len(values) for key, values in meta.items()}
    if len(set(lengths.values())) > 1:
        listed = ", ".join(f"{key} {n}" for key, n in lengths.items())
        return meta, f"{where} counts its queries differently in different arrays ({listed})"
    for key, values in meta.items():
        if not np.isfinite(values).all():
            return meta, f"{where} has non-finite values in {key!r}"
    for key in ("records", "canaries"):
        values = meta[key]
        if (values < 0).any() or (values != np.round(values)).any():
            return meta, f"{where} has {key} counts that are not non-negative integers"
    if "projected" in meta and not np.isin(meta["projected"], (0.0, 1.0)).all():
        return meta, f"{where} marks queries as projected with values other than 0 and 1"
    if ((meta["rate"] <= 0) | (meta["rate"] > 1)).any():
        return meta, f"{where} has sampling rates outside (0, 1]"
    if (meta["noise_multiplier"] < 0).any() or (meta["max_grad_norm"] <= 0).any() or (meta["batch"] <= 0).any():
        return meta, f"{where} has a negative noise multiplier or a non-positive clipping norm or batch size"
    return meta, None


def _kept_index(
    drawn: torch.Tensor | None, name: str, population: int, records: int
) -> tuple[np.ndarray | None, str | None]:
    """A kept query's record positions (None where the log predates them), or why they cannot be checked: as many
    as its step drew, each once, inside its client's population."""
    if drawn is None:
        return None, None
    if drawn.dim() != 1 or drawn.is_floating_point() or drawn.is_complex():
        return None, f"{name} has record positions that are not a list of integers"
    index = drawn.numpy().astype(np.int64)
    if len(index) != records or (len(index) and (index.min() < 0 or index.max() >= population)):
        return None, f"{name} lists {len(index)} record positions in 0..{population - 1}, but its step drew {records}"
    if len(np.unique(index)) != len(index):
        return None, f"{name} lists a record position twice"
    return index, None


def _kept_device(
    flag: torch.Tensor | None, threads: torch.Tensor | None, name: str
) -> tuple[str | None, int | None, str | None]:
    """Where a kept query's noise was drawn ("cuda" or "cpu"; None where the log does not say) and, on a GPU, the
    most threads its generators spread a draw over (None where not said), or why that cannot be read."""
    if flag is None:
        return None, None, None
    flag = flag.reshape(-1)
    if flag.numel() != 1 or flag.is_floating_point() or int(flag.item()) not in (0, 1):
        return None, None, f"{name} says neither that it was drawn on a GPU nor that it was not"
    device = "cuda" if int(flag.item()) else "cpu"
    if threads is None:
        return device, None, None
    threads = threads.reshape(-1)
    if threads.numel() != 1 or threads.is_floating_point() or int(threads.item()) < 1 or device != "cuda":
        return None, None, f"{name} says its GPU spread its draws over {threads.tolist()} threads"
    return device, int(threads.item()), None


def _kept(
    tensors: Mapping[str, torch.Tensor],
    j: int,
    meta: dict[str, np.ndarray],
    facts: _Run,
    number: int,
    client: int,
    where: str,
) -> tuple[_Kept | None, str | None]:
    """Kept query ``j`` of a log, or why it cannot be checked."""
    name = f"kept query {j} of {where}"
    missing = [key for key in _KEPT if f"kept{j}/{key}" not in tensors]
    if missing:
        return None, f"{name} has no {', '.join(missing)}"
    part = {key: tensors[f"kept{j}/{key}"] for key in _KEPT}
    step_values = part["step"].reshape(-1)
    if step_values.numel() != 1 or step_values.is_floating_point() or step_values.is_complex():
        return None, f"{name} has a step that is not one integer"
    step = int(step_values.item())
    if not 0 <= step < len(meta["rate"]):
        return None, f"{name} is step {step}, but the log records {len(meta['rate'])} queries"
    for key in ("params", "released"):
        if part[key].dim() != 1 or part[key].numel() != facts.dimension:
            return None, (
                f"{name} has {key} of shape {tuple(part[key].shape)}, but the model has {facts.dimension} parameters"
            )
    x, y, ids = part["x"], part["y"], part["canaries"]
    if tuple(x.shape[1:]) != facts.input_shape:
        return None, f"{name} has inputs of shape {tuple(x.shape)}, but the model takes {facts.input_shape}"
    if y.dim() != 1 or len(y) != len(x) or y.is_floating_point() or y.is_complex():
        return None, f"{name} has {tuple(y.shape)} labels for {len(x)} inputs"
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= facts.num_classes):
        return None, f"{name} has labels outside the model's {facts.num_classes} classes"
    for key in ("params", "released", "x"):
        if not torch.isfinite(part[key].to(torch.float64)).all():
            return None, f"{name} has non-finite {key}"
    if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex():
        return None, f"{name} has canary ids that are not a list of integers"
    ids_array = ids.numpy().astype(np.int64)
    count = len(facts.canary_client)
    if len(ids_array) and (
        ids_array.min() < 0
        or ids_array.max() >= count
        or (facts.canary_client[ids_array] != client).any()
        or (facts.canary_included[ids_array] != 1).any()
    ):
        return None, f"{name} draws canaries that are not in client {client}'s data"
    records, canaries = int(meta["records"][step]), int(meta["canaries"][step])
    expected_rows = records + (canaries if facts.kind == "input" else 0)
    if len(x) != expected_rows:
        return None, f"{name} holds {len(x)} examples, but its step drew {expected_rows}"
    # input canaries are rows of x already; their ids may be listed too (the recorder lists every canary drawn)
    if len(ids_array) != canaries and (facts.kind != "input" or len(ids_array)):
        return None, f"{name} lists {len(ids_array)} canaries, but its step drew {canaries}"
    index, problem = _kept_index(tensors.get(f"kept{j}/index"), name, facts.populations(number, client, 1)[0], records)
    if problem is None:
        device, threads, problem = _kept_device(tensors.get(f"kept{j}/cuda"), tensors.get(f"kept{j}/threads"), name)
    if problem is not None:
        return None, problem
    query = _Kept(
        round=number,
        client=client,
        step=step,
        params=part["params"].to(torch.float64),
        released=part["released"].to(torch.float64),
        x=x,
        y=y.to(torch.int64),
        canaries=ids_array,
        sigma=float(meta["noise_multiplier"][step]),
        clip=float(meta["max_grad_norm"][step]),
        rate=float(meta["rate"][step]),
        index=index,
        device=device,
        threads=threads,
    )
    return query, None


# --- the reference: an obviously correct clipped sum ---------------------------------------------------------------


@dataclass(frozen=True)
class _Residual:
    """A kept query against its clean clipped sum, recomputed one example at a time."""

    query: _Kept
    residual: torch.Tensor  # released - clean clipped sum, float64
    scale: float  # sigma C
    clipped_away: float  # || sum of unclipped - sum of clipped ||
    along: float  # <residual, unit direction of what clipping took away>, 0 when nothing was clipped
    largest_norm: float  # the largest per-example gradient norm of the batch's records
    examples: int  # records and canaries
    along_clean: float | None  # <residual, unit direction of the clean clipped sum>, None when that sum is 0
    tensor_along: dict[str, float]  # per tensor: <residual's part, unit direction of what clipping took away there>
    span_energy: float  # ||projection of the residual on the span of the examples' gradients||^2
    span_rank: int  # the dimension of that span


def _residual(query: _Kept, facts: _Run) -> _Residual:
    """Per example: the cross-entropy gradient at the query's point (float64), clipped to norm <= C with factor
    min(1, C / ||g||); the gradient canaries' 10 C u_i likewise; summed. Also the sum without clipping."""
    model, names, clip = facts.model, list(facts.shapes), query.clip
    params, start = {}, 0
    for name, shape in facts.shapes.items():
        size = int(shape.numel())
        params[name] = query.params[start : start + size].reshape(shape).clone().requires_grad_(True)
        start += size
    clipped = torch.zeros(facts.dimension, dtype=torch.float64)
    unclipped = torch.zeros(facts.dimension, dtype=torch.float64)
    largest = 0.0
    x = query.x.to(torch.float64)

    rows: list[torch.Tensor] = []

    def add(gradient: torch.Tensor) -> float:
        norm = float(gradient.norm())
        factor = min(1.0, clip / norm) if norm > 0 else 1.0
        clipped.add_(gradient, alpha=factor)
        unclipped.add_(gradient)
        if len(rows) < SPAN_LIMIT:
            rows.append(gradient)
        return norm

    for i in range(len(query.y)):
        loss = F.cross_entropy(functional_call(model, params, (x[i : i + 1],)), query.y[i : i + 1])
        grads = torch.autograd.grad(loss, [params[name] for name in names])
        largest = max(largest, add(torch.cat([g.reshape(-1) for g in grads])))
    if facts.kind == "gradient" and len(query.canaries):
        directions = canary_directions(facts.seed, query.canaries, facts.shapes, layout=facts.layout)
        flat = torch.cat([directions[name].reshape(len(query.canaries), -1) for name in names], dim=1)
        for u in flat.to(torch.float64):
            add(GRADIENT_CANARY_NORM * clip * u)
    residual = query.released - clipped
    difference = unclipped - clipped
    away = float(difference.norm())
    tiny = 1e-9 * max(clip, 1.0)
    along = float(residual @ difference) / away if away > tiny else 0.0
    clean_norm = float(clipped.norm())
    tensor_along: dict[str, float] = {}
    start = 0
    for name, shape in facts.shapes.items():
        part = slice(start, start + int(shape.numel()))
        start = part.stop
        size = float(difference[part].norm())
        if size > tiny:
            tensor_along[name] = float(residual[part] @ difference[part]) / size
    energy, rank = 0.0, 0
    if rows:  # |P r|^2 for P the projection on the examples' gradients G: (G r)' (G G')^+ (G r), by eigenvalues
        gradients = torch.stack(rows)
        values, vectors = torch.linalg.eigh(gradients @ gradients.T)
        independent = values > 1e-10 * float(values.max()) if float(values.max()) > 0 else values > 0
        projection = (vectors[:, independent].T @ (gradients @ residual)) / values[independent].sqrt()
        energy, rank = float(projection @ projection), int(independent.sum())
    return _Residual(
        query=query,
        residual=residual,
        scale=query.sigma * clip,
        clipped_away=away,
        along=along,
        largest_norm=largest,
        examples=len(query.y) + (len(query.canaries) if facts.kind == "gradient" else 0),
        along_clean=float(residual @ clipped) / clean_norm if clean_norm > tiny else None,
        tensor_along=tensor_along,
        span_energy=energy,
        span_rank=rank,
    )


# --- combining sub-tests -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Test:
    """One sub-test of a check: its p-value, statistic and the sentence that says what its failure means."""

    name: str
    p_value: float
    statistic: float
    failure: str
    exact: bool = False


def _combine(name: str, tests: list[_Test], level: float, n: int, success: str, details: dict[str, Any]) -> Check:
    """A check from its sub-tests: an exact failure gives p = 0, otherwise Bonferroni over the statistical ones."""
    details = {**details, "tests": {t.name: {"p_value": t.p_value, "statistic": t.statistic} for t in tests}}
    if not tests:
        return Check(name, True, None, n, None, success, details)
    exact_failures = [t for t in tests if t.exact and t.p_value == 0]
    statistical = [t for t in tests if not t.exact]
    if exact_failures:
        worst, p_value = exact_failures[0], 0.0
    elif statistical:
        worst = min(statistical, key=lambda t: t.p_value)
        p_value = min(1.0, len(statistical) * worst.p_value)
    else:
        worst, p_value = tests[0], 1.0
    passed = p_value > level
    return Check(name, passed, p_value, n, worst.statistic, success if passed else worst.failure, details)


def _two_sided_normal(z: float) -> float:
    return float(min(1.0, 2 * stats.norm.sf(abs(z))))


def _two_sided_chi2(value: float, dof: float) -> float:
    return float(min(1.0, 2 * min(stats.chi2.cdf(value, dof), stats.chi2.sf(value, dof))))


def _exact(name: str, ok: bool, failure: str) -> _Test:
    return _Test(name, 1.0 if ok else 0.0, 0.0 if ok else 1.0, failure, exact=True)


# --- the checks ----------------------------------------------------------------------------------------------------


def _log_check(read: _Logs) -> Check:
    queries = sum(log.queries for log in read.logs)
    kept = sum(len(log.kept) for log in read.logs)
    details = {
        "logs": len(read.logs),
        "queries": queries,
        "kept": kept,
        "kept_found": read.kept_seen,
        "problems": read.problems,
    }
    if read.problems:
        more = f" (and {len(read.problems) - 1} more problems)" if len(read.problems) > 1 else ""
        sentence = f"The query log is inconsistent: {read.problems[0]}{more}."
        return Check("log", False, 0.0, len(read.logs), float(len(read.problems)), sentence, details)
    sentence = (
        f"The query logs of {len(read.participants)} rounds ({len(read.logs)} client logs, {queries} queries, "
        f"{kept} kept whole) are complete and consistent."
    )
    return Check("log", True, 1.0, len(read.logs), 0.0, sentence, details)


def _not_checked(name: str) -> Check:
    """A check that needs whole queries, in a run whose sites keep their records: none was kept, because a whole
    query holds the records of its batch."""
    return Check(
        name,
        True,
        None,
        0,
        None,
        f"Not checked: this run's sites keep their records, so no whole query (which holds its batch's records) left "
        f"them, and the {name} of the released sums could not be recomputed here; the canary audit's query view "
        "and the sampling and ledger checks still see every query.",
        {"not_checked": True},
    )


def _independence_test(noisy: list[_Residual], scaled: list[torch.Tensor]) -> tuple[_Test, int]:
    """Whether two kept queries' noise is correlated (a noise draw reused): the largest of the pairwise normalised
    inner products, Bonferroni over the pairs; with the number of pairs."""
    matrix = torch.stack(scaled)
    dimension = matrix.shape[1]
    gram = (matrix @ matrix.T / math.sqrt(dimension)).numpy()
    upper = np.triu_indices(len(noisy), k=1)
    zs = gram[upper]
    worst = int(np.argmax(np.abs(zs)))
    a, b = noisy[upper[0][worst]].query, noisy[upper[1][worst]].query
    pairs = len(zs)
    test = _Test(
        "independence",
        min(1.0, pairs * _two_sided_normal(float(zs[worst]))),
        float(zs[worst]),
        f"The noise of ({a.label}) and ({b.label}) is correlated ({zs[worst] / math.sqrt(dimension):.3g}, "
        f"z = {zs[worst]:.3g} over {pairs} pairs of kept queries): a noise draw was reused.",
    )
    return test, pairs


def _noise_check(residuals: list[_Residual], shapes: Mapping[str, torch.Size], level: float, seed: int) -> Check:
    noisy = [r for r in residuals if r.scale > 0]
    silent = [r for r in residuals if r.scale == 0]
    tests: list[_Test] = []
    details: dict[str, Any] = {"kept_queries": len(residuals), "zero_noise_queries": len(silent)}
    for r in silent:
        tolerance = ZERO_NOISE_TOLERANCE * r.query.clip * (r.examples + 1)
        gap = float(r.residual.norm())
        tests.append(
            _exact(
                f"zero noise at {r.query.label}",
                gap <= tolerance,
                f"With sigma C = 0 the released sum of {r.query.label} should be the clean clipped sum, but it is "
                f"{gap:.3g} away from it (tolerance {tolerance:.3g}, for float32 sums).",
            )
        )
    if noisy:
        scaled = [r.residual / r.scale for r in noisy]
        total = sum(len(e) for e in scaled)
        z = float(sum(float(e.sum()) for e in scaled)) / math.sqrt(total)
        chi2 = float(sum(float(e.square().sum()) for e in scaled))
        ratio = chi2 / total
        tests.append(
            _Test(
                "mean",
                _two_sided_normal(z),
                z,
                f"The released noise of {len(noisy)} kept queries has mean {z / math.sqrt(total):.3g} sigma C, not "
                f"0 (z = {z:.3g}).",
            )
        )
        tests.append(
            _Test(
                "variance",
                _two_sided_chi2(chi2, total),
                ratio,
                f"The released noise of {len(noisy)} kept queries has variance {ratio:.4g} (sigma C)^2, not (sigma "
                f"C)^2 (chi-square over {total} coordinates).",
            )
        )
        tests.append(_per_tensor_variance(scaled, shapes))
        pooled = torch.cat(scaled).numpy()
        rng = np.random.default_rng(seed)
        sample = pooled if len(pooled) <= NORMALITY_SAMPLE else rng.choice(pooled, NORMALITY_SAMPLE, replace=False)
        ks = stats.kstest(sample, "norm")
        tests.append(
            _Test(
                "normality",
                float(ks.pvalue),
                float(ks.statistic),
                f"The released noise of {len(noisy)} kept queries is not Gaussian (Kolmogorov-Smirnov distance "
                f"{float(ks.statistic):.3g} over {len(sample)} coordinates).",
            )
        )
        if len(noisy) > 1:
            independence, details["pairs"] = _independence_test(noisy, scaled)
            tests.append(independence)
        details.update(coordinates=total, variance_ratio=ratio)
    count = len(residuals)
    if not residuals:
        success = "No whole query was kept, so the noise could not be tested."
        details["not_checked"] = True  # passed only in that nothing contradicts it: a report counts it as not made
    elif noisy:
        success = (
            f"The noise of {count} kept queries ({sum(r.residual.numel() for r in noisy)} coordinates) is "
            "N(0, (sigma C)^2) in mean, variance, shape and independence between queries."
        )
    else:
        success = f"Every one of the {count} kept queries has sigma C = 0 and released its clean clipped sum."
    return _combine("noise", tests, level, count, success, details)


def _per_tensor_variance(scaled: list[torch.Tensor], shapes: Mapping[str, torch.Size]) -> _Test:
    """The variance test on each parameter tensor apart (Bonferroni over tensors): a loop that noises some tensors
    and not others hides in the pooled test when the skipped ones are small (biases)."""
    matrix = torch.stack(scaled)
    worst: tuple[float, str, float, int] = (1.0, "", 1.0, 0)
    start = 0
    for name, shape in shapes.items():
        size = int(shape.numel())
        block = matrix[:, start : start + size]
        start += size
        coordinates = block.numel()
        chi2 = float(block.square().sum())
        p_value = _two_sided_chi2(chi2, coordinates)
        if p_value <= worst[0]:
            worst = (p_value, name, chi2 / coordinates, coordinates)
    p_value, name, ratio, coordinates = worst
    return _Test(
        "per-tensor variance",
        min(1.0, len(shapes) * p_value),
        ratio,
        f"The released noise on parameter {name} of {len(scaled)} kept queries has variance {ratio:.4g} (sigma C)^2, "
        f"not (sigma C)^2 (chi-square over {coordinates} coordinates): that tensor is not noised as the others.",
    )


def _clipping_check(residuals: list[_Residual], level: float) -> Check:
    largest = max((r.largest_norm for r in residuals), default=None)
    clips = sorted({r.query.clip for r in residuals})
    details: dict[str, Any] = {
        "largest_per_example_norm": largest,
        "clipping_norms": clips,
        "queries_with_clipping": sum(r.clipped_away > 0 for r in residuals),
    }
    tested = [r for r in residuals if r.clipped_away > 1e-9 * max(r.query.clip, 1.0)]
    tests: list[_Test] = []
    noisy = [r for r in tested if r.scale > 0]
    for r in tested:
        if r.scale == 0:
            tolerance = ZERO_NOISE_TOLERANCE * r.query.clip * (r.examples + 1)
            tests.append(
                _exact(
                    f"zero noise at {r.query.label}",
                    abs(r.along) <= tolerance,
                    f"The released sum of {r.query.label} (sigma C = 0) moved {r.along:.3g} along what clipping "
                    f"takes away ({r.clipped_away:.3g}): the query is not clipped to C.",
                )
            )
    if noisy:
        z = sum(r.along / r.scale for r in noisy) / math.sqrt(len(noisy))
        shift = sum(r.along / r.scale for r in noisy) / len(noisy)
        tests.append(
            _Test(
                "projection",
                float(stats.norm.sf(z)),
                float(z),
                f"The released sums of {len(noisy)} kept queries move along what clipping takes away by {shift:.3g} "
                f"noise standard deviations on average (z = {z:.3g}): the queries are not clipped to C.",
            )
        )
        details["mean_shift"] = shift
        tests += _tensor_tests(noisy)
    tests += _data_direction_tests([r for r in residuals if r.scale > 0])
    norm_text = "" if largest is None else f"; the largest per-example gradient norm was {largest:.3g}"
    if not residuals or not tested:
        details["not_checked"] = True  # nothing contradicts it, nothing tested it: a report counts it as not made
    if not residuals:
        success = "No whole query was kept, so clipping could not be tested."
    elif not tested:
        success = (
            f"No example of the {len(residuals)} kept queries needed clipping, so clipping was not tested{norm_text}."
        )
    else:
        success = (
            f"The released sums of {len(tested)} kept queries carry nothing of what clipping takes away{norm_text} "
            f"(C = {', '.join(f'{c:g}' for c in clips)})."
        )
    return _combine("clipping", tests, level, len(tested), success, details)


def _tensor_tests(noisy: list[_Residual]) -> list[_Test]:
    """Per parameter tensor, the residual's part along what clipping took away in that tensor (one-sided): a tensor
    left unclipped, or clipped with a norm of its own, puts its excess there, where the whole model's direction
    dilutes it."""
    tests = []
    for name in dict.fromkeys(name for r in noisy for name in r.tensor_along):
        values = [r.tensor_along[name] / r.scale for r in noisy if name in r.tensor_along]
        z = sum(values) / math.sqrt(len(values))
        tests.append(
            _Test(
                f"projection {name}",
                float(stats.norm.sf(z)),
                float(z),
                f"The released sums of {len(values)} kept queries move along what clipping takes away in {name} by "
                f"{sum(values) / len(values):.3g} noise standard deviations on average (z = {z:.3g}): {name} is not "
                "clipped to C with the rest of each example's gradient.",
            )
        )
    return tests


def _data_direction_tests(noisy: list[_Residual]) -> list[_Test]:
    """The residual along directions the data gives, where the noise alone is N(0, (sigma C)^2) each: the clean
    clipped sum (two-sided: a sum scaled up or down), and the span of the examples' own gradients (chi-square with
    the span's dimension: whatever a wrong clipping adds is a combination of the examples' gradients)."""
    tests = []
    clean = [r.along_clean / r.scale for r in noisy if r.along_clean is not None]
    if clean:
        z = sum(clean) / math.sqrt(len(clean))
        tests.append(
            _Test(
                "clean sum",
                _two_sided_normal(z),
                float(z),
                f"The released sums of {len(clean)} kept queries move along their clean clipped sums by "
                f"{sum(clean) / len(clean):.3g} noise standard deviations on average (z = {z:.3g}): the examples "
                "are not clipped to C (the sum is scaled as by another clipping norm or divisor).",
            )
        )
    spanned = [r for r in noisy if r.span_rank > 0]
    if spanned:
        energy = sum(r.span_energy / r.scale**2 for r in spanned)
        dof = sum(r.span_rank for r in spanned)
        tests.append(
            _Test(
                "examples' span",
                float(stats.chi2.sf(energy, dof)),
                energy / dof,
                f"The released sums of {len(spanned)} kept queries carry {energy / dof:.3g} times the noise's energy "
                f"in the span of their examples' gradients ({dof} dimensions): the examples are not clipped to C (the "
                "released sums carry more of them than their clipped gradients).",
            )
        )
    return tests


def _binomial_tests(
    what: str, drawn: np.ndarray, population: np.ndarray, rate: np.ndarray
) -> tuple[list[_Test], dict[str, Any]]:
    """Mean and dispersion of ``drawn`` ~ Binomial(population, rate), query by query; certain draws (rate 1 or an
    empty population) must be exact."""
    tests: list[_Test] = []
    certain = (rate >= 1) | (population == 0)
    if certain.any():
        wrong = int((drawn[certain] != np.round(population[certain] * rate[certain])).sum())
        tests.append(_exact(f"{what} certain", wrong == 0, f"{wrong} queries drew {what} where the draw is certain."))
    over = int((drawn > population).sum())
    if over:
        tests.append(_exact(f"{what} bounded", False, f"{over} queries drew more {what} than there are."))
    b, n, q = drawn[~certain], population[~certain], rate[~certain]
    details: dict[str, Any] = {"queries": int(len(b))}
    if not len(b):
        return tests, details
    mean, variance = n * q, n * q * (1 - q)
    z = float((b - mean).sum() / math.sqrt(variance.sum()))
    terms = (b - mean) ** 2 / variance
    statistic = float(terms.sum())
    # each term has mean 1 and variance 2 + (1 - 6 q (1 - q)) / (N q (1 - q)) (the binomial's kurtosis): the sum
    # is matched to a scaled chi-square (Satterthwaite), which is chi-square(n) when N q (1 - q) is large
    spread = float((2 + (1 - 6 * q * (1 - q)) / variance).sum())
    scale, dof = spread / (2 * len(b)), 2 * len(b) ** 2 / spread
    dispersion = statistic / len(b)
    tests.append(
        _Test(
            f"{what} mean",
            _two_sided_normal(z),
            z,
            f"The {what} drawn by {len(b)} queries average {float(b.mean()):.4g} where the charged rate gives "
            f"{float(mean.mean()):.4g} (z = {z:.3g}): they are not sampled at the rate the ledger charges.",
        )
    )
    tests.append(
        _Test(
            f"{what} dispersion",
            _two_sided_chi2(statistic / scale, dof),
            dispersion,
            f"The {what} drawn by {len(b)} queries vary {dispersion:.3g} times as much as Poisson sampling at the "
            f"charged rate makes them vary: the batches are not Poisson samples.",
        )
    )
    details.update(mean_z=z, dispersion=dispersion)
    return tests, details


def _participation_tests(read: _Logs, facts: _Run) -> tuple[list[_Test], np.ndarray, int]:
    """Each round's participants against the client fraction (every client in the set-up rounds), and each
    client's participation against uniform selection; with the counts and the number of sampled rounds."""
    tests: list[_Test] = []
    everyone = len(facts.sizes)
    wrong_rounds = {
        m: len(c)
        for m, c in read.participants.items()
        if len(c) != (everyone if m <= facts.setup_rounds else facts.selected)
    }
    if wrong_rounds:
        m, count = next(iter(wrong_rounds.items()))
        expected = (
            f"every client ({everyone}) takes part in its first {facts.setup_rounds} round(s)"
            if m <= facts.setup_rounds
            else f"ceil(p K) = {facts.selected} take part in every round"
        )
        tests.append(_exact("participants", False, f"Round {m} has logs of {count} clients where {expected}."))
    counts = np.zeros(len(facts.sizes), dtype=int)
    sampled = {m: c for m, c in read.participants.items() if m > facts.setup_rounds}  # chosen by --client-fraction
    for clients in sampled.values():
        counts[[k for k in clients if k < len(counts)]] += 1
    rounds = len(sampled)
    if 0 < facts.fraction < 1 and rounds:
        lower = stats.binom.cdf(counts, rounds, facts.fraction)
        upper = stats.binom.sf(counts - 1, rounds, facts.fraction)
        per_client = np.minimum(1.0, 2 * np.minimum(lower, upper))
        k = int(np.argmin(per_client))
        tests.append(
            _Test(
                "participation",
                float(min(1.0, len(counts) * per_client[k])),
                float(counts[k]),
                f"Client {k} took part in {counts[k]} of {rounds} rounds, where uniform selection of "
                f"{facts.selected} of {len(counts)} clients gives {rounds * facts.fraction:.3g} on average.",
            )
        )
    return tests, counts, rounds


def _sampling_check(read: _Logs, facts: _Run, ledger: _Ledger, level: float) -> Check:
    tests: list[_Test] = []
    details: dict[str, Any] = {}
    records, canaries, sizes, held, rates = [], [], [], [], []
    mismatched: list[str] = []
    uncharged: list[int] = []
    for log in read.logs:
        row = ledger.rounds[log.round - 1] if log.round <= len(ledger.rounds) else {}
        events = row.get(log.client, [])
        if not events or log.client not in ledger.per_client:
            uncharged.append(log.client)
            continue
        # the rate and population of each query: its round's events in order (a query past them: the last event's)
        populations = facts.populations(log.round, log.client, len(events))
        index = np.repeat(np.arange(len(events)), [n for _, _, n in events])[: log.queries]
        index = np.concatenate([index, np.full(log.queries - len(index), len(events) - 1, dtype=int)])
        charged = np.array([q for _, q, _ in events])[index]
        rate = log.meta["rate"]
        if np.any(np.abs(rate - charged) > RATE_RTOL * charged):
            at = int(np.argmax(np.abs(rate - charged)))
            mismatched.append(
                f"client {log.client} sampled at rate {float(rate[at]):.6g} in round {log.round} (query {at + 1}) "
                f"but the ledger charges {float(charged[at]):.6g}"
            )
        records.append(log.meta["records"])
        canaries.append(log.meta["canaries"])
        sizes.append(np.array(populations, dtype=float)[index])
        held.append(np.full(log.queries, facts.held[log.client], dtype=float))
        rates.append(charged)
    if uncharged:
        clients = ", ".join(map(str, sorted(set(uncharged))))
        tests.append(
            _exact("charged", False, f"The ledger charges no sampling rate to client(s) {clients}, which made queries.")
        )
    if mismatched:
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        tests.append(_exact("rate", False, f"{mismatched[0][0].upper()}{mismatched[0][1:]}{more}."))
    queries = 0
    if records:
        rate = np.concatenate(rates)
        queries = len(rate)
        found, info = _binomial_tests("records", np.concatenate(records), np.concatenate(sizes), rate)
        tests += found
        details["records"] = info
        found, info = _binomial_tests("canaries", np.concatenate(canaries), np.concatenate(held), rate)
        tests += found
        details["canaries"] = info
    found, counts, rounds = _participation_tests(read, facts)
    tests += found
    details["participation"] = counts.tolist()
    setup = f" after {facts.setup_rounds} round(s) of every client" if facts.setup_rounds else ""
    success = (
        f"The batches of {queries} queries are Poisson samples at the rate the ledger charges, and each of "
        f"{rounds} rounds{setup} had {facts.selected} of {len(facts.sizes)} clients (participation "
        f"{counts.tolist()})."
    )
    return _combine("sampling", tests, level, queries, success, details)


def _ledger_history_problems(facts: _Run, ledger: _Ledger) -> list[str]:
    """The ledger against itself and the run: a row and an epsilon per round, the final epsilon the largest client's,
    and each client's entries the composition of its rows."""
    failures = []
    if len(ledger.rounds) != facts.rounds or len(ledger.epsilon_per_round) != facts.rounds:
        failures.append(
            f"The ledger records {len(ledger.rounds)} rounds and {len(ledger.epsilon_per_round)} epsilons, but the "
            f"run completed {facts.rounds} rounds."
        )
    client_epsilons = [epsilon for epsilon, _ in ledger.per_client.values()]
    final = ledger.epsilon_per_round[-1] if ledger.epsilon_per_round else 0.0
    top = max(client_epsilons, default=0.0)
    if not (final == top or abs(final - top) <= 1e-9 * abs(top)):
        failures.append(f"The ledger's final epsilon {final:.4g} is not the largest of its clients' ({top:.4g}).")
    history: dict[int, Counter[tuple[float, float]]] = {}
    for row in ledger.rounds:
        for client, events in row.items():
            for sigma, q, steps in events:
                history.setdefault(client, Counter())[(sigma, q)] += steps
    for client, (_, entries) in ledger.per_client.items():
        stored: Counter[tuple[float, float]] = Counter()
        for sigma, q, steps in entries:
            stored[(sigma, q)] += steps
        if +stored != +history.get(client, Counter()):
            failures.append(f"The ledger's entries for client {client} are not the composition of its history.")
    return failures


def _charged_queries(read: _Logs, ledger: _Ledger) -> tuple[list[str], dict[int, Counter[tuple[float, float]]]]:
    """Each client's logged queries against what its ledger row charged (count, noise multiplier, rate), and the
    queries each client made, by (noise multiplier, rate)."""
    failures: list[str] = []
    recorded: dict[int, Counter[tuple[float, float]]] = {}
    for log in read.logs:
        row = ledger.rounds[log.round - 1] if log.round <= len(ledger.rounds) else {}
        charged = row.get(log.client, [])
        steps = sum(n for _, _, n in charged)
        where = f"In round {log.round} client {log.client}"
        if log.queries > steps:
            failures.append(f"{where} made {log.queries} DP queries but the ledger charged it {steps}.")
        elif log.queries:
            least_sigma = min(s for s, _, _ in charged)
            most_rate = max(q for _, q, _ in charged)
            if float(log.meta["noise_multiplier"].min()) < least_sigma * (1 - RATE_RTOL):
                failures.append(
                    f"{where} queried at noise multiplier {float(log.meta['noise_multiplier'].min()):.4g} but the "
                    f"ledger charged {least_sigma:.4g}."
                )
            if float(log.meta["rate"].max()) > most_rate * (1 + RATE_RTOL):
                failures.append(
                    f"{where} sampled at rate {float(log.meta['rate'].max()):.6g} but the ledger charged at most "
                    f"{most_rate:.6g}."
                )
        spent = recorded.setdefault(log.client, Counter())
        for sigma, q in zip(log.meta["noise_multiplier"], log.meta["rate"]):
            spent[(float(sigma), float(q))] += 1
    return failures, recorded


def _ledger_check(read: _Logs, facts: _Run, ledger: _Ledger) -> Check:
    details: dict[str, Any] = {"accountant": ledger.accountant, "delta": ledger.delta, "pld_interval": PLD_INTERVAL}
    failures = _ledger_history_problems(facts, ledger)
    final = ledger.epsilon_per_round[-1] if ledger.epsilon_per_round else 0.0
    charged_problems, recorded = _charged_queries(read, ledger)
    failures += charged_problems
    clients: dict[str, Any] = {}
    ratio = 0.0
    use_rdp = ledger.accountant == "rdp"
    for client, queries in sorted(recorded.items()):
        # what decides (exact RDP for an RDP ledger, PLD's lower bound for a PLD one) for every client; all four
        # spends, dp-accounting's own accountants included (seconds a client), for the client that spends most
        spend = {"rdp": recorded_rdp(queries, ledger.delta)}
        if not use_rdp:
            spend["pld_lower"] = recorded_pld_lower(queries, ledger.delta)
        entry = ledger.per_client.get(client)
        says = entry[0] if entry is not None else 0.0
        floor = 1 - LEDGER_RTOL
        reference = spend["rdp"] if use_rdp else spend["pld_lower"]
        clients[str(client)] = {
            "ledger": says,
            "queries": sum(queries.values()),
            "rounds": sum(1 for log in read.logs if log.client == client),
            "covered": says >= reference * floor,
            **spend,
        }
        if use_rdp and says < spend["rdp"] * floor:
            failures.append(
                f"Client {client}'s ledger says epsilon {says:.4g} but its recorded queries spend "
                f"{spend['rdp']:.4g} (RDP at dp-accounting's orders)."
            )
        elif not use_rdp and says < spend["pld_lower"] * floor:
            failures.append(
                f"Client {client}'s ledger says epsilon {says:.4g} but its recorded queries spend at least "
                f"{spend['pld_lower']:.4g} (dp-accounting PLD, optimistic discretisation)."
            )
        if reference > 0:
            ratio = max(ratio, 1.0 if reference == says else reference / says if says > 0 else math.inf)
        if final < reference * floor:
            failures.append(
                f"The ledger's final epsilon {final:.4g} is below the {reference:.4g} that client {client}'s recorded "
                "queries spend."
            )
    if recorded:
        most = max(recorded, key=lambda k: (clients[str(k)]["rdp"], -k))
        clients[str(most)].update(asdict(recorded_spend(recorded[most], ledger.delta)))
    details.update(clients=clients, failures=failures)
    if failures:
        more = f" (and {len(failures) - 1} more problems)" if len(failures) > 1 else ""
        return Check("ledger", False, 0.0, len(recorded), ratio, f"{failures[0][:-1]}{more}.", details)
    worst = clients[str(most)] if recorded else None
    spent = (
        f" (a client's recorded spend is at most {ratio:.4f} of its ledger epsilon; the largest is "
        f"{worst['rdp']:.4g} by RDP, {worst['pld']:.4g} by PLD)"
        if worst is not None
        else ""
    )
    sentence = (
        f"The ledger covers what the recorded queries of {len(recorded)} clients spend without amplification by "
        f"client sampling{spent}, and agrees with its history and the run."
    )
    return Check("ledger", True, 1.0, len(recorded), ratio, sentence, details)


def verify(run: RunDirectory, *, seed: int = 0, level: float = 0.001) -> Verification:
    """Test a canary run's recorded DP queries against the mechanism its ledger charged for (module docstring).

    Args:
        run: a run trained with ``--dp --canaries N`` (it records the query log).
        seed: draws the residual coordinates the normality test looks at; nothing else is random.
        level: the family-wise level: a correct run fails some check with probability at most this.

    Returns:
        The checks log, noise, clipping, sampling, secrecy and ledger, each at ``level`` / 6.

    Raises:
        AttackError: a run without DP, without the query log, with a round missing its log, or with a ledger
            whose structure is broken (one sentence).
    """
    if not 0 < level < 1:
        raise AttackError(f"The level of the conformance tests must be in (0, 1), got {level!r}.")
    facts, ledger = _read_run(run)
    read = _read_logs(run, facts)
    per_check = level / len(CHECKS)
    kept = [query for log in read.logs for query in log.kept]
    with torch.enable_grad():  # the reference loop differentiates, even when called under torch.no_grad()
        residuals = [_residual(query, facts) for query in kept]
    at_sites = not kept and facts.records_at_sites
    checks = [
        _log_check(read),
        _not_checked("noise") if at_sites else _noise_check(residuals, facts.shapes, per_check, seed),
        _not_checked("clipping") if at_sites else _clipping_check(residuals, per_check),
        _sampling_check(read, facts, ledger, per_check),
        _secrecy_check(residuals, facts, per_check, at_sites=at_sites),
        _ledger_check(read, facts, ledger),
    ]
    return Verification(checks=checks, level=level, per_check_level=per_check)


def _secrecy_check(residuals: list[_Residual], facts: _Run, level: float, *, at_sites: bool) -> Check:
    """The kept queries' noise and samples against every public stream, and traced to the clients' secrets."""
    assert facts.public is not None
    queries = [
        KeptQuery(
            label=r.query.label,
            round=r.query.round - 1,
            client=r.query.client,
            step=r.query.step,
            noise=r.residual,
            scale=r.scale,
            index=r.query.index,
            population=facts.populations(r.query.round, r.query.client, 1)[0],
            rate=r.query.rate,
            canaries=int(facts.held[r.query.client]),
            device=r.query.device or facts.public.device,
            threads=r.query.threads,
        )
        for r in residuals
        if r.scale > 0
    ]
    if at_sites and facts.public.source != "run-seed":
        return _not_checked("secrecy")
    found = secrecy(queries, facts.public, level)
    return Check("secrecy", found.passed, found.p_value, found.n, found.statistic, found.sentence, found.details)
