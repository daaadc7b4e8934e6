"""How much the README's demo figures move: the DP run's with its clients' noise (a fresh secret each run), and the
run without DP with the CPU's kernels (the instruction set ATen and MKL/oneDNN dispatch to, which fixes the order of
float sums).

The demo's own commands are read from the Makefile (``make -n demo``), as ``tests/cli/test_demo.py`` reads them, and
run as they stand, each training followed by the demo's attack:

- DP-FedAvg ``--repeats`` times: each run draws its clients' secrets afresh, so its noise is new each time;
- FedAvg without DP once under each kernel setting: the Makefile's (``ATEN_CPU_CAPABILITY=avx2``), ATen's choice for
  this CPU (``ATEN_CPU_CAPABILITY`` unset), ``MKL_CBWR=COMPATIBLE``, and ``MKL_CBWR=AVX2`` with
  ``ONEDNN_MAX_CPU_ISA=AVX2``.

For each figure of the README's table it prints the smallest and largest value seen and the README's: the spread
that ``tests/cli/test_demo.py`` allows (docs/measured-figures.md records a measurement).

    python benchmarks/demo_spread.py [--repeats 8] [--out DIR] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from _machine import add_program_option, describe, fedaudit_command, use_program

from fedaudit.reports.collect import collect_runs

ROOT = Path(__file__).resolve().parents[1]
KERNELS = {
    "Makefile's (avx2)": {},
    "ATen's choice": {"ATEN_CPU_CAPABILITY": None},
    "MKL_CBWR=COMPATIBLE": {"MKL_CBWR": "COMPATIBLE"},
    "MKL and oneDNN at AVX2": {"MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}
FIGURES = (
    "accuracy",
    "accuracy low",
    "accuracy high",
    "loss AUC",
    "loss AUC low",
    "loss AUC high",
    "grad-norm AUC",
    "grad-norm AUC low",
    "grad-norm AUC high",
    "loss bound",
    "grad-norm bound",
    "both bound",
)


def demo_commands(out: Path) -> dict[str, list[str]]:
    """The Makefile's demo commands for ``out``, by run name: its training and its attack."""
    venv = Path(fedaudit_command()[0]).parent.parent  # the Makefile runs VENV/bin/fedaudit
    listing = subprocess.run(
        ["make", "-s", "-n", "demo", f"RUN={out}", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    trains = [line for line in listing.splitlines() if re.search(r"/fedaudit train ", line)]
    attack = next(line for line in listing.splitlines() if re.search(r"/fedaudit attack ", line))
    commands = {}
    for name in ("fedavg", "dp-fedavg"):
        train = next(line for line in trains if f"--out {out}/{name} " in line)
        commands[name] = [train, re.sub(r"attack \S+ \S+ ", f"attack {out}/{name} ", attack)]
    return commands


def figures(run: Path) -> dict[str, float]:
    """The figures of the README's table for one attacked run."""
    (summary,) = collect_runs([run])
    attacks = {a.signal: a for a in summary.final_attacks}
    low, high = summary.final_accuracy_ci
    found = {"accuracy": summary.final_accuracy, "accuracy low": low, "accuracy high": high}
    for signal in ("loss", "grad-norm"):
        found[f"{signal} AUC"] = attacks[signal].auc
        found[f"{signal} AUC low"], found[f"{signal} AUC high"] = attacks[signal].auc_ci
        found[f"{signal} bound"] = attacks[signal].epsilon_lower_bound
    found["both bound"] = summary.epsilon_lower_bound()[0]
    return found


def run_demo(commands: list[str], env: dict[str, str | None], extra: dict[str, str]) -> None:
    """The commands under ``env`` (a None value unsets that variable), with ``extra`` options for the training and
    the attack."""
    environment = {k: v for k, v in os.environ.items() if k not in env or env[k] is not None}
    environment.update({k: v for k, v in env.items() if v is not None})
    for command in commands:
        if env.get("ATEN_CPU_CAPABILITY", "") is None:
            command = command.replace("ATEN_CPU_CAPABILITY=avx2 ", "")
        command += extra.get("train" if " train " in command else "attack", "")
        subprocess.run(command, shell=True, cwd=ROOT, env=environment, check=True, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8, help="DP runs, each with fresh client secrets")
    parser.add_argument("--out", type=Path, help="where the runs go [default: a temporary folder]")
    parser.add_argument(
        "--smoke", action="store_true", help="one DP run and one kernel setting, 1 round, 100 records attacked"
    )
    add_program_option(parser)
    args = parser.parse_args()
    use_program(args.fedaudit)
    kernels = dict(list(KERNELS.items())[:1]) if args.smoke else KERNELS
    smoke = {"train": " --rounds 1", "attack": " --max-records 100 --bootstrap 40"}
    repeats, extra = (1, smoke) if args.smoke else (args.repeats, {})
    folder = args.out or Path(tempfile.mkdtemp(prefix="demo-spread-"))
    print(describe("cpu", threads=1), flush=True)
    seen: dict[str, list[dict[str, float]]] = {"dp-fedavg": [], "fedavg": []}
    for k in range(repeats):
        out = folder / f"dp-{k}"
        run_demo(demo_commands(out)["dp-fedavg"], {}, extra)
        seen["dp-fedavg"].append(figures(out / "dp-fedavg"))
    for j, env in enumerate(kernels.values()):
        out = folder / f"kernels-{j}"
        run_demo(demo_commands(out)["fedavg"], env, extra)
        seen["fedavg"].append(figures(out / "fedavg"))
    print(f"DP-FedAvg: {repeats} runs, fresh client secrets each; FedAvg: {', '.join(kernels)}")
    print(f"{'run':<10} {'figure':<20} {'min':>8} {'max':>8} {'spread':>8}")
    for name, rows in seen.items():
        for figure in FIGURES:
            values = [row[figure] for row in rows]
            print(f"{name:<10} {figure:<20} {min(values):>8.3f} {max(values):>8.3f} {max(values) - min(values):>8.3f}")
    if args.out is None:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
