"""``fedaudit verify`` for a client-level DP run (``--dp --dp-level client``): is what the server released each round
the mechanism its ledger charged for?

The mechanism: every round the server samples each client with probability q, clips each sampled client's update to
C, sums, adds N(0, (sigma C)^2 I) and divides by q P (P the clients it samples from, canary clients included); the
global model moves by the server's step times that. From the run's files alone (every round's checkpoint, what each
client sent: ``--save-transmitted``, and the canary clients' log), with numpy, scipy and Google's dp-accounting and
nothing of ``fedaudit.privacy``, each round's residual

    r_t = q P (theta_t - theta_{t-1}) / eta - sum_k clip_C(u_k)

must be the noise alone: N(0, (sigma C)^2 I), once the span of the canary clients' directions (whose sampled updates
the files do not name) is projected out. Four checks, each at the family-wise level over four:

- ``noise``: sum_t |r_t|^2 / (sigma C)^2 against chi-square with its degrees of freedom (two-sided): noise removed,
  scaled, or a release divided by the wrong number of clients moves it;
- ``clipping``: the part of r_t in the span of the round's updates against chi-square with its rank (upper tail): an
  update released unclipped leaves (|u_k| - C) along its own direction there;
- ``sampling``: the clients sampled over all rounds (real ones from what they sent, canary clients from the log)
  against Binomial(P T, q) with the ledger's q (two-sided): a server sampling more often than it charges;
- ``ledger``: privacy.json's unit, sigma, q and rounds for every client, and its final epsilon at least what an exact
  RDP computation of T Poisson-sampled Gaussians at (sigma, q) gives;
- with adaptive clipping, C of each round is the server's saved state, the updates' noise is sigma_Delta C with
  sigma_Delta = (sigma^-2 - (2 sigma_b)^-2)^-1/2, and ``quantile``: the count released with each round, recovered
  from how C moved (C' = C exp(-eta_C (b - gamma))), less the centred count of the updates under C, against
  N(0, sigma_b^2) (chi-square, two-sided): a count released without its noise.

With the noise in shares (``--noise-at clients``) what the clients sent already carries the noise, so ``noise`` and
``clipping`` give way to ``shares`` (each client's share of the noise, with at most C of update beside it) and
``server`` (the release is the sum of what was sent): :class:`_Shares`. In a Flower deployment the server
received the shares of a round's clients only summed (secure aggregation): the run kept that sum and how many
clients it adds up, and the checks take it as one update of that many shares and clipped updates. From a sum the
clipping is checked only as |sum_k c_k| <= n C: unclipped updates whose sum stays under that cannot be told from
clipped ones by a server that holds the sum alone (what secure aggregation is for).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file
from scipy import stats

from fedaudit.attacks import AttackError
from fedaudit.attacks.conformance.checks import LEDGER_RTOL, Check, Verification, recorded_rdp
from fedaudit.instruments.canary_log import read_log
from fedaudit.models import initial_params
from fedaudit.rundir import EXPORT_RECORD, RunDirectory
from fedaudit.rundir.stores import SECURE_SUM_FILE
from fedaudit.seeding import Stream, numpy_rng

CHECKS = ("noise", "clipping", "sampling", "ledger")  # and "quantile" for adaptive clipping


def needs(run: RunDirectory) -> str | None:
    """Why ``run`` cannot be verified at client level, or None."""
    if (run.path / EXPORT_RECORD).exists():
        return "it is a copy for others, which holds neither what the clients sent nor the server's own records"
    if not run.transmitted_dir.is_dir():
        return "it was trained without --save-transmitted, so the clients' updates the checks recompute are not here"
    config = run.read_run_config()
    if config.keep_checkpoints is not None:
        return "it kept only its last checkpoints (--keep-checkpoints), and the checks need every round's model"
    return None


def verify_client_level(run: RunDirectory, *, level: float = 0.001) -> Verification:
    """The four checks of a client-level run (module docstring), each at ``level`` / 4.

    Raises:
        AttackError: a run that is not client level, or whose files the checks need are missing.
    """
    config, manifest = run.read_run_config(), run.read_manifest()
    if not config.privacy.client_level:
        raise AttackError(f"{run.path} is not a client-level DP run.")
    missing = needs(run)
    if missing is not None:
        raise AttackError(f"{run.path} cannot be verified at client level: {missing}.")
    priv, fed = config.privacy, config.federated
    sigma, q, eta = priv.noise_multiplier, fed.client_fraction, fed.server_lr
    rounds, clients = manifest.rounds_done, config.data.num_clients
    adaptive = priv.clipping == "adaptive"
    clips = _clip_norms(run, priv.max_update_norm, rounds + 1) if adaptive else [priv.max_update_norm] * (rounds + 1)
    count_noise = priv.count_noise if priv.count_noise is not None else q * clients / 20
    update_sigma = (sigma**-2 - (2 * count_noise) ** -2) ** -0.5 if adaptive else sigma
    names = sorted(initial_params(manifest.model.spec, config.seed))
    models = [_flat(_initial(manifest, config.seed), names)]
    models += [_flat(load_file(str(run.checkpoints.path(t))), names) for t in range(1, rounds + 1)]
    sent = [_sent(run, t, names) for t in range(1, rounds + 1)]
    summed = [_summed(run, t, names) for t in range(1, rounds + 1)]
    in_sums = [0 if s is None else s[1] for s in summed]
    log = read_log(run.canary_clients_path) if config.audit.canary_clients else None
    population = clients + (int(log.included.sum()) if log is not None else 0)
    basis = _canary_basis(config.seed, log, models[0].size) if log is not None else None
    stored = run.read_privacy() or {}
    per_check = level / (len(CHECKS) + adaptive)
    counted = _sampled_counts(run, log, rounds)
    sampled = int(counted.sum()) if counted is not None else sum(len(s) for s in sent) + sum(in_sums)
    common = [
        _sampling_check(sampled, population * rounds, _ledger_rate(stored, q), per_check),
        _ledger_check(stored, sigma, q, rounds, clients),
    ]
    if priv.noise_in_shares:
        taking_part = [int(counted[t]) if counted is not None else len(sent[t]) + in_sums[t] for t in range(rounds)]
        shares = _Shares(sigma * priv.max_update_norm, priv.max_update_norm, q * population / eta, basis)
        received = [[(u, 1) for u in sent[t]] + ([] if summed[t] is None else [summed[t]]) for t in range(rounds)]
        return Verification(
            checks=[*shares.checks(models, received, taking_part, per_check), *common],
            level=level,
            per_check_level=per_check,
        )
    noise, noise_dof, spans, span_dof, counts = 0.0, 0, 0.0, 0, []
    for t in range(rounds):
        clip = clips[t]
        std = update_sigma * clip
        norms = [float(np.linalg.norm(u)) for u in sent[t]]
        clipped = [u * min(1.0, clip / max(n, 1e-300)) for u, n in zip(sent[t], norms)]
        residual = q * population * (models[t + 1] - models[t]) / eta - sum(clipped, np.zeros_like(models[t]))
        residual, dof = _outside(residual, basis)
        noise += float(residual @ residual) / std**2
        noise_dof += dof
        if adaptive:  # the count's noise, from the next C: canary clients (10 C) are never under C
            fraction = priv.target_quantile - math.log(clips[t + 1] / clip) / priv.clip_lr
            canaries = int(counted[t]) - len(sent[t]) if counted is not None else 0
            centred = sum(n <= clip for n in norms) - (len(norms) + canaries) / 2
            counts.append((fraction - 0.5) * q * population - centred)
        if sent[t]:
            span = np.linalg.qr(_outside_all(np.stack(sent[t], axis=1), basis))[0]
            inside = span.T @ residual
            spans += float(inside @ inside) / std**2
            span_dof += span.shape[1]
    checks = [_noise_check(noise, noise_dof, per_check, rounds), _clipping_check(spans, span_dof, per_check), *common]
    if adaptive:
        checks.insert(2, _count_check(np.array(counts), count_noise, per_check))
    return Verification(checks=checks, level=level, per_check_level=per_check)


class _Shares:
    """The checks of a run whose clients add the noise in shares (``--noise-at clients``): each client sends its
    update clipped to C plus N(0, (sigma C)^2 / m), m the round's clients (canary clients included, whose shares the
    server adds), and the server releases their sum over q P.

    - ``shares``: what client k sent is c_k + n_k, its clipped update (|c_k| <= C) and its share n_k ~ N(0, s^2 I),
      s = sigma C / sqrt(m), drawn after c_k. So E = sum_k |sent_k|^2 / s^2 is chi-square with D degrees of freedom
      (every coordinate sent) plus sum_k (|c_k|^2 + 2 <c_k, n_k>) / s^2, whose mean lies in [0, K C^2 / s^2] and
      whose variance is at most 4 K C^2 / s^2 over K updates. E below D by more than the spread allows: a share
      left out or scaled down; E above D + K C^2 / s^2 by more than it allows: updates sent unclipped (or more
      noise than charged). Normal tails, with the variance 2 D + 4 K C^2 / s^2;
    - ``server``: q P (theta_t - theta_{t-1}) / eta less the sum of what the clients sent, outside the canary
      clients' span, is the canary clients' shares alone: N(0, c_t s^2) for c_t of them (zero where none was
      sampled): a server that adds, removes or rescales anything is seen here."""

    def __init__(self, std: float, clip: float, scale: float, basis: np.ndarray | None) -> None:
        self.std, self.clip, self.scale, self.basis = std, clip, scale, basis

    def checks(
        self,
        models: list[np.ndarray],
        sent: list[list[tuple[np.ndarray, int]]],
        taking_part: list[int],
        level: float,
    ) -> list[Check]:
        """The ``shares`` and ``server`` checks over every round; ``sent`` holds each round's vectors received, each
        with how many clients' results it adds up (1, or a secure sum's count n: then n shares, variance n s^2,
        and an update part of norm at most n C, so its energy |v|^2 / (n s^2) has slack n C^2 / s^2)."""
        energy = slack = 0.0
        dof = updates_sent = server = server_dof = 0
        stray = 0.0
        for t, vectors in enumerate(sent):
            share = self.std / math.sqrt(max(taking_part[t], 1))
            for vector, count in vectors:
                energy += float(vector @ vector) / (count * share**2)
                slack += count * self.clip**2 / share**2
                dof += vector.size
                updates_sent += count
            updates = [vector for vector, _ in vectors]
            residual = self.scale * (models[t + 1] - models[t]) - sum(updates, np.zeros_like(models[t]))
            residual, free = _outside(residual, self.basis)
            canaries = taking_part[t] - sum(count for _, count in vectors)
            if canaries > 0:
                server += float(residual @ residual) / (canaries * share**2)
                server_dof += free
            else:  # nothing but float rounding: far below one share's noise
                stray = max(stray, float(np.linalg.norm(residual)) / (share * math.sqrt(free)))
        shares = _shares_check(energy, slack, dof, updates_sent, level)
        return [shares, _server_check(server, server_dof, stray, level)]


def _shares_check(energy: float, slack: float, dof: int, updates: int, level: float) -> Check:
    """The ``shares`` test of :class:`_Shares`: ``energy`` E, ``slack`` K C^2 / s^2, over ``dof`` coordinates."""
    if not dof:
        return Check("shares", True, None, 0, None, "No client sent an update, so no share is tested.")
    spread = math.sqrt(2 * dof + 4 * slack)
    too_small = float(stats.norm.cdf((energy - dof) / spread))
    too_large = float(stats.norm.sf((energy - dof - slack) / spread))
    p = min(1.0, 2 * min(too_small, too_large))
    ratio = energy / dof
    passed = p >= level
    sentence = (
        f"The {updates} updates the clients sent carry their shares of the noise, sigma C / sqrt(m), and at most C "
        f"each besides (energy {ratio:.4f} of the shares' over {dof} coordinates)."
        if passed
        else f"The clients' shares are not the charged noise (energy {ratio:.4g} of the shares' over {dof} "
        "coordinates): "
        + (
            "less than the shares alone carry (a share left out or scaled down)."
            if too_small < too_large
            else "more than the shares and C per update can carry (updates sent unclipped, or noise not charged)."
        )
    )
    return Check("shares", passed, p, dof, energy, sentence, {"energy_ratio": ratio, "updates": updates})


def _server_check(statistic: float, dof: int, stray: float, level: float) -> Check:
    p = _two_sided_chi2(statistic, dof) if dof else 1.0
    passed = p >= level and stray < 1e-3
    sentence = (
        "The server released the sum of what the clients sent (and the canary clients' shares), over q P."
        if passed
        else f"The release is not the sum of what the clients sent over q P (its remainder is {stray:.3g} of a "
        f"share's noise, or the canary clients' part has {statistic / max(dof, 1):.4g} times their shares' "
        "variance): the server added, removed or rescaled something."
    )
    return Check("server", passed, p if stray < 1e-3 else 0.0, dof, statistic, sentence, {"remainder": stray})


def _clip_norms(run: RunDirectory, initial: float, rounds: int) -> list[float]:
    """Adaptive clipping's C of every round (and the one after the last): the first given, each next one the server
    state its round saved. Empty for fixed clipping."""
    norms = [initial]
    for t in range(1, rounds):
        path = run.states.server_path(t)
        if not path.is_file():
            raise AttackError(f"{run.path} has no server state for round {t}, where adaptive clipping keeps its C.")
        norms.append(float(load_file(str(path))["clip_norm"]))
    return norms


def _count_check(errors: np.ndarray, count_noise: float, level: float) -> Check:
    """The noise on each round's count of updates under C, recovered from how C moved: N(0, sigma_b^2)."""
    statistic = float((errors**2).sum()) / count_noise**2
    p = _two_sided_chi2(statistic, len(errors)) if len(errors) else 1.0
    ratio = statistic / len(errors) if len(errors) else math.nan
    passed = p >= level
    sentence = (
        f"How C moved in {len(errors)} rounds is the noisy count of updates under it, with the charged noise "
        f"(variance ratio {ratio:.4g})."
        if passed
        else f"How C moved is not a count of updates under it with the charged noise sigma_b (variance ratio "
        f"{ratio:.4g} over {len(errors)} rounds): the count was released without its noise, or C moved otherwise."
    )
    return Check("quantile", passed, p, len(errors), statistic, sentence, {"variance_ratio": ratio})


def _initial(manifest: Any, seed: int) -> dict[str, np.ndarray]:
    return {name: p.detach().double().numpy() for name, p in initial_params(manifest.model.spec, seed).items()}


def _flat(params: dict[str, Any], names: list[str]) -> np.ndarray:
    return np.concatenate([np.asarray(params[name], dtype=np.float64).ravel() for name in names])


def _sent(run: RunDirectory, round_number: int, names: list[str]) -> list[np.ndarray]:
    folder = run.transmitted_dir / f"round-{round_number:04d}"
    return [_flat(load_file(str(path)), names) for path in sorted(folder.glob("client-*.safetensors"))]


def _summed(run: RunDirectory, round_number: int, names: list[str]) -> tuple[np.ndarray, int] | None:
    """A round's secure sum and how many clients it adds up, where the server received the shares only summed."""
    path = run.transmitted_dir / f"round-{round_number:04d}" / SECURE_SUM_FILE
    if not path.is_file():
        return None
    with safe_open(str(path), "np") as file:
        clients = [k for k in (file.metadata() or {}).get("clients", "").split(",") if k]
    return _flat(load_file(str(path)), names), len(clients)


def _canary_basis(seed: int, log: Any, dimension: int) -> np.ndarray:
    """An orthonormal basis of the canary clients' directions (each drawn from (seed, CANARY, i), as the log's)."""
    directions = np.stack([numpy_rng(seed, Stream.CANARY, i).standard_normal(dimension) for i in range(log.canaries)])
    return np.linalg.qr(directions.T)[0]


def _outside(vector: np.ndarray, basis: np.ndarray | None) -> tuple[np.ndarray, int]:
    """``vector`` with the canary span projected out, and the dimensions left."""
    if basis is None:
        return vector, vector.size
    return vector - basis @ (basis.T @ vector), vector.size - basis.shape[1]


def _outside_all(columns: np.ndarray, basis: np.ndarray | None) -> np.ndarray:
    return columns if basis is None else columns - basis @ (basis.T @ columns)


def _ledger_rate(stored: dict[str, Any], default: float) -> float:
    """The client sampling rate the ledger (privacy.json) charged (the largest of its entries), else the
    configuration's."""
    rates = [float(e["sample_rate"]) for e in stored.get("entries", []) if "sample_rate" in e]
    return max(rates) if rates else default


def _two_sided_chi2(statistic: float, dof: int) -> float:
    return float(min(1.0, 2 * min(stats.chi2.cdf(statistic, dof), stats.chi2.sf(statistic, dof))))


def _noise_check(statistic: float, dof: int, level: float, rounds: int) -> Check:
    p = _two_sided_chi2(statistic, dof)
    ratio = statistic / dof if dof else math.nan
    passed = p >= level
    sentence = (
        f"The released updates of {rounds} rounds, less the clipped updates the clients sent, are noise of the "
        f"charged standard deviation sigma C (variance ratio {ratio:.4f} over {dof} coordinates)."
        if passed
        else f"The released updates less the clipped updates are not N(0, (sigma C)^2): their variance is {ratio:.4g} "
        f"times the charged one over {dof} coordinates (noise missing or scaled, or the sum divided by another "
        "number of clients)."
    )
    return Check("noise", passed, p, dof, statistic, sentence, {"variance_ratio": ratio})


def _clipping_check(statistic: float, dof: int, level: float) -> Check:
    p = float(stats.chi2.sf(statistic, dof)) if dof else 1.0
    passed = p >= level
    sentence = (
        f"Along the {dof} directions of the updates the clients sent, the release carries nothing beyond the clipped "
        "updates and the noise."
        if passed
        else f"Along the clients' own update directions the release carries {statistic / max(dof, 1):.4g} times the "
        "noise's energy: some update was released beyond its clipping norm."
    )
    return Check("clipping", passed, p, dof, statistic, sentence)


def _sampled_counts(run: RunDirectory, log: Any, rounds: int) -> np.ndarray | None:
    """Each round's clients sampled, canary clients included, where the run has canary clients (None otherwise):
    the server's records (server-metrics.csv's ``sampled``), or the canary log of a run written before the count
    moved there (the log goes to others with the run; the count is the server's sample)."""
    if log is None:
        return None
    metrics = run.read_metrics(server=True)
    if "sampled" in metrics.columns:
        return metrics["sampled"].to_numpy()[:rounds].astype(np.int64)
    return np.asarray(log.sampled[:rounds], dtype=np.int64)


def _sampling_check(sampled: int, trials: int, rate: float, level: float) -> Check:
    p = float(stats.binomtest(sampled, trials, rate).pvalue) if trials else 1.0
    passed = p >= level
    observed = sampled / trials if trials else math.nan
    sentence = (
        f"The server sampled {sampled} of {trials} client-rounds, as Poisson sampling at the charged rate "
        f"{rate:.4g} gives."
        if passed
        else f"The server sampled {sampled} of {trials} client-rounds ({observed:.4g}), not what the charged rate "
        f"{rate:.4g} gives."
    )
    return Check("sampling", passed, p, trials, float(sampled), sentence, {"observed_rate": observed, "rate": rate})


def _ledger_check(stored: dict[str, Any], sigma: float, q: float, rounds: int, clients: int) -> Check:
    failures = []
    if stored.get("unit") != "client":
        failures.append(f"the ledger's unit is {stored.get('unit')!r}, not 'client'")
    expected = [{"noise_multiplier": sigma, "sample_rate": q, "steps": rounds}]
    per_client = stored.get("per_client", {})
    wrong = [k for k in range(clients) if (per_client.get(str(k)) or {}).get("entries") != expected]
    if wrong:
        failures.append(f"{len(wrong)} of {clients} clients are not charged {rounds} rounds at sigma {sigma}, q {q}")
    final = (stored.get("epsilon_per_round") or [0.0])[-1]
    exact = recorded_rdp({(sigma, q): rounds}, float(stored.get("delta", 1e-5)))
    if final < exact * (1 - LEDGER_RTOL):
        failures.append(f"its final epsilon {final:.4g} is below the {exact:.4g} of {rounds} such rounds (exact RDP)")
    sentence = (
        f"The ledger charges every one of {clients} clients {rounds} rounds at sigma {sigma:g} and q {q:g}, and its "
        f"epsilon {final:.4g} covers the {exact:.4g} they spend (exact RDP)."
        if not failures
        else "The ledger undercharges: " + "; ".join(failures) + "."
    )
    return Check("ledger", not failures, 1.0 if not failures else 0.0, clients, final, sentence, {"exact_rdp": exact})
