"""The golden runs: one small run per algorithm (DP where the algorithm has record-level DP-SGD), trained, attacked
and reported through the Python API, each file reduced to what a change of the code's shape must leave as it was.

A file is reduced to its normalized text (the run's folder, timestamps, run ids, wall times, versions and the
manifest's file hashes taken out) and its skeleton (that text with every decimal number replaced by ``#``). On the
machine that made tests/golden/runs.json (same CPU, instruction set, torch and thread count) the runs must be the same
byte for byte: every normalized text and every tensor file the same hash. On another machine float sums take another
order (ATen, MKL and oneDNN pick their kernels per CPU), and what follows from them moves: by 1e-7 for FedAvg, by more
than 1% for FedLAP's and Fedssyn's models, whose synthetic data is optimised, and with them which records an attack
finds most exposed. There the same files must be written, the files that no float sum decides
(:data:`PORTABLE`: the configuration, the manifest, the membership split) must be the same, and every other run file,
the ledger included, the same skeleton (tensors' names, shapes and types; columns; rows; keys).

Regenerate after a change that is meant to change results (and say why in the commit):
``OMP_NUM_THREADS=1 .venv/bin/python tests/support/golden.py``.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import platform
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "runs.json"
COMMON = {
    "dataset": "digits",
    "num_clients": 2,
    "rounds": 1,
    "width": 8,
    "local_epochs": 1,
    "holdout_fraction": 0.5,
}
DP = {"dp": True, "noise_multiplier": 1.0, "max_grad_norm": 1.0, "noise_seed": 7}  # reproducible noise
RUNS: dict[str, dict[str, Any]] = {
    "fedavg": DP,
    "fedprox": {},
    "fedsgd": {},
    "scaffold": {},
    "fedssyn": {"rounds": 2},  # its first round deals the synthetic records
    "fedlap": DP,
    "fedgm": {},
    "feddm": {},
}
# Keys whose values say when, where or with what a run was made, not what it computed.
VOLATILE_KEYS = {"created", "updated", "run_id", "versions", "wall_seconds", "seconds"}
SKIPPED = {".fedaudit.lock", "client-secrets.json"}  # the lock; the clients' secret keys (random by design)
# The same on any x86-64 CPU: no float is computed in them (privacy.json's epsilons come from numpy's exp and log,
# whose SIMD kernels numpy picks per CPU, so only its skeleton is compared across machines)
PORTABLE = ("config.json", "manifest.json", "membership.npz")
NUMBER = re.compile(r"(?<![\w.])-?(?:\d+\.\d+(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+)(?![\w.])")
TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:[+-]\d\d:\d\d|Z)?")
LISTED = 4000  # characters: a longer skeleton is kept as its hash
FOLLOWS_THE_MODEL = ("attacks/", "report/")  # counts and most-exposed records: their skeletons move with the model


def make(out: Path) -> list[Path]:
    """Train every golden run under ``out``, attack each (loss, threshold) and report them all (markdown)."""
    import fedaudit

    runs = []
    for name, options in RUNS.items():
        fedaudit.train(None, out / name, algorithm=name, echo=lambda _: None, **{**COMMON, **options})
        runs.append(out / name)
    fedaudit.attack(runs, signals=["loss"], methods=["threshold"], echo=lambda _: None)
    fedaudit.report(runs, out / "report", formats=["md"])
    return runs


def machine() -> dict[str, Any]:
    """What decides the order of float sums here: the CPU (model and flags), torch and its kernels' ISA, threads."""
    import torch

    cpu = {}
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "flags") and key.strip() not in cpu:
                cpu[key.strip()] = value.strip()
    return {
        "platform": platform.machine(),
        "cpu": cpu.get("model name", platform.processor()),
        "cpu_flags": hashlib.sha256(cpu.get("flags", "").encode()).hexdigest()[:16],
        "torch": torch.__version__,
        "isa": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
    }


def _strip(value: Any, root: str) -> Any:
    """A JSON value without its volatile keys, with the run folder as ``<OUT>`` and no timestamps."""
    if isinstance(value, dict):
        kept = {k: _strip(v, root) for k, v in value.items() if k not in VOLATILE_KEYS}
        if "files" in kept and isinstance(kept["files"], dict):  # the manifest's hashes: the names are kept
            kept["files"] = sorted(kept["files"])
        return kept
    if isinstance(value, list):
        return [_strip(v, root) for v in value]
    if isinstance(value, str):
        return TIMESTAMP.sub("<TIME>", value.replace(root, "<OUT>"))
    return value


def _normalized(path: Path, root: str) -> str:
    """The file as text, with what says when and where it was made taken out."""
    if path.suffix == ".json":
        return json.dumps(_strip(json.loads(path.read_text()), root), indent=1, sort_keys=True)
    if path.suffix == ".csv":
        rows = list(csv.reader(io.StringIO(path.read_text())))
        keep = [i for i, name in enumerate(rows[0]) if name not in VOLATILE_KEYS]
        return "\n".join(",".join(row[i] for i in keep) for row in rows).replace(root, "<OUT>")
    if path.suffix == ".safetensors":
        from safetensors.numpy import load_file

        tensors = load_file(str(path))
        return "\n".join(
            f"{name} {array.dtype} {list(array.shape)} sum {float(np.sum(array, dtype=np.float64))!r} "
            f"norm {float(np.linalg.norm(array.astype(np.float64)))!r}"
            for name, array in sorted(tensors.items())
        )
    if path.suffix == ".npz":
        with np.load(path) as arrays:
            return "\n".join(
                f"{name} {arrays[name].dtype} {list(arrays[name].shape)} "
                f"{hashlib.sha256(np.ascontiguousarray(arrays[name]).tobytes()).hexdigest()}"
                for name in sorted(arrays.files)
            )
    return TIMESTAMP.sub("<TIME>", path.read_text().replace(root, "<OUT>"))


def reduce(path: Path, root: str) -> dict[str, Any]:
    """One file's entry: the hash of its normalized text (and of its bytes for a tensor file) and its skeleton (or
    the skeleton's hash, when long)."""
    text = _normalized(path, root)
    skeleton = NUMBER.sub("#", text)
    entry: dict[str, Any] = {
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
        "skeleton": skeleton if len(skeleton) <= LISTED else "sha256:" + hashlib.sha256(skeleton.encode()).hexdigest(),
    }
    if path.suffix == ".safetensors":
        entry["bytes_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return entry


def snapshot(out: Path) -> dict[str, dict[str, Any]]:
    """Every file the golden runs, their attacks and their report wrote, reduced (by path under ``out``)."""
    root = str(out)
    return {
        str(path.relative_to(out)): reduce(path, root)
        for path in sorted(out.rglob("*"))
        if path.is_file() and path.name not in SKIPPED
    }


def differences(found: dict[str, dict[str, Any]], golden: dict[str, dict[str, Any]], *, exact: bool) -> list[str]:
    """What differs, one line per file: the same files; then, ``exact``, the same hashes; else the same portable
    files and the same skeletons of the run files that do not follow the trained model's exposure."""
    lines = [f"{name}: missing" for name in sorted(golden.keys() - found.keys())]
    lines += [f"{name}: not in the golden runs" for name in sorted(found.keys() - golden.keys())]
    for name in sorted(found.keys() & golden.keys()):
        new, old = found[name], golden[name]
        if exact or name.rpartition("/")[2] in PORTABLE:
            for key in ("sha256", "bytes_sha256"):
                if new.get(key) != old.get(key):
                    lines.append(f"{name}: {key} {new.get(key)} != {old.get(key)}")
        elif not any(f"/{part}" in f"/{name}" for part in FOLLOWS_THE_MODEL) and new["skeleton"] != old["skeleton"]:
            lines.append(f"{name}: its text differs beyond its numbers")
    return lines


def main() -> None:
    """Write tests/golden/runs.json from the runs this code makes on this machine."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "golden"
        make(out)
        files = snapshot(out)
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({"machine": machine(), "files": files}, indent=1, sort_keys=True) + "\n")
    print(f"{GOLDEN}: {len(files)} files")


if __name__ == "__main__":
    if os.environ.get("OMP_NUM_THREADS") != "1":
        sys.exit("Run with OMP_NUM_THREADS=1, as the tests do.")
    main()
