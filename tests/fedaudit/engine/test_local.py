"""The in-process engine: one client_update per selected client, in order, and a time estimate said once."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch
from torch import nn

import fedaudit.engine.local as local
from fedaudit.algorithms.base import ClientData, ClientMessage, RoundContext
from fedaudit.config import RunConfig
from fedaudit.engine.base import Engine
from fedaudit.engine.local import ESTIMATE_FROM_SECONDS, LocalEngine, duration
from fedaudit.privacy.randomness import SeededKeys


class RecordingAlgorithm:
    """A fake Algorithm: records every client_update call and answers with a message naming the client."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def client_update(self, model, global_params, data, ctx, generator, state=None) -> ClientMessage:
        self.calls.append(
            {"model": model, "params": global_params, "data": data, "ctx": ctx, "generator": generator, "state": state}
        )
        return ClientMessage(data.client_id, data.num_examples, {"delta": data.x.sum(0)})


class Clock:
    """A fake time.perf_counter: the given readings, then the last one forever."""

    def __init__(self, *readings: float) -> None:
        self.readings = list(readings)

    def __call__(self) -> float:
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]


def clients(*ids: int) -> list[ClientData]:
    return [ClientData(k, torch.full((k + 1, 1, 2, 2), float(k)), torch.zeros(k + 1, dtype=torch.long)) for k in ids]


def context(round_index: int = 0, rounds: int = 5) -> RoundContext:
    return RoundContext(round_index, rounds, RunConfig(), torch.device("cpu"))


def run(engine, algorithm, data, ctx=None, states=None, made=None):
    """engine.run_clients with keys per client (recorded in ``made`` by client id)."""
    made = {} if made is None else made

    def keys(client_id: int) -> SeededKeys:
        made[client_id] = SeededKeys(0, client_id)
        return made[client_id]

    model, params = nn.Linear(2, 2), {"w": torch.ones(2)}
    return engine.run_clients(algorithm, model, params, data, ctx or context(), keys, states or {}), model, params


def test_run_clients_calls_each_client_once_in_order_with_its_keys_and_state():
    algorithm, made = RecordingAlgorithm(), {}
    states = {3: {"kept": torch.tensor([3.0])}, 0: {"kept": torch.tensor([0.0])}, 9: {"kept": torch.tensor([9.0])}}
    ctx = context(2, 4)
    messages, model, params = run(LocalEngine(progress=False), algorithm, clients(3, 0, 5), ctx, states, made)

    assert [m.client_id for m in messages] == [3, 0, 5]
    assert [m.num_examples for m in messages] == [4, 1, 6]
    assert torch.equal(messages[0].payload["delta"], torch.full((1, 2, 2), 12.0))
    assert [call["data"].client_id for call in algorithm.calls] == [3, 0, 5]
    assert all(call["data"].draws.keys is made[call["data"].client_id] for call in algorithm.calls)
    assert all(call["data"].draws.round == ctx.round for call in algorithm.calls)
    seeds = [call["generator"].initial_seed() for call in algorithm.calls]
    assert seeds == [made[k].round_seed(ctx.round) for k in (3, 0, 5)]  # each its own round generator
    assert sorted(made) == [0, 3, 5]  # keys for every selected client, none for others
    assert algorithm.calls[0]["state"] is states[3]
    assert algorithm.calls[1]["state"] is states[0]
    assert algorithm.calls[2]["state"] is None  # client 5 kept nothing
    assert all(call["model"] is model and call["params"] is params and call["ctx"] is ctx for call in algorithm.calls)


def test_run_clients_of_no_clients_returns_no_messages():
    algorithm = RecordingAlgorithm()
    assert run(LocalEngine(progress=False), algorithm, [])[0] == []
    assert algorithm.calls == []


def test_a_failing_client_propagates():
    class Failing(RecordingAlgorithm):
        def client_update(self, *args, **kwargs):
            raise RuntimeError("client 1 failed")

    with pytest.raises(RuntimeError, match="client 1 failed"):
        run(LocalEngine(progress=False), Failing(), clients(1, 2))


def test_no_progress_bar_without_progress(capsys):
    run(LocalEngine(progress=False), RecordingAlgorithm(), clients(0, 1))
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------- the time estimate


def test_a_long_round_is_estimated_once_from_the_first_client(monkeypatch):
    said: list[str] = []
    engine = LocalEngine(progress=False, echo=said.append)
    monkeypatch.setattr(local.time, "perf_counter", Clock(100.0, 130.0))  # the first client takes 30 s
    run(engine, RecordingAlgorithm(), clients(0, 1, 2), context(0, 5))
    assert said == [
        "round 1/5: the first client took 30 s, so a round's clients take about 2 min and the 5 round(s) to go "
        "about 8 min"
    ]
    monkeypatch.setattr(local.time, "perf_counter", Clock(0.0, 1000.0))  # later rounds: never again
    run(engine, RecordingAlgorithm(), clients(0, 1, 2), context(1, 5))
    assert len(said) == 1


def test_the_estimate_counts_only_the_rounds_left(monkeypatch):
    said: list[str] = []
    monkeypatch.setattr(local.time, "perf_counter", Clock(0.0, 3000.0))
    run(LocalEngine(progress=False, echo=said.append), RecordingAlgorithm(), clients(0, 1), context(7, 10))
    assert said == [
        "round 8/10: the first client took 50 min, so a round's clients take about 1.7 h and the 3 round(s) to go "
        "about 5.0 h"
    ]


@pytest.mark.parametrize(
    "first_client, expected",
    [(ESTIMATE_FROM_SECONDS / 3, 1), (ESTIMATE_FROM_SECONDS / 3 - 0.01, 0)],
    ids=["at the threshold", "just under"],
)
def test_the_estimate_is_said_only_from_the_threshold(monkeypatch, first_client, expected):
    said: list[str] = []
    monkeypatch.setattr(local.time, "perf_counter", Clock(0.0, first_client))
    run(LocalEngine(progress=False, echo=said.append), RecordingAlgorithm(), clients(0, 1, 2))
    assert len(said) == expected


def test_a_short_first_round_means_no_estimate_later(monkeypatch):
    """The estimate is taken from the first client of the process only."""
    said: list[str] = []
    engine = LocalEngine(progress=False, echo=said.append)
    monkeypatch.setattr(local.time, "perf_counter", Clock(0.0, 1.0))
    run(engine, RecordingAlgorithm(), clients(0, 1, 2))
    monkeypatch.setattr(local.time, "perf_counter", Clock(0.0, 1000.0))
    run(engine, RecordingAlgorithm(), clients(0, 1, 2), context(1, 5))
    assert said == []


def test_without_echo_a_long_round_says_nothing(monkeypatch, capsys):
    monkeypatch.setattr(local.time, "perf_counter", Clock(0.0, 1000.0))
    messages = run(LocalEngine(progress=False), RecordingAlgorithm(), clients(0, 1))[0]
    assert len(messages) == 2
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize(
    "seconds, words",
    [
        (0.4, "0 s"),
        (40, "40 s"),
        (89.4, "89 s"),
        (90, "2 min"),
        (720, "12 min"),
        (5399, "90 min"),
        (5400, "1.5 h"),
        (9000, "2.5 h"),
        (36 * 3600, "36.0 h"),
    ],
)
def test_duration_in_words(seconds, words):
    assert duration(seconds) == words


# ---------------------------------------------------------------------------- the Engine protocol


def test_local_engine_has_the_engine_protocols_methods():
    """Every method the Engine protocol declares, with the same parameters (LocalEngine does not subclass it)."""
    declared = {name for name, value in vars(Engine).items() if callable(value) and not name.startswith("_")}
    # a new protocol method must be added to this check and to LocalEngine
    assert declared == {"run_clients", "take_secure_sum"}
    for name in (*declared, "__enter__", "__exit__"):
        ours, theirs = inspect.signature(getattr(LocalEngine, name)), inspect.signature(getattr(Engine, name))
        assert list(ours.parameters) == list(theirs.parameters), name
    assert "name" in Engine.__annotations__
    assert LocalEngine.name == "local"


def test_local_engine_is_a_context_manager_that_lets_errors_through():
    engine = LocalEngine(progress=False)
    with engine as entered:
        assert entered is engine
    with pytest.raises(KeyError), LocalEngine(progress=False):
        raise KeyError("not swallowed")


def test_a_setup_round_is_not_estimated_and_the_first_training_round_is(monkeypatch):
    """Fedssyn's generation round costs nothing like its training rounds: the estimate waits for round 2."""

    class WithSetupRound(RecordingAlgorithm):
        setup_rounds = 1

    said: list[str] = []
    engine = LocalEngine(progress=False, echo=said.append)
    monkeypatch.setattr(local.time, "perf_counter", Clock(0.0, 1000.0))
    run(engine, WithSetupRound(), clients(0, 1), context(0, 5))
    assert said == []
    monkeypatch.setattr(local.time, "perf_counter", Clock(0.0, 100.0))
    run(engine, WithSetupRound(), clients(0, 1), context(1, 5))
    assert said == [
        "round 2/5: the first client took 2 min, so a round's clients take about 3 min and the 4 round(s) to go "
        "about 13 min"
    ]


_FRAGMENTING_ROUND = """
import sys
import torch
from torch import nn
import fedaudit.engine.local as local
from fedaudit.algorithms.base import ClientData, ClientMessage, RoundContext
from fedaudit.config import RunConfig
from fedaudit.privacy.randomness import SeededKeys

kept = []


class Fragmenting:
    name = "fragmenting"

    def client_update(self, model, global_params, data, ctx, generator, state=None):
        blocks = [bytearray(4000) for _ in range(30_000)]  # 120 MB from the worker thread's malloc arena
        kept.extend(blocks[::50])  # one block in fifty outlives the client, so the arena cannot shrink from its top
        return ClientMessage(data.client_id, 1, {"delta": torch.zeros(1)})


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


if sys.argv[1] == "keep":
    local.release_free_memory = lambda: False
data = [ClientData(k, torch.zeros(1, 1, 2, 2), torch.zeros(1, dtype=torch.long)) for k in range(4)]
ctx = RoundContext(0, 1, RunConfig(), torch.device("cpu"))
before = rss_mb()
local.LocalEngine(progress=False, parallel=2).run_clients(
    Fragmenting(), nn.Linear(2, 2), {"w": torch.ones(2)}, data, ctx,
    lambda k: SeededKeys(0, k), {},
)
print(rss_mb() - before)
"""


@pytest.mark.skipif(local._malloc_trim() is None, reason="the C library has no malloc_trim (not glibc)")
def test_a_round_hands_what_its_client_threads_freed_back_to_the_system():
    """Four clients on two threads each free 118 of the 120 MB they allocated; after the round the process holds
    that memory only when the engine does not trim (the creep the thousand-client benchmark measured)."""
    grown = {}
    for mode in ("trim", "keep"):
        done = subprocess.run(
            [sys.executable, "-c", _FRAGMENTING_ROUND, mode], capture_output=True, text=True, check=True, timeout=120
        )
        grown[mode] = float(done.stdout.split()[-1])
    assert grown["keep"] > 150, grown  # untrimmed, at least one thread's freed blocks stay resident
    assert grown["trim"] < grown["keep"] - 120, grown
    assert grown["trim"] < 60, grown


def test_release_free_memory_says_whether_it_could():
    assert local.release_free_memory() is (local._malloc_trim() is not None)
