"""In-process engine: runs the selected clients one after another on this machine."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from fedaudit.algorithms.base import Algorithm, ClientData, ClientMessage, RoundContext, TensorDict

# A round whose clients are estimated to take at least this long gets an estimate of the time left, said after the
# first client of the process has run (so that a long run says up front what it will cost, in a log too).
ESTIMATE_FROM_SECONDS = 60.0


def duration(seconds: float) -> str:
    """Seconds in words: "40 s", "12 min", "2.5 h"."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


class LocalEngine:
    """Runs clients sequentially in this process, on the run's device."""

    name = "local"

    def __init__(self, *, progress: bool = True, echo: Callable[[str], None] | None = None) -> None:
        self.progress = progress
        self.echo = echo
        self._estimated = False

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def run_clients(
        self,
        algorithm: Algorithm,
        model: nn.Module,
        global_params: TensorDict,
        clients: Sequence[ClientData],
        ctx: RoundContext,
        make_generator: Callable[[int], torch.Generator],
        states: Mapping[int, TensorDict],
    ) -> list[ClientMessage]:
        """One client update per selected client; ``model`` is reused as scratch space, ``states`` is what clients
        kept."""
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
            messages.append(
                algorithm.client_update(
                    model, global_params, data, ctx, make_generator(data.client_id), state=states.get(data.client_id)
                )
            )
            if not self._estimated:
                self._estimated = True
                self._estimate(time.perf_counter() - began, len(clients), ctx)
        return messages

    def _estimate(self, seconds: float, clients: int, ctx: RoundContext) -> None:
        """Say how long the rest of the run's client work will take, from the first client's time, when it is long."""
        per_round = seconds * clients
        if self.echo is None or per_round < ESTIMATE_FROM_SECONDS:
            return
        left = ctx.rounds - ctx.round
        self.echo(
            f"round {ctx.round + 1}/{ctx.rounds}: the first client took {duration(seconds)}, so a round's clients "
            f"take about {duration(per_round)} and the {left} round(s) to go about {duration(per_round * left)}"
        )
