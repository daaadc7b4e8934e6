"""What drawing each DP query's randomness from the client's secret costs a DP step, and what --secure-noise costs.

One DP-SGD step of a client (a Poisson batch of its records at rate B / N, the clipped sum of their per-example
gradients, Gaussian noise on every parameter) timed three ways on the same records, model and batch size:

- previous: the code path before client secrets: one torch generator per client round, from which every query drew
  its sample and its noise in turn;
- secret: fedaudit's default: each query's own generator, seeded by HMAC-SHA256 of the client's key, the round and
  the query (:class:`fedaudit.privacy.randomness.QueryDraws`);
- secure: ``--secure-noise``: each query's own ChaCha20 keystream, each Gaussian coordinate the sum of four float64
  Box-Muller draws, added in float64.

The three alternate (previous, secret, secure, previous, ...) after an untimed warm-up of each; each timing is
``--steps`` steps, and the script prints the median milliseconds per step of each and their ratios to previous.
Last, what handing out one query's source costs on its own (what the secret path adds to every step), as a share of
the cheapest step measured.

    python benchmarks/noise_sources.py [--dataset fashion-mnist] [--width 32 --width 128] [--batch 16 --batch 256]
                                       [--records 2400] [--steps 20] [--repeats 7] [--threads 1] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from _machine import describe

from fedaudit.algorithms.base import ClientData
from fedaudit.data import DataError, load_dataset
from fedaudit.models import ModelSpec, build_model, default_depth
from fedaudit.privacy.primitive import dp_gradient, poisson_sample
from fedaudit.privacy.randomness import QueryDraws, SecretKeys, client_key, new_secret

SIGMA, CLIP = 1.0, 1.0


def records(name: str, count: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``count`` training records of the dataset (Fashion-MNIST, else random 28x28 images, said in the title)."""
    try:
        dataset = load_dataset(name)
        return dataset.train_x[:count], dataset.train_y[:count], name
    except DataError:
        x = torch.randn(count, 1, 28, 28, generator=torch.Generator().manual_seed(0))
        return x, torch.arange(count) % 10, "random 28x28 images (Fashion-MNIST is not installed)"


def step_paths(model: torch.nn.Module, data: ClientData, batch: int) -> dict[str, Callable[[], None]]:
    """One DP step on each path (its generators made as each path makes them)."""
    rate = batch / data.num_examples
    previous = torch.Generator().manual_seed(1)
    key = client_key(new_secret(), "0" * 32, 0)
    draws = {
        "secret": QueryDraws(SecretKeys(key), 0, torch.device("cpu")),
        "secure": QueryDraws(SecretKeys(key, secure=True), 0, torch.device("cpu")),
    }

    def step(source: object, idx: torch.Tensor) -> None:
        dp_gradient(
            model,
            data.x[idx],
            data.y[idx],
            noise_multiplier=SIGMA,
            max_grad_norm=CLIP,
            expected_batch_size=batch,
            generator=source,
        )

    def on_previous() -> None:
        step(previous, poisson_sample(data.num_examples, rate, generator=previous))

    def on(name: str) -> Callable[[], None]:
        def run() -> None:
            source = draws[name].next()
            step(source, poisson_sample(data.num_examples, rate, generator=source))

        return run

    return {"previous": on_previous, "secret": on("secret"), "secure": on("secure")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--width", type=int, action="append")
    parser.add_argument("--batch", type=int, action="append")
    parser.add_argument("--records", type=int, default=2400, help="the client's records (N)")
    parser.add_argument("--steps", type=int, default=20, help="DP steps per timing")
    parser.add_argument("--repeats", type=int, default=7, help="timings of each path")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="width 8, batch 16, 200 records, 2 steps, 1 repeat")
    args = parser.parse_args()
    widths, batches = args.width or [32, 128], args.batch or [16, 256]
    if args.smoke:
        widths, batches, args.records, args.steps, args.repeats = [8], [16], 200, 2, 1
    torch.set_num_threads(args.threads)
    x, y, title = records(args.dataset, args.records)
    print(describe("cpu"), flush=True)
    print(f"{title}: one client of {len(y)} records, sigma {SIGMA:g}, C {CLIP:g}; {args.steps} steps a timing")
    print(f"{'width':>5} {'batch':>5} {'params':>8} {'previous ms':>12} {'secret ms':>10} {'secure ms':>10} "
          f"{'secret/previous':>16} {'secure/previous':>16}")  # fmt: skip
    data = ClientData(0, x, y)
    cheapest = float("inf")
    for width in widths:
        spec = ModelSpec(
            "convnet", tuple(x.shape[1:]), 10, width=width, depth=default_depth("convnet", tuple(x.shape[1:]))
        )
        torch.manual_seed(0)
        model = build_model(spec)
        parameters = sum(p.numel() for p in model.parameters())
        for batch in batches:
            paths = step_paths(model, data, batch)
            for run in paths.values():
                run()  # warm-up
            seconds: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(args.repeats):
                for name, run in paths.items():
                    start = time.perf_counter()
                    for _ in range(args.steps):
                        run()
                    seconds[name].append((time.perf_counter() - start) / args.steps)
            ms = {name: 1000 * statistics.median(values) for name, values in seconds.items()}
            print(
                f"{width:>5} {batch:>5} {parameters:>8} {ms['previous']:>12.2f} {ms['secret']:>10.2f} "
                f"{ms['secure']:>10.2f} {ms['secret'] / ms['previous']:>16.3f} {ms['secure'] / ms['previous']:>16.3f}",
                flush=True,
            )
            cheapest = min(cheapest, ms["previous"])
    derive = derivation_ms(1000 if args.smoke else 20_000)
    print(
        f"deriving a query's source from the client's key (HMAC-SHA256, a generator seeded): {1000 * derive:.1f} us, "
        f"{100 * derive / cheapest:.2f}% of the cheapest DP step above"
    )


def derivation_ms(count: int) -> float:
    """Milliseconds to hand out one DP query's source (what the secret path adds to a step), over ``count``."""
    draws = QueryDraws(SecretKeys(client_key(new_secret(), "0" * 32, 0)), 0, torch.device("cpu"))
    start = time.perf_counter()
    for _ in range(count):
        draws.next()
    return 1000 * (time.perf_counter() - start) / count


if __name__ == "__main__":
    main()
