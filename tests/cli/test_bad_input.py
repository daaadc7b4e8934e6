"""Bad input, table-driven, through the real command line: every case must exit 2 with exactly one sentence on
stderr (no traceback, no usage dump) and write nothing: neither into the working folder nor into the runs it names.

The cases are what users get wrong: out-of-range and malformed option values for every command, contradictory
options, damaged or foreign files where a run, a policy, a study, a configuration or a key is expected, and output
paths that would overwrite or land inside a run."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from helpers import FAST_ARGS, assert_user_error, invoke, tree_digest

# train: option -> values that must be refused (each with the fast base arguments and a fresh --out)
TRAIN_VALUES: dict[str, tuple[str, ...]] = {
    "--rounds": ("0", "-1", "1.5", "abc", "100001"),
    "--num-clients": ("0", "-3", "x", "1.5"),
    "--client-fraction": ("0", "1.5", "-0.1", "nan", "x"),
    "--local-epochs": ("0", "-1", "x"),
    "--lr": ("-1", "0", "nan", "inf", "x"),
    "--batch-size": ("0", "-1", "x"),
    "--width": ("0", "-1", "x"),
    "--depth": ("-1", "x"),
    "--holdout-fraction": ("-0.1", "1", "1.5", "nan"),
    "--seed": ("-1", "x", "1e3"),
    "--server-lr": ("0", "-1", "nan"),
    "--momentum": ("-0.5", "x"),
    "--keep-checkpoints": ("0", "-1", "x"),
    "--partition": ("classes:0", "dirichlet:-1", "foo", "classes:x", "dirichlet:"),
    "--dataset": ("nope", "", "mnist2"),
    "--model": ("resnet", ""),
    "--algorithm": ("fedfoo", ""),
    "--device": ("tpu", ""),
    "--engine": ("spark",),
    "--accountant": ("moments",),
    "--parallel-clients": ("0", "-2"),
    "--canaries": ("-1", "x"),
}
# train --dp: the mechanism's values
DP_VALUES: dict[str, tuple[str, ...]] = {
    "--noise-multiplier": ("-1", "nan", "x", "inf"),
    "--max-grad-norm": ("0", "-1", "inf", "nan"),
    "--delta": ("0", "1", "1.5", "-1", "nan"),
    "--target-epsilon": ("0", "-1", "nan", "x"),
}
# FedLAP's own settings
FEDLAP_VALUES: dict[str, tuple[str, ...]] = {
    "--ipc": ("0", "-1"),
    "--radius": ("0", "-1", "nan"),
    "--image-lr": ("0", "-1"),
    "--max-loops": ("0", "-1"),
    "--real-batches": ("0",),
    "--image-steps": ("0",),
    "--server-batch-size": ("0",),
    "--server-epochs": ("0",),
}
# the other algorithms' settings, each with its algorithm
ALGORITHM_VALUES: dict[tuple[str, str], tuple[str, ...]] = {
    ("fedprox", "--mu"): ("-1", "nan", "x"),
    ("feddm", "--dm-ipc"): ("0", "-1"),
    ("feddm", "--dm-iterations"): ("0",),
    ("feddm", "--dm-lr"): ("0", "-1"),
    ("feddm", "--dm-batch"): ("0",),
    ("fedgm", "--distill-ipc"): ("0",),
    ("fedgm", "--distill-steps"): ("0",),
    ("fedgm", "--distill-lr"): ("0", "-1"),
    ("fedssyn", "--generator-epochs"): ("0", "-1"),
    ("fedssyn", "--generator-lr"): ("0", "-1"),
}
TRAIN_CONFLICTS: tuple[tuple[str, ...], ...] = (
    ("--canaries", "10"),  # canaries need --dp
    ("--dp", "--canaries", "1"),  # never on both sides of the audit
    ("--ipc", "5"),  # FedLAP's option on FedAvg (the default) would be ignored
    ("--algorithm", "scaffold", "--radius", "3"),
    ("--mu", "0.1"),  # FedProx's
    ("--dp", "--dp-level", "client", "--max-update-norm", "1", "--clipping", "adaptive", "--count-noise", "1e6"),
    ("--dp", "--canaries", "10", "--keep-checkpoints", "1"),
    ("--dp", "--noise-multiplier", "1", "--target-epsilon", "2"),
    ("--dp-level", "client", "--max-update-norm", "1"),  # client level needs --dp
    ("--dp", "--dp-level", "client"),  # and a clipping norm for the updates
    ("--dp", "--dp-level", "client", "--max-update-norm", "-1"),
    ("--dp", "--dp-level", "client", "--max-update-norm", "nan"),
    ("--dp", "--dp-level", "client", "--max-update-norm", "1", "--max-grad-norm", "1"),  # record-level clipping
    ("--dp", "--max-update-norm", "1"),  # record level: no update clipping
    ("--dp", "--dp-level", "client", "--max-update-norm", "1", "--algorithm", "fedlap"),  # shares synthetic sets
    ("--dp", "--dp-level", "client", "--max-update-norm", "1", "--canaries", "10"),  # record-level canaries
    ("--dp", "--dp-level", "client", "--max-update-norm", "1", "--algorithm", "scaffold"),  # needs --local-steps
    ("--dp", "--dp-level", "clients", "--max-update-norm", "1"),
    ("--dp", "--clipping", "adaptive"),  # adaptive clipping clips client updates
    ("--dp", "--dp-level", "client", "--max-update-norm", "1", "--clipping", "adaptive", "--target-quantile", "1.5"),
    ("--dp", "--dp-level", "client", "--max-update-norm", "1", "--clipping", "adaptive", "--count-noise", "-1"),
    ("--dp", "--dp-level", "client", "--max-update-norm", "1", "--clipping", "adaptive", "--clip-lr", "0"),
    # the count's noise leaves nothing for the updates: sigma 3 >= 2 * sigma_b
    ("--dp", "--dp-level", "client", "--max-update-norm", "1", "--clipping", "adaptive", "--noise-multiplier", "3"),
    ("--engine", "flower", "--ray-address", "127.0.0.1:1"),  # no cluster there: Ray would retry for ever
    ("--resume", "RUN", "--lr", "0.1"),
    ("--resume", "RUN", "--out", "OTHER"),
    ("--resume", "NOWHERE"),
    ("--out", "RUN"),  # exists: --resume or --overwrite
    ("--out", "FOREIGN", "--overwrite"),  # not a run
    ("--out", "FILE"),  # a file, not a directory
    ("--out", ""),
    ("--config", "NOWHERE"),
    ("--config", "BADYAML"),
    ("--config", "UNKNOWNKEY"),
    ("--config", "WRONGTYPE"),
    ("--config", "TAGGED"),
    ("--config", "ALIASBOMB"),
    ("--config", "DEEPYAML"),
    ("--config", "DEEPJSON"),
    ("--config", "HUGEYAML"),
    ("--config", "ARCH_LIST"),  # model.arch: [1]
    ("--engine", "deployment"),  # no --superlink
)
# your own data: --dataset KIND:NAME with a malformed file
OWN_DATA: tuple[tuple[str, ...], ...] = (
    ("--dataset", "npz:PICKLED"),
    ("--dataset", "npz:RAGGED"),
    ("--dataset", "npz:NOWHERE"),
    ("--dataset", "npz:FILE"),
    ("--dataset", "npz:NO_Y"),
    ("--dataset", "npz:FRACTIONAL_LABELS"),
    ("--dataset", "csv:CSV"),  # no --label-column
    ("--dataset", "csv:CSV", "--label-column", "nope"),
    ("--dataset", "csv:TEXT_CSV", "--label-column", "label"),
    ("--dataset", "csv:NOWHERE", "--label-column", "label"),
    ("--dataset", "folder:EMPTY_CLASS"),
    ("--dataset", "folder:BROKEN_IMAGE"),
    ("--dataset", "folder:NOWHERE"),
    ("--dataset", "folder:FOREIGN"),
    ("--dataset", "npz:"),
    ("--dataset", "npz:GOOD", "--label-column", "label"),
    ("--dataset", "npz:GOOD", "--image-size", "16"),
    ("--dataset", "folder:EMPTY_CLASS", "--image-size", "0"),
    ("--dataset", "npz:GOOD", "--data-dir", "FOREIGN"),
    ("--dataset", "npz:TRUNCATED_NPZ"),  # the first 300 bytes of a good one
    ("--dataset", "npz:RANDOM_NPZ"),  # 100 random bytes: not "a pickled array"
    ("--dataset", "npz:NPY_AS_NPZ"),  # one .npy array under an .npz name
    ("--dataset", "npz:NPZ_BOMB"),  # a header that claims 8 TB
    ("--dataset", "csv:NAN_CSV", "--label-column", "label"),  # literal nan cells
    ("--dataset", "csv:SPARSE_CSV", "--label-column", "label"),  # 1 TB (sparse) of CSV
    ("--dataset", "folder:BIG_IMAGE"),  # 9000 x 9000 pixels
    ("--dataset", "folder:BOMB_IMAGE"),  # 30000 x 30000 pixels (Pillow's decompression-bomb limit)
    ("--model", "user_models:thirteen_outputs"),  # 13 outputs for 10 classes
    ("--model", "user_models:misfit"),  # a first layer that does not take the records
    ("--model", "user_models:exits"),  # SystemExit(0) in the factory
    ("--model", "exiting_module:factory"),  # SystemExit(0) when imported
    ("--model", "user_models:not_a_tensor"),  # returns a tuple
)
# datasets: the same malformed files, read without training
DATASETS_CASES: tuple[tuple[str, ...], ...] = (
    ("datasets", "--dataset", "npz:TRUNCATED_NPZ"),
    ("datasets", "--dataset", "npz:RANDOM_NPZ"),
    ("datasets", "--dataset", "npz:NPZ_BOMB"),
    ("datasets", "--dataset", "csv:NAN_CSV", "--label-column", "label"),
    ("datasets", "--dataset", "folder:BOMB_IMAGE"),
)
ATTACK_CASES: tuple[tuple[str, ...], ...] = (
    ("attack", "RUN", "--signal", "entropy"),
    ("attack", "RUN", "--signal", ""),
    ("attack", "RUN", "--method", "likelihood"),
    ("attack", "RUN", "--target", "round:9"),
    ("attack", "RUN", "--target", "round:0"),
    ("attack", "RUN", "--target", "round:-1"),
    ("attack", "RUN", "--target", "garbage"),
    ("attack", "RUN", "--nonmembers", "train"),
    ("attack", "RUN", "--max-records", "1"),
    ("attack", "RUN", "--max-records", "-5"),
    ("attack", "RUN", "--seed", "-1"),
    ("attack", "RUN", "--bootstrap", "0"),
    ("attack", "RUN", "--bootstrap", "1"),  # an interval of one resample excluded its own AUC
    ("attack", "RUN", "--bootstrap", "-1"),
    ("attack", "RUN", "--method", "canary"),  # a run without DP or canaries
    ("attack", "RUN", "--method", "rmia", "--references", "0"),
    ("attack", "RUN", "--method", "lira", "--references", "3", "--online"),
    ("attack", "NOWHERE"),
    ("attack", "FOREIGN"),
    ("attack", "FILE"),
    ("attack", "TAMPERED"),
    ("attack", "FORGED_LEDGER"),
    ("attack", "RUN", "--device", "tpu"),
    ("attack", "RUN", "--method", "reconstruction"),  # trained without --save-transmitted
    ("attack", "SENT", "--method", "reconstruction", "--target", "round:9"),  # no such round
    ("attack", "SENT", "--method", "reconstruction", "--target", "round:1:client:99"),  # no such client
    ("attack", "SENT", "--method", "reconstruction", "--target", "ABSENT_CLIENT"),  # did not take part
    ("attack", "SENT", "--method", "reconstruction", "--target", "round:1:client:x"),
    ("attack", "SENT", "--method", "reconstruction", "--target", "round:0:client:1"),
    ("attack", "NO_BIAS", "--method", "reconstruction"),  # the labels cannot be read off this model
    ("attack", "SENT", "--method", "reconstruction", "--iterations", "0"),
    ("attack", "SENT", "--method", "reconstruction", "--restarts", "-1"),
    ("attack", "SENT", "--method", "reconstruction", "--psnr-threshold", "0"),
    ("attack", "SENT", "--method", "reconstruction", "--psnr-threshold", "nan"),
    ("attack", "RUN", "--target", "round:1:client:0"),  # a client is for reconstruction only
)
# attack --flower-log: files that are not a whole Flower canary log, and options that do not go with one
FLOWER_LOG_CASES: tuple[tuple[str, ...], ...] = (
    ("attack",),  # nothing to attack
    ("attack", "--flower-log", "NOWHERE"),
    ("attack", "--flower-log", "FILE"),  # a text file
    ("attack", "--flower-log", "FOREIGN"),  # a folder
    ("attack", "--flower-log", "GOOD"),  # an .npz that is not a log
    ("attack", "--flower-log", "PICKLED"),
    ("attack", "--flower-log", "FLOWER_TRUNCATED"),
    ("attack", "--flower-log", "FLOWER_VERSION"),
    ("attack", "--flower-log", "FLOWER_MISMATCH"),  # lengths that do not agree
    ("attack", "--flower-log", "FLOWER_ONE_SIDE"),  # every canary included
    ("attack", "--flower-log", "FLOWER_LOG", "--out", "FILE"),
    ("attack", "--flower-log", "FLOWER_LOG", "--out", ""),
    ("attack", "--flower-log", "FLOWER_LOG", "--signal", "loss"),
    ("attack", "--flower-log", "FLOWER_LOG", "--max-records", "10"),
    ("attack", "--flower-log", "FLOWER_LOG", "--seed", "-1"),
    ("attack", "--flower-log", "FLOWER_LOG", "--bootstrap", "0"),
    ("attack", "RUN", "--flower-log", "FLOWER_LOG"),
    ("attack", "RUN", "--out", "OUT"),  # --out is for --flower-log
)
REPORT_CASES: tuple[tuple[str, ...], ...] = (
    ("report", "RUN", "--out", ""),
    ("report", "RUN", "--out", "OUT/x.csv"),
    ("report", "RUN", "--out", "RUN"),
    ("report", "RUN", "--out", "RUN/reports"),
    ("report", "RUN", "--out", "EXISTING/report.html"),
    ("report", "RUN", "--out", "EXISTING"),
    ("report", "RUN", "--out", "OUT/r.html", "--format", "pdf"),
    ("report", "RUN", "--out", "OUT", "--format", "docx"),
    ("report", "RUN", "--out", "FILE/r.html"),
    ("report", "RUN", "--out", "FILE/sub"),  # a file on the way to a folder
    ("report", "RUN", "--out", "/proc/fedaudit-report"),
    ("report", "NOWHERE", "--out", "OUT"),
    ("report", "FOREIGN", "--out", "OUT"),
    ("report", "RUN", "--out", "OUT", "--policy", "NOWHERE"),
    ("report", "RUN", "--out", "OUT", "--policy", "BADYAML"),
    ("report", "RUN", "--out", "OUT", "--policy", "ALIASBOMB"),
    ("report", "RUN", "--out", "OUT", "--policy", "DEEPYAML"),
    ("report", "RUN", "--out", "OUT", "--policy", "HUGEYAML"),
)
POLICIES: tuple[str, ...] = (
    "max_attack_auc: 2",
    "max_attack_auc: 0.4",
    "max_attack_auc: x",
    "delta: 1.5",
    "delta: 0",
    "max_epsilon: -1",
    "max_epsilon: 0",
    "max_epsilon: .nan",
    "max_tpr_at_0_1pct_fpr: 1.5",
    "max_tpr_at_1pct_fpr_per_client: -0.1",
    "min_accuracy: 2",
    "max_audit_ratio: -1",
    "max_failed_conformance_checks: -1",
    "unknown_limit: 1",
    "delta: 0.00001",  # no limit at all
    "[1, 2]",
    "",
    "max_epsilon: !!python/object/apply:os.system ['echo pwned']",
    "max_reconstruction_psnr: 0",
    "max_reconstruction_psnr: x",
    "max_failed_conformance_checks: 1.5",  # a count
    "max_epsilon: true",
    "max_failed_conformance_checks: 1" + "0" * 400,  # a whole number no float holds: it overflowed, exit 1
    "max_attack_auc: 0.9\ndelta: 1.0e-9",  # delta qualifies max_epsilon alone: it was ignored without a word
)
EPSILON_CASES: tuple[tuple[str, ...], ...] = (
    ("epsilon", "--noise-multiplier", "1", "--sample-rate", "0", "--steps", "10"),
    ("epsilon", "--noise-multiplier", "1", "--sample-rate", "1.5", "--steps", "10"),
    ("epsilon", "--noise-multiplier", "1", "--sample-rate", "0.1", "--steps", "0"),
    ("epsilon", "--noise-multiplier", "-1", "--sample-rate", "0.1", "--steps", "10"),
    ("epsilon", "--noise-multiplier", "1", "--sample-rate", "x", "--steps", "10"),
    ("epsilon", "--noise-multiplier", "1", "--steps", "10"),
    ("epsilon", "--noise-multiplier", "1", "--sample-rate", "0.1", "--steps", "10", "--delta", "1"),
    ("epsilon", "--noise-multiplier", "1", "--sample-rate", "0.1", "--steps", "10", "--rounds", "0"),
)
OTHER_CASES: tuple[tuple[str, ...], ...] = (
    ("verify", "NOWHERE"),
    ("verify", "FOREIGN"),
    ("verify", "RUN", "--public-key", "NOWHERE"),
    ("verify", "RUN", "--public-key", "BADYAML"),
    ("sign", "RUN", "--key", "NOWHERE"),
    ("sign", "RUN", "--key", "BADYAML"),
    ("sign", "RUN", "--key", "/dev/zero"),
    ("verify", "RUN", "--public-key", "/dev/zero"),
    ("sign", "TAMPERED", "--key", "KEY"),
    ("sign", "NOWHERE", "--key", "KEY"),
    ("compare", "--out", "OUT/s", "--budget", "eps:x"),
    ("compare", "--out", "OUT/s", "--budget", "eps:-1"),
    ("compare", "--out", "OUT/s", "--algorithm", "fedfoo"),
    ("compare", "--out", "OUT/s", "--seeds", "0"),
    ("compare", "--out", "OUT/s.html"),
    ("compare", "--out", "FOREIGN"),
    ("compare", "--study", "NOWHERE", "--out", "OUT/s"),
    ("compare", "--study", "BADYAML", "--out", "OUT/s"),
    ("compare", "--out", "OUT/s", "--attack", "inversion"),
    ("datasets", "--data-dir", "FILE"),
    ("nonsense-command",),
    ("train", "--no-such-option"),
)


def _cases() -> list[tuple[str, ...]]:
    cases: list[tuple[str, ...]] = []
    for option, values in TRAIN_VALUES.items():
        cases += [("train", *FAST_ARGS, option, value, "--out", "OUT/run") for value in values]
    for option, values in DP_VALUES.items():
        cases += [("train", *FAST_ARGS, "--dp", option, value, "--out", "OUT/run") for value in values]
    for option, values in FEDLAP_VALUES.items():
        cases += [("train", *FAST_ARGS, "--algorithm", "fedlap", option, v, "--out", "OUT/run") for v in values]
    for (algorithm, option), values in ALGORITHM_VALUES.items():
        cases += [("train", *FAST_ARGS, "--algorithm", algorithm, option, v, "--out", "OUT/run") for v in values]
    for args in TRAIN_CONFLICTS:  # each with somewhere to write, so that --out's absence is not what is refused
        cases.append(
            ("train", *args)
            if "--resume" in args
            else ("train", *FAST_ARGS, *args, *(() if "--out" in args else ("--out", "OUT/run")))
        )
    own = [a for a in FAST_ARGS if a not in ("--dataset", "digits")]
    cases += [("train", *own, *args, "--out", "OUT/run") for args in OWN_DATA]
    cases += [("datasets", *(a for a in args if a != "--data-dir" and a != "FOREIGN")) for args in OWN_DATA[:6]]
    cases += [*DATASETS_CASES, *ATTACK_CASES, *FLOWER_LOG_CASES, *REPORT_CASES, *EPSILON_CASES, *OTHER_CASES]
    cases += [("report", "RUN", "--out", "OUT", "--policy", f"POLICY{i}") for i in range(len(POLICIES))]
    return cases


CASES = _cases()


def test_the_table_has_at_least_260_cases():
    assert len(CASES) >= 260


@pytest.fixture(scope="module")
def workspace(plain_run, tmp_path_factory) -> dict[str, Path]:
    """Named paths the cases refer to: a run, a tampered copy, a forged ledger, foreign folders and files."""
    import json

    from helpers import rehash

    root = tmp_path_factory.mktemp("bad")
    run = Path(shutil.copytree(plain_run, root / "run"))
    tampered = Path(shutil.copytree(plain_run, root / "tampered"))
    (tampered / "metrics.csv").write_text("round,test_accuracy\n1,0.99\n")
    sent = invoke(
        "train", *FAST_ARGS, "--rounds", "1", "--client-fraction", "0.4", "--save-transmitted", "--out", root / "sent"
    )
    assert sent.exit_code == 0, sent.output
    took_part = {int(p.stem.split("-")[1]) for p in (root / "sent" / "transmitted" / "round-0001").iterdir()}
    absent = min(set(range(5)) - took_part)
    (root / "recon_models.py").write_text(
        "from torch import nn\n\n\ndef no_bias(input_shape, num_classes):\n"
        "    n = input_shape[0] * input_shape[1] * input_shape[2]\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(n, 8), nn.ReLU(), nn.Linear(8, num_classes, bias=False))\n"
    )
    sys.path.insert(0, str(root))
    no_bias = invoke(
        "train",
        *FAST_ARGS,
        "--model",
        "recon_models:no_bias",
        "--rounds",
        "1",
        "--save-transmitted",
        "--out",
        root / "no_bias",
    )
    assert no_bias.exit_code == 0, no_bias.output
    dp = invoke("train", *FAST_ARGS, "--dp", "--rounds", "2", "--out", root / "forged")
    assert dp.exit_code == 0, dp.output
    ledger = json.loads((root / "forged" / "privacy.json").read_text())
    ledger["epsilon_per_round"][-1] = 0.2
    (root / "forged" / "privacy.json").write_text(json.dumps(ledger))
    rehash(root / "forged")
    foreign = root / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    (root / "file").write_text("a file")
    (root / "existing").mkdir()
    (root / "existing" / "report.html").write_text("an earlier report")
    (root / "bad.yaml").write_text("a: [unclosed")
    (root / "unknown.yaml").write_text("no_such_section: 1\n")
    (root / "wrongtype.yaml").write_text("federated:\n  rounds: many\n")
    (root / "tagged.yaml").write_text("seed: !!python/object/apply:os.system ['echo pwned']\n")
    # nine levels of anchors, each list holding the one above nine times (9^9 leaves once expanded), inside a known key
    bomb = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    bomb += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    (root / "bomb.yaml").write_text("\n".join(bomb) + "\nseed: *a8\nmax_epsilon: *a8\n")
    (root / "deep.yaml").write_text("seed: " + "[" * 60 + "]" * 60 + "\n")
    (root / "deep.json").write_text('{"seed": ' + "[" * 5000 + "]" * 5000 + "}")
    (root / "huge.yaml").write_text("# padding\n" * 120_000 + "seed: 1\n")
    (root / "arch_list.yaml").write_text("model:\n  arch: [1]\n")
    (root / "user_models.py").write_text(USER_MODELS)
    (root / "exiting_module.py").write_text("raise SystemExit(0)\n")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    (root / "key.pem").write_bytes(
        Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    import numpy as np
    from PIL import Image

    evil = np.empty(2, dtype=object)
    evil[:] = [{"a": 1}, {"b": 2}]
    np.savez(root / "pickled.npz", x=evil, y=np.array([0, 1]))
    ragged = np.empty(2, dtype=object)
    ragged[:] = [np.zeros(3), np.zeros(4)]
    np.savez(root / "ragged.npz", x=ragged, y=np.array([0, 1]))
    np.savez(root / "no_y.npz", x=np.zeros((20, 4)))
    np.savez(root / "fractional.npz", x=np.zeros((20, 4)), y=np.full(20, 0.5))
    np.savez(root / "good.npz", x=np.random.default_rng(0).random((60, 4)), y=np.arange(60) % 2)
    flower = _flower_log()
    flower.write(root / "flower.npz")
    (root / "flower_truncated.npz").write_bytes(flower.to_bytes()[:300])
    np.savez(root / "flower_version.npz", **{**flower.to_arrays(), "version": np.array(3)})
    np.savez(root / "flower_mismatch.npz", **{**flower.to_arrays(), "final_cosines": np.zeros(39)})
    np.savez(root / "flower_one_side.npz", **{**flower.to_arrays(), "included": np.ones(40, dtype=np.int8)})
    (root / "truncated.npz").write_bytes((root / "good.npz").read_bytes()[:300])
    (root / "random.npz").write_bytes(np.random.default_rng(1).bytes(100))
    np.save(root / "single.npy", np.zeros((20, 4)))
    (root / "single.npy").rename(root / "single.npz")
    _claiming_npz(root / "bomb.npz", (10**12,))
    (root / "nan.csv").write_text("a,b,label\n" + "".join(f"{i},nan,{i % 2}\n" for i in range(40)))
    sparse_csv = tmp_path_factory.mktemp("sparse") / "sparse.csv"  # outside root, which every case hashes
    with sparse_csv.open("wb") as sparse:
        sparse.write(b"a,b,label\n")
        sparse.truncate(10**12)
    for folder, size in (("big_image", (9000, 9000)), ("bomb_image", (30000, 30000))):
        for name in ("cat", "dog"):
            (root / folder / name).mkdir(parents=True)
            (root / folder / name / "0.png").write_bytes(_png_claiming(*size))
    (root / "records.csv").write_text("a,b,label\n" + "".join(f"{i},{i % 3},{i % 2}\n" for i in range(40)))
    (root / "text.csv").write_text("a,b,label\n" + "".join(f"x{i},{i},{i % 2}\n" for i in range(40)))
    for folder, broken in (("empty_class", False), ("broken_image", True)):
        for name in ("cat", "dog"):
            (root / folder / name).mkdir(parents=True)
        Image.fromarray(np.zeros((4, 4), dtype=np.uint8)).save(root / folder / "cat" / "0.png")
        if broken:
            (root / folder / "dog" / "0.png").write_bytes(b"not a png")
    names = {
        "PICKLED": root / "pickled.npz",
        "RAGGED": root / "ragged.npz",
        "NO_Y": root / "no_y.npz",
        "FRACTIONAL_LABELS": root / "fractional.npz",
        "GOOD": root / "good.npz",
        "FLOWER_LOG": root / "flower.npz",
        "FLOWER_TRUNCATED": root / "flower_truncated.npz",
        "FLOWER_VERSION": root / "flower_version.npz",
        "FLOWER_MISMATCH": root / "flower_mismatch.npz",
        "FLOWER_ONE_SIDE": root / "flower_one_side.npz",
        "CSV": root / "records.csv",
        "TEXT_CSV": root / "text.csv",
        "EMPTY_CLASS": root / "empty_class",
        "TRUNCATED_NPZ": root / "truncated.npz",
        "RANDOM_NPZ": root / "random.npz",
        "NPY_AS_NPZ": root / "single.npz",
        "NPZ_BOMB": root / "bomb.npz",
        "NAN_CSV": root / "nan.csv",
        "SPARSE_CSV": sparse_csv,
        "BIG_IMAGE": root / "big_image",
        "BOMB_IMAGE": root / "bomb_image",
        "ARCH_LIST": root / "arch_list.yaml",
        "BROKEN_IMAGE": root / "broken_image",
        "RUN": run,
        "TAMPERED": tampered,
        "FORGED_LEDGER": root / "forged",
        "FOREIGN": foreign,
        "FILE": root / "file",
        "EXISTING": root / "existing",
        "BADYAML": root / "bad.yaml",
        "UNKNOWNKEY": root / "unknown.yaml",
        "WRONGTYPE": root / "wrongtype.yaml",
        "TAGGED": root / "tagged.yaml",
        "ALIASBOMB": root / "bomb.yaml",
        "DEEPYAML": root / "deep.yaml",
        "DEEPJSON": root / "deep.json",
        "HUGEYAML": root / "huge.yaml",
        "KEY": root / "key.pem",
        "NOWHERE": root / "nowhere",
        "OTHER": root / "other",
        "OUT": root / "out",
        "SENT": root / "sent",
        "NO_BIAS": root / "no_bias",
        "ABSENT_CLIENT": Path(f"round:1:client:{absent}"),
    }
    for i, text in enumerate(POLICIES):
        (root / f"policy{i}.yaml").write_text(text + "\n")
        names[f"POLICY{i}"] = root / f"policy{i}.yaml"
    return names


USER_MODELS = """from torch import nn


def _flat(input_shape, outputs):
    n = input_shape[0] * input_shape[1] * input_shape[2]
    return nn.Sequential(nn.Flatten(), nn.Linear(n, outputs))


def thirteen_outputs(input_shape, num_classes):
    return _flat(input_shape, 13)


def misfit(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(7, num_classes))


def exits(input_shape, num_classes):
    raise SystemExit(0)


class Pair(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x), self.inner(x)


def not_a_tensor(input_shape, num_classes):
    return Pair(_flat(input_shape, num_classes))
"""


def _claiming_npz(path: Path, shape: tuple[int, ...]) -> None:
    """An .npz whose x.npy header claims ``shape`` (float64) over a few bytes of data: what a decompression bomb's
    header says, without the gigabytes."""
    import io
    import zipfile

    import numpy as np

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": shape})
    labels = io.BytesIO()
    np.save(labels, np.zeros(2, dtype=np.int64))
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", header.getvalue() + bytes(64))
        archive.writestr("y.npy", labels.getvalue())


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` grey pixels (over one row of data): Pillow reads the size
    from the header before it decodes anything."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


def _flower_log():
    """A small, whole Flower canary log (fedaudit.instruments.canary_log), 40 canaries over 2 rounds."""
    import numpy as np

    from fedaudit.instruments.canary_log import CanaryLog

    rng = np.random.default_rng(0)
    return CanaryLog(
        seed=0,
        included=(np.arange(40) % 2).astype(np.int8),
        scale=10.0,
        clipping_norm=0.1,
        noise_multiplier=1.0,
        mechanism="central DP, server-side clipping",
        strategy="DifferentialPrivacyServerSideFixedClipping(FedAvg)",
        dimension=100,
        delta=1e-5,
        round_cosines=rng.normal(0, 0.1, (2, 40)),
        round_norms=np.ones(2),
        released=np.ones(2, dtype=np.int8),
        sampled=np.full(2, 5),
        population=np.full(2, 30),
        equal_weights=np.ones(2, dtype=np.int8),
        final_cosines=rng.normal(0, 0.1, 40),
        final_norm=1.0,
        sample_rate=np.full(2, float("nan")),
        flower_epsilon=float("nan"),
        flower_delta=float("nan"),
        flower_report="Flower reports no epsilon.",
        flower_version="1.41.0",
        fedaudit_version="0.1.0",
    )


def _resolve(arg: str, names: dict[str, Path]) -> str:
    kind, colon, name = arg.partition(":")
    if colon and kind in ("npz", "csv", "folder"):
        return f"{kind}:{_resolve(name, names)}" if name else arg
    head, _, rest = arg.partition("/")
    if head in names:
        return str(names[head] / rest) if rest else str(names[head])
    return arg


@pytest.mark.parametrize("case", CASES, ids=[" ".join(c).replace(" ".join(FAST_ARGS), "FAST") for c in CASES])
def test_bad_input_is_one_sentence_exit_2_and_writes_nothing(workspace, case):
    """... and takes less than 1 GB more memory than the process held before: its peak resident size may rise above
    the larger of its earlier peak and what it held before plus 1 GB only if the case itself took more (a case that
    stays under an earlier, higher peak is not seen, so the cases that read files are each far below it here)."""
    root = workspace["RUN"].parent
    before = tree_digest(root)
    held, peak = _resident_bytes(), _peak_bytes()
    assert_user_error(invoke(*(_resolve(a, workspace) for a in case)))
    assert tree_digest(root) == before
    assert _peak_bytes() <= max(peak, held + (1 << 30)), f"peak {_peak_bytes() / 2**30:.2f} GiB"


def _resident_bytes() -> int:
    """This process's resident set now (Linux /proc)."""
    import os

    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_bytes() -> int:
    """This process's peak resident set so far (ru_maxrss is in KiB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
