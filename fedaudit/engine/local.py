"""In-process engine: runs the selected clients one after another on this machine."""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from fedaudit.algorithms.base import Algorithm, ClientData, ClientMessage, RoundContext, TensorDict


class LocalEngine:
    """Runs clients sequentially in this process, on the run's device."""

    name = "local"

    def __init__(self, *, progress: bool = True) -> None:
        self.progress = progress

    def __enter__(self) -> "LocalEngine":
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
        """One client update per selected client; ``model`` is reused as scratch space, ``states`` is what clients kept."""
        messages = []
        bar = tqdm(clients, desc=f"round {ctx.round + 1}/{ctx.rounds} clients", unit="client",
                   leave=False, disable=not self.progress)
        for data in bar:
            bar.set_postfix(client=data.client_id)
            messages.append(algorithm.client_update(
                model, global_params, data, ctx, make_generator(data.client_id), state=states.get(data.client_id)
            ))
        return messages
