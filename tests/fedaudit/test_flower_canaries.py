"""Canary clients in a Flower app (fedaudit.flower.CanaryClients) and the audit of their log.

The app (tests/support/flower_digits.py) is written with Flower's API only: a ClientApp that trains a small MLP on its
share of digits, a ServerApp with FedAvg under DifferentialPrivacyServerSideFixedClipping, run on Flower's simulation
runtime in this process. One simulation (Ray started once, shared by the xdist workers through a lock) trains seven
runs in turn:

- four correct runs (two sampling 10% of the population for 8 rounds, two taking every client for 3 rounds), each
  with five nested canary sets of 100 canaries drawn from their own seeds: 20 canary seeds. Each set's audit is a
  valid audit of its run (the other sets' canary clients are other clients of the population, whose inclusion bits
  are independent of its own), so each of the 20 has at most a 5% chance of a bound above the accountant's epsilon;
  those of one run share its noise and are not independent samples;
- three runs with a fault planted in Flower's own code for their duration: the noise's standard deviation computed
  as 0, clipping switched off, the noise added to the first round's aggregate only.

Beside them, the wrapper is checked without a simulation against Flower's client-side clipping mod, LocalDpMod and
Flower's own accountant, and for the set-ups it refuses.
"""

from __future__ import annotations

import fcntl
import math
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

flwr = pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp.mod import LocalDpMod, fixedclipping_mod  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402
from flwr.serverapp.strategy import (  # noqa: E402
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
)
from helpers import invoke  # noqa: E402

from fedaudit.attacks.canary.flower_log import audit_log  # noqa: E402
from fedaudit.flower import CanaryClients, CanaryClientsError, canary_client_count  # noqa: E402
from fedaudit.instruments.canary_log import read_log  # noqa: E402
from fedaudit.seeding import Stream, numpy_rng  # noqa: E402

SUPPORT = Path(__file__).resolve().parents[1] / "support"
NULL_SETS = 5


def _scenarios() -> list:
    from flower_digits import FAULTS, Scenario

    null = [
        Scenario(
            f"null{seed}",
            seed=seed,
            fraction=fraction,
            rounds=rounds,
            noise_multiplier=sigma,
            canaries=tuple((100, 100 + 10 * seed + k) for k in range(NULL_SETS)),
            keep_models=seed == 0,
        )
        for seed, (fraction, rounds, sigma) in enumerate([(0.1, 8, 1.0), (0.1, 8, 1.0), (1.0, 3, 2.0), (1.0, 3, 2.0)])
    ]
    faulty = [
        Scenario(fault, seed=10 + i, fraction=0.1, rounds=8, canaries=((500, 200 + i),), fault=fault)
        for i, fault in enumerate(FAULTS)
    ]
    return null + faulty


@pytest.fixture(scope="module")
def simulation(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """The logs of every scenario, simulated once per test session (the xdist workers share them through a lock)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out = root / "flower-canaries"
    scenarios = _scenarios()
    with open(root / "flower-canaries.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "done").exists():
            from flower_digits import simulate

            saved = os.environ.get("PYTHONPATH")
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SUPPORT), saved]))  # Ray's workers import it
            os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
            try:
                simulate(scenarios, out)
            finally:
                os.environ.pop("PYTHONPATH") if saved is None else os.environ.update(PYTHONPATH=saved)
            (out / "done").write_text("")
    return out, scenarios


def _scenario(scenarios: list, name: str):
    return next(s for s in scenarios if s.name == name)


# --- the log of a real Flower run ---------------------------------------------------------------------------------


def test_the_log_holds_the_cosines_a_slow_loop_computes(simulation) -> None:
    """Every round's cosines and the final model's, recomputed from the global models Flower handed to evaluate_fn,
    with each direction drawn again from its stream and every dot product summed one term at a time."""
    out, scenarios = simulation
    scenario = _scenario(scenarios, "null0")
    models = np.load(out / "null0-models.npz")
    models = [models[f"arr_{i}"].astype(np.float64) for i in range(len(models.files))]
    assert len(models) == scenario.rounds + 1
    population = 10 + sum(canary_client_count(count, seed) for count, seed in scenario.canaries)
    for count, seed in scenario.canaries[:: NULL_SETS - 1]:  # the innermost and the outermost set
        log = read_log(scenario.log(out, seed))
        assert log.dimension == models[0].size == 2410 and log.rounds == scenario.rounds
        np.testing.assert_array_equal(log.included, numpy_rng(seed, Stream.CANARY_DRAW).random(count) < 0.5)
        assert (log.population == population).all() and (log.sampled == int(population * 0.1)).all()
        updates = [b - a for a, b in zip(models, models[1:])] + [models[-1] - models[0]]
        for i in range(count):
            direction = numpy_rng(seed, Stream.CANARY, i).standard_normal(log.dimension)
            direction /= math.sqrt(math.fsum(direction * direction))
            for t, update in enumerate(updates):
                cosine = math.fsum(update * direction) / math.sqrt(math.fsum(update * update))
                logged = log.round_cosines[t, i] if t < scenario.rounds else log.final_cosines[i]
                assert logged == pytest.approx(cosine, abs=1e-12), (seed, i, t)
        assert log.round_norms == pytest.approx([np.linalg.norm(u) for u in updates[:-1]], rel=1e-12)


def test_a_canary_client_adds_exactly_c_over_n_along_its_direction(simulation) -> None:
    """With the noise removed, a round's aggregate is the mean of the n clipped updates: along an included canary's
    direction it moves by C / n when the canary was sampled (clipped from 10 C to C, weighted 1/n like the others)
    and by 0 otherwise, up to the other updates' overlap (sd about sqrt(n / d) = 0.1 in these units); an excluded
    canary's direction sees the overlap only. With clipping off (and the noise on), an included canary moves by
    10 C / n on average over the rounds it is sampled in, q = n / N of them."""
    out, scenarios = simulation
    scenario = _scenario(scenarios, "noise-zero")
    along, included = _along_all(read_log(scenario.log(out, scenario.canaries[0][1])))
    inside, outside = along[:, included == 1], along[:, included == 0]
    moved = inside[inside > 0.5]
    assert np.abs(outside).max() < 0.5 and np.abs(inside[inside <= 0.5]).max() < 0.5
    assert moved.size > 100 and abs(moved.mean() - 1.0) < 0.03, (moved.size, moved.mean())
    scenario = _scenario(scenarios, "no-clipping")
    log = read_log(scenario.log(out, scenario.canaries[0][1]))
    along, included = _along_all(log)
    expected = 10.0 * float(np.mean(log.sampled / log.population))
    gap = along[:, included == 1].mean() - along[:, included == 0].mean()
    assert abs(gap - expected) < 0.25 * expected, (gap, expected)


def _along_all(log) -> tuple[np.ndarray, np.ndarray]:
    """Each canary's movement along its direction in each round, in units of C / n."""
    return log.round_cosines * log.round_norms[:, None] * log.sampled[:, None] / log.clipping_norm, log.included


def test_correct_runs_are_not_flagged_over_20_canary_seeds(simulation) -> None:
    out, scenarios = simulation
    audits = [
        audit_log(s.log(out, seed), resamples=200).metrics
        for s in scenarios
        if s.fault is None
        for _, seed in s.canaries
    ]
    assert len(audits) == 20
    flagged = [
        (m["log"], m["epsilon_lower_bound"], m["accountant_epsilon"])
        for m in audits
        if m["epsilon_lower_bound_exceeds_accountant"]
    ]
    assert flagged == []
    assert all(m["epsilon_lower_bound"] <= m["accountant_epsilon"] for m in audits)


@pytest.mark.parametrize("fault", ["noise-zero", "no-clipping", "noise-once"])
def test_each_planted_fault_is_caught(simulation, fault: str) -> None:
    """The accountant's epsilon is that of the configuration (sigma 1, 10% of the population per round, 8 rounds):
    what Flower was told, not what it did. A rigorous bound above it is a caught fault."""
    out, scenarios = simulation
    scenario = _scenario(scenarios, fault)
    metrics = audit_log(scenario.log(out, scenario.canaries[0][1]), resamples=200).metrics
    assert metrics["epsilon_lower_bound_exceeds_accountant"], metrics["epsilon_lower_bound"]
    assert metrics["epsilon_lower_bound"] > 1.5 * metrics["accountant_epsilon"]


def test_the_command_audits_a_log_beside_it(simulation, tmp_path: Path) -> None:
    out, scenarios = simulation
    scenario = _scenario(scenarios, "noise-zero")
    log = tmp_path / "canaries.npz"
    log.write_bytes(scenario.log(out, scenario.canaries[0][1]).read_bytes())
    done = invoke("attack", "--flower-log", log, "--bootstrap", "100")
    assert done.exit_code == 0, done.output
    results = tmp_path / "canaries-audit"
    assert sorted(p.name for p in results.iterdir()) == ["metrics.json", "roc.csv", "scores.csv"]
    assert "ABOVE the accountant's epsilon" in done.output and "all-iterates" in done.output
    assert len(pd.read_csv(results / "scores.csv")) == 500
    again = invoke("attack", "--flower-log", log, "--bootstrap", "100", "--out", tmp_path / "elsewhere")
    assert (
        again.exit_code == 0
        and (tmp_path / "elsewhere" / "metrics.json").read_bytes() == (results / "metrics.json").read_bytes()
    )


# --- the wrapper against Flower's other DP code paths, without a simulation ---------------------------------------


class FakeGrid(Grid):
    """A grid of fixed nodes that sends nothing (the test answers for the clients)."""

    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes

    def set_run(self, run: object) -> None: ...

    @property
    def run(self) -> object:
        raise NotImplementedError

    def create_message(self, *args: object, **kwargs: object) -> Message:
        raise NotImplementedError

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)

    def push_messages(self, messages: object) -> list[str]:
        raise NotImplementedError

    def pull_messages(self, message_ids: object) -> list[Message]:
        raise NotImplementedError

    def send_and_receive(self, messages: object, *, timeout: float | None = None) -> list[Message]:
        raise NotImplementedError


@pytest.fixture
def identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower makes messages only inside a run: give this process one."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_task_id", 1), ("_node_id", 0)):
        monkeypatch.setattr(TaskIdentity, name, value)


def _model() -> ArrayRecord:
    rng = np.random.default_rng(0)
    return ArrayRecord(
        {"w": Array(rng.normal(size=(40, 100)).astype(np.float32)), "b": Array(np.zeros(100, np.float32))}
    )


def _round(strategy: CanaryClients, nodes: list[int], update_norm: float) -> tuple[np.ndarray, list[Message]]:
    """One round: the real nodes answer with the model plus a random update of ``update_norm``; returns the new
    model as a vector and the messages the canary clients were sent."""
    arrays = _model()
    sent = list(strategy.configure_train(1, arrays, ConfigRecord(), FakeGrid(nodes)))
    assert sorted(m.metadata.dst_node_id for m in sent) == sorted(nodes)
    canary_messages = strategy._pending[1].canary_messages
    rng = np.random.default_rng(1)
    replies = []
    for message in sent:
        step = {k: rng.normal(size=a.shape) for k, a in arrays.items()}
        scale = update_norm / math.sqrt(sum(float((s * s).sum()) for s in step.values()))
        new = {k: Array((arrays[k].numpy() + scale * step[k]).astype(np.float32)) for k in arrays}
        content = RecordDict({"arrays": ArrayRecord(new), "metrics": MetricRecord({"num-examples": 7, "loss": 1.0})})
        replies.append(Message(content, reply_to=message))
    result, metrics = strategy.aggregate_train(1, replies)
    assert metrics is not None and metrics["loss"] == pytest.approx(1.0)  # the canaries leave the metrics as they were
    return np.concatenate([a.ravel() for a in result.to_numpy_ndarrays()]), canary_messages


def _along(log_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Each canary's movement along its direction in round 1, in units of C / n."""
    log = read_log(log_path)
    return log.round_cosines[0] * log.round_norms[0] * log.sampled[0] / log.clipping_norm, log.included


def test_client_side_clipping_clips_the_canaries_with_the_clients_mod(identity, tmp_path: Path) -> None:
    nodes = [11, 12, 13]
    n = 3 + canary_client_count(40, 3)
    dp = DifferentialPrivacyClientSideFixedClipping(
        FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=3), 0.0, 0.5, n
    )
    strategy = CanaryClients(dp, canaries=40, seed=3, log=tmp_path / "log.npz", client_mods=[fixedclipping_mod])
    _, canary_messages = _round(strategy, nodes, update_norm=0.5)
    assert all(m.content["config"]["clipping_norm"] == 0.5 for m in canary_messages)
    along, included = _along(tmp_path / "log.npz")
    assert np.abs(along[included == 1] - 1).max() < 0.4 and np.abs(along[included == 0]).max() < 0.4
    assert read_log(tmp_path / "log.npz").mechanism == "central DP, client-side clipping"


def test_local_dp_passes_the_canaries_through_local_dp_mod(identity, tmp_path: Path) -> None:
    nodes = [11, 12, 13]
    mod = LocalDpMod(clipping_norm=0.5, sensitivity=0.5, epsilon=200.0, delta=1e-5)
    np.random.seed(0)  # LocalDpMod draws its noise from NumPy's global generator
    strategy = CanaryClients(
        FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=3),
        canaries=40,
        seed=3,
        log=tmp_path / "log.npz",
        client_mods=[mod],
    )
    _round(strategy, nodes, update_norm=0.5)
    along, included = _along(tmp_path / "log.npz")
    assert np.abs(along[included == 1] - 1).max() < 0.5 and np.abs(along[included == 0]).max() < 0.5
    log = read_log(tmp_path / "log.npz")
    deviation = 0.5 * math.sqrt(2 * math.log(1.25e5)) / 200.0
    assert log.noise_multiplier == pytest.approx(deviation / 0.5) and log.flower_epsilon == 200.0
    assert "composes nothing" in log.flower_report


def test_flowers_own_accountant_runs_with_canary_clients_and_its_epsilon_is_logged(identity, tmp_path: Path) -> None:
    pytest.importorskip("dp_accounting")
    from flwr.supercore.privacy_accounting import NeighboringRelation, PrivacyConfig, SamplingMethod
    from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

    n = 3 + canary_client_count(40, 3)
    config = PrivacyConfig(1e-6, n, NeighboringRelation.ADD_OR_REMOVE_ONE, SamplingMethod.NO_AMPLIFICATION)
    dp = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=3),
        2.0,
        0.5,
        n,
        accountant=RdpAccountant(config),
    )
    strategy = CanaryClients(dp, canaries=40, seed=3, log=tmp_path / "log.npz")
    _round(strategy, [11, 12, 13], update_norm=2.0)
    log = read_log(tmp_path / "log.npz")
    assert log.delta == 1e-6 and log.flower_delta == 1e-6
    assert log.flower_epsilon == pytest.approx(dp.privacy_spent().epsilon) and "in full" in log.flower_report


def test_what_cannot_be_audited_is_refused_in_one_sentence(tmp_path: Path) -> None:
    log = tmp_path / "log.npz"
    plain = FedAvg()
    cases = [
        (plain, {}),  # no DP anywhere
        (DifferentialPrivacyClientSideFixedClipping(FedAvg(), 1.0, 1.0, 5), {}),  # client-side clipping, no mod
        (DifferentialPrivacyClientSideAdaptiveClipping(FedAvg(), 1.0, 5, clipped_count_stddev=1.0), {}),
        (
            DifferentialPrivacyServerSideFixedClipping(FedAvg(), 1.0, 1.0, 5),
            {"client_mods": [LocalDpMod(1, 1, 1, 1e-5)]},
        ),
        (DifferentialPrivacyServerSideFixedClipping(FedAvg(), 1.0, 1.0, 5), {"canaries": 3}),
        (DifferentialPrivacyServerSideFixedClipping(FedAvg(), 1.0, 1.0, 5), {"seed": -1}),
        (DifferentialPrivacyServerSideFixedClipping(FedAvg(), 1.0, 1.0, 5), {"scale": 0.5}),
        (DifferentialPrivacyServerSideFixedClipping(FedAvg(), 1.0, 1.0, 5), {"delta": 1.0}),
    ]
    for strategy, changes in cases:
        arguments = {"canaries": 10, "seed": 0, "log": log, **changes}
        with pytest.raises(CanaryClientsError) as caught:
            CanaryClients(strategy, **arguments)
        assert str(caught.value).endswith(".") and "\n" not in str(caught.value)
    assert not log.exists()


def test_a_sample_size_that_forgets_the_canary_clients_is_one_sentence(identity, tmp_path: Path) -> None:
    dp = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=3), 1.0, 0.5, 3
    )
    strategy = CanaryClients(dp, canaries=40, seed=3, log=tmp_path / "log.npz")
    with pytest.raises(CanaryClientsError, match=f"set it to {3 + canary_client_count(40, 3)}"):
        strategy.configure_train(1, _model(), ConfigRecord(), FakeGrid([11, 12, 13]))
    twice = CanaryClients(
        CanaryClients(dp, canaries=40, seed=3, log=tmp_path / "a.npz"), canaries=40, seed=3, log=tmp_path / "b.npz"
    )
    with pytest.raises(CanaryClientsError, match="different seeds"):
        twice.configure_train(1, _model(), ConfigRecord(), FakeGrid([11, 12, 13]))
