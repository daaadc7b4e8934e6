"""Client-level DP's mechanism and accounting, against closed forms, Flower's server-side fixed clipping and its
accountant, and Google's dp-accounting; and a trained client-level run against its own transmitted updates."""

from __future__ import annotations

import json
import shutil
import stat

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import FAST_ARGS, invoke
from safetensors.numpy import load_file

from fedaudit.attacks.conformance.client_level import verify_client_level
from fedaudit.models import initial_params
from fedaudit.preparation import prepare
from fedaudit.privacy.accounting import RDP_ORDERS, PrivacyLedger, round_events
from fedaudit.privacy.primitive import client_level_mean, client_noise_share
from fedaudit.privacy.randomness import SERVER_NOISE, SeededServerKeys, add_gaussian
from fedaudit.rundir import RunDirectory

SHAPES = {"conv.weight": (4, 1, 3, 3), "conv.bias": (4,), "fc.weight": (10, 16)}


def _updates(norms: list[float], seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Updates of the given L2 norms (over all tensors), in random directions."""
    rng = np.random.default_rng(seed)
    updates = []
    for norm in norms:
        parts = {name: rng.standard_normal(shape) for name, shape in SHAPES.items()}
        total = np.sqrt(sum(float((p**2).sum()) for p in parts.values()))
        updates.append({name: torch.from_numpy(p * norm / total).float() for name, p in parts.items()})
    return updates


def _like() -> dict[str, torch.Tensor]:
    return {name: torch.zeros(shape) for name, shape in SHAPES.items()}


def _silent(generator_seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(generator_seed)


def test_each_update_is_clipped_to_c_and_the_sum_divided_by_the_expected_clients() -> None:
    """sigma -> 0: the release is sum_k u_k min(1, C / ||u_k||) / (q K), in float64 by hand; a non-finite update
    adds nothing; the norms returned are the updates' own."""
    updates = _updates([0.5, 3.0, 1.0, 7.5], seed=1)
    updates.append({name: torch.full(shape, float("nan")) for name, shape in SHAPES.items()})
    released, norms = client_level_mean(
        updates, _like(), max_update_norm=1.0, noise_multiplier=1e-12, expected_clients=2.5, generator=_silent()
    )
    assert np.allclose(norms[:4].numpy(), [0.5, 3.0, 1.0, 7.5], rtol=1e-5)
    for name in SHAPES:
        expected = sum(u[name].double().numpy() * min(1.0, 1.0 / n) for u, n in zip(updates[:4], [0.5, 3.0, 1.0, 7.5]))
        assert np.allclose(released[name].double().numpy(), expected / 2.5, rtol=1e-5, atol=1e-7)


def test_the_noise_has_standard_deviation_sigma_c_over_q_k_and_comes_alone_when_nobody_was_sampled() -> None:
    released, norms = client_level_mean(
        [], {"w": torch.zeros(200_000)}, max_update_norm=0.5, noise_multiplier=2.0, expected_clients=4.0,
        generator=_silent(3),
    )  # fmt: skip
    assert len(norms) == 0
    noise = released["w"].double()
    assert abs(float(noise.mean())) < 4 * 0.25 / np.sqrt(200_000)
    assert float(noise.std()) == pytest.approx(2.0 * 0.5 / 4.0, rel=0.01)


def test_a_clients_noise_share_is_its_clipped_update_plus_sigma_c_over_root_m_and_m_shares_make_sigma_c() -> None:
    """--noise-at clients: a share is u min(1, C / ||u||) plus N(0, (sigma C)^2 / m), by hand in float64; the noise
    of m shares (each from its own generator) sums to standard deviation sigma C, as the server's single draw."""
    direction = torch.randn(200_000, generator=_silent(5), dtype=torch.float64)
    update = {"w": (direction * 5.0 / direction.norm()).float()}
    share, norm = client_noise_share(
        update, max_update_norm=1.0, noise_multiplier=2.0, participants=16, generator=_silent(7)
    )
    assert float(norm) == pytest.approx(5.0, rel=1e-5)
    noise = share["w"].double() - update["w"].double() / 5.0
    assert float(noise.std()) == pytest.approx(2.0 * 1.0 / 4.0, rel=0.01)
    assert abs(float(noise @ update["w"].double())) / 5.0 < 5 * 0.5  # independent of the update's direction
    zero = {"w": torch.zeros(50_000)}
    total = sum(
        client_noise_share(zero, max_update_norm=0.5, noise_multiplier=2.0, participants=9, generator=_silent(k))[0][
            "w"
        ].double()
        for k in range(9)
    )
    assert float(total.std()) == pytest.approx(2.0 * 0.5, rel=0.02)
    with pytest.raises(ValueError, match="number of clients"):
        client_noise_share(zero, max_update_norm=0.5, noise_multiplier=2.0, participants=0, generator=_silent())


def test_clipping_and_noise_scale_equal_flowers_server_side_fixed_clipping() -> None:
    """Flower's DifferentialPrivacyServerSideFixedClipping clips each update with clip_inputs_inplace and adds noise
    of compute_stdv(sigma, C, n) to the mean of n sampled clients: with every client sampled (q K = n), the same
    clipped mean and the same standard deviation."""
    dp = pytest.importorskip("flwr.supercore.differential_privacy")
    updates = _updates([0.2, 2.0, 5.0], seed=2)
    flower = []
    for update in updates:
        arrays = [update[name].numpy().copy() for name in SHAPES]
        dp.clip_inputs_inplace(arrays, 1.5)
        flower.append(arrays)
    ours, _ = client_level_mean(
        updates, _like(), max_update_norm=1.5, noise_multiplier=1e-12, expected_clients=3.0, generator=_silent()
    )
    for i, name in enumerate(SHAPES):
        assert np.allclose(ours[name].numpy(), np.mean([arrays[i] for arrays in flower], axis=0), rtol=1e-5, atol=1e-7)
    noise, _ = client_level_mean(
        [], {"w": torch.zeros(100_000)}, max_update_norm=1.5, noise_multiplier=0.8, expected_clients=3.0,
        generator=_silent(4),
    )  # fmt: skip
    assert float(noise["w"].double().std()) == pytest.approx(dp.compute_stdv(0.8, 1.5, 3), rel=0.015)


@pytest.mark.parametrize("sigma, q, rounds", [(1.0, 1.0, 5), (1.1, 0.1, 50), (0.8, 0.02, 200)])
def test_the_client_level_ledger_equals_dp_accounting_and_flowers_accountant(sigma: float, q: float, rounds: int):
    """Every client charged one Poisson-sampled Gaussian per round at the server's rate: the ledger's epsilon is
    dp-accounting's RDP epsilon of that composition and Flower's RdpAccountant's (Poisson sampling, add/remove one
    client), each on the same orders."""
    import dp_accounting
    from flwr.supercore.privacy_accounting import (
        GaussianPrivacyEvent,
        NeighboringRelation,
        PrivacyConfig,
        SamplingMethod,
    )
    from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

    clients, delta = 50, 1e-5
    ledger = PrivacyLedger(
        accountant="rdp", delta=delta, noise_multiplier=sigma, max_grad_norm=None, unit="client", max_update_norm=1.0
    )
    for _ in range(rounds):
        epsilon = ledger.record_round(
            {k: round_events(noise_multiplier=sigma, sample_rate=q, queries_per_round=1) for k in range(clients)}
        )
    reference = dp_accounting.rdp.RdpAccountant(orders=list(RDP_ORDERS))
    reference.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), rounds
        )
    )
    config = PrivacyConfig(delta, clients, NeighboringRelation.ADD_OR_REMOVE_ONE, SamplingMethod.POISSON)
    flower = RdpAccountant(config, orders=tuple(RDP_ORDERS))
    flower.compose(GaussianPrivacyEvent(sigma, round(q * clients), clients), rounds)
    assert epsilon == pytest.approx(reference.get_epsilon(delta), rel=2e-3)
    assert epsilon == pytest.approx(flower.get_epsilon(delta), rel=2e-3)
    assert set(ledger.client_epsilons) == set(range(clients)) and ledger.to_dict()["unit"] == "client"
    assert PrivacyLedger.from_dict(json.loads(json.dumps(ledger.to_dict()))).epsilon == epsilon


CLIENT_LEVEL = ("--dp", "--dp-level", "client", "--max-update-norm", "0.5", "--noise-multiplier", "0.7")


@pytest.mark.parametrize("clients, fraction", [(3, 1.0), (6, 0.5)])
def test_a_trained_round_is_the_clipped_noised_mean_of_what_the_clients_sent(tmp_path, clients, fraction) -> None:
    """One round with --noise-seed: the new global model is the initial one plus the server's step times (the
    clipped updates the sampled clients sent, summed, plus the server's noise) over q K, not over the clients that
    happened to be sampled; the noise regenerated from the seed's server stream."""
    run = tmp_path / "run"
    args = (*FAST_ARGS, *CLIENT_LEVEL, "--rounds", "1", "--noise-seed", "11", "--save-transmitted")
    result = invoke("train", *args, "--num-clients", str(clients), "--client-fraction", str(fraction), "--out", run)
    assert result.exit_code == 0, result.output
    config = json.loads((run / "config.json").read_text())
    initial = _initial(run)
    final = load_file(str(run / "model.safetensors"))
    sent = [load_file(str(path)) for path in sorted((run / "transmitted").rglob("*.safetensors"))]
    assert len(sent) == (clients if fraction == 1 else 2)  # a sample of 2 of 6 at q = 0.5: q K = 3 divides
    norms = [np.sqrt(sum(float((u[name].astype(np.float64) ** 2).sum()) for name in initial)) for u in sent]
    clipped = {
        name: sum(u[name].astype(np.float64) * min(1.0, 0.5 / n) for u, n in zip(sent, norms)) for name in initial
    }
    source = SeededServerKeys(11).query_source(0, SERVER_NOISE, "cpu")
    noise = {
        name: add_gaussian(torch.zeros(initial[name].shape), 0.7 * 0.5, source).double().numpy() for name in initial
    }
    step = config["federated"]["server_lr"]
    for name in initial:
        expected = initial[name] + step * (clipped[name] + noise[name]) / (fraction * clients)
        assert np.allclose(final[name], expected, rtol=1e-4, atol=1e-6), name
    ledger = json.loads((run / "privacy.json").read_text())
    assert ledger["unit"] == "client" and ledger["max_update_norm"] == 0.5
    assert ledger["entries"] == [{"noise_multiplier": 0.7, "sample_rate": fraction, "steps": 1}]


def _initial(run) -> dict[str, np.ndarray]:
    """The run's round-0 model, as training draws it from the seed."""
    setup = prepare(RunDirectory(run).read_run_config(), device="cpu")
    return {name: p.double().numpy() for name, p in initial_params(setup.spec, setup.config.seed).items()}


def test_the_server_samples_clients_from_a_secret_of_its_own_kept_out_of_the_copy(tmp_path) -> None:
    """Without --noise-seed the server's sample and noise come from server-secret.json (mode 0600, no hash in the
    manifest, left out of an export): the same seed trains another model, and each round's clients are a Poisson
    sample, not the seed's fixed-size choice."""
    args = (*FAST_ARGS, *CLIENT_LEVEL, "--num-clients", "8", "--client-fraction", "0.5", "--rounds", "4")
    first, second = tmp_path / "first", tmp_path / "second"
    for run in (first, second):
        assert invoke("train", *args, "--out", run).exit_code == 0
    secret = first / "server-secret.json"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert "server-secret.json" not in json.loads((first / "manifest.json").read_text())["files"]
    assert _weights(first) != _weights(second)
    counts = [
        *pd.read_csv(first / "server-metrics.csv")["clients"],
        *pd.read_csv(second / "server-metrics.csv")["clients"],
    ]
    assert len(set(counts)) > 1, counts  # ceil(q K) = 4 every round if it were the seed's choice
    exported = tmp_path / "exported"
    assert invoke("export", first, "--out", exported).exit_code == 0
    assert not (exported / "server-secret.json").exists() and (exported / "privacy.json").exists()


def test_a_copy_for_others_holds_nothing_of_the_servers_sample_and_still_checks(tmp_path) -> None:
    """A client-level run's sample (which clients, how many: the bytes count them too) and its un-noised update
    statistics are the server's: metrics.csv holds none of them, and an export leaves out the files that do (listed
    in its export.json); the copy verifies, is attacked and reported. Its record excuses no other missing file, and
    the run itself without them fails. A run whose manifest names a file per client and round is not exported."""
    run, copy = tmp_path / "run", tmp_path / "copy"
    args = (*FAST_ARGS, *CLIENT_LEVEL, "--num-clients", "6", "--client-fraction", "0.5", "--rounds", "2")
    assert invoke("train", *args, "--out", run).exit_code == 0
    public, server = pd.read_csv(run / "metrics.csv"), pd.read_csv(run / "server-metrics.csv")
    assert list(public.columns) == ["round", "test_accuracy", "test_loss", "epsilon", "clip_norm"]  # time counts too
    assert {"clients", "bytes_up", "clipped_updates", "update_norm_median", "wall_seconds"} <= set(server.columns)
    # the copy keeps the hashes of what it leaves out: each record is salted from the server's secret, so that a
    # guess of a round's sample (its clients, steps and bytes are otherwise predictable) cannot be matched
    salts = [json.loads((run / "checkpoints" / f"round-000{n}.json").read_text())["salt"] for n in (1, 2)]
    assert len(set(salts)) == 2 and all(len(salt) == 32 for salt in salts) and list(server["salt"]) == salts
    result = invoke("export", run, "--out", copy)
    assert result.exit_code == 0 and "3 file(s) only the server may see" in result.output, result.output
    left_out = json.loads((copy / "export.json").read_text())["left_out"]
    expected = {"server-metrics.csv", "checkpoints/round-0001.json", "checkpoints/round-0002.json"}
    assert set(left_out) == expected and not any((copy / name).exists() for name in expected)
    held = b"".join(path.read_bytes() for path in copy.rglob("*") if path.is_file())
    assert b"clipped_updates" not in held and b"bytes_up" not in held and b'"clients": [' not in held
    for command in (("verify", copy), ("attack", copy, "--signal", "loss", "--method", "threshold")):
        result = invoke(*command)
        assert result.exit_code == 0, result.output
    assert invoke("report", copy, "--out", tmp_path / "report", "--format", "md").exit_code == 0
    for damage in ("model.safetensors", "membership.npz"):  # an export record excuses no other file
        broken = tmp_path / f"broken-{damage}"
        shutil.copytree(copy, broken)
        record = json.loads((broken / "export.json").read_text())
        (broken / "export.json").write_text(json.dumps({**record, "left_out": {**left_out, damage: "mine"}}))
        (broken / damage).unlink()
        assert invoke("verify", broken).exit_code == 1
    (run / "export.json").write_text((copy / "export.json").read_text())  # planted beside the server's secret
    (run / "server-metrics.csv").unlink()  # the run itself: no record excuses it
    assert invoke("verify", run).exit_code == 1
    sent = tmp_path / "sent"
    assert invoke("train", *args, "--save-transmitted", "--out", sent).exit_code == 0
    result = invoke("export", sent, "--out", tmp_path / "sent-copy")
    assert result.exit_code == 2 and "names the clients each round sampled" in result.output
    assert not (tmp_path / "sent-copy").exists()


def test_scaffold_at_client_level_writes_its_clients_states_every_round_and_keeps_them_from_the_copy(tmp_path):
    """SCAFFOLD's client states move with each client's unclipped update: the server's files keep them, written
    every round (a round without a file would say it sampled nobody), and a copy for others leaves them out."""
    run, copy = tmp_path / "run", tmp_path / "copy"
    args = (*FAST_ARGS, *CLIENT_LEVEL, "--algorithm", "scaffold", "--local-steps", "2", "--num-clients", "6")
    extra = ("--client-fraction", "0.1", "--rounds", "5", "--noise-seed", "3", "--delta", "1e-3")
    assert invoke("train", *args, *extra, "--out", run).exit_code == 0
    assert 0 in set(pd.read_csv(run / "server-metrics.csv")["clients"])  # a round that sampled nobody
    states = RunDirectory(run).states
    assert all(states.path(number).is_file() for number in range(1, 6))
    assert invoke("export", run, "--out", copy).exit_code == 0
    assert not list((copy / "checkpoints").glob("*-clients.safetensors"))
    assert invoke("verify", copy).exit_code == 0


def test_a_resumed_client_level_run_reads_the_servers_secret_back_and_is_the_same_run(tmp_path, fixed_secrets):
    args = (*FAST_ARGS, *CLIENT_LEVEL, "--num-clients", "8", "--client-fraction", "0.5", "--lr-schedule", "constant")
    whole, resumed, lost = tmp_path / "whole", tmp_path / "resumed", tmp_path / "lost"
    assert invoke("train", *args, "--rounds", "4", "--out", whole).exit_code == 0
    assert invoke("train", *args, "--rounds", "2", "--out", resumed).exit_code == 0
    shutil.copytree(resumed, lost)
    result = invoke("train", "--resume", resumed, "--rounds", "4")
    assert result.exit_code == 0, result.output
    assert _weights(resumed) == _weights(whole)
    (lost / "server-secret.json").unlink()
    result = invoke("train", "--resume", lost, "--rounds", "4")
    assert result.exit_code == 2 and "server-secret.json is missing" in result.output


def _weights(run) -> dict[str, bytes]:
    return {name: array.tobytes() for name, array in load_file(str(run / "model.safetensors")).items()}


def test_the_report_and_verify_state_the_client_as_the_unit(tmp_path) -> None:
    """The report says what a client-level run protects and how it was accounted; verify, on a run trained without
    --save-transmitted, checks the files and ledger and says why it could not check the mechanism."""
    run, report = tmp_path / "run", tmp_path / "report"
    args = (*FAST_ARGS, *CLIENT_LEVEL, "--num-clients", "6", "--client-fraction", "0.5", "--rounds", "2")
    assert invoke("train", *args, "--out", run).exit_code == 0
    assert invoke("attack", run, "--signal", "loss", "--method", "threshold").exit_code == 0
    assert invoke("report", run, "--out", report, "--format", "md").exit_code == 0
    text = (report / "report.md").read_text()
    epsilon = json.loads((run / "privacy.json").read_text())["epsilon_per_round"][-1]
    assert f"DP-FedAvg (client level) promises epsilon {epsilon:.3f} at delta 1e-05 per client" in text
    assert "one client's training data as a whole (client-level DP)" in text
    assert "1/n = 0.167 for the n = 6 clients" in text
    assert "amplification by the server's Poisson sampling of clients at q = 0.500" in text
    assert "not against the server, which sees each client's update" in text
    assert "one training record of one client (record-level DP)" not in text
    result = invoke("verify", run)
    assert result.exit_code == 0 and "PASS integrity" in result.output
    assert "conformance not checked: it was trained without --save-transmitted" in result.output


def test_scaffold_at_client_level_moves_its_control_variate_by_the_release_alone(tmp_path) -> None:
    """Round 1 from c = 0: the server's control variate is q (-c - released / (K eta_l)), the released update
    (theta_1 - theta_0) / eta_s read from the run's own files; verify passes the run."""
    run = tmp_path / "run"
    args = (*FAST_ARGS, *CLIENT_LEVEL, "--algorithm", "scaffold", "--local-steps", "3", "--lr", "0.1")
    extra = ("--num-clients", "6", "--client-fraction", "0.5", "--rounds", "1", "--save-transmitted")
    result = invoke("train", *args, *extra, "--lr-schedule", "constant", "--noise-seed", "2", "--out", run)
    assert result.exit_code == 0, result.output
    initial = _initial(run)
    final = load_file(str(run / "model.safetensors"))
    control = load_file(str(RunDirectory(run).states.server_path(1)))
    step = json.loads((run / "config.json").read_text())["federated"]["server_lr"]
    for name in initial:
        released = (final[name].astype(np.float64) - initial[name]) / step
        assert np.allclose(control[name], 0.5 * (-released / (3 * 0.1)), rtol=1e-4, atol=1e-6), name
    assert verify_client_level(RunDirectory(run)).passed


SHARES = (*CLIENT_LEVEL, "--noise-at", "clients", "--num-clients", "30", "--client-fraction", "0.3", "--delta", "1e-3")


def test_a_run_with_the_noise_in_shares_resumed_for_more_rounds_is_accounted_as_a_run_of_those_rounds(
    tmp_path,
) -> None:
    """With the noise in shares the accountant's delta is --delta less the chance that some round samples a client
    alone, which grows with the rounds: a run resumed for more rounds accounts every round at the new delta (its
    ledger equals a run trained for those rounds from the start), verify passes it, and it can be resumed again."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert invoke("train", *FAST_ARGS, *SHARES, "--rounds", "4", "--out", whole).exit_code == 0
    assert invoke("train", *FAST_ARGS, *SHARES, "--rounds", "2", "--out", resumed).exit_code == 0
    before = json.loads((resumed / "privacy.json").read_text())
    result = invoke("train", "--resume", resumed, "--rounds", "4")
    assert result.exit_code == 0, result.output
    after, planned = (json.loads((run / "privacy.json").read_text()) for run in (resumed, whole))
    assert after["delta"] == planned["delta"] < before["delta"] < 1e-3
    assert after["epsilon_per_round"] == planned["epsilon_per_round"]
    assert after["epsilon_per_round"][:2] != before["epsilon_per_round"]  # the first rounds accounted anew
    result = invoke("verify", resumed)
    assert result.exit_code == 0 and "PASS integrity" in result.output, result.output
    assert invoke("train", "--resume", resumed, "--rounds", "5").exit_code == 0


def test_a_client_level_run_records_no_clients_training_loss(tmp_path) -> None:
    """A client's training loss is a function of its records without noise: a client-level run's checkpoints keep
    each client's number of steps, not its loss (a run without DP keeps both)."""
    for name, extra in (("dp", CLIENT_LEVEL), ("plain", ())):
        run = tmp_path / name
        args = (*FAST_ARGS, *extra, "--num-clients", "4", "--rounds", "1", "--out", run)
        assert invoke("train", *args).exit_code == 0
        clients = json.loads((run / "checkpoints" / "round-0001.json").read_text())["clients"]
        assert clients and all("local_steps" in client for client in clients)
        assert all(("train_loss" in client) == (name == "plain") for client in clients), clients
