"""How good Fedssyn's generator is: a classifier trained on generated records only, tested on real ones.

For each dataset, the conditional VAE of ``fedaudit.models.generative`` trains on N random training records (all
classes) with Fedssyn's defaults, without DP and, with ``--sigma``, with DP-SGD at that noise multiplier (epsilon by the
run's RDP accountant, delta 1e-5). It then generates N records with the same class counts. A ConvNet (width 32) trains
on those for 10 epochs, and, as the reference measured in the same run, a ConvNet trains on the N real records; both are
tested on the real test set. The ratio of the two accuracies is the figure: "classification accuracy score" (Ravuri and
Vinyals, 2019), a classifier-based stand-in for FID that needs no Inception network.

    python benchmarks/generator.py [--datasets digits fashion-mnist] [--records 1000 9000] [--threads 1] [--smoke]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from _machine import describe

from fedaudit.algorithms.base import ClientData
from fedaudit.config import FedssynConfig
from fedaudit.data import load_dataset
from fedaudit.models import ModelSpec, build_model, default_depth
from fedaudit.models.generative import ConditionalVAE, sample, train_generator
from fedaudit.privacy.accounting import compute_epsilon
from fedaudit.privacy.randomness import QueryDraws, SeededKeys


def classifier_accuracy(dataset, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator) -> float:
    """Test accuracy of a ConvNet (width 32) trained on (x, y) for 10 epochs of SGD (lr 0.05, momentum 0.9)."""
    shape = tuple(dataset.train_x.shape[1:])
    spec = ModelSpec("convnet", shape, dataset.num_classes, 32, default_depth("convnet", shape))
    torch.manual_seed(0)
    net = build_model(spec)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for _ in range(10):
        for batch in torch.randperm(len(y), generator=generator).split(128):
            optimizer.zero_grad()
            F.cross_entropy(net(x[batch]), y[batch]).backward()
            optimizer.step()
    with torch.no_grad():
        return float((net(dataset.test_x).argmax(1) == dataset.test_y).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", nargs="+", default=["digits", "fashion-mnist"])
    parser.add_argument("--records", nargs="+", type=int, default=[1000, 9000])
    parser.add_argument("--sigma", type=float, default=1.0, help="noise multiplier of the DP run (0: no DP run)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="smallest sizes (seconds): digits only, 100 records")
    args = parser.parse_args()
    if args.smoke:
        args.datasets, args.records = ["digits"], [100]
    torch.set_num_threads(args.threads)
    defaults = FedssynConfig()
    print(describe("cpu"), flush=True)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), CPU; conditional VAE, "
        f"{defaults.generator_epochs} epochs, batch {defaults.generator_batch}, Adam lr {defaults.generator_lr}"
    )
    print("dataset | records | generator | epsilon | train s | real-trained acc | generated-trained acc | ratio")
    for name, records in zip(args.datasets, args.records):
        dataset = load_dataset(name, None)
        generator = torch.Generator().manual_seed(0)
        pick = torch.randperm(len(dataset.train_y), generator=generator)[:records]
        x, y = dataset.train_x[pick], dataset.train_y[pick]
        real = classifier_accuracy(dataset, x, y, generator)
        for sigma in [None, *([args.sigma] if args.sigma > 0 else [])]:
            torch.manual_seed(0)
            vae = ConditionalVAE(tuple(x.shape[1:]), dataset.num_classes)
            started = time.perf_counter()
            # under DP each step is a query of a client whose draws come from keys of a public seed
            data = ClientData(0, x, y, draws=QueryDraws(SeededKeys(0, 0), 0, torch.device("cpu")))
            events, _ = train_generator(
                vae,
                x,
                y,
                epochs=defaults.generator_epochs,
                batch_size=defaults.generator_batch,
                lr=defaults.generator_lr,
                generator=generator,
                noise_multiplier=sigma,
                max_grad_norm=defaults.generator_clip,
                draw=data.dp_batch if sigma is not None else None,
            )
            seconds = time.perf_counter() - started
            generated = sample(vae, y, generator)
            accuracy = classifier_accuracy(dataset, generated, y, generator)
            epsilon = f"{compute_epsilon(events, delta=1e-5):.2f}" if events else "no DP"
            label = "no DP" if sigma is None else f"DP-SGD sigma {sigma:g}"
            print(
                f"{name} | {records} | {label} | {epsilon} | {seconds:.0f} | {real:.3f} | {accuracy:.3f} | "
                f"{accuracy / real:.2f}"
            )


if __name__ == "__main__":
    main()
