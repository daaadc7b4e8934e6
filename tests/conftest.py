"""Shared fixtures: an in-process ``fedaudit`` runner and small, fast, session-cached runs.

The suite runs with ``pytest -n 2``, so every worker process uses one torch
thread. Runs use the bundled digits data and a tiny MLP (one hidden layer of 16 units)
so that a three-round run takes well under a second once torch is loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from click.testing import Result
from helpers import FAST_ARGS, fixed_sequence_secrets, invoke, same_secrets
from zygote import Zygote

torch.set_num_threads(1)


@pytest.fixture
def fixed_secrets() -> Iterator[None]:
    """The runs this test starts get the secrets and run id of :func:`helpers.same_secrets`, as the session's
    ``trained`` runs do: two runs of one configuration are then the same run, byte for byte. Patched apart from the
    test's own ``monkeypatch``, so that its ``undo()`` keeps them."""
    with same_secrets():
        yield


@pytest.fixture(autouse=True)
def secrets_of_the_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every run a test starts in this process gets its run id and its clients' secrets from a sequence named after
    the test (:func:`helpers.fixed_sequence_secrets`): each run's noise is still its own, but the same on every
    machine and every time, so that no outcome of a test hangs on fresh secrets (a fault test whose planted fault
    shows by a margin in most draws fails in the others). Tests that compare runs on fresh secrets, and processes
    of their own, still draw from the operating system. Patched apart from the test's ``monkeypatch``."""
    patch = pytest.MonkeyPatch()
    fixed_sequence_secrets(patch, request.node.nodeid)
    try:
        yield
    finally:
        patch.undo()


# What a `fedaudit` process imports before it works: its command line, training, the attacks and the reports.
FEDAUDIT_IMPORTS = ["torch", "fedaudit.cli", "fedaudit.training", "fedaudit.attacks.runner", "fedaudit.reports.render"]


@pytest.fixture(scope="session")
def fedaudit_zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    """A zygote that imported fedaudit once (tests/support/zygote.py): the tests that start `fedaudit` as processes of
    their own (killed by their pid, or run as a page's shell blocks) fork them from it instead of importing torch and
    fedaudit again for each. Its ``bin`` holds a ``fedaudit`` shim to put first on PATH. Stopped by its pid."""
    zygote = Zygote(tmp_path_factory.mktemp("zygote"), {"fedaudit": "fedaudit.cli:main"}, FEDAUDIT_IMPORTS)
    try:
        yield zygote
    finally:
        zygote.close()


@pytest.fixture
def cli() -> Callable[..., Result]:
    """``cli("train", "--out", d, ...)`` runs the command line in this process and returns click's Result."""
    return invoke


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``trained(*extra_args)``: a completed run with FAST_ARGS + extra_args, trained once per session.

    The returned directory is shared between tests: treat it as read-only
    (copy it with shutil.copytree before resuming or overwriting it). Its clients' secrets are those of
    :func:`helpers.same_secrets`.
    """
    cache: dict[tuple[str, ...], Path] = {}

    def get(*extra: str) -> Path:
        key = tuple(str(a) for a in extra)
        if key not in cache:
            out = tmp_path_factory.mktemp("run") / "run"
            with same_secrets():  # a test with fixed_secrets trains the same run again
                result = invoke("train", *FAST_ARGS, *key, "--out", out)
            assert result.exit_code == 0, result.output
            cache[key] = out
        return cache[key]

    return get


@pytest.fixture(scope="session")
def plain_run(trained: Callable[..., Path]) -> Path:
    """A completed three-round FedAvg run without DP."""
    return trained("--rounds", "3")


@pytest.fixture(scope="session")
def dp_run(trained: Callable[..., Path]) -> Path:
    """A completed three-round DP-FedAvg run (sigma 1.0, and C 1.0 and lr 0.5 by default on digits)."""
    return trained("--dp", "--rounds", "3")
