"""Client-level DP with the noise in shares (``--noise-at clients``): ``fedaudit verify`` passes correct runs (20 seeds,
and with canary clients) and catches planted faults at the clients (a share left out, a share scaled by 1/m instead
of 1/sqrt(m), updates sent unclipped) and at the server (noise of its own added, the sum divided by the realised
number of clients); a configuration whose clients could be sampled alone is refused. Runs draw from --noise-seed,
so that each test's outcome is fixed (with fresh secrets, 20 correct runs would be flagged at the checks' level, 0.1%
each: one was, once, its server sampling 83 of 120 client-rounds at q = 0.5)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import FAST_ARGS, invoke, verified_client_level

import fedaudit.algorithms.fedavg as fedavg
from fedaudit.attacks.conformance.client_level import verify_client_level
from fedaudit.rundir import RunDirectory

SHARES = (
    *("--dp", "--dp-level", "client", "--max-update-norm", "0.2", "--noise-multiplier", "1", "--noise-at", "clients"),
    *("--num-clients", "60", "--partition", "iid", "--client-fraction", "0.5", "--save-transmitted"),
)


def _verified(tmp_path, name: str, *extra: str):
    return verified_client_level(tmp_path / name, *SHARES, *extra)


def test_correct_runs_are_never_flagged(tmp_path) -> None:
    for seed in range(20):
        verification = _verified(
            tmp_path, f"run-{seed}", "--rounds", "2", "--seed", str(seed), "--noise-seed", str(seed)
        )
        assert [c.name for c in verification.checks] == ["shares", "server", "sampling", "ledger"]
        assert verification.passed, (seed, [c.sentence for c in verification.checks if not c.passed])


def test_a_run_with_canary_clients_passes_and_the_server_adds_their_shares(tmp_path) -> None:
    verification = _verified(tmp_path, "canaries", "--rounds", "3", "--canary-clients", "40", "--noise-seed", "3")
    assert verification.passed, [c.sentence for c in verification.checks if not c.passed]
    assert verification.check("server").n > 0  # the canary clients' shares were tested, not only the remainder


HONEST_SHARE = fedavg.client_noise_share


def _share(**changed):
    """A client's share with some of its arguments replaced (a planted fault at the clients)."""

    def faulty(update, **kw):
        kw.update({k: (v(kw) if callable(v) else v) for k, v in changed.items()})
        return HONEST_SHARE(update, **kw)

    return faulty


def _unclipped(update, **kw):
    """The charged share of noise on the update as it is: what clipping took off is added back."""
    share, norm = HONEST_SHARE(update, **kw)
    kept = min(1.0, kw["max_update_norm"] / float(norm))
    return {name: share[name] + (1.0 - kept) * update[name] for name in share}, norm


CLIENT_FAULTS = {
    "share-left-out": _share(noise_multiplier=1e-9),
    "share-over-m": _share(participants=lambda kw: kw["participants"] ** 2),
    "unclipped": _unclipped,
}


@pytest.mark.parametrize("fault", CLIENT_FAULTS, ids=list(CLIENT_FAULTS))
def test_a_faulty_share_is_caught(tmp_path, monkeypatch, fault: str) -> None:
    monkeypatch.setattr(fedavg, "client_noise_share", CLIENT_FAULTS[fault])
    verification = _verified(tmp_path, "run", "--rounds", "3", "--lr", "0.5", "--noise-seed", "3")
    assert not verification.check("shares").passed, verification.check("shares").sentence


def _as_secure_sums(run) -> None:
    """What a Flower deployment keeps of the same run (SecAgg+): each round's client files replaced by their sum,
    with the clients it adds up."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    for folder in sorted((run / "transmitted").glob("round-*")):
        files = sorted(folder.glob("client-*.safetensors"))
        sent = [load_file(str(f)) for f in files]
        total = {name: np.sum([s[name] for s in sent], axis=0, dtype=np.float64).astype(np.float32) for name in sent[0]}
        clients = ",".join(str(int(f.stem.split("-")[1])) for f in files)
        save_file(total, str(folder / "secure-sum.safetensors"), metadata={"round": folder.name, "clients": clients})
        for f in files:
            f.unlink()


@pytest.mark.parametrize("fault", [None, *CLIENT_FAULTS], ids=["correct", *CLIENT_FAULTS])
def test_shares_received_only_summed_are_checked_as_sums(tmp_path, monkeypatch, fault: str | None) -> None:
    """Runs as above with what the server kept turned into each round's secure sum: the correct one passes (every
    client counted once), each faulty share is still caught. From a sum alone the clipping is seen only where the
    clients' updates add up to more than n C: at --lr 0.5 the unclipped updates' sum stays under it (as the
    server, holding the sum alone, cannot tell them from clipped ones); at --lr 4 it does not."""
    if fault is not None:
        monkeypatch.setattr(fedavg, "client_noise_share", CLIENT_FAULTS[fault])
    run = tmp_path / "run"
    result = invoke("train", *FAST_ARGS, *SHARES, "--rounds", "3", "--lr", "4", "--noise-seed", "3", "--out", run)
    assert result.exit_code == 0, result.output
    counted = sum(len(list(f.glob("client-*"))) for f in (run / "transmitted").glob("round-*"))
    _as_secure_sums(run)
    verification = verify_client_level(RunDirectory(run))
    shares = verification.check("shares")
    if fault is None:
        assert verification.passed, [c.sentence for c in verification.checks if not c.passed]
        assert shares.details["updates"] == counted > 0
    else:
        assert not shares.passed, shares.sentence


def _server_adding_noise(global_params, messages, ctx, expected, generator):
    result = HONEST_SUM(global_params, messages, ctx, expected, generator)
    noisy = {name: p + 0.01 * torch.randn(p.shape, generator=generator) for name, p in result.params.items()}
    return fedavg.ServerResult(params=noisy)


def _server_dividing_by_realised(global_params, messages, ctx, expected, generator):
    return HONEST_SUM(global_params, messages, ctx, max(len(messages), 1), generator)


HONEST_SUM = fedavg.FedAvg._sum_of_shares
SERVER_FAULTS = {"server-noise": _server_adding_noise, "realised-denominator": _server_dividing_by_realised}


@pytest.mark.parametrize("fault", SERVER_FAULTS, ids=list(SERVER_FAULTS))
def test_a_faulty_server_is_caught(tmp_path, monkeypatch, fault: str) -> None:
    monkeypatch.setattr(fedavg.FedAvg, "_sum_of_shares", staticmethod(SERVER_FAULTS[fault]))
    verification = _verified(tmp_path, "run", "--rounds", "3", "--noise-seed", "3")
    assert not verification.check("server").passed, verification.check("server").sentence


def test_the_ledger_spends_delta_less_the_chance_of_a_client_sampled_alone(tmp_path) -> None:
    run = tmp_path / "run"
    assert invoke("train", *FAST_ARGS, *SHARES, "--rounds", "2", "--out", run).exit_code == 0
    ledger = json.loads((run / "privacy.json").read_text())
    alone = 2 * 0.5 * 0.5**59  # T q (1 - q)^(K - 1)
    assert ledger["delta"] == pytest.approx(1e-5 - alone, rel=1e-12, abs=0) and ledger["delta"] < 1e-5
    assert invoke("verify", run).exit_code == 0


@pytest.mark.parametrize(
    "extra, says",
    [
        (("--num-clients", "8"), "sampled alone"),
        (("--clipping", "adaptive"), "--clipping adaptive needs --noise-at server"),
    ],
)
def test_configurations_the_shares_cannot_protect_are_refused(tmp_path, extra, says) -> None:
    run = tmp_path / "run"
    result = invoke("train", *FAST_ARGS, *SHARES, "--rounds", "2", *extra, "--out", run)
    assert result.exit_code == 2 and says in result.output and not run.exists(), result.output


def test_noise_at_clients_needs_client_level(tmp_path) -> None:
    run = tmp_path / "run"
    result = invoke("train", *FAST_ARGS, "--dp", "--noise-at", "clients", "--out", run)
    assert result.exit_code == 2 and "add --dp --dp-level client" in result.output and not run.exists()
