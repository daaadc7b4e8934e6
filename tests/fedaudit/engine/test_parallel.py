"""Clients run several at once by the local engine (threads): the same messages, runs and resumes, bit for bit."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import FAST_ARGS, assert_user_error, engine_independent_digest, interrupt_in_round
from torch import nn

from fedaudit.algorithms.base import ClientData, ClientMessage, RoundContext
from fedaudit.config import RunConfig
from fedaudit.engine.local import LocalEngine
from fedaudit.privacy.randomness import SeededKeys

FEDLAP = (
    *"--dp --algorithm fedlap --ipc 2 --trajectories 1 --max-loops 2 --real-batches 2 --image-steps 2".split(),
    *"--init previous --client-fraction 0.6 --save-transmitted".split(),
)


def assert_same_run(a: Path, b: Path) -> None:
    assert engine_independent_digest(a) == engine_independent_digest(b)
    metrics = [pd.read_csv(run / "metrics.csv").drop(columns="wall_seconds") for run in (a, b)]
    pd.testing.assert_frame_equal(*metrics)


class ThreadRecorder:
    """A fake Algorithm that notes which thread and model ran each client, and waits so that clients overlap."""

    name = "recorder"

    def __init__(self, fail: int | None = None) -> None:
        self.calls: dict[int, tuple[str, nn.Module, torch.Generator]] = {}
        self.lock = threading.Lock()
        self.fail = fail

    def client_update(self, model, global_params, data, ctx, generator, state=None) -> ClientMessage:
        if data.client_id == self.fail:
            raise RuntimeError(f"client {data.client_id} failed")
        with self.lock:
            self.calls[data.client_id] = (threading.current_thread().name, model, generator)
        delta = model.weight.detach().sum() + torch.rand(1, generator=generator)
        return ClientMessage(data.client_id, data.num_examples, {"delta": delta})


def _run(engine: LocalEngine, algorithm, ids: list[int]):
    data = [ClientData(k, torch.zeros(k + 1, 1, 2, 2), torch.zeros(k + 1, dtype=torch.long)) for k in ids]
    ctx = RoundContext(0, 1, RunConfig(), torch.device("cpu"))
    torch.manual_seed(0)
    model = nn.Linear(2, 2)

    def keys(client_id: int) -> SeededKeys:
        return SeededKeys(0, client_id)

    return engine.run_clients(algorithm, model, {"w": torch.ones(2)}, data, ctx, keys, {}), model


def test_parallel_clients_answer_in_order_from_their_threads_own_model_copies():
    """Each thread works on a copy of the model of its own, never the original, and its clients reuse it (as the
    clients one after another reuse the original)."""
    ids = [4, 0, 3, 1, 2]
    sequential, _ = _run(LocalEngine(progress=False), ThreadRecorder(), ids)
    recorder = ThreadRecorder()
    parallel, model = _run(LocalEngine(progress=False, parallel=3), recorder, ids)
    assert [m.client_id for m in parallel] == ids
    assert all(torch.equal(a.payload["delta"], b.payload["delta"]) for a, b in zip(sequential, parallel))
    assert sorted(recorder.calls) == sorted(ids)
    assert all(name.startswith("fedaudit-client") for name, _, _ in recorder.calls.values())
    threads_of: dict[int, set[str]] = {}
    for name, copy, _ in recorder.calls.values():
        assert copy is not model
        threads_of.setdefault(id(copy), set()).add(name)
    assert all(len(names) == 1 for names in threads_of.values())  # no copy is shared between threads
    assert len(threads_of) == len({name for name, _, _ in recorder.calls.values()}) <= 3  # one copy a thread


def test_the_next_round_s_threads_work_on_the_copies_of_the_last_round():
    """A round's threads take the copies earlier rounds' threads worked on (what belongs to a model object, such as a
    captured DP query's graph, is made once a run): three threads a round (their first clients wait for each other),
    three copies in the whole run, none used by two threads in a round."""

    class Overlapping(ThreadRecorder):
        def __init__(self) -> None:
            super().__init__()
            self.together = threading.Barrier(3, timeout=30)

        def client_update(self, model, global_params, data, ctx, generator, state=None) -> ClientMessage:
            if data.client_id < 3:
                self.together.wait()
            return super().client_update(model, global_params, data, ctx, generator, state)

    engine, model = LocalEngine(progress=False, parallel=3), nn.Linear(2, 2)
    every_copy: dict[int, nn.Module] = {}  # held, so that no copy's id is reused by another
    for round_index in range(3):
        recorder = Overlapping()
        data = [ClientData(k, torch.zeros(k + 1, 1, 2, 2), torch.zeros(k + 1, dtype=torch.long)) for k in range(6)]
        ctx = RoundContext(round_index, 3, RunConfig(), torch.device("cpu"))
        engine.run_clients(recorder, model, {"w": torch.ones(2)}, data, ctx, lambda k: SeededKeys(0, k), {})
        threads_of: dict[int, set[str]] = {}
        for name, scratch, _ in recorder.calls.values():
            assert scratch is not model
            threads_of.setdefault(id(scratch), set()).add(name)
        assert len(threads_of) == 3 and all(len(names) == 1 for names in threads_of.values())
        every_copy.update({id(scratch): scratch for _, scratch, _ in recorder.calls.values()})
    assert len(every_copy) == 3


def test_one_client_or_one_at_a_time_stays_in_this_thread():
    recorder = ThreadRecorder()
    _run(LocalEngine(progress=False, parallel=4), recorder, [2])
    _run(LocalEngine(progress=False, parallel=1), recorder, [0, 1])
    assert {name for name, _, _ in recorder.calls.values()} == {threading.current_thread().name}


def test_a_failing_parallel_client_propagates():
    with pytest.raises(RuntimeError, match="client 3 failed"):
        _run(LocalEngine(progress=False, parallel=2), ThreadRecorder(fail=3), [0, 3, 1, 2])


@pytest.mark.parametrize("algorithm", ["fedavg", "fedlap"])
def test_a_run_with_parallel_clients_is_the_sequential_run(tmp_path, cli, algorithm, fixed_secrets):
    args = (*FAST_ARGS, "--rounds", "2", "--dp", *(FEDLAP if algorithm == "fedlap" else ("--algorithm", "fedavg")))
    sequential, parallel = tmp_path / "sequential", tmp_path / "parallel"
    assert cli("train", *args, "--out", sequential).exit_code == 0
    assert cli("train", *args, "--parallel-clients", "3", "--out", parallel).exit_code == 0
    assert json.loads((parallel / "config.json").read_text())["parallel_clients"] == 3
    assert_same_run(parallel, sequential)


def test_an_interrupted_run_resumes_with_parallel_clients(tmp_path, cli, monkeypatch, fixed_secrets):
    args = (*FAST_ARGS, "--rounds", "3", *FEDLAP)
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert cli("train", *args, "--out", whole).exit_code == 0
    interrupt_in_round(monkeypatch, 2)
    assert cli("train", *args, "--out", resumed).exit_code == 1
    monkeypatch.undo()
    assert cli("train", "--resume", resumed, "--parallel-clients", "2", "--no-progress").exit_code == 0
    assert json.loads((resumed / "config.json").read_text())["parallel_clients"] == 2
    assert_same_run(resumed, whole)


@pytest.mark.parametrize(
    ("extra", "mentions"),
    [
        (("--parallel-clients", "0"), "--parallel-clients must be a positive integer"),
        (("--parallel-clients", "2", "--engine", "flower"), "--parallel-clients is for the local engine"),
    ],
)
def test_bad_parallel_clients_are_one_sentence(tmp_path, cli, extra, mentions):
    out = tmp_path / "run"
    assert_user_error(cli("train", *FAST_ARGS, *extra, "--out", out), mentions=mentions)
    assert not out.exists()
