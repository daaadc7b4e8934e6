"""The shared test harness: fast run options, an in-process ``fedaudit`` runner, and assertions used across packages."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pandas as pd
import pytest
import torch
from click.testing import CliRunner, Result
from safetensors.torch import load_file

IN_CI = os.environ.get("CI") == "true"
CHROMIUM_FLAGS = tuple(
    (
        "--headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking "
        "--disable-component-update --disable-sync"
    ).split()
)

# Options that keep a run small and quick; tests add --rounds, --dp, ... to these.
FAST_ARGS: tuple[str, ...] = tuple(
    (
        "--dataset digits --model mlp --width 16 --depth 1 --batch-size 32 --local-epochs 1 --device cpu --no-progress"
    ).split()
)


# What tests need from the machine beyond PyPI, by what the skip line calls it: the Debian packages that provide it.
# .ci/run installs them all; without CI=true a test that needs a missing one skips with one line that names the
# package and its install command (pytest's -ra prints those lines at the end of `make test`), and in CI it fails.
SYSTEM_PACKAGES = {
    "chromium": "chromium",
    "pdftoppm": "poppler-utils",
    "pdftotext": "poppler-utils",
    "Fashion-MNIST": "dataset-fashion-mnist",
    "Pango (the PDF report)": "libpango-1.0-0 libpangoft2-1.0-0",
}
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


def missing_system(what: str) -> NoReturn:
    """Skip the test that needs ``what`` (a key of :data:`SYSTEM_PACKAGES`) in one line, or fail it in CI."""
    packages = SYSTEM_PACKAGES[what]
    line = f"needs {what}: sudo apt-get install {packages}"
    if IN_CI:
        pytest.fail(f"{line} (.ci/run installs it)")
    pytest.skip(line)


def binary(name: str) -> str:
    """Path of a program the test needs (skipped when absent, except in CI: :func:`missing_system`)."""
    found = shutil.which(name)
    if found is None:
        missing_system(name)
    return found


def fashion_mnist() -> None:
    """Debian's Fashion-MNIST files, which a test needs (skipped when absent, except in CI)."""
    if not (FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz").is_file():
        missing_system("Fashion-MNIST")


def pango() -> None:
    """The Pango library WeasyPrint lays the PDF report out with (skipped when absent, except in CI)."""
    import ctypes.util

    if ctypes.util.find_library("pango-1.0") is None or ctypes.util.find_library("pangoft2-1.0") is None:
        missing_system("Pango (the PDF report)")


def invoke(*args: str) -> Result:
    """Run ``fedaudit ARGS`` in-process; exceptions other than SystemExit propagate (no hidden tracebacks)."""
    from fedaudit.cli import main

    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def verified_client_level(out: Path, *args: str) -> Any:
    """Train ``fedaudit train FAST_ARGS ARGS`` into ``out`` and return its client-level verification."""
    from fedaudit.attacks.conformance.client_level import verify_client_level
    from fedaudit.rundir import RunDirectory

    result = invoke("train", *FAST_ARGS, *args, "--out", out)
    assert result.exit_code == 0, result.output
    return verify_client_level(RunDirectory(out))


def tree_digest(path: Path) -> dict[str, str]:
    """SHA-256 of every file under ``path`` by relative name: equal digests mean a byte-identical tree."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def rehash(run: Path) -> None:
    """Record every file of ``run`` in its manifest as it now is, as a forger who knows the format would after editing
    them: what the deeper checks (round of the model, corrupt weights, the ledger's arithmetic) must still catch."""
    manifest = json.loads((run / "manifest.json").read_text())
    skip = {"manifest.json", "signature.json", ".fedaudit.lock", "client-secrets.json"}
    manifest["files"] = {
        p.relative_to(run).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run.rglob("*"))
        if p.is_file() and p.relative_to(run).as_posix() not in skip and not p.name.endswith(".tmp")
    }
    manifest.pop("pending", None)
    (run / "manifest.json").write_text(json.dumps(manifest))


# name the engine or settings, or hold clock times (a client-level run's server-metrics.csv holds its rounds' times)
ENGINE_VOLATILE = ("manifest.json", "config.json", "metrics.csv", "server-metrics.csv")


def engine_independent_digest(run: Path) -> dict[str, str]:
    """:func:`tree_digest` of every file of a run whose bytes must not depend on the engine, on how the clients were
    scheduled, or on the clock (the rest is compared field by field)."""
    return {
        name: value
        for name, value in tree_digest(run).items()
        if name not in ENGINE_VOLATILE and not (name.startswith("checkpoints/") and name.endswith(".json"))
    }


def read_json(path: Path):
    return json.loads(path.read_text())


@contextlib.contextmanager
def same_secrets() -> Iterator[None]:
    """Inside the block every run started gets the same run id and every client the same secret, so that two runs
    started apart are the same run, byte for byte, as two processes holding the same client secrets would train it
    (a DP run's noise otherwise differs from run to run). Runs resumed inside it read their secrets back as always."""
    import fedaudit.privacy.randomness as randomness
    import fedaudit.training as training

    patch = pytest.MonkeyPatch()
    patch.setattr(training, "new_run_id", lambda: "5e" * 16)
    patch.setattr(randomness, "new_secret", lambda: bytes(range(32)))
    try:
        yield
    finally:
        patch.undo()


def fixed_sequence_secrets(monkeypatch: pytest.MonkeyPatch, label: str) -> None:
    """Every run started after this gets the next run id and its clients the next secrets of a fixed sequence
    (``label``), so that a test training several runs trains the same runs on every machine: each run's noise is
    still its clients' own (unlike :func:`same_secrets`, where every run is the same run)."""
    import itertools

    import fedaudit.privacy.randomness as randomness
    import fedaudit.training as training

    secrets, runs = itertools.count(), itertools.count()
    monkeypatch.setattr(randomness, "new_secret", lambda: hashlib.sha256(f"{label} {next(secrets)}".encode()).digest())
    monkeypatch.setattr(
        training, "new_run_id", lambda: hashlib.sha256(f"{label} run {next(runs)}".encode()).hexdigest()[:32]
    )


def digit_halves(folder: Path) -> tuple[Path, Path]:
    """Two npz files of digits with the same shapes and labels, in the same order, but other records: what a server
    that chose the seed sees of two runs that differ only in their records."""
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = digits.images.astype(np.float32)[:, None], digits.target
    rng = np.random.default_rng(0)
    first, second = [], []
    for c in range(10):
        members = rng.permutation(np.flatnonzero(y == c))
        half = len(members) // 2
        first += list(members[:half])
        second += list(members[half : 2 * half])
    paths = folder / "a.npz", folder / "b.npz"
    for path, rows in zip(paths, (first, second)):
        np.savez(path, x=x[rows], y=y[rows])
    return paths


def update_distances(a: Path, b: Path) -> list[float]:
    """|A - B| / |A| of each client's update in round 1 between two runs that kept what crossed the wire."""
    distances = []
    for sent in sorted((a / "transmitted" / "round-0001").glob("client-*.safetensors")):
        ours = torch.cat([t.flatten() for t in load_file(sent).values()])
        theirs = torch.cat([t.flatten() for t in load_file(b / sent.relative_to(a)).values()])
        distances.append(float((ours - theirs).norm() / ours.norm()))
    return distances


def with_keys(data, keys, round_index: int = 0, device: str = "cpu"):
    """``data`` (a ClientData) as run_client hands it to an algorithm in round ``round_index``: with the sources of
    its DP queries drawn from ``keys`` (e.g. ``SeededKeys(seed, client)``)."""
    from dataclasses import replace

    from fedaudit.privacy.randomness import QueryDraws

    return replace(data, draws=QueryDraws(keys, round_index, torch.device(device)))


def assert_user_error(result, *, mentions: str | None = None, exit_code: int = 2) -> str:
    """Exit code 2 (or ``exit_code``: 1 for a run that fails its integrity check) and exactly one line on stderr,
    starting with 'Error:', without a traceback."""
    assert result.exit_code == exit_code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.output
    if mentions is not None:
        assert mentions.lower() in lines[0].lower(), lines[0]
    return lines[0]


def assert_same_tensors(a: Path, b: Path) -> None:
    ta, tb = load_file(str(a)), load_file(str(b))
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name


def epsilon_cli(cli, *args) -> float:
    result = cli("epsilon", *args)
    assert result.exit_code == 0, result.output
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("epsilon="), last
    return float(last.split("=", 1)[1])


def without_wall(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.drop(columns=["wall_seconds"])


def interrupt_in_round(monkeypatch, round_number: int) -> None:
    """Make fedaudit.training.evaluate raise KeyboardInterrupt in round ``round_number`` (1-based)."""
    import fedaudit.training as training

    real = training.evaluate
    calls = {"n": 0}

    def evaluate(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == round_number:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "evaluate", evaluate)


BATCH = 32  # FAST_ARGS' --batch-size


def client_plan(run: Path) -> dict[int, tuple[float, int]]:
    """(q, T) of each client, from the manifest: q = B / N_k, T = E * floor(N_k / B) with E = 1."""
    sizes = read_json(run / "manifest.json")["clients"]["num_examples"]
    return {k: (BATCH / n, max(1, n // BATCH)) for k, n in enumerate(sizes)}


def loop_grads(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, params: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Per-example gradients of the cross-entropy by the obviously correct loop, one backward per example (at
    ``params`` if given, which are loaded into ``model``): the reference for every per-sample gradient path. A
    parameter the loss does not depend on has zero gradients."""
    if params is not None:
        model.load_state_dict(params, strict=False)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    per_example: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    for i in range(len(y)):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        for name, p in model.named_parameters():
            if p.requires_grad:
                per_example[name].append(torch.zeros_like(p) if p.grad is None else p.grad.detach().clone())
    return {name: torch.stack(gs) for name, gs in per_example.items()}


def norms_without(monkeypatch: pytest.MonkeyPatch, left_out) -> None:
    """Plant a sensitivity fault: the per-example norm of the primitive's layer-wise path summed over only some of
    the parameters (``left_out(names)`` names the tensors it leaves out), so that their part of an example's gradient
    is no longer bounded by C."""
    import fedaudit.privacy.primitive as primitive

    real = primitive._layer_squares

    def partial(*args, **kwargs):
        traced = real(*args, **kwargs)
        if traced is None:
            return None
        traces, squares = traced
        dropped = left_out(list(squares))
        return traces, {name: torch.zeros_like(s) if name in dropped else s for name, s in squares.items()}

    monkeypatch.setattr(primitive, "_layer_squares", partial)
