"""Two tables of a run's report that a privacy reviewer signs against: the privacy guarantee laid out as NIST SP
800-226 (Guidelines for Evaluating Differential Privacy Guarantees) asks for it, and the attack families of the
EDPB's Opinion 28/2024 that were tried, not tried, or do not apply (docs/audit.md)."""

from __future__ import annotations

import json

import pandas as pd

from fedaudit.privacy.randomness import CLIENT_SECRETS, NOISE_SEED
from fedaudit.reports.collect import RunSummary
from fedaudit.reports.summary import fmt

RUN, NOT_RUN, NOT_APPLICABLE = "run", "not run", "not applicable"
ASPECTS = (
    "unit of privacy",
    "privacy loss",
    "delta against 1/n",
    "mechanism",
    "composition and conversion",
    "trust model",
    "not counted",
    "outside the guarantee",
)
_ACCOUNTANTS = {
    "rdp": "Renyi DP of the subsampled Gaussian",
    "prv": "the privacy random variable of the subsampled Gaussian, numerically composed",
}


def guarantee_table(run: RunSummary) -> pd.DataFrame:
    """The run's guarantee, one row per aspect NIST SP 800-226 asks an evaluator to state."""
    privacy, setup = run.privacy, run.setup
    budget = str(setup.get("privacy budget", ""))
    rows: list[tuple[str, str]] = []
    if privacy.client_level and privacy.epsilon_per_round:
        rows += _client_level_rows(run)
    elif privacy.dp and privacy.epsilon_per_round:
        rows.append(("unit of privacy", "one training record of one client (record-level DP), not a whole client"))
        rows.append(("privacy loss", f"epsilon {fmt(privacy.epsilon)} at delta {fmt(privacy.delta)}"))
        rows.append(("delta against 1/n", _delta(privacy.delta, run.records)))
        rows.append(
            (
                "mechanism",
                f"the Sampled Gaussian Mechanism at every DP-SGD step: each record's gradient clipped to C = "
                f"{fmt(privacy.max_grad_norm)}, Gaussian noise of standard deviation sigma C with sigma = "
                f"{fmt(privacy.noise_multiplier)}, on Poisson batches"
                + ("" if privacy.sample_rate is None else f" of rate q = {fmt(privacy.sample_rate)} (worst client)"),
            )
        )
        steps = (
            ""
            if privacy.queries_per_round is None
            else f"{privacy.queries_per_round} step{'s' if privacy.queries_per_round != 1 else ''} per round, "
        )
        rows.append(
            (
                "composition and conversion",
                f"{steps}{privacy.worst_client_rounds} round{'s' if privacy.worst_client_rounds != 1 else ''} "
                "taken part in by the worst client, composed by the "
                f"{privacy.accountant} accountant ({_ACCOUNTANTS.get(str(privacy.accountant), 'its own method')}) "
                "and converted to (epsilon, delta); every round a client takes part in is charged in full, with no "
                f"amplification by client sampling (p = {fmt(privacy.client_fraction)})",
            )
        )
    elif "label DP" in budget:
        rows.append(
            (
                "unit of privacy",
                f"the label of one synthetic image sent ({budget}), each randomized once; not the training records, "
                "features or labels: each client's images are matched to its records class by class and sent in "
                "clear, and their number is its number of classes times --distill-ipc",
            )
        )
    elif privacy.dp:
        rows.append(
            (
                "unit of privacy",
                "not stated: the run was trained with differential privacy, but its ledger privacy.json is missing, "
                "so neither what it protects nor its epsilon can be read",
            )
        )
    else:
        rows.append(("unit of privacy", "none: trained without differential privacy, so no record is protected"))
    rows.append(("trust model", _trust(run)))
    rows.append(
        (
            "not counted",
            "hyperparameters tuned on the same records (each run is accounted alone), other runs on the same records, "
            "and side channels (timing, message sizes, memory), which no attack here audits",
        )
    )
    if privacy.dp and privacy.epsilon_per_round:
        rows.append(("outside the guarantee", _server_records(run) if privacy.client_level else _public(run)))
    return pd.DataFrame(rows, columns=["aspect", "what this run guarantees"])


def guarantees_table(runs: list[RunSummary]) -> pd.DataFrame:
    """Every run's guarantee in one table for the top of a report: one row per aspect and group of runs that
    guarantee the same ("every run" when all do), aspects in the order of :func:`guarantee_table`."""
    names = [run.name for run in runs]
    groups: dict[str, dict[str, list[str]]] = {}
    for run in runs:
        for aspect, text in guarantee_table(run).itertuples(index=False):
            groups.setdefault(aspect, {}).setdefault(text, []).append(run.name)
    order = {aspect: i for i, aspect in enumerate(ASPECTS)}
    rows = [
        (aspect, "every run" if len(runs) > 1 and members == names else ", ".join(members), text)
        for aspect in sorted(groups, key=lambda a: order.get(a, len(order)))
        for text, members in groups[aspect].items()
    ]
    return pd.DataFrame(rows, columns=["aspect", "runs", "what is guaranteed"])


def _client_level_rows(run: RunSummary) -> list[tuple[str, str]]:
    """The guarantee of a client-level DP run: a client's data as a whole, one query per round at the server."""
    privacy = run.privacy
    return [
        (
            "unit of privacy",
            "one client's training data as a whole (client-level DP): every record of a client at once, so each "
            "record is protected at least as well",
        ),
        ("privacy loss", f"epsilon {fmt(privacy.epsilon)} at delta {fmt(privacy.delta)}"),
        ("delta against 1/n", _delta(privacy.delta, privacy.clients, "clients")),
        ("mechanism", _client_mechanism(run)),
        (
            "composition and conversion",
            f"one query per round for {privacy.rounds} rounds, charged to every client whether sampled or not, "
            f"composed by the {privacy.accountant} accountant ({_ACCOUNTANTS.get(str(privacy.accountant), 'its own')})"
            + (
                f" with amplification by the server's Poisson sampling of clients at q = {fmt(privacy.client_fraction)}"
                " (the sample is drawn from the server's secret and must stay with the server)"
                if _samples_clients(privacy.client_fraction)
                else " without amplification: every client takes part in every round (q = 1)"
            )
            + ", converted to (epsilon, delta)",
        ),
    ]


def _samples_clients(fraction: float | None) -> bool:
    """Whether the server samples clients (q < 1), which is what amplifies a client-level guarantee."""
    return fraction is not None and fraction < 1


def _public(run: RunSummary) -> str:
    """What a record-level DP run releases outside its guarantee: each client's number of records, and what its
    algorithm sends in clear."""
    facts = run.facts
    clear = f"; {facts.sent_in_clear}" if facts is not None and facts.sent_in_clear else ""
    return f"each client's number of records, public in its sampling rate and steps{clear}"


def _server_records(run: RunSummary) -> str:
    """What a client-level run's directory holds for the server alone, outside the guarantee."""
    norms = (
        ""
        if run.privacy.noise_at == "clients"
        else " and the fraction of updates clipped and their median norm, computed before the noise"
    )
    return (
        f"the server's own records in the run directory: each round's sample of clients (the checkpoints' "
        f"round-NNNN.json, server-metrics.csv){norms}, which the guarantee assumes stay with the server "
        f"(fedaudit export leaves them out of a copy for others)"
    )


def _client_mechanism(run: RunSummary) -> str:
    """The client-level mechanism in words: fixed clipping, or adaptive clipping with its count released beside."""
    privacy = run.privacy
    settings = (json.loads(run.seedless_config) if run.seedless_config else {}).get("privacy") or {}
    sampled = f"each client sampled by the server with probability q = {fmt(privacy.client_fraction)}"
    if settings.get("clipping") == "adaptive":
        return (
            f"one Gaussian mechanism per round at the server with noise multiplier sigma = "
            f"{fmt(privacy.noise_multiplier)}, made of two releases (Andrew et al. 2021): the sum of the clients' "
            f"updates, each clipped to this round's C (from {fmt(privacy.max_update_norm)}, following the "
            f"{fmt(settings.get('target_quantile'))} quantile of the update norms), with Gaussian noise, and the count "
            f"of updates under C with noise of its own; {sampled}"
        )
    if settings.get("noise_at") == "clients":
        return (
            f"the Sampled Gaussian Mechanism once per round, its noise added in shares: each sampled client clips "
            f"its model update to C = {fmt(privacy.max_update_norm)} and adds Gaussian noise of standard deviation "
            f"sigma C / sqrt(m) with sigma = {fmt(privacy.noise_multiplier)} and m the round's clients, so that the "
            f"sum carries sigma C; the server divides the sum by the expected number of clients; {sampled}"
        )
    return (
        f"the Sampled Gaussian Mechanism once per round at the server: each client's model update clipped to C = "
        f"{fmt(privacy.max_update_norm)}, the clipped updates summed, Gaussian noise of standard deviation "
        f"sigma C with sigma = {fmt(privacy.noise_multiplier)} added by the server, divided by the expected number "
        f"of clients; {sampled}"
    )


def _delta(delta: float | None, records: int | None, what: str = "training records") -> str:
    if delta is None or not records:
        return "not available"
    ratio = (1 / records) / delta
    verdict = (
        f"delta is {ratio:.0f} times smaller, as a meaningful guarantee needs"
        if ratio >= 10
        else f"delta is not much smaller than 1/n: a mechanism could reveal a few {what} outright within it"
    )
    return f"delta {fmt(delta)}; 1/n = {1 / records:.3g} for the n = {records} {what}; {verdict}"


def _trust(run: RunSummary) -> str:
    config = json.loads(run.seedless_config) if run.seedless_config else {}
    deployment = bool((config.get("flower") or {}).get("superlink"))
    own = str((config.get("data") or {}).get("dataset", "")).strip().lower() == "sites"
    protected = run.privacy.dp and bool(run.privacy.epsilon_per_round)
    where = (
        "a Flower deployment: each client trains at its own site (a SuperNode)"
        if deployment
        else f"clients run on this machine (engine {run.setup.get('engine', 'local')})"
    )
    if own:
        where += (
            " on the records that site keeps, split into members and held-out records there; besides the model "
            "updates, the server received their counts, positions and keyed hashes, each round every site's test "
            "counts and summed loss, and from an audit the audited records' loss, confidence and gradient norms, "
            "without noise (computed at the sites); this assumes an honest server, since a server that sent a "
            "crafted model could read features of records through those numbers"
            if deployment
            else ", each from its own site's file, read as that site would read it"
        )
    if run.privacy.dp and not protected:
        return (
            f"{where}; the clients trained with DP noise, but without the ledger privacy.json nothing here states "
            "what it protects"
        )
    if not protected:
        return (
            f"{where}; each client sends its update without DP noise, so nothing protects a record against the "
            "server, the network or anyone who sees the final model"
        )
    held = (
        "each site is trusted with its own records"
        if deployment and own
        else "each site is trusted with its records (every site holds the whole dataset and trains its partition; "
        "with --dataset sites each keeps only its own)"
        if deployment
        else "but not against this machine's operator, who holds every client's records"
    )
    if run.privacy.client_level:
        return f"{where}: {_server_noise(run)}"
    return f"{where}: {_noise_holders(run, deployment)}; {held}"


def _server_noise(run: RunSummary) -> str:
    """Whom a client-level run's guarantee holds against: the server is the trusted party of central DP, or with
    the noise in shares, would not need to be if it saw their sum alone."""
    if run.privacy.noise_in_shares and run.privacy.secure_sum:
        return (
            "each sampled client clips its update and adds its share of the noise from its own secret, and the "
            "sites' results are summed under Flower's SecAgg+ (secure aggregation: each masked with masks agreed "
            "with the round's other sites), so the server received their sum alone, which carries the whole noise "
            "(sigma C): the guarantee holds against a server that follows the protocol (honest but curious), and "
            "against anyone who sees the global models; besides the sum the server received each site's number of "
            "examples, local steps and data fingerprint. A round that sampled one client sent its result unmasked "
            "(no sum to hide it in): the accountant's delta covers that chance. A site that took part knows its "
            "own share, so against it the other sites' updates carry noise sigma C sqrt((m - 1) / m). The server "
            "knows the canary clients' shares it adds itself, so in an audit run it sees the real clients' shares "
            "summed with less than the whole noise"
        )
    if run.privacy.noise_in_shares and run.randomness == NOISE_SEED:
        return (
            "each sampled client clips its update and adds its share of the noise, drawn from a public --noise-seed "
            "(for experiments): whoever holds the run's configuration can remove the noise, summed or not, so the "
            "guarantee holds only against those who see the models and not the configuration; the server is trusted"
        )
    if run.privacy.noise_in_shares and run.randomness != NOISE_SEED:
        return (
            "each sampled client clips its update and adds its share of the noise from its own secret, and sends "
            "the result in clear: this engine runs no secure aggregation, so the server saw each client's "
            "clipped update under only its share of the noise (standard deviation sigma C / sqrt(m)), and the "
            "guarantee holds against anyone who sees the global models, not against the server; in a Flower "
            "deployment (--superlink) the shares are summed under Flower's SecAgg+ and the server sees the sum alone"
        )
    if run.randomness == NOISE_SEED:
        return (
            "each client sends its update in clear and the server clips them and adds noise drawn from a public "
            "--noise-seed (for experiments): whoever holds the run's configuration can remove it, so the guarantee "
            "holds only against those who see the models and not the configuration; the server is trusted"
        )
    return (
        "each client sends its update in clear and the server clips the updates, samples the clients and adds noise "
        "drawn from its own secret (server-secret.json, kept in the run directory and left out of an export), so the "
        "guarantee holds against anyone who sees the global models of every round, not against the server, which "
        "sees each client's update"
    )


def _noise_holders(run: RunSummary, deployment: bool) -> str:
    """Where the clients' noise came from and who can therefore remove it: the clients only, or whoever holds a
    public seed."""
    if run.randomness == CLIENT_SECRETS:
        if deployment:
            return (
                "each site adds noise drawn from a secret that only it holds (a file at the site, never sent) and "
                "answers each round once, so the guarantee holds against the server (honest but curious: it sets the "
                "DP settings the sites apply), the network and anyone who sees the final model"
            )
        kept = "in this run directory" if run.secrets_here else "left out of this copy of the run"
        return (
            "each client adds noise drawn from its own secret before sending, so the guarantee holds against the "
            f"server, the network and anyone who sees the final model; whoever holds client-secrets.json ({kept}) "
            "can remove the noise"
        )
    if run.randomness == NOISE_SEED:
        return (
            "each client adds noise drawn from a public --noise-seed (for experiments): whoever holds the run's "
            "configuration, the server included, can remove it, so the guarantee holds only against those who see "
            "just the final model"
        )
    return (
        "each client drew its noise from the run seed (trained before fedaudit kept client secrets): whoever holds "
        "the run's configuration, the server included, can remove it, so the guarantee holds only against those who "
        "see just the final model"
    )


# How the threat model names each membership signal: what it reads and from where.
SIGNAL_WORDS = {
    "loss": "the per-record loss (black-box)",
    "confidence": "the confidence in the true label (black-box)",
    "logit-confidence": "the logit-scaled confidence (black-box)",
    "grad-norm": "the per-record gradient norm (white-box)",
    "synthetic-distance": "the distance to the nearest synthetic image that crossed the wire",
}


def attacks_sentence(run: RunSummary) -> str:
    """What the membership attacks of this report read, from the results it holds (not from the defaults)."""
    order = list(SIGNAL_WORDS)
    records = [a for a in run.attacks if a.method != "canary" and a.unit == "record"]
    signals = sorted({a.signal for a in records}, key=lambda s: (order.index(s) if s in order else len(order), s))
    clients = any(a.unit == "client" for a in run.attacks)
    canaries = any(a.method == "canary" for a in run.attacks)
    if not signals and not clients:
        return (
            "No membership attack has been run on this run yet, so nothing in this report bounds its leakage from "
            "below (the table of attack families gives the command)"
            + ("; its canary audit, below, audits the DP mechanism." if canaries else ".")
        )
    words = [SIGNAL_WORDS.get(s, f"the {s} signal") for s in signals]
    parts = (
        [f"score each record by {', '.join(words[:-1]) + ' and ' if len(words) > 1 else ''}{words[-1]}"]
        if words
        else []
    )
    if clients:
        parts.append("score each client by its records' mean loss on the final model (the client attack)")
    return f"The membership attacks in this report {'; they '.join(parts)}; they give lower bounds on the leakage."


def coverage_table(run: RunSummary) -> pd.DataFrame:
    """Which attack families were tried on the run: run, not run (with how to run it), or not applicable."""
    final = run.final_attacks
    attack = f"fedaudit attack {run.path}"
    rows = [
        (
            "membership inference, black-box (loss, confidence)",
            *_tried(
                [a.label for a in final if a.signal != "grad-norm" and not a.references],
                f"no black-box result on the final model: `{attack}`",
            ),
        ),
        (
            "membership inference, white-box (gradient norm)",
            *_tried([a.label for a in final if a.signal == "grad-norm"], f"`{attack} --signal grad-norm`"),
        ),
        (
            "membership inference with reference models (LiRA, RMIA)",
            *_tried([a.label for a in final if a.references], f"`{attack} --method rmia`"),
        ),
    ]
    if run.privacy.dp:
        client = run.privacy.client_level
        planted = "--canary-clients N" if client else "--dp --canaries N"
        rows.append(
            (
                "canary clients (one-run epsilon bound of the client-level mechanism)"
                if client
                else "canary audit of the DP mechanism (one-run epsilon bound)",
                *_tried(
                    [a.name for a in run.canary_audits],
                    f"train with {planted}, attack with --method canary",
                ),
            )
        )
        verified = run.verification is not None
        rows.append(
            (
                f"conformance of the {'client-level ' if client else ''}mechanism (fedaudit verify)",
                RUN if verified else NOT_RUN,
                f"{len(run.verification.checks)} checks"
                if verified
                else f"`fedaudit verify {run.path}` on "
                + ("a run trained with --save-transmitted" if client else "a canary run"),
            )
        )
    else:
        rows.append(("canary audit and conformance of the DP mechanism", NOT_APPLICABLE, "the run has no DP mechanism"))
    rows.append(
        (
            "reconstruction of records from what crossed the wire (gradient inversion, synthetic sets)",
            *_tried(
                [f"round {r.round} ({len(r.clients)} client(s))" for r in run.reconstruction_rounds],
                f"`{attack} --method reconstruction` on a run trained with --save-transmitted",
            ),
        )
    )
    rows.append(("attribute inference", NOT_RUN, "fedaudit has no attribute inference attack"))
    return pd.DataFrame(rows, columns=["attack family", "status", "which, or how to run it"])


def _tried(labels: list[str], how: str) -> tuple[str, str]:
    return (RUN, ", ".join(sorted(set(labels)))) if labels else (NOT_RUN, how)
