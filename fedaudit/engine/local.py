"""In-process engine: runs the selected clients of a round on this machine, one after another or several at once.

Several at once means threads, each with its own copy of the scratch model (and, on a GPU, its own CUDA stream).
A client's update reads only the global parameters, its own data, draws and state, so the messages are the
same as one after another, bit for bit: each operation computes the same thing in either order. Threads pay on
CPU because PyTorch releases the GIL inside its operations: two clients on two cores took about half the time
(docs/performance.md).
"""

from __future__ import annotations

import copy
import ctypes
import functools
import math
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from tqdm.auto import tqdm

from fedaudit.algorithms.base import (
    Algorithm,
    ClientData,
    ClientMessage,
    RoundContext,
    TensorDict,
    run_client,
    setup_rounds,
)
from fedaudit.privacy.randomness import ClientKeys

# A round whose clients are estimated to take at least this long gets an estimate of the time left, said after the
# first client of the process has run (so that a long run says up front what it will cost, in a log too).
ESTIMATE_FROM_SECONDS = 60.0


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (looked up in this process's own symbols), or None where the C library has none
    (musl, macOS, Windows)."""
    try:
        library = ctypes.CDLL(None)
    except (OSError, TypeError):  # TypeError: Windows has no handle for the process itself
        return None
    trim = getattr(library, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_memory() -> bool:
    """Hand the C allocator's free pages back to the system; False where that cannot be asked for.

    A round's clients allocate and free their tensors on worker threads, and glibc keeps what they freed in
    per-thread arenas, where it is resident but unused; over rounds the peak crept up by about 85 MB on the
    thousand-client benchmark (docs/measured-figures.md). Trimming once a round cost 2% of that run's time, once a
    client 22%.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def duration(seconds: float) -> str:
    """Seconds in words: "40 s", "12 min", "2.5 h"."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


class LocalEngine:
    """Runs clients in this process on the run's device, ``parallel`` at a time (None: all on CUDA, 1 on CPU)."""

    name = "local"

    def __init__(
        self, *, progress: bool = True, echo: Callable[[str], None] | None = None, parallel: int | None = 1
    ) -> None:
        self.progress = progress
        self.echo = echo
        self.parallel = parallel
        self._estimated = False
        # the copies of a model that client threads worked on, kept for the next round's threads: what belongs to a
        # model object (a captured DP query's CUDA graph) is made once a run, not once a round
        self._copies: weakref.WeakKeyDictionary[nn.Module, list[nn.Module]] = weakref.WeakKeyDictionary()

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def take_secure_sum(self) -> None:
        """Every payload is the server's own to read here (no secure aggregation)."""
        return None

    def run_clients(
        self,
        algorithm: Algorithm,
        model: nn.Module,
        global_params: TensorDict,
        clients: Sequence[ClientData],
        ctx: RoundContext,
        client_keys: Callable[[int], ClientKeys],
        states: Mapping[int, TensorDict],
    ) -> list[ClientMessage]:
        """One client update per selected client; ``model`` is reused as scratch space, ``states`` is what clients
        kept."""
        device = next(iter(global_params.values())).device
        # a setup round (Fedssyn's generation) says nothing about the cost of the rounds after it
        estimate = not self._estimated and ctx.round >= setup_rounds(algorithm)
        parallel = self.parallel if self.parallel is not None else (len(clients) if device.type == "cuda" else 1)

        def update(data: ClientData, scratch: nn.Module) -> ClientMessage:
            keys = client_keys(data.client_id)
            return run_client(algorithm, scratch, global_params, data, ctx, keys, state=states.get(data.client_id))

        try:
            if parallel > 1 and len(clients) > 1:
                return self._run_parallel(update, model, clients, ctx, device, parallel, estimate)
            return self._run_in_turn(update, model, clients, ctx, estimate)
        finally:
            release_free_memory()

    def _run_in_turn(
        self,
        update: Callable[[ClientData, nn.Module], ClientMessage],
        model: nn.Module,
        clients: Sequence[ClientData],
        ctx: RoundContext,
        estimate: bool,
    ) -> list[ClientMessage]:
        """The clients one after another on ``model``."""
        messages = []
        bar = tqdm(
            clients,
            desc=f"round {ctx.round + 1}/{ctx.rounds} clients",
            unit="client",
            leave=False,
            disable=not self.progress,
        )
        for data in bar:
            bar.set_postfix(client=data.client_id)
            began = time.perf_counter()
            messages.append(update(data, model))
            if estimate and not self._estimated:
                self._estimated = True
                self._estimate(time.perf_counter() - began, len(clients), ctx)
        return messages

    def _run_parallel(
        self,
        update: Callable[[ClientData, nn.Module], ClientMessage],
        model: nn.Module,
        clients: Sequence[ClientData],
        ctx: RoundContext,
        device: torch.device,
        parallel: int,
        estimate: bool,
    ) -> list[ClientMessage]:
        """The clients in ``parallel`` threads, each on its own copy of ``model``; messages in the order of
        ``clients``."""
        cuda = device.type == "cuda"
        if cuda:  # the global parameters are written on the default stream: finish before other streams read them
            torch.cuda.synchronize(device)

        own = threading.local()
        spare = self._copies.setdefault(model, [])
        taken: list[nn.Module] = []
        lock = threading.Lock()

        def update_in_thread(data: ClientData) -> ClientMessage:
            # modules carry hooks and are loaded in place: a copy for each thread, reused by its clients as the
            # clients one after another reuse ``model`` (and with it what belongs to the model object, such as the
            # CUDA graph of a captured DP query); a copy an earlier round's thread worked on where one is spare
            scratch = getattr(own, "model", None)
            if scratch is None:
                with lock:
                    scratch = spare.pop() if spare else copy.deepcopy(model)
                    taken.append(scratch)
                own.model = scratch
            if not cuda:
                return update(data, scratch)
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # a new copy's clones were issued on this one
            with torch.cuda.stream(stream):
                message = update(data, scratch)
            stream.synchronize()
            return message

        workers = min(parallel, len(clients))
        with (
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fedaudit-client") as pool,
            tqdm(
                total=len(clients),
                desc=f"round {ctx.round + 1}/{ctx.rounds} clients ({workers} at once)",
                unit="client",
                leave=False,
                disable=not self.progress,
            ) as bar,
        ):
            began = time.perf_counter()
            futures = [pool.submit(update_in_thread, data) for data in clients]
            messages = []
            try:
                for future in futures:
                    messages.append(future.result())
                    bar.update(1)
                    if estimate and not self._estimated:
                        self._estimated = True
                        self._estimate(time.perf_counter() - began, len(clients), ctx, at_once=workers)
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)  # clients not started never start
                raise
            finally:
                spare.extend(taken)
        if cuda:
            torch.cuda.synchronize(device)
        return messages

    def _estimate(self, seconds: float, clients: int, ctx: RoundContext, at_once: int = 1) -> None:
        """Say how long the rest of the run's client work will take, from the first client's time, when it is long."""
        per_round = seconds * math.ceil(clients / at_once)
        if self.echo is None or per_round < ESTIMATE_FROM_SECONDS:
            return
        left = ctx.rounds - ctx.round
        together = f" ({at_once} at once)" if at_once > 1 else ""
        self.echo(
            f"round {ctx.round + 1}/{ctx.rounds}: the first client took {duration(seconds)}{together}, so a round's "
            f"clients take about {duration(per_round)} and the {left} round(s) to go about {duration(per_round * left)}"
        )
