"""What every engine does: run the selected clients of one round and hand back their messages."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from torch import nn

from fedaudit.algorithms.base import Algorithm, ClientData, ClientMessage, RoundContext, TensorDict
from fedaudit.privacy.randomness import ClientKeys


class Engine(Protocol):
    """Runs clients for the training core's round loop; a context manager that releases what it started.

    An engine decides only *where* clients run (in this process, on Flower's runtime, ...), never what they
    compute: each client's update is ``algorithm.client_update`` with its draws from ``client_keys(client_id)``
    (:func:`fedaudit.algorithms.base.run_client`), so the same keys give the same run on every engine. A Flower
    deployment's sites hold their own keys: that engine never asks for them.
    """

    name: str

    def __enter__(self) -> Engine: ...

    def __exit__(self, *exc: object) -> None: ...

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
        """One :class:`ClientMessage` per client in ``clients``, in that order.

        Args:
            algorithm: the run's algorithm; its ``client_update`` is what runs.
            model: a scratch module the engine may reuse for in-process clients.
            global_params: the global model's parameters at the start of the round.
            clients: the selected clients' data (an engine that runs clients elsewhere may rebuild it there).
            ctx: the round's context (round index, rounds, configuration, device).
            client_keys: where a client's draws come from, by client id (its secret's keys, or a public seed's).
            states: what each client kept from its last round (e.g. FedLAP's synthetic set).

        Raises:
            RuntimeError: a client failed; the round is not committed and the run stays resumable.
        """
        ...

    def take_secure_sum(self) -> ClientMessage | None:
        """The last round's payloads that reached the server only added up (secure aggregation: their messages
        came with empty payloads), as one message of client :data:`~fedaudit.algorithms.base.SECURE_SUM` whose
        ``num_examples`` is how many it sums; None where every payload came on its own. Given once."""
        ...
