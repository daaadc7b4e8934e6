"""How much of a Flower app's epsilon the canary-client audit proves from one run (fedaudit.flower.CanaryClients).

A Flower app written with Flower's API (a ClientApp training an MLP on its share of digits, a ServerApp running FedAvg
under Flower's DifferentialPrivacyServerSideFixedClipping with Flower's own RDP accountant) runs on Flower's
simulation runtime with 10 real nodes and --canaries canary clients (about half of them join the population). The
noise multiplier is calibrated by fedaudit's accountant (client-level DP, canary clients counted in the population)
to --epsilon at delta 1e-5 over the run's rounds, for two ways of sampling clients:

- every client takes part in every round (q = 1) for --rounds rounds: the Gaussian mechanism composed --rounds times,
  where the final model's cosine with a canary is the statistic the accounting describes;
- 10% of the population each round (q = 0.1) for --sampled-rounds rounds: a client then takes part in a tenth of the
  rounds, and in ten rounds a third of the canaries are never sampled (as absent as an excluded one), which caps what
  one run can prove; a sampled deployment runs many more rounds (default 100).

For each it prints the largest rigorous bound (one-run and Gaussian-DP bounds of both views, 95% together), the
two-Gaussian estimate of the final model's view with its interval, their ratios to the accountant's epsilon, what
Flower's own accountant reports (every round in full), and the times. Target: with 1,000 canary clients at epsilon 8
and every client in every round, the bound is at least 0.3 of the accountant's epsilon.

    python benchmarks/flower_canaries.py [--epsilon 8] [--canaries 1000] [--rounds 10] [--sampled-rounds 100]
                                         [--width 128] [--threads 1] [--out studies/flower-canaries] [--smoke]
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _machine import describe
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg
from sklearn.datasets import load_digits
from torch import nn

from fedaudit.attacks.canary.flower_log import audit_log, write_results
from fedaudit.flower import CanaryClients, canary_client_count
from fedaudit.privacy.accounting import calibrate_noise_multiplier

NODES = 10
RECORDS = 179  # per node: equal shares, so that Flower's DP noise (which assumes equal weights) is right
DELTA = 1e-5
CLIPPING_NORM = 0.1
SAMPLINGS = {"every client": 1.0, "10% of clients": 0.1}
WIDTH = {"value": 128}  # the ClientApp's model width, set by main() before the simulation starts


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(64, WIDTH["value"]), nn.ReLU(), nn.Linear(WIDTH["value"], 10))


client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    """One local epoch of SGD on this node's share of digits."""
    torch.set_num_threads(1)
    node, nodes = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    x, y = load_digits(return_X_y=True)
    mine = np.random.default_rng(0).permutation(len(y))[: nodes * RECORDS][node::nodes]
    x, y = torch.tensor(x[mine] / 16.0, dtype=torch.float32), torch.tensor(y[mine])
    model = net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(int(msg.content["config"]["server-round"]) * 1000 + node)
    for batch in torch.randperm(len(y), generator=generator).split(32):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        optimizer.step()
    metrics = MetricRecord({"num-examples": len(y)})
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}), reply_to=msg)


def flower_accountant(population: int) -> object | None:
    """Flower's own accountant (RDP, no amplification: what its fixed-clipping wrappers allow), when dp-accounting
    is installed."""
    try:
        from flwr.supercore.privacy_accounting import NeighboringRelation, PrivacyConfig, SamplingMethod
        from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

        config = PrivacyConfig(
            DELTA, population, NeighboringRelation.ADD_OR_REMOVE_ONE, SamplingMethod.NO_AMPLIFICATION
        )
        return RdpAccountant(config)
    except ImportError:
        return None


def server_app(
    args: argparse.Namespace, plans: dict[str, tuple[float, float, int]], times: dict[str, float]
) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        population = NODES + canary_client_count(args.canaries, 0)
        for name, (fraction, sigma, rounds) in plans.items():
            random.seed(0)
            np.random.seed(0)  # Flower's DP noise and sampler draw from the global generators
            torch.manual_seed(0)
            sampled = max(int(population * fraction), 2)
            dp = DifferentialPrivacyServerSideFixedClipping(
                FedAvg(fraction_train=fraction, fraction_evaluate=0.0, min_available_nodes=NODES),
                noise_multiplier=sigma,
                clipping_norm=CLIPPING_NORM,
                num_sampled_clients=sampled,
                accountant=flower_accountant(population),
            )
            strategy = CanaryClients(dp, canaries=args.canaries, seed=0, log=args.out / f"{slug(name)}.npz")
            start = time.perf_counter()
            strategy.start(grid=grid, initial_arrays=ArrayRecord(net().state_dict()), num_rounds=rounds)
            times[name] = time.perf_counter() - start

    return app


def slug(name: str) -> str:
    return name.replace("% ", "pct-").replace(" ", "-")


def machine() -> str:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}), {gpu}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--canaries", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=10, help="rounds with every client in every round")
    parser.add_argument("--sampled-rounds", type=int, default=100, help="rounds with 10%% of the clients a round")
    parser.add_argument("--width", type=int, default=128, help="hidden units of the MLP")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, help="logs and audits [default: studies/flower-canaries]")
    parser.add_argument("--smoke", action="store_true", help="smallest sizes (seconds): 100 canaries, 2 rounds")
    args = parser.parse_args()
    if args.smoke:
        args.canaries, args.rounds, args.sampled_rounds, args.width = 100, 2, 2, 16
    torch.set_num_threads(args.threads)
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    logging.getLogger("flwr").setLevel(logging.WARNING)
    WIDTH["value"] = args.width
    with tempfile.TemporaryDirectory() as scratch:
        args.out = args.out or (Path(scratch) if args.smoke else Path("studies/flower-canaries"))
        args.out.mkdir(parents=True, exist_ok=True)
        study(args)


def study(args: argparse.Namespace) -> None:
    from flwr.simulation import run_simulation

    population = NODES + canary_client_count(args.canaries, 0)
    plans = {}
    for name, fraction in SAMPLINGS.items():
        rate = max(int(population * fraction), 2) / population
        rounds = args.rounds if fraction == 1.0 else args.sampled_rounds
        sigma = calibrate_noise_multiplier(
            target_epsilon=args.epsilon, sample_rate=rate, queries_per_round=1, rounds=rounds, delta=DELTA
        )
        plans[name] = (fraction, sigma, rounds)
    times: dict[str, float] = {}
    started = time.perf_counter()
    run_simulation(
        server_app=server_app(args, plans, times),
        client_app=client_app,
        num_supernodes=NODES,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            # address "local": a Ray instance of its own, even where `ray start` left a cluster on this machine
            "init_args": {
                "address": "local",
                "num_cpus": 1,
                "include_dashboard": False,
                "logging_level": logging.ERROR,
            },
        },
    )
    simulation = time.perf_counter() - started
    print(describe("cpu"), flush=True)
    print(
        f"Flower {__import__('flwr').__version__} canary clients: {args.canaries} drawn, {population - NODES} in the "
        f"population of {population} ({NODES} real nodes); {args.rounds} rounds of every client, "
        f"{args.sampled_rounds} of 10%; MLP 64-{args.width}-10; "
        f"C {CLIPPING_NORM}; delta {DELTA:g}; machine: {machine()}; torch threads {torch.get_num_threads()}"
    )
    print(f"simulation (Ray start-up and both trainings): {simulation:.1f} s")
    header = (
        f"{'sampling':<15} {'sigma':>6} {'eps':>6} {'bound':>6} {'bound/eps':>9} {'view':>12} "
        f"{'estimate [95% CI]':>24} {'est/eps':>7} {'Flower eps':>10} {'train s':>7} {'audit s':>7}"
    )
    print(header)
    for name, (_, sigma, _) in plans.items():
        started = time.perf_counter()
        audit = audit_log(args.out / f"{slug(name)}.npz")
        write_results(audit, args.out / f"{slug(name)}-audit")
        seconds = time.perf_counter() - started
        m = audit.metrics
        best = max(m["views"], key=lambda v: m["views"][v]["epsilon_lower_bound"])
        final = m["views"]["final-model"]["estimate"]
        flower = m["flower"]["epsilon"]
        print(
            f"{name:<15} {sigma:>6.3f} {m['accountant_epsilon']:>6.2f} {m['epsilon_lower_bound']:>6.2f} "
            f"{m['ratio_to_accountant']:>9.2f} {best:>12} "
            f"{final['epsilon']:>7.2f} [{final['ci95'][0]:>6.2f}, {final['ci95'][1]:>6.2f}] "
            f"{final['epsilon'] / m['accountant_epsilon']:>7.2f} {'-' if flower is None else f'{flower:.2f}':>10} "
            f"{times[name]:>7.1f} {seconds:>7.1f}"
        )
        for view, v in m["views"].items():
            one, gdp = v["estimators"]["one-run"], v["estimators"]["gdp"]
            print(
                f"    {view}: AUC {v['auc']:.3f} [{v['auc_ci95'][0]:.3f}, {v['auc_ci95'][1]:.3f}], one-run "
                f"{one['epsilon']:.2f} and GDP {gdp['epsilon']:.2f} (judged on {gdp['canaries_in']} in / "
                f"{gdp['canaries_out']} out), estimate {v['estimate']['epsilon']:.2f} "
                f"[{v['estimate']['ci95'][0]:.2f}, {v['estimate']['ci95'][1]:.2f}] (n {v['num_members']}/"
                f"{v['num_nonmembers']})"
            )
    print(f"logs and audits: {args.out}")


if __name__ == "__main__":
    main()
