"""How often the audit catches each kind of DP bug: faults planted in the real training code, over many seeds.

Each fault of the catalogue below is planted (one function of the training code replaced, as a bug would change it)
while a small DP-FedAvg canary run trains, ``fedaudit train --dp --canaries M`` on digits (5 clients, a tiny MLP,
sigma 1, C 1); the sensitivity probe (``verify --probe``) runs with the fault still planted, since it exercises the
installed code; then, with the fault removed, as an independent auditor would, ``fedaudit attack --method canary``
audits the run (every view's rigorous bound against the accountant's epsilon) and runs ``verify`` (every check).
Each detector's detection rate over the seeds is printed, and the false alarms of each over correct runs (no fault).
A detector flags a run when its check fails, or, for a canary view, when its 95% lower bound on epsilon exceeds the
accountant's epsilon. Faults the audit cannot see by construction are printed below the table with the reason.

    python benchmarks/fault_detection.py [--seeds 10] [--null 50] [--faults NAME ...] [--kept-queries 12]
                                         [--canaries 500] [--rounds 3] [--jobs 2] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _machine import describe

SMALL_RUN = (
    "--dataset digits --model mlp --width 16 --depth 1 --batch-size 32 --local-epochs 1 --device cpu --no-progress "
    "--dp --noise-multiplier 1 --max-grad-norm 1"
).split()


class Patcher:
    """Replaces attributes and puts them back (a bug planted for the length of a run)."""

    def __init__(self) -> None:
        self.saved: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        self.saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def undo(self) -> None:
        for owner, name, value in reversed(self.saved):
            setattr(owner, name, value)
        self.saved.clear()


@dataclass(frozen=True)
class Fault:
    """One bug: its name, where it is planted, and the plant (given a patcher and the run's seed)."""

    name: str
    where: str
    plant: Callable[[Patcher, int], None]


# --- the plants ----------------------------------------------------------------------------------------------------


def _noisy_sum(change: Callable[..., Any]) -> Callable[[Patcher, int], None]:
    def plant(patch: Patcher, seed: int) -> None:
        import fedaudit.privacy.primitive as primitive

        patch.set(primitive, "noisy_sum", change(primitive.noisy_sum))

    return plant


def _noise_zero(real):
    return lambda summed, **kwargs: dict(summed)


def _noise_not_added(real):
    def drawn_only(summed, **kwargs):
        real(summed, **kwargs)
        return dict(summed)

    return drawn_only


def _noise_scaled(factor: float):
    def change(real):
        return lambda summed, *, noise_multiplier, **kwargs: real(
            summed, noise_multiplier=noise_multiplier * factor, **kwargs
        )

    return change


def _noise_reused(real):
    first: dict[str, Any] = {}

    def reused(summed, **kwargs):
        released = real(summed, **kwargs)
        for name, s in summed.items():
            first.setdefault(name, released[name] - s)
        return {name: s + first[name] for name, s in summed.items()}

    return reused


def _biases_not_noised(real):
    def weights_only(summed, **kwargs):
        released = real(summed, **kwargs)
        return {name: summed[name] if name.endswith("bias") else t for name, t in released.items()}

    return weights_only


def _clipped_after_noising(real):
    import torch

    def late(summed, *, max_grad_norm, **kwargs):
        released = real(summed, max_grad_norm=max_grad_norm, **kwargs)
        norm = float(torch.sqrt(sum(t.pow(2).sum() for t in released.values())))
        return {name: t * min(1.0, max_grad_norm / norm) for name, t in released.items()}

    return late


def _noise_from_the_data(patch: Patcher, seed: int) -> None:
    """The noise scaled by the batch's largest per-example norm (a data-dependent noise scale)."""
    import fedaudit.privacy.primitive as primitive

    real_sum, real_noise = primitive.clipped_sum, primitive.noisy_sum
    largest = {"norm": 1.0}

    def remembered(*args, **kwargs):
        summed, norms = real_sum(*args, **kwargs)
        largest["norm"] = max(1.0, float(norms.max())) if len(norms) else 1.0
        return summed, norms

    def scaled(summed, *, noise_multiplier, **kwargs):
        return real_noise(summed, noise_multiplier=noise_multiplier * largest["norm"], **kwargs)

    patch.set(primitive, "clipped_sum", remembered)
    patch.set(primitive, "noisy_sum", scaled)


def _clip_at(factor: float) -> Callable[[Patcher, int], None]:
    """Examples (records and gradient canaries) clipped to factor x C while noise and ledger use C."""

    def plant(patch: Patcher, seed: int) -> None:
        import fedaudit.privacy.primitive as primitive

        real_sum, real_clip = primitive.clipped_sum, primitive.clip_and_sum
        patch.set(primitive, "clipped_sum", lambda model, x, y, c, **kw: real_sum(model, x, y, factor * c, **kw))
        patch.set(primitive, "clip_and_sum", lambda grads, c: real_clip(grads, factor * c))

    return plant


def _batch_clipped(mean: bool) -> Callable[[Patcher, int], None]:
    """The batch's summed gradient clipped to C (or its mean clipped to C, times the batch size: microbatches)."""

    def plant(patch: Patcher, seed: int) -> None:
        import torch

        import fedaudit.privacy.primitive as primitive

        real = primitive.clipped_sum

        def whole(model, x, y, max_grad_norm, **kwargs):
            summed, norms = real(model, x, y, math.inf, **kwargs)
            count = max(1, len(y)) if mean else 1
            norm = float(torch.sqrt(sum(t.pow(2).sum() for t in summed.values()))) / count
            factor = min(1.0, max_grad_norm / norm) if norm > 0 else 1.0
            return {name: t * factor for name, t in summed.items()}, norms

        patch.set(primitive, "clipped_sum", whole)

    return plant


def _per_layer_clipping(patch: Patcher, seed: int) -> None:
    """Each layer's part of an example's gradient clipped to C on its own: the whole is bounded by C sqrt(layers)."""
    import torch

    import fedaudit.privacy.primitive as primitive

    real = primitive.clipped_sum

    def per_layer(model, x, y, max_grad_norm, *, params=None, loss_fn=None, extra=None):
        params = dict(primitive.trainable_params(model) if params is None else params)
        if len(y) == 0:
            return real(model, x, y, max_grad_norm, params=params, extra=extra)
        grads = primitive.per_sample_gradients(model, x, y, params=params)
        summed = {}
        layers: dict[str, list[str]] = {}
        for name in grads:
            layers.setdefault(name.rpartition(".")[0], []).append(name)
        for members in layers.values():
            norms = torch.sqrt(sum(grads[name].flatten(1).pow(2).sum(1) for name in members))
            factors = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
            summed.update({name: torch.einsum("b,b...->...", factors, grads[name]) for name in members})
        return primitive._with_extra(summed, primitive.per_sample_norms(grads), extra, max_grad_norm)

    patch.set(primitive, "clipped_sum", per_layer)


def _norm_without(which: str) -> Callable[[Patcher, int], None]:
    """The per-example norm of the records' path summed over every tensor but one (the first or the last)."""

    def plant(patch: Patcher, seed: int) -> None:
        import torch

        import fedaudit.privacy.primitive as primitive

        real = primitive._layer_squares

        def partial(*args, **kwargs):
            traced = real(*args, **kwargs)
            if traced is None:
                return None
            traces, squares = traced
            names = list(squares)
            left_out = names[0] if which == "first" else names[-1]
            return traces, {name: torch.zeros_like(s) if name == left_out else s for name, s in squares.items()}

        patch.set(primitive, "_layer_squares", partial)

    return plant


def _canary_norm_without_first(patch: Patcher, seed: int) -> None:
    """The gradient records' (canaries') per-example norm taken without their first tensor."""
    import fedaudit.privacy.primitive as primitive

    real = primitive.per_sample_norms
    patch.set(primitive, "per_sample_norms", lambda grads: real(dict(list(grads.items())[1:])))


def _biases_unclipped(patch: Patcher, seed: int) -> None:
    import torch

    import fedaudit.privacy.primitive as primitive

    real = primitive.layer_weighted_sums

    def whole_biases(layer, factors):
        clipped, whole = real(layer, factors), real(layer, torch.ones_like(factors))
        return {name: whole[name] if name.endswith("bias") else part for name, part in clipped.items()}

    patch.set(primitive, "layer_weighted_sums", whole_biases)


def _divided_by_the_batch(patch: Patcher, seed: int) -> None:
    """DP-FedAvg's step divides the noisy sum by the batch's own size instead of the expected one."""
    import fedaudit.algorithms.fedavg as fedavg
    import fedaudit.privacy.primitive as primitive

    real = fedavg.dp_gradient

    def own_size(model, x, y, **kwargs):
        result = real(model, x, y, **kwargs)
        scale = kwargs["expected_batch_size"] / max(1, len(y))
        return primitive.DPGradient(
            {name: g * scale for name, g in result.grads.items()}, result.batch_size, result.per_sample_norms
        )

    patch.set(fedavg, "dp_gradient", own_size)


def _noise_not_used(patch: Patcher, seed: int) -> None:
    """The noisy query is computed (and recorded) but the step uses the clean clipped mean."""
    import torch

    import fedaudit.algorithms.fedavg as fedavg

    real = fedavg.dp_gradient

    def recorded_not_used(model, x, y, **kwargs):
        real(model, x, y, **kwargs)
        clean = {**kwargs, "noise_multiplier": 0.0, "recorder": None, "generator": torch.Generator()}
        return real(model, x, y, **clean)

    patch.set(fedavg, "dp_gradient", recorded_not_used)


def _fixed_batches(patch: Patcher, seed: int) -> None:
    import torch

    import fedaudit.algorithms.base as base

    def fixed(num_records, sample_rate, *, generator):
        order = torch.randperm(num_records, generator=generator, device=generator.device)
        return order[: round(num_records * sample_rate)].sort().values

    patch.set(base, "poisson_sample", fixed)


def _with_replacement(patch: Patcher, seed: int) -> None:
    """A Binomial number of records drawn with replacement (a record may be drawn twice)."""
    import torch

    import fedaudit.algorithms.base as base

    real = base.poisson_sample

    def replaced(num_records, sample_rate, *, generator):
        count = len(real(num_records, sample_rate, generator=generator))
        return torch.randint(num_records, (count,), generator=generator).sort().values

    patch.set(base, "poisson_sample", replaced)


def _sampler_doubled(patch: Patcher, seed: int) -> None:
    import fedaudit.algorithms.base as base

    real = base.poisson_sample
    patch.set(base, "poisson_sample", lambda n, rate, *, generator: real(n, min(1.0, 2 * rate), generator=generator))


def _ledger(change: Callable[[dict[str, Any]], dict[str, Any]]) -> Callable[[Patcher, int], None]:
    def plant(patch: Patcher, seed: int) -> None:
        import fedaudit.training as training

        real = training.round_events
        patch.set(training, "round_events", lambda **kwargs: real(**change(kwargs)))

    return plant


def _scaled(kwargs: dict[str, Any], name: str, factor: float, plus: int = 0) -> dict[str, Any]:
    return {**kwargs, name: kwargs[name] * factor + plus}


def _ledger_last_round_only(patch: Patcher, seed: int) -> None:
    import fedaudit.training as training

    real = training._round_privacy_events
    calls: list[int] = []

    def only_last(setup, messages, round_index, selected):
        events = real(setup, messages, round_index, selected)
        calls.append(1)
        return events if len(calls) == setup.config.federated.rounds else {k: [] for k in events}

    patch.set(training, "_round_privacy_events", only_last)


def _steps_from_the_data(patch: Patcher, seed: int) -> None:
    """A client makes one more DP step when its labels sum to an odd number (a loop count from private data), and
    reports the planned count."""
    import fedaudit.algorithms.fedavg as fedavg

    real = fedavg.FedAvg._train_dp

    def more(self, model, optimizer, global_params, data, ctx, generator, correction):
        events, metrics = real(self, model, optimizer, global_params, data, ctx, generator, correction)
        if int(data.y.sum()) % 2:
            priv, batch = ctx.config.privacy, ctx.config.federated.batch_size
            x, y, extra, source = data.dp_batch(batch / data.num_examples)
            result = fedavg.dp_gradient(
                model, x, y, noise_multiplier=priv.noise_multiplier, max_grad_norm=priv.max_grad_norm,
                expected_batch_size=batch, generator=source, extra=extra, recorder=data.recorder,
            )  # fmt: skip
            for name, p in model.named_parameters():
                p.grad = result.grads[name]
            optimizer.step()
        return events, metrics

    patch.set(fedavg.FedAvg, "_train_dp", more)


def _keys_from_the_seed(patch: Patcher, seed: int) -> None:
    import fedaudit.privacy.randomness as randomness

    real = randomness.RunRandomness.for_config.__func__

    def planted(cls, config, run_id, *, at_sites):
        made = real(cls, config, run_id, at_sites=at_sites)
        made.keys = lambda client: randomness.SeededKeys(config.seed, client, secure=config.privacy.secure_noise)
        return made

    patch.set(randomness.RunRandomness, "for_config", classmethod(planted))


def _one_round_stream(patch: Patcher, seed: int) -> None:
    import fedaudit.algorithms.base as base
    from fedaudit.seeding import Stream, make_generator

    streams: dict[tuple[int, int], Any] = {}

    def next_query(self):
        key = (self.draws.round, self.client_id)
        if key not in streams:
            streams[key] = make_generator(seed, Stream.CLIENT, *key)
        self.draws.made += 1
        return streams[key]

    patch.set(base.ClientData, "next_query", next_query)


def _secret_from_the_seed(patch: Patcher, seed: int) -> None:
    import fedaudit.privacy.randomness as randomness

    patch.set(randomness, "new_secret", lambda: seed.to_bytes(32, "big"))


def _global_generator(patch: Patcher, seed: int) -> None:
    import torch

    import fedaudit.privacy.primitive as primitive

    patch.set(primitive, "add_gaussians", lambda totals, std, source: [t + std * torch.randn(t.shape) for t in totals])


CATALOGUE: tuple[Fault, ...] = (
    Fault("noise replaced by zeros", "the noisy sum", _noisy_sum(_noise_zero)),
    Fault("noise drawn but not added", "the noisy sum", _noisy_sum(_noise_not_added)),
    Fault("noise std too small by 1.5", "the noisy sum", _noisy_sum(_noise_scaled(1 / 1.5))),
    Fault("noise sigma instead of sigma C (as at C = 10)", "the noisy sum", _noisy_sum(_noise_scaled(0.1))),
    Fault("one noise draw reused across steps", "the noisy sum", _noisy_sum(_noise_reused)),
    Fault("biases not noised", "the noisy sum", _noisy_sum(_biases_not_noised)),
    Fault("noisy sum clipped after the noise", "the noisy sum", _noisy_sum(_clipped_after_noising)),
    Fault("noise scaled by the batch's largest norm", "the noisy sum", _noise_from_the_data),
    Fault("clipping switched off", "the per-example clipping", _clip_at(math.inf)),
    Fault("examples clipped to 2 C", "the per-example clipping", _clip_at(2.0)),
    Fault("the batch's sum clipped, not each example", "the clipped sum", _batch_clipped(mean=False)),
    Fault("the batch's mean clipped (microbatch)", "the clipped sum", _batch_clipped(mean=True)),
    Fault("each layer clipped to C on its own", "the clipped sum", _per_layer_clipping),
    Fault("norm without the first tensor", "the records' norms", _norm_without("first")),
    Fault("norm without the last tensor (a bias)", "the records' norms", _norm_without("last")),
    Fault("canaries' norm without their first tensor", "the gradient records' norms", _canary_norm_without_first),
    Fault("biases summed unclipped", "the layer-wise sums", _biases_unclipped),
    Fault("divided by the batch's own size", "DP-FedAvg's step", _divided_by_the_batch),
    Fault("noise recorded but not used", "DP-FedAvg's step", _noise_not_used),
    Fault("one more step when the labels' sum is odd", "DP-FedAvg's loop", _steps_from_the_data),
    Fault("fixed batch size (shuffling)", "the sampler", _fixed_batches),
    Fault("sampling with replacement", "the sampler", _with_replacement),
    Fault("sampler at twice the rate", "the sampler", _sampler_doubled),
    Fault("ledger charges half the rate", "the ledger", _ledger(lambda kw: _scaled(kw, "sample_rate", 0.5))),
    Fault("ledger charges q = B / N of all clients", "the ledger", _ledger(lambda kw: _scaled(kw, "sample_rate", 0.2))),
    Fault("ledger charges one query fewer", "the ledger", _ledger(lambda kw: _scaled(kw, "queries_per_round", 1, -1))),
    Fault("ledger charges sigma x 1.5", "the ledger", _ledger(lambda kw: _scaled(kw, "noise_multiplier", 1.5))),
    Fault("ledger charges only the last round", "the ledger", _ledger_last_round_only),
    Fault("keys from the run seed", "the key factory", _keys_from_the_seed),
    Fault("one run-seed stream per round (before secrets)", "the query sources", _one_round_stream),
    Fault("secret made from the run seed", "the secret's generator", _secret_from_the_seed),
    Fault("noise from torch's global generator", "the Gaussian draw", _global_generator),
)  # fmt: skip

NOT_MEASURED = (
    ("adaptive clipping whose quantile query is not charged", "fedaudit has no adaptive clipping yet"),
    (
        "FedLAP-DP's radius search running more loops than charged",
        "a FedLAP-DP fault: its queries go through the same primitive and ledger, so the ledger and sampling checks "
        "see extra queries; FedLAP-DP without noise is caught by the query view (tests/cli/test_canary.py)",
    ),
    (
        "label-DP randomisation reused across rounds (FedGM)",
        "not caught: FedGM's guarantee is label DP, which has no canaries or conformance check in fedaudit yet",
    ),
    (
        "the same noise drawn by two clients",
        "not caught by construction: each client's queries are correct on their own, and the log keeps whole "
        "queries of one client at a time",
    ),
)


# --- one trial -------------------------------------------------------------------------------------------------------


def trial(fault_name: str | None, seed: int, args: dict[str, Any], scratch: str) -> dict[str, Any]:
    """Train one run with the fault planted (None: a correct run), probe it, audit it; which detectors flagged it."""
    import torch
    from click.testing import CliRunner

    from fedaudit.attacks.conformance.probe import probe_run
    from fedaudit.cli import main
    from fedaudit.rundir import RunDirectory

    torch.set_num_threads(1)
    fault = next((f for f in CATALOGUE if f.name == fault_name), None)
    out = Path(scratch) / f"run-{abs(hash((fault_name, seed)))}"
    runner = CliRunner()
    patch = Patcher()
    began = time.perf_counter()
    try:
        if fault is not None:
            fault.plant(patch, seed)
        trained = runner.invoke(
            main,
            [
                "train", *SMALL_RUN, "--canaries", str(args["canaries"]), "--rounds", str(args["rounds"]),
                "--kept-queries", str(args["kept_queries"]), "--seed", str(seed), "--out", str(out),
            ],
        )  # fmt: skip
        if trained.exit_code != 0:
            return {"fault": fault_name, "seed": seed, "error": f"train: {trained.output.strip()[-200:]}"}
        probe = probe_run(RunDirectory(out))
    finally:
        patch.undo()
    attacked = runner.invoke(main, ["attack", str(out), "--method", "canary", "--no-progress", "--device", "cpu"])
    flags: dict[str, bool] = {"verify:probe": not probe.passed}
    verification = out / "verification.json"
    if not verification.exists():
        shutil.rmtree(out, ignore_errors=True)
        return {"fault": fault_name, "seed": seed, "error": f"attack: {attacked.output.strip()[-200:]}"}
    for check in json.loads(verification.read_text())["checks"]:
        flags[f"verify:{check['name']}"] = not check["passed"]
    for path in sorted((out / "attacks").glob("*-canary/metrics.json")):
        metrics = json.loads(path.read_text())
        flags[f"canary:{path.parent.name.removesuffix('-canary')}"] = bool(
            metrics["epsilon_lower_bound_exceeds_accountant"]
        )
    shutil.rmtree(out, ignore_errors=True)
    return {"fault": fault_name, "seed": seed, "flags": flags, "seconds": time.perf_counter() - began}


# --- the table -------------------------------------------------------------------------------------------------------


def _detectors(results: list[dict[str, Any]]) -> list[str]:
    names = sorted({name for r in results if "flags" in r for name in r["flags"]})
    order = ["verify:probe", *(f"verify:{c}" for c in ("log", "noise", "clipping", "sampling", "secrecy", "ledger"))]
    return [n for n in order if n in names] + [n for n in names if n not in order]


def _short(detector: str) -> str:
    return {"verify:probe": "probe"}.get(detector, detector.split(":", 1)[1])


def print_table(results: list[dict[str, Any]], faults: list[str | None]) -> None:
    detectors = _detectors(results)
    header = f"{'fault':<48} {'runs':>4} {'any':>5} " + " ".join(f"{_short(d)[:9]:>9}" for d in detectors)
    print(header)
    for name in faults:
        if not any(r["fault"] == name for r in results):
            continue
        mine = [r for r in results if r["fault"] == name and "flags" in r]
        errors = sum(1 for r in results if r["fault"] == name and "error" in r)
        label = "correct runs (false alarms)" if name is None else name
        if not mine:
            print(f"{label:<48} {0:>4} {'-':>5}  every run failed to train or audit ({errors})")
            continue
        anyone = sum(any(r["flags"].values()) for r in mine) / len(mine)
        rates = " ".join(f"{sum(r['flags'].get(d, False) for r in mine) / len(mine):>9.2f}" for d in detectors)
        note = f"  ({errors} runs failed)" if errors else ""
        print(f"{label[:48]:<48} {len(mine):>4} {anyone:>5.2f} {rates}{note}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10, help="runs per fault")
    parser.add_argument("--null", type=int, default=50, help="correct runs (the false alarms)")
    parser.add_argument("--faults", nargs="+", help="only these faults of the catalogue (by name)")
    parser.add_argument("--kept-queries", type=int, default=12)
    parser.add_argument("--canaries", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (one torch thread each)")
    parser.add_argument("--json", type=Path, help="also write every run's flags here")
    parser.add_argument("--smoke", action="store_true", help="one fault, one seed, one correct run")
    args = parser.parse_args()
    faults: list[str | None] = [f.name for f in CATALOGUE]
    if args.faults:
        unknown = sorted(set(args.faults) - set(faults))
        if unknown:
            parser.error(f"unknown faults: {', '.join(unknown)}")
        faults = list(args.faults)
    if args.smoke:
        args.seeds, args.null, args.canaries, args.rounds, args.jobs = 1, 1, 100, 2, 1
        faults = ["noise replaced by zeros"]
    settings = {"canaries": args.canaries, "rounds": args.rounds, "kept_queries": args.kept_queries}
    print(describe("cpu", 1), flush=True)
    print(
        f"DP-FedAvg on digits, 5 clients, MLP width 16, sigma 1, C 1, {args.rounds} rounds, {args.canaries} gradient "
        f"canaries, {args.kept_queries} kept queries; {args.seeds} seeds a fault, {args.null} correct runs; "
        f"{args.jobs} run(s) at once; detection rates (a canary view: its bound above the accountant's epsilon)"
    )
    tasks = [(name, 1000 + s) for name in faults for s in range(args.seeds)]
    tasks += [(None, 5000 + s) for s in range(args.null)]
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fault-detection-") as scratch:
        if args.jobs == 1:
            results = [trial(name, seed, settings, scratch) for name, seed in tasks]
        else:
            context = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
                futures = [pool.submit(trial, name, seed, settings, scratch) for name, seed in tasks]
                results = [future.result() for future in futures]
    print_table(results, [*faults, None])
    print(f"{len(results)} runs in {time.perf_counter() - began:.0f} s")
    print("Not measured here:")
    for name, reason in NOT_MEASURED:
        print(f"  {name}: {reason}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
