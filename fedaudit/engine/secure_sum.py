"""A round's noise shares summed under Flower's SecAgg+ in a Flower deployment, so that the server sees the sum alone.

With ``--noise-at clients`` each sampled client sends its clipped update plus its share of the noise, and only the
sum of the shares carries the noise the accountant charges: the guarantee holds against the server only if the
server learns the sum and nothing else. In a Flower deployment fedaudit therefore sums the round's payloads with
Flower's own SecAgg+ protocol (Bell et al., CCS 2020): the four stages of Flower's ``SecAggPlusWorkflow`` (set-up,
key sharing, masked vectors, unmasking), driven here round by round with fedaudit's own training message as each
site's fit instruction, and Flower's ``secaggplus_mod`` in every site's ClientApp. Each site masks its quantised
payload with masks agreed pairwise with the round's other sites and a private mask; the server unmasks the sum.
The reply still carries in the clear what it carries without secure aggregation and is not the update: which
client, its number of examples, its training metrics and privacy events, its data's fingerprint.

Quantisation: SecAgg+ adds integers modulo 2^32, each coordinate clipped to [-R, R] and stochastically rounded to
one of 2^22 levels. A clipped update's coordinate is at most C and a share's standard deviation is sigma C /
sqrt(m), so R = C (1 + 10 sigma / sqrt(m)) clips a coordinate with probability below 1e-22; the rounding (of the
result in float64) is unbiased and adds a variance of at most (R / 2^21)^2 / 4 per coordinate and site, under 1e-11
of the noise's at C = 1, sigma 1. Every site of a round must finish every stage (the reconstruction threshold is all
of them): a site that fails or falls silent ends the round, as without secure aggregation, and the run resumes.

Masks: Flower 1.42 expands each mask key into its mask with NumPy's ``RandomState`` seeded by the key folded to 32
bits, which a server could search (2^32 seeds) to strip a pairwise mask in a round of two or three sites. Both ends
here are fedaudit's, so the masks are expanded instead by :func:`mask_of` (a PCG64 generator seeded with a SHA-256 of
the whole key) at the sites and at the server alike (:func:`_full_key_masks`).

What it protects against: a server that follows the protocol (honest but curious). A site refuses a training
message for noise in shares that does not come through SecAgg+ (fedaudit.engine.deployment), and a site's round is
seeded by its inputs, so a server asking the same round again gets the same shares; a server that departs from the
protocol (asking a subset of the same round's sites for a second sum, or lying about who dropped out) is outside it.
A site that takes part knows its own share, so against it the others' updates carry noise sigma C sqrt((m - 1) / m).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from fedaudit.config import SECURE_SUM_SITES
from fedaudit.errors import UserError

SUMMED = "summed"  # the reply's info entry naming the payload's tensors, in the order they were summed
CLEAR_METRICS = ("local_steps",)  # what a site's reply tells of its training beside the sum (the steps it took)
MAX_SITES = SECURE_SUM_SITES  # 2^22 levels a site, summed modulo 2^32: at most 1,023 sites before the sum wraps
TARGET_RANGE = 1 << 22
MOD_RANGE = 1 << 32


def mask_of(seed: bytes, num_range: int, dimensions_list: list[tuple[int, ...]]) -> list[np.ndarray]:
    """Flower's ``pseudo_rand_gen`` (the masks of SecAgg+, integers in [0, num_range - 1)) from the whole key: a PCG64
    generator seeded with the key's SHA-256 (256 bits), where Flower's folds the key to a 32-bit seed."""
    generator = np.random.Generator(
        np.random.PCG64(np.random.SeedSequence(int.from_bytes(hashlib.sha256(seed).digest())))
    )
    return [
        np.asarray(generator.integers(0, num_range - 1, size=dimension, dtype=np.int64), dtype=np.int64)
        for dimension in dimensions_list
    ]


@contextlib.contextmanager
def _full_key_masks(module: Any) -> Iterator[None]:
    """SecAgg+'s masks expanded by :func:`mask_of` in ``module`` (Flower's client mod or server workflow) for the
    block; both ends of fedaudit's secure sums use it."""
    flowers = module.pseudo_rand_gen
    module.pseudo_rand_gen = mask_of
    try:
        yield
    finally:
        module.pseudo_rand_gen = flowers


def clipping_range(max_update_norm: float, noise_multiplier: float, participants: int) -> float:
    """R: a clipped update's largest coordinate (C) plus ten standard deviations of a share (sigma C / sqrt(m))."""
    return float(max_update_norm) * (1.0 + 10.0 * float(noise_multiplier) / np.sqrt(max(participants, 1)))


# ---------------------------------------------------------------------------- at each site


def secure_sum_mod(message: Any, context: Any, call_next: Callable[[Any, Any], Any]) -> Any:
    """Flower's ``secaggplus_mod`` for the training messages of a secure sum; every other message passes by.

    The masked stage (the one that carries fedaudit's training task) rounds the site's result with NumPy's global
    generator; it is seeded here, after training and for the rounding alone (and restored after), from the client,
    the round and the global model it was sent, so that a round asked again (a resumed run) sums to exactly what
    its first try would have. The rounding is unbiased and its draws are not secret: the Gaussian shares, not the
    rounding, are the noise the accountant charges, and the server sees the rounded results only summed."""
    flowers_mod = importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod")  # the module (its
    # package's attribute of that name is the function)
    if message.metadata.message_type != "train" or not is_secure(message):
        return call_next(message, context)
    if "task" not in message.content.config_records:
        with _full_key_masks(flowers_mod):
            return flowers_mod.secaggplus_mod(message, context, call_next)
    task = message.content["task"]
    digest = hashlib.sha256(f"fedaudit secure-sum rounding/{task['client']}/{task['round']}".encode())
    for name, array in message.content["global"].items():
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(array.numpy()).tobytes())

    def train_then_seed(inner: Any, inner_context: Any) -> Any:
        reply = call_next(inner, inner_context)
        np.random.seed(int.from_bytes(digest.digest()[:4], "little"))  # for the rounding that follows, alone
        return reply

    kept = np.random.get_state()
    try:
        with _full_key_masks(flowers_mod):
            return flowers_mod.secaggplus_mod(message, context, train_then_seed)
    finally:
        np.random.set_state(kept)


def is_secure(message: Any) -> bool:
    """Whether ``message`` is one of SecAgg+'s stages."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    return RECORD_KEY_CONFIGS in message.content.config_records


def as_fit_result(reply: Any, message: Any) -> Any:
    """A site's training reply to ``message`` as SecAgg+'s mod masks it: the payload as the fit result's parameters
    (weight 1, so that the unmasked mean times the sites is the sum), its tensors' names in the info; no other
    array (the mod clears what it does not mask, and nothing else may reach the server), and of the training's
    metrics only :data:`CLEAR_METRICS` (a training loss is a function of the site's data, without noise)."""
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.common import Code, ndarrays_to_parameters
    from flwr.compat.common.recorddict_compat import parameters_to_arrayrecord

    content = reply.content
    if set(content.array_records) != {"payload"}:
        extra = sorted(set(content.array_records) - {"payload"})
        raise RuntimeError(f"a secure sum's reply carries {extra} beside the payload, which would reach the server")
    payload = content["payload"]
    arrays = [array.numpy().astype(np.float64) for array in payload.values()]  # rounded without float32's bias
    info = dict(content["info"])
    metrics = json.loads(str(info["metrics"]))
    info["metrics"] = json.dumps({name: metrics[name] for name in CLEAR_METRICS if name in metrics})
    out = RecordDict(
        {
            "info": ConfigRecord({**info, SUMMED: json.dumps(list(payload.keys()))}),
            "fitres.metrics": ConfigRecord({}),
            "fitres.num_examples": MetricRecord({"num_examples": 1}),
            "fitres.parameters": parameters_to_arrayrecord(ndarrays_to_parameters(arrays), True),
            "fitres.status": ConfigRecord({"code": int(Code.OK.value), "message": "Success"}),
        }
    )
    return Message(content=out, reply_to=message)


# ---------------------------------------------------------------------------- at the server


class SecureRoundError(UserError):
    """A stage of the secure sum did not complete: ``node`` failed with ``error`` (a Flower error), or with
    ``error`` None did not answer in time, or (``reason``) the sites' replies did not fit the protocol (the
    deployment engine says which, in one sentence)."""

    def __init__(self, node: int, error: Any, stage: str, reason: str | None = None) -> None:
        super().__init__(f"Node {node} did not complete SecAgg+'s {stage} stage.")
        self.node, self.error, self.stage, self.reason = node, error, stage, reason


class _Proxy:
    """What SecAgg+'s set-up stage needs of a client proxy: its node."""

    def __init__(self, node_id: int) -> None:
        self.node_id = node_id


class _Strategy:
    """The legacy strategy SecAgg+'s workflow calls: it samples the round's nodes and keeps the unmasked mean."""

    def __init__(self, nodes: Iterable[int]) -> None:
        self.nodes = list(nodes)
        self.mean: list[np.ndarray] | None = None

    def configure_fit(self, server_round: int, parameters: Any, client_manager: Any) -> list[tuple[Any, Any]]:
        from flwr.common import FitIns

        return [(_Proxy(node), FitIns(parameters, {})) for node in self.nodes]

    def aggregate_fit(self, server_round: int, results: list[Any], failures: list[Any]) -> tuple[None, dict]:
        from flwr.common import parameters_to_ndarrays

        if results and not failures:
            self.mean = parameters_to_ndarrays(results[0][1].parameters)
        return None, {}


class _Grid:
    """The run's grid for SecAgg+'s stages: replies pulled every ``poll`` seconds (Flower's own waits 3 s between
    pulls), the stage failed on the first error or once ``timeout`` passes, and the masked stage's replies kept."""

    STAGES = ("set-up", "key sharing", "masked vectors", "unmasking")

    def __init__(self, grid: Any, timeout: float, poll: float, alive: Callable[[], bool]) -> None:
        self.grid, self.timeout, self.poll, self.alive = grid, timeout, poll, alive
        self.stage = 0
        self.replies: dict[int, Any] = {}

    def send_and_receive(self, messages: Iterable[Any], *, timeout: float | None = None) -> list[Any]:
        messages = list(messages)
        ids = self.grid.push_messages(messages)
        pending = {mid: message.metadata.dst_node_id for mid, message in zip(ids, messages, strict=True)}
        deadline = time.monotonic() + self.timeout
        replies: list[Any] = []
        while pending:
            if not self.alive():
                raise SecureRoundError(next(iter(pending.values())), None, "heartbeat")
            for reply in self.grid.pull_messages(list(pending)):
                node = pending.pop(reply.metadata.reply_to_message_id)
                if reply.has_error():
                    raise SecureRoundError(node, reply.error, self.STAGES[self.stage])
                replies.append(reply)
            if pending:
                if time.monotonic() > deadline:
                    raise SecureRoundError(min(pending.values()), None, self.STAGES[self.stage])
                time.sleep(self.poll)
        if self.stage == 2:
            self.replies = {reply.metadata.src_node_id: reply for reply in replies}
        self.stage += 1
        return replies


def secure_round(
    grid: Any,
    context: Any,
    requests: Mapping[int, Any],
    *,
    round_number: int,
    like: Mapping[str, torch.Tensor],
    clip_range: float,
    timeout: float,
    poll: float,
    alive: Callable[[], bool],
) -> tuple[dict[int, Any], dict[str, torch.Tensor]]:
    """Run SecAgg+ over the nodes of ``requests`` (node -> fedaudit's training message for it): each node's reply
    (its payload masked away) and the sum of the payloads, as tensors named, shaped and typed as ``like``'s.

    Raises:
        SecureRoundError: a node failed, went silent or the server task ended (stage "heartbeat"), or summed other
            tensors than ``like``'s (stage "tensors").
    """
    from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
    from flwr.server.compat.legacy_context import LegacyContext
    from flwr.server.workflow import SecAggPlusWorkflow
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
    from flwr.server.workflow.constant import Key as WorkflowKey

    nodes = sorted(requests)
    if len(nodes) > MAX_SITES:  # the configuration refuses more clients (fedaudit.config)
        raise SecureRoundError(nodes[MAX_SITES], None, f"set-up (at most {MAX_SITES} sites a round)")

    class Workflow(SecAggPlusWorkflow):
        def setup_stage(self, grid: Any, context: Any, state: Any) -> bool:
            done = super().setup_stage(grid, context, state)
            state.nid_to_fitins = {node: requests[node].content for node in nodes}
            return done

    state = RecordDict(
        {
            MAIN_CONFIGS_RECORD: ConfigRecord({WorkflowKey.CURRENT_ROUND: round_number}),
            MAIN_PARAMS_RECORD: ArrayRecord(),
        }
    )
    own = Context(
        run_id=context.run_id, node_id=context.node_id, node_config={}, state=state, run_config=context.run_config
    )
    strategy = _Strategy(nodes)
    legacy = LegacyContext(own, strategy=strategy)  # type: ignore[arg-type]
    stages = _Grid(grid, timeout, poll, alive)
    workflow = Workflow(
        num_shares=1.0,  # every site shares its keys with every other site of the round
        reconstruction_threshold=1.0,  # and every share is needed: no site may drop out
        max_weight=1.0,
        clipping_range=clip_range,
        quantization_range=TARGET_RANGE,
        modulus_range=MOD_RANGE,
    )
    try:
        with _full_key_masks(importlib.import_module("flwr.server.workflow.secure_aggregation.secaggplus_workflow")):
            workflow(stages, legacy)
    except SecureRoundError:
        raise
    except (KeyError, ValueError, TypeError, AttributeError, IndexError) as exc:  # a reply not of the protocol
        stage = _Grid.STAGES[min(max(stages.stage - 1, 0), len(_Grid.STAGES) - 1)]  # the stage whose replies these were
        raise SecureRoundError(nodes[0], None, stage, f"{type(exc).__name__}: {exc}") from exc
    if strategy.mean is None:
        raise SecureRoundError(nodes[0], None, "unmasking", "too few shares came back to remove the masks")
    for node, reply in stages.replies.items():
        if json.loads(str(reply.content["info"][SUMMED])) != list(like):
            raise SecureRoundError(node, None, "tensors")
    total = {
        name: torch.from_numpy(mean * len(nodes)).to(p.device, p.dtype)
        for (name, p), mean in zip(like.items(), strategy.mean, strict=True)
    }
    return stages.replies, total
