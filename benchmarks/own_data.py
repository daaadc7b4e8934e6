"""How long your own data takes to load: a folder of PNG images and the same records as an .npz and a CSV file,
each through ``load_dataset`` (read, check, split, standardise, fingerprint), against the floor of merely decoding
the files (Pillow's decode of every image; NumPy's and pandas' reads).

    python benchmarks/own_data.py [--images 10000] [--size 28] [--features 20] [--repeats 3] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
from _machine import describe
from PIL import Image

from fedaudit.data import load_dataset


def _median(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=10_000)
    parser.add_argument("--size", type=int, default=28, help="the images' side, also --image-size")
    parser.add_argument("--features", type=int, default=20, help="columns of the tabular records")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="smallest sizes (seconds): 100 images, 1 repeat")
    args = parser.parse_args()
    if args.smoke:
        args.images, args.repeats = 100, 1
    rng = np.random.default_rng(0)
    labels = np.arange(args.images) % 10
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        pixels = (rng.random((args.images, args.size, args.size, 3)) * 255).astype(np.uint8)
        files = []
        for i, (image, label) in enumerate(zip(pixels, labels)):
            path = root / "images" / f"class-{label}" / f"{i:06d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(path)
            files.append(path)
        np.savez(root / "records.npz", x=pixels.transpose(0, 3, 1, 2), y=labels)
        table = pd.DataFrame(
            rng.normal(size=(args.images, args.features)), columns=[f"f{j}" for j in range(args.features)]
        )
        table["label"] = labels
        table.to_csv(root / "records.csv", index=False)

        def decode() -> None:
            for path in files:
                with Image.open(path) as image:
                    image.load()

        rows = [
            (
                f"folder: {args.images} PNG {args.size}x{args.size}",
                _median(lambda: load_dataset(f"folder:{root / 'images'}", image_size=args.size), args.repeats),
                _median(decode, args.repeats),
            ),
            (
                f"npz: the same {args.images} images",
                _median(lambda: load_dataset(f"npz:{root / 'records.npz'}"), args.repeats),
                _median(lambda: dict(np.load(root / "records.npz")), args.repeats),
            ),
            (
                f"csv: {args.images} records x {args.features} features",
                _median(lambda: load_dataset(f"csv:{root / 'records.csv'}", label_column="label"), args.repeats),
                _median(lambda: pd.read_csv(root / "records.csv"), args.repeats),
            ),
        ]
    print(describe("cpu"), flush=True)
    print(f"own data, median of {args.repeats}, 1 process")
    print(f"{'dataset':<38} {'load_dataset':>12} {'decode only':>12} {'ratio':>7}")
    for name, loaded, floor in rows:
        print(f"{name:<38} {loaded:>11.2f}s {floor:>11.2f}s {loaded / floor:>7.2f}")


if __name__ == "__main__":
    main()
