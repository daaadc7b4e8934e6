"""The sensitivity probe of ``fedaudit verify --probe``: the DP query as training makes it, on neighbouring batches.

DP-SGD's accountant assumes that adding one record changes a query's released sum by at most C, the clipping norm.
The other checks of ``verify`` test that on the queries a run recorded, where the noise hides small faults. The probe
tests it with the noise cancelled, on the code that trains:

- it builds the run's setup as ``fedaudit train`` does (dataset, partition, model, algorithm) and runs one client
  round of the algorithm in a sandbox, at the run's initial model and at its final one;
- the first :data:`PROBED_QUERIES` DP queries of each round are intercepted where the algorithm calls the DP primitive
  (every module of fedaudit that binds a function named ``dp_gradient``), and answered again with the call's own
  arguments (model, parameters, loss, sigma, C, expected batch size) on crafted batches: a base batch D (the first
  rows of the batch training drew), and D plus one record, for each case of :func:`cases` (a real record, a huge one,
  a blank one, a mislabelled one, a record alone; gradient records with no input, concentrated in each parameter
  tensor, in each layer, spread over the model, tiny). Both answers draw the same noise (one seed replayed), so the
  noise cancels unless it depends on the data;
- the difference, times the expected batch size, is what the record added to the released sum. Its norm must be at
  most C, and it must be the record's gradient scaled to norm at most C, which a slow reference computes one record
  at a time in float64 with torch alone (this module takes nothing of fedaudit.privacy's arithmetic);
- the base batch is also answered with a second seed: the two answers differ by two noise draws, whose variance in
  each parameter tensor must be 2 (sigma C)^2 (chi-square), so a query that adds less noise than charged, none, or
  noise that does not come from the source it is given (reused, or from elsewhere) fails.

The probe exercises the installed fedaudit with the run's settings (and the user's model, if the run has one); it does
not read the run's recorded queries. Sites that keep their records are probed on inputs of the records' shape.
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from scipy import stats
from torch import nn
from torch.func import functional_call

from fedaudit.attacks import AttackError
from fedaudit.attacks.conformance.checks import Check

PROBED_QUERIES = 2  # DP queries probed per sandboxed round (FedSSyn's first is its class counts, its second a VAE step)
BASE_ROWS = 3  # records of the base batch D
HUGE = 1000.0  # the huge record's input: a real record's times this
GRADIENT_RECORD_NORM = 10.0  # a gradient record's norm, in units of C (clipping must scale it to C)
TINY = 1e-6  # the tiny gradient record's norm, in units of C (clipping must leave it alone)
RELATIVE_TOLERANCE = 1e-4  # float32: |difference| may exceed C, and miss the reference, by this per record summed
NOISE_TOLERANCE = 1e-6  # and by this times sigma C sqrt(d): the replayed noise cancels only to float32 rounding
PROBE_SEED = 20261126  # the replayed noise's seed (any fixed value: both neighbours draw the same noise)
NOISE_LEVEL = 0.001  # the noise tests' family-wise level (verify's)
_QUERY_FUNCTION = "dp_gradient"


class _Stop(Exception):
    """Raised by the intercepting primitive when the round has been probed enough."""


@dataclass(frozen=True)
class Case:
    """One neighbouring pair: the base batch, and the base batch plus one record."""

    name: str
    kind: str  # "input": the record is an input and label; "gradient": a per-example gradient with no input
    x: torch.Tensor | None = None  # the added input record, [1, ...]
    y: torch.Tensor | None = None
    gradient: dict[str, torch.Tensor] | None = None  # the added gradient record, by parameter name
    alone: bool = False  # the base batch is empty


@dataclass(frozen=True)
class Outcome:
    """What one case found at one query."""

    point: str  # "initial" or "final"
    query: int  # 1-based index of the query in the sandboxed round
    case: str
    norm: float  # |what the record added to the released sum|
    expected_norm: float  # |the reference: the record's gradient clipped to C|
    error: float  # |added - reference|
    clip: float  # C of the call
    tolerance: float

    @property
    def over(self) -> bool:
        return not math.isfinite(self.norm) or self.norm > self.clip + self.tolerance

    @property
    def wrong(self) -> bool:
        return not math.isfinite(self.error) or self.error > self.tolerance

    def to_dict(self) -> dict[str, Any]:
        return {
            "point": self.point,
            "query": self.query,
            "case": self.case,
            "norm_over_clip": self.norm / self.clip,
            "expected_over_clip": self.expected_norm / self.clip,
            "error_over_clip": self.error / self.clip,
            "tolerance_over_clip": self.tolerance / self.clip,
        }


# --- the reference: torch alone, one record at a time, float64 ----------------------------------------------------


def reference_gradient(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    loss_fn: Callable[..., torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    dtype: torch.dtype = torch.float64,
) -> dict[str, torch.Tensor]:
    """The gradient of ``loss_fn(model(x), y)`` for one record, computed in ``dtype``, by parameter name (zeros where
    the loss does not reach a parameter)."""
    twin = copy.deepcopy(model).to(dtype)
    leaves = {name: p.detach().to(dtype).requires_grad_(True) for name, p in params.items()}
    buffers = {name: b.to(dtype) if b.is_floating_point() else b for name, b in twin.named_buffers()}
    others = {name: p.detach().to(dtype) for name, p in twin.named_parameters() if name not in leaves}
    inputs = x.to(dtype) if x.is_floating_point() else x
    loss = loss_fn(functional_call(twin, {**buffers, **others, **leaves}, (inputs,)), y)
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return {name: torch.zeros_like(leaf) if g is None else g for (name, leaf), g in zip(leaves.items(), grads)}


def clipped(gradient: Mapping[str, torch.Tensor], clip: float) -> torch.Tensor:
    """One record's gradient, flattened in float64 and scaled to norm at most ``clip``."""
    flat = torch.cat([g.reshape(-1).to(torch.float64) for g in gradient.values()])
    norm = float(flat.norm())
    return flat * (min(1.0, clip / norm) if norm > 0 else 1.0)


def flat(tensors: Mapping[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([tensors[name].detach().reshape(-1).to(torch.float64).cpu() for name in names])


# --- the cases -----------------------------------------------------------------------------------------------------


def layers(names: list[str]) -> dict[str, list[str]]:
    """Parameter names grouped by the module that owns them (the name without its last part)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(name.rpartition(".")[0] or name, []).append(name)
    return groups


def cases(
    x: torch.Tensor,
    y: torch.Tensor,
    shapes: Mapping[str, torch.Size],
    clip: float,
    generator: torch.Generator,
    *,
    labels: int | None,
) -> list[Case]:
    """The records added to the base batch: four input records made from the row after the base (a real record, its
    input times :data:`HUGE`, a blank input, and the real record with another label where labels are classes), the
    huge record alone, and gradient records in every parameter tensor, in every layer, over the whole model, and a
    tiny one."""
    row = min(BASE_ROWS, len(y) - 1)
    record_x, record_y = x[row : row + 1], y[row : row + 1]
    found = [
        Case("a record", "input", record_x, record_y),
        Case("a huge record", "input", record_x * HUGE, record_y),
        Case("a blank record", "input", torch.zeros_like(record_x), record_y),
        Case("a huge record alone", "input", record_x * HUGE, record_y, alone=True),
    ]
    if labels is not None and labels > 1 and not y.is_floating_point():
        found.append(Case("a mislabelled huge record", "input", record_x * HUGE, (record_y + 1) % labels))
    names = list(shapes)

    def gradient_record(inside: list[str], norm: float) -> dict[str, torch.Tensor]:
        draws = {
            name: torch.randn(shapes[name], generator=generator, dtype=torch.float64)
            if name in inside
            else torch.zeros(shapes[name], dtype=torch.float64)
            for name in names
        }
        total = math.sqrt(sum(float(d.pow(2).sum()) for d in draws.values()))
        return {name: d * (norm * clip / total) for name, d in draws.items()}

    big = GRADIENT_RECORD_NORM
    found += [Case(f"a gradient record in {name}", "gradient", gradient=gradient_record([name], big)) for name in names]
    grouped = layers(names)
    if len(grouped) > 1:
        found += [
            Case(f"a gradient record in layer {layer}", "gradient", gradient=gradient_record(members, big))
            for layer, members in grouped.items()
            if len(members) > 1
        ]
    found += [
        Case("a gradient record over the model", "gradient", gradient=gradient_record(names, big)),
        Case("a tiny gradient record", "gradient", gradient=gradient_record(names, TINY)),
    ]
    return found


# --- the sandbox ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NoiseTest:
    """The noise of one query in one parameter tensor: two answers on the same batch with two seeds differ by the
    difference of two noise draws, N(0, 2 (sigma C)^2) per coordinate."""

    point: str
    query: int
    tensor: str
    coordinates: int
    variance_ratio: float  # the difference's mean square over 2 (sigma C)^2 (1 for correct noise)
    p_value: float  # two-sided chi-square; with sigma C = 0, 1 when the answers agree and 0 when they do not

    def to_dict(self) -> dict[str, Any]:
        return {
            "point": self.point,
            "query": self.query,
            "tensor": self.tensor,
            "coordinates": self.coordinates,
            "variance_ratio": self.variance_ratio,
            "p_value": self.p_value,
        }


@dataclass(frozen=True)
class Probe:
    """What the probe found: every neighbouring pair's outcome, and every tensor's noise test."""

    outcomes: list[Outcome]
    noise: list[NoiseTest]


@dataclass
class _Probed:
    """What the interceptors of one sandboxed round share: the queries seen and what probing them found."""

    point: str
    labels: int | None
    outcomes: list[Outcome]
    noise: list[NoiseTest]
    queries: int = 0


@dataclass
class _Interceptor:
    """One module's binding of the DP primitive: answers each query as training asked, after probing it (until the
    round has been probed enough)."""

    real: Callable[..., Any]
    shared: _Probed

    def __call__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, **kwargs: Any) -> Any:
        self.shared.queries += 1
        self.probe(model, x, y, kwargs)
        if self.shared.queries >= PROBED_QUERIES:
            raise _Stop
        return self.real(model, x, y, **kwargs)

    def probe(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, kwargs: dict[str, Any]) -> None:
        clip = float(kwargs["max_grad_norm"])
        sigma = float(kwargs["noise_multiplier"])
        divisor = float(kwargs["expected_batch_size"])
        params = kwargs.get("params")
        if params is None:
            params = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
        names = list(params)
        shapes = {name: p.shape for name, p in params.items()}
        dimension = sum(int(p.numel()) for p in params.values())
        loss_fn = kwargs.get("loss_fn", F.cross_entropy)
        device = x.device
        if len(y) == 0:
            return  # an empty batch has no row to build records from; the next query will have one
        rows = torch.arange(max(BASE_ROWS + 1, 2), device=device) % len(y)
        x, y = x[rows], y[rows]
        base_x, base_y = x[:BASE_ROWS], y[:BASE_ROWS]
        generator = torch.Generator().manual_seed(PROBE_SEED + self.shared.queries)

        def answer(
            bx: torch.Tensor, by: torch.Tensor, extra: dict[str, torch.Tensor] | None, seed: int = PROBE_SEED
        ) -> torch.Tensor:
            replay = torch.Generator(device=device).manual_seed(seed)
            arguments = {
                **kwargs,
                "generator": replay,
                "extra": extra,
                "recorder": None,
            }
            result = self.real(model, bx, by, **arguments)
            return flat(result.grads, names) * divisor

        with torch.enable_grad():
            alone = answer(base_x[:0], base_y[:0], None)
            together = answer(base_x, base_y, None)
            self.noise_tests(together - answer(base_x, base_y, None, PROBE_SEED + 1), shapes, sigma * clip)
            for case in cases(x, y, shapes, clip, generator, labels=self.shared.labels):
                before = alone if case.alone else together
                bx, by = (base_x[:0], base_y[:0]) if case.alone else (base_x, base_y)
                if case.kind == "input":
                    assert case.x is not None and case.y is not None
                    after = answer(torch.cat([bx, case.x]), torch.cat([by, case.y]), None)
                    reference = clipped(reference_gradient(model, params, loss_fn, case.x, case.y), clip)
                    single = clipped(reference_gradient(model, params, loss_fn, case.x, case.y, torch.float32), clip)
                    if not bool(torch.isfinite(single).all()):  # it overflows where training computes: it must add 0
                        reference = torch.zeros_like(reference)
                        single = reference
                    conditioning = float((single - reference).norm())
                else:
                    assert case.gradient is not None
                    extra = {
                        name: g.to(params[name].dtype).to(device).unsqueeze(0) for name, g in case.gradient.items()
                    }
                    after = answer(bx, by, extra)
                    reference = clipped({name: case.gradient[name] for name in names}, clip)
                    conditioning = 0.0
                added = after - before
                # float32 sums of the batch's records, the replayed noise's rounding, and the record's own conditioning
                # (how far its clipped gradient moves between float32 and float64: large for a blank input whose
                # channels a normalisation divides by their zero spread)
                tolerance = (
                    clip * RELATIVE_TOLERANCE * (len(by) + 2)
                    + NOISE_TOLERANCE * sigma * clip * math.sqrt(dimension)
                    + 2 * conditioning
                )
                self.shared.outcomes.append(
                    Outcome(
                        point=self.shared.point,
                        query=self.shared.queries,
                        case=case.name,
                        norm=float(added.norm()),
                        expected_norm=float(reference.norm()),
                        error=float((added - reference).norm()),
                        clip=clip,
                        tolerance=tolerance,
                    )
                )

    def noise_tests(self, difference: torch.Tensor, shapes: Mapping[str, torch.Size], scale: float) -> None:
        """Each tensor's part of the difference of two answers that differ only in their seeds."""
        start = 0
        for name, shape in shapes.items():
            part = difference[start : start + int(shape.numel())]
            start += int(shape.numel())
            if scale == 0:
                agree = bool(part.abs().max() <= RELATIVE_TOLERANCE) if len(part) else True
                ratio, p_value = (0.0 if agree else math.inf), (1.0 if agree else 0.0)
            else:
                statistic = float(part.pow(2).sum()) / (2 * scale**2)
                ratio = statistic / len(part)
                p_value = float(
                    min(1.0, 2 * min(stats.chi2.cdf(statistic, len(part)), stats.chi2.sf(statistic, len(part))))
                )
            self.shared.noise.append(NoiseTest(self.shared.point, self.shared.queries, name, len(part), ratio, p_value))


@contextmanager
def _intercepted(shared: _Probed) -> Iterator[None]:
    """Every fedaudit module's binding of the DP primitive (a callable named ``dp_gradient``) wrapped in its own
    interceptor, each calling what that module had bound; restored on exit."""
    bound = [
        (module, getattr(module, _QUERY_FUNCTION))
        for name, module in list(sys.modules.items())
        if (name == "fedaudit" or name.startswith("fedaudit.")) and callable(getattr(module, _QUERY_FUNCTION, None))
    ]
    try:
        for module, function in bound:
            setattr(module, _QUERY_FUNCTION, _Interceptor(function, shared))
        yield
    finally:
        for module, function in bound:
            setattr(module, _QUERY_FUNCTION, function)


def probe_config(config: Any, final: Mapping[str, torch.Tensor] | None = None) -> Probe:
    """Probe the DP queries of a run configured as ``config`` (a :class:`fedaudit.config.RunConfig`): one sandboxed
    client round at the initial model and one at ``final`` (the run's final model), on the CPU."""
    from fedaudit.models import initial_params
    from fedaudit.preparation import prepare
    from fedaudit.privacy.randomness import SeededKeys
    from fedaudit.registry import algorithm
    from fedaudit.training import isolated_round

    if not config.privacy.dp:
        raise AttackError("The run was trained without --dp, so it has no DP query to probe.")
    if config.privacy.client_level:
        raise AttackError("The run is client-level DP: the probe tests the clients' DP-SGD queries of record-level DP.")
    entry = algorithm(config.federated.algorithm)
    if not entry.record_dp:
        raise AttackError(
            f"{entry.dp_label}'s guarantee is label DP, which has no clipped Gaussian query for the probe to test."
        )
    setup = prepare(replace(config, audit=replace(config.audit, canaries=0)), device="cpu")
    records = None
    if setup.records_at_sites:  # the sites hold the records: inputs of their shape stand in for them
        generator = torch.Generator().manual_seed(PROBE_SEED)
        count = max(setup.config.federated.batch_size * 2, 16)
        records = (
            torch.randn((count, *setup.spec.input_shape), generator=generator),
            torch.arange(count) % (setup.spec.num_classes),
        )
    points = {"initial": initial_params(setup.spec, setup.config.seed)}
    if final is not None:
        points["final"] = dict(final)
    outcomes: list[Outcome] = []
    noise: list[NoiseTest] = []
    for point, params in points.items():
        shared = _Probed(point, setup.spec.num_classes, [], [])
        with _intercepted(shared):
            try:
                isolated_round(setup, params, SeededKeys(PROBE_SEED, 0), records)
            except _Stop:
                pass
        if shared.queries == 0:
            raise _NoQuery(setup.config.federated.algorithm)
        outcomes += shared.outcomes
        noise += shared.noise
    return Probe(outcomes, noise)


class _NoQuery(AttackError):
    def __init__(self, algorithm: str) -> None:
        super().__init__(
            f"A sandboxed {algorithm} round made no DP query through the DP primitive, so its queries cannot be "
            "probed: a DP algorithm whose clipping and noise are its own is not covered by the ledger's guarantee."
        )
        self.algorithm = algorithm


def probe_run(run: Any) -> Check:
    """The ``sensitivity`` check of a run directory (a :class:`fedaudit.rundir.RunDirectory`): its configuration
    probed at the initial model and at its final one."""
    config = run.read_run_config()
    final = None
    if run.read_manifest().rounds_done > 0:
        final = {name: p.detach() for name, p in run.load_model().named_parameters()}
    try:
        return sensitivity_check(probe_config(config, final))
    except _NoQuery as exc:
        return sensitivity_check(None, str(exc))


def sensitivity_check(probe: Probe | None, failure: str | None = None, level: float = NOISE_LEVEL) -> Check:
    """The ``sensitivity`` check of ``verify --probe``: the neighbouring pairs are exact (p = 0 or 1); the noise
    tests are chi-square tests, Bonferroni over tensors and queries at ``level``."""
    if probe is None:
        return Check("sensitivity", False, 0.0, 0, None, failure or "The probe could not run.", {})
    outcomes, noise = probe.outcomes, probe.noise
    over = [o for o in outcomes if o.over]
    wrong = [o for o in outcomes if o.wrong and not o.over]
    worst = max((o.norm / o.clip for o in outcomes), default=0.0)
    noisiest = min(noise, key=lambda t: t.p_value, default=None)
    noise_p = 1.0 if noisiest is None else min(1.0, noisiest.p_value * len(noise))
    details = {
        "cases": len(outcomes),
        "largest_norm_over_clip": worst,
        "largest_error_over_clip": max((o.error / o.clip for o in outcomes), default=0.0),
        "noise_p_value": noise_p,
        "outcomes": [o.to_dict() for o in outcomes],
        "noise": [t.to_dict() for t in noise],
    }
    count = len(outcomes) + len(noise)
    if over:
        first = max(over, key=lambda o: o.norm / o.clip)
        sentence = (
            f"Adding {first.case} changed the released sum of query {first.query} (at the {first.point} model) by "
            f"{first.norm:.6g}, more than C = {first.clip:g} ({len(over)} of {len(outcomes)} probes): the query's "
            "sensitivity is not the C the ledger charges for."
        )
        return Check("sensitivity", False, 0.0, count, worst, sentence, details)
    if wrong:
        first = max(wrong, key=lambda o: o.error)
        sentence = (
            f"Adding {first.case} changed the released sum of query {first.query} (at the {first.point} model) by "
            f"{first.error:.3g} away from the record's gradient clipped to C = {first.clip:g} ({len(wrong)} of "
            f"{len(outcomes)} probes): the query is not the clipped sum it is documented to be."
        )
        return Check("sensitivity", False, 0.0, count, worst, sentence, details)
    if noisiest is not None and noise_p <= level:
        sentence = (
            f"Two answers of query {noisiest.query} (at the {noisiest.point} model) on one batch with two seeds "
            f"differ in {noisiest.tensor} by {noisiest.variance_ratio:.3g} times the variance two draws of "
            f"N(0, (sigma C)^2) give (p = {noise_p:.3g} over {len(noise)} tensors and queries): the query does not "
            "add the noise the ledger charges for, drawn from the source it is given."
        )
        return Check("sensitivity", False, noise_p, count, worst, sentence, details)
    sentence = (
        f"{len(outcomes)} probes of the DP query as training calls it: each added record changed the released sum by "
        f"its own gradient clipped to C, at most {worst:.4g} C; and its noise, drawn from the source it is given, "
        f"has the charged variance in every tensor (p = {noise_p:.3g})."
    )
    return Check("sensitivity", True, noise_p, count, worst, sentence, details)
