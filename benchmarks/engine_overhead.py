"""What running the clients on Flower costs: the local engine vs Flower's simulation and deployment runtimes.

The same run (``fedaudit train`` with the same seed, so the same model bytes on every engine) on:

- local: the clients one after another inside the training process;
- simulation: ``--engine flower``, each client a ClientApp on Flower's simulation runtime (Ray);
- deployment: ``--engine flower --superlink``, a TLS SuperLink and one SuperNode per client as separate
  processes on 127.0.0.1, with fedaudit as the server (the federation is up before the run starts, as at
  real sites; its start-up is shown on its own line);
- deployment-window: the same with ``--parallel-clients`` = the cores, so that no more sites work at once than
  there are cores, as the local engine's clients (at real sites every SuperNode has its own machine; here five
  share the cores, and without the window all five ClientApps of a round time-share them).

Every process of every engine is pinned to the same cores with ``taskset`` (one core by default) and runs
one torch thread, and every engine may run as many clients at once as there are cores (the local engine with
``--parallel-clients``, the simulation with one CPU per client, the deployment's SuperNodes as they like), so
the engines get the same compute and the ratio to local is the engine's overhead, not extra parallelism. The
federation uses Flower's default polling intervals. Seconds per round come from each run's ``metrics.csv``
(clients plus server update), averaged over the rounds after the first when there are several: the first round
also pays the engine's session start (for the deployment: submitting the run and asking every site which records
it holds, one ClientApp process each), a start-up cost shown in ``first_round_s``; "outside rounds" is the rest of
the train command (imports, data, engine start-up, evaluation, checkpoints). ``cpu_s`` is the CPU time the whole
run cost: the train command and every process it started, and for the deployment also the SuperLink's and
SuperNodes' processes meanwhile (their polling, and the ClientApp process each SuperNode starts per message); it
is not measured for the simulation, whose Ray workers are not processes the train command reaps. The model bytes
of every engine are checked against local's.

    python benchmarks/engine_overhead.py [--datasets digits fashion-mnist] [--algorithms fedlap-dp] \
        [--rounds 2] [--cores 0] [--width 32] [--smoke]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
from _machine import describe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # for federation (deployment)

BIN = Path(sys.executable).parent
ALGORITHMS = {
    "fedlap-dp": ("--algorithm", "fedlap", "--dp"),
    "dp-fedavg": ("--algorithm", "fedavg", "--dp"),
}
DATASETS = {
    "digits": ("--dataset", "digits"),
    "fashion-mnist": ("--dataset", "fashion-mnist", "--partition", "classes:2"),
}


def _pinned(cores: str, argv: list[str]) -> list[str]:
    """``argv`` pinned to ``cores``; unpinned where there is no taskset (only --smoke gets this far without it)."""
    return ["taskset", "-c", cores, *argv] if shutil.which("taskset") else argv


def _count(cores: str) -> int:
    """How many cores a taskset list ("0", "0,1", "0-3") names."""
    total = 0
    for part in cores.split(","):
        first, _, last = part.partition("-")
        total += int(last or first) - int(first) + 1
    return total


TICK = os.sysconf("SC_CLK_TCK")


def group_cpu(groups: set[int]) -> float:
    """CPU seconds of every live process in the process groups ``groups``, with the children each has reaped."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in groups:
            total += sum(int(value) for value in fields[11:15])  # utime, stime, cutime, cstime
    return total / TICK


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _train(argv: list[str], cores: str, env: dict[str, str], groups: set[int] = frozenset()) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the train command and of the federation's processes meanwhile)."""
    began, cpu_before, fed_before = time.perf_counter(), _children_cpu(), group_cpu(groups)
    result = subprocess.run(_pinned(cores, argv), env=env, capture_output=True, text=True)
    wall = time.perf_counter() - began
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return wall, _children_cpu() - cpu_before + group_cpu(groups) - fed_before


def _digest(run: Path) -> str:
    return hashlib.sha256((run / "model.safetensors").read_bytes()).hexdigest()


def _row(engine: str, run: Path, measured: tuple[float, float]) -> dict[str, object]:
    total, cpu = measured
    metrics = pd.read_csv(run / "metrics.csv")
    rounds = metrics["wall_seconds"].to_numpy()
    steady = rounds[1:] if len(rounds) > 1 else rounds  # round 1 also opens the engine's session (see below)
    return {
        "engine": engine,
        "s_per_round": float(steady.mean()),
        "first_round_s": float(rounds[0]),
        "round_seconds": " ".join(f"{r:.1f}" for r in rounds),
        "outside_rounds_s": total - float(rounds.sum()),
        "total_s": total,
        "cpu_s": cpu,
        "accuracy": float(metrics["test_accuracy"].iloc[-1]),
        "model": _digest(run),
    }


def measure(dataset: str, algorithm: str, args: argparse.Namespace, work: Path) -> pd.DataFrame:
    """The three engines on one run; returns one row each."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    base = [
        str(BIN / "fedaudit"),
        "train",
        *DATASETS[dataset],
        *("--width", str(args.width)),
        *ALGORITHMS[algorithm],
        *("--num-clients", str(args.clients), "--rounds", str(args.rounds), "--seed", "0"),
        *("--device", "cpu", "--no-progress"),
    ]
    cores = _count(args.cores)
    rows = []
    for engine in args.engines:
        out = work / f"{dataset}-{algorithm}-{engine}"
        if engine == "local":
            argv = [*base, "--parallel-clients", str(cores), "--out", str(out)]
            rows.append(_row(engine, out, _train(argv, args.cores, env)))
        elif engine == "simulation":
            argv = [*base, "--engine", "flower", "--client-cpus", "1", "--out", str(out)]
            wall, _ = _train(argv, args.cores, env)
            rows.append(_row(engine, out, (wall, float("nan"))))  # Ray's workers are not children it reaps
        else:  # deployment, deployment-window
            from federation import Federation  # the test suite's launcher of a TLS SuperLink and SuperNodes

            window = ("--parallel-clients", str(cores)) if engine == "deployment-window" else ()
            federation = Federation(work / f"federation-{dataset}-{algorithm}", task_poll_seconds=None)
            try:
                began = time.perf_counter()
                federation.start_superlink()
                for client in range(args.clients):
                    federation.start_supernode(client)
                federation_up = time.perf_counter() - began
                for process in federation.processes.values():  # the whole federation on the same cores
                    if shutil.which("taskset"):
                        subprocess.run(["taskset", "-a", "-p", "-c", args.cores, str(process.pid)], capture_output=True)
                argv = [
                    *base,
                    *("--engine", "flower", "--superlink", federation.address),
                    *("--root-certificates", str(federation.tls["ca"]), *window, "--out", str(out)),
                ]
                groups = {process.pid for process in federation.processes.values()}
                row = _row(engine, out, _train(argv, args.cores, env, groups))
                row["federation_up_s"] = federation_up
                rows.append(row)
            finally:
                federation.close()
    table = pd.DataFrame(rows)
    local = table.loc[table["engine"] == "local", "s_per_round"]
    if len(local):
        table["ratio_to_local"] = table["s_per_round"] / float(local.iloc[0])
        table["cpu_ratio_to_local"] = table["cpu_s"] / float(table.loc[table["engine"] == "local", "cpu_s"].iloc[0])
        reference = table.loc[table["engine"] == "local", "model"].iloc[0]
        table["same_model_as_local"] = table["model"] == reference
    table.insert(0, "run", f"{dataset} {algorithm}")
    return table.drop(columns="model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", nargs="+", default=["digits", "fashion-mnist"], choices=sorted(DATASETS))
    parser.add_argument("--algorithms", nargs="+", default=["fedlap-dp"], choices=sorted(ALGORITHMS))
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=["local", "simulation", "deployment", "deployment-window"],
        help="[default: all four; with --smoke local only]",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--width", type=int, default=32, help="ConvNet width")
    parser.add_argument(
        "--cores",
        help="taskset core list every process is pinned to [default: 0; with --smoke the first core this process may "
        "use]",
    )
    parser.add_argument("--keep", help="keep the run directories here instead of a temporary directory")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="smallest sizes (seconds): digits, DP-FedAvg, 2 clients, 1 round, width 8, the local engine only unless "
        "--engines names more (a Flower engine takes about 30 s), unpinned where there is no taskset",
    )
    args = parser.parse_args()
    if args.smoke:
        args.datasets, args.algorithms, args.clients, args.rounds, args.width = ["digits"], ["dp-fedavg"], 2, 1, 8
        args.engines = args.engines or ["local"]
        args.cores = args.cores or str(min(os.sched_getaffinity(0)))
    args.engines = args.engines or ["local", "simulation", "deployment", "deployment-window"]
    args.cores = args.cores or "0"
    if shutil.which("taskset") is None and not args.smoke:
        raise SystemExit("taskset (util-linux) is needed to give every engine the same cores")
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="engine-overhead-"))
    work.mkdir(parents=True, exist_ok=True)
    pinning = f"cores {args.cores} for every process" if shutil.which("taskset") else "no taskset: unpinned"
    print(describe("cpu", 1), flush=True)
    print(f"{pinning}, 1 torch thread each, {args.clients} clients, {args.rounds} rounds", flush=True)
    try:
        for dataset in args.datasets:
            for algorithm in args.algorithms:
                table = measure(dataset, algorithm, args, work)
                with pd.option_context("display.width", 200, "display.max_columns", 20):
                    print(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
