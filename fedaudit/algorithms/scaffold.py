"""SCAFFOLD: FedAvg whose local steps are corrected by control variates, so that clients do not drift apart.

Every client k keeps a control variate c_k (its own estimate of its gradient) and the server keeps c, the mean of
all clients' c_k; both start at zero. In a round, a selected client runs local SGD from the global model x with
every step's gradient corrected by c - c_k, and then updates its control variate with the cheap rule ("option II"
of Karimireddy et al., 2020):

    c_k+ = c_k - c + (x - y_k) / (K eta_l)      (y_k its local model after K steps of learning rate eta_l)

It sends the model delta y_k - x and the control delta c_k+ - c_k (twice FedAvg's upload). The server applies the
deltas like FedAvg (``--weighting``, ``--server-lr``) and moves c by |S| / N times the plain mean of the selected
clients' control deltas, which keeps c the mean of all N clients' c_k.

At client level (``--dp --dp-level client --local-steps K``) the updates are clipped and noised by the server like
FedAvg's and the server's control variate moves by the released update alone
(:meth:`Scaffold._client_level_controls`). With record-level ``--dp`` the local steps are DP-SGD queries of the one
DP primitive and the correction is added after the noise (it does not depend on the batch), and the control update is
a function of the client's DP output and of earlier state: post-processing. The privacy ledger is therefore
DP-FedAvg's, query for query. Option II's (x - y_k) / (K eta_l) is the mean applied gradient for plain SGD; with
``--momentum`` it is an approximation.
"""

from __future__ import annotations

import torch
from torch import nn

from fedaudit.algorithms.base import ClientData, ClientMessage, RoundContext, ServerResult, TensorDict
from fedaudit.algorithms.fedavg import FedAvg

CONTROL = "control/"  # payload prefix of the control delta; the model delta keeps the parameters' own names


class Scaffold(FedAvg):
    """SCAFFOLD (option II control variates), with record-level DP-SGD on the clients under ``--dp``."""

    name = "scaffold"
    keeps_client_states = True  # a client-level run writes its clients' states every round, changed or not

    def client_update(
        self,
        model: nn.Module,
        global_params: TensorDict,
        data: ClientData,
        ctx: RoundContext,
        generator: torch.Generator,
        state: TensorDict | None = None,
    ) -> ClientMessage:
        """Corrected local training; the message carries the model delta and the control delta, and the client
        keeps its new control variate."""
        server = _controls(ctx.server_state, global_params)
        own = _controls(state, global_params)
        correction = {name: server[name] - own[name] for name in global_params}
        delta, events, metrics = self.local_update(model, global_params, data, ctx, generator, correction)
        step = metrics["local_steps"] * ctx.cosine_lr(ctx.config.federated.client_lr)
        updated = {name: own[name] - server[name] - delta[name] / step for name in global_params}
        control_delta = {f"{CONTROL}{name}": updated[name] - own[name] for name in global_params}
        # at client level the server moves its control variate by the release alone: the client sends its update
        sent = self.sent_update(delta, data, ctx) if ctx.config.privacy.client_level else {**delta, **control_delta}
        return ClientMessage(
            client_id=data.client_id,
            num_examples=data.num_examples,
            payload=sent,
            metrics=metrics,
            privacy_events=events,
            state=updated,
        )

    def server_update(
        self,
        model: nn.Module,
        global_params: TensorDict,
        messages: list[ClientMessage],
        ctx: RoundContext,
        generator: torch.Generator,
    ) -> ServerResult:
        """x <- x + eta_s * weighted mean model delta; c <- c + |S| / N * mean control delta. At client level the
        control update is computed from the released update alone (:meth:`_client_level_controls`)."""
        result = super().server_update(model, global_params, messages, ctx, generator)
        server = _controls(ctx.server_state, global_params)
        if ctx.config.privacy.client_level:
            control = self._client_level_controls(server, global_params, result.params, ctx)
            return ServerResult(params=result.params, metrics=result.metrics, state={**result.state, **control})
        share = 1.0 / ctx.config.data.num_clients  # |S| / N times the mean over the |S| messages
        control = {}
        for name, c in server.items():
            total = torch.zeros_like(c)
            for message in messages:
                total += message.payload[f"{CONTROL}{name}"].to(c.device)
            control[name] = c + share * total
        return ServerResult(params=result.params, metrics=result.metrics, state=control)

    @staticmethod
    def _client_level_controls(
        server: TensorDict, before: TensorDict, after: TensorDict, ctx: RoundContext
    ) -> TensorDict:
        """Client-level SCAFFOLD: a client's control delta is -c - delta_k / (K eta_l) (option II), so the mean of
        the sampled clients' is -c - mean delta / (K eta_l), taken here from the released (clipped, noised) mean
        update, with q for |S| / N: post-processing of the DP release, at no privacy cost. It needs every client's K,
        so client-level SCAFFOLD takes --local-steps K (the configuration says so)."""
        fed = ctx.config.federated
        step = fed.local_steps * ctx.cosine_lr(fed.client_lr)
        released = {name: (after[name] - before[name]) / fed.server_lr for name in server}
        return {name: c + fed.client_fraction * (-c - released[name] / step) for name, c in server.items()}


def _controls(values: TensorDict | None, like: TensorDict) -> TensorDict:
    """A control variate by parameter name; zeros before the first round a client (or the server) takes part in."""
    if not values:
        return {name: torch.zeros_like(p) for name, p in like.items()}
    return {name: values[name].to(like[name].device, like[name].dtype) for name in like}
