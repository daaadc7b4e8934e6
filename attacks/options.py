"""What ``fedaudit attack`` can be asked: the attacks' options (:class:`AttackOptions`) and the reconstruction's
(:class:`ReconstructionOptions`), each field with its command-line option in its metadata (fedaudit.options), so
that the command line builds ``attack``'s options, help texts and shown defaults from these fields.

Torch-free, as the command line reads it to show ``--help``; the checks that need the attacks' modules import them
when they run.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from fedaudit.attacks import AttackError
from fedaudit.attacks.registry import (
    ATTACKS,
    DEFAULT_METHODS,
    RECONSTRUCTION,
    RECONSTRUCTION_METHOD,
    REFERENCE,
    attack,
    family_of,
)
from fedaudit.config import DEVICES, MAX_SEED
from fedaudit.options import option_name, option_of, setting

DEFAULT_SIGNALS: tuple[str, ...] = ("loss", "grad-norm")
SYNTHETIC_SIGNAL = "synthetic-distance"  # read from what crossed the wire, not from a model
DEFAULT_MAX_RECORDS = 2000  # members audited at most, and as many non-members
DEFAULT_RESAMPLES = 1000  # bootstrap resamples of an AUC interval
MIN_RESAMPLES = 40  # the fewest whose 2.5% and 97.5% quantiles are not their smallest and largest
MAX_RESAMPLES = 100_000  # a hundred times the default: the interval's quantiles move by less than its rounding
DEFAULT_REFERENCES = 4  # reference models of rmia and lira
MAX_REFERENCES = 256
NONMEMBER_SOURCES: tuple[str, ...] = ("holdout", "test", "both")

DEFAULT_ITERATIONS = 250  # Adam steps per start
DEFAULT_RESTARTS = 4  # random starts; the one whose update matches best is kept
DEFAULT_PSNR_THRESHOLD = 20.0  # dB: a record counts as recovered at this PSNR or more (docs/attack.md: why 20)
LEARNING_RATE = 0.1  # Adam on the dummy records (standardised pixels), decayed tenfold at 3/8, 5/8 and 7/8
TV_WEIGHT = 1e-4  # total variation prior
ORDER_WEIGHT = 1e-2  # Dimitrov et al.'s epoch order-invariant prior


@dataclass(frozen=True)
class ReconstructionOptions:
    """How hard the attack tries, and what counts as a recovered record."""

    iterations: int = setting(DEFAULT_ITERATIONS, "reconstruction: optimisation steps of each random start.")
    restarts: int = setting(DEFAULT_RESTARTS, "reconstruction: random starts (the best is kept).")
    psnr_threshold: float = setting(
        DEFAULT_PSNR_THRESHOLD, "reconstruction: a record counts as recovered at this PSNR (dB) or more."
    )
    learning_rate: float = LEARNING_RATE
    tv_weight: float = TV_WEIGHT
    order_weight: float = ORDER_WEIGHT

    def validate(self) -> None:
        """Raise :class:`AttackError` with one sentence for the first invalid value."""
        for option, value in (("--iterations", self.iterations), ("--restarts", self.restarts)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise AttackError(f"{option} must be an integer of at least 1, got {value!r}.")
        threshold = self.psnr_threshold
        if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not 0 < threshold < math.inf:
            raise AttackError(f"--psnr-threshold must be a positive number of dB, got {threshold!r}.")


@dataclass(frozen=True)
class AttackOptions:
    """What to attack and how; :meth:`validate` checks it before any run is read."""

    signals: tuple[str, ...] = setting(
        DEFAULT_SIGNALS,
        "loss, grad-norm, confidence or logit-confidence; synthetic-distance (distance to the nearest synthetic "
        "image that crossed the wire: FedLAP and FedGM runs kept with --save-transmitted); repeat for several.",
        shown="loss and grad-norm",
        name="signal",
        multiple=True,
    )
    methods: tuple[str, ...] = setting(
        DEFAULT_METHODS,
        "threshold, classifier, population, rmia or lira (with reference models), canary (the run's canaries), "
        "client (each client's data as a whole against held-out twins), or reconstruction (rebuild a client's "
        "records from what it sent: runs kept with --save-transmitted); repeat for several.",
        shown=" and ".join(DEFAULT_METHODS),
        name="method",
        multiple=True,
    )
    target: str | None = setting(
        None,
        "final (model.safetensors), round:N (its checkpoint) or all (every saved round); for reconstruction, what "
        "the clients sent in those rounds, or round:N:client:K one client's.",
        shown="final; reconstruction: every client of the first and the final round",
    )
    seed: int | None = setting(
        None, "Seed of the evaluation set, the split and the attack classifier.", shown="the run's seed"
    )
    device: str = setting("auto", "Where to compute the signals.", choices=DEVICES)
    nonmembers: str = setting("both", "Non-members from the held-out pool (holdout), the test split (test) or both.")
    max_records: int = setting(DEFAULT_MAX_RECORDS, "At most this many members and as many non-members.")
    per_layer: bool = setting(
        False, "With grad-norm: also write each layer's gradient norm into scores.csv.", negatable=False
    )
    # records per batch of signals: 64 peaked 0.45 GB lower than 256 and ran faster on one thread
    batch_size: int = setting(
        64,
        "Records per batch when computing signals (more use more memory: the width-128 ConvNet's gradient-norm "
        "signal holds about 2.3 MB per record).",
    )
    resamples: int = setting(
        DEFAULT_RESAMPLES, f"Bootstrap resamples of the AUC interval (at least {MIN_RESAMPLES}).", name="bootstrap"
    )
    progress: bool = False  # the command line's --progress is a terminal's default, not the options'
    references: int = setting(
        DEFAULT_REFERENCES,
        "rmia and lira: reference models, each the run's recipe retrained on population records (cached in "
        "RUN_DIR/references/).",
    )
    online: bool = setting(
        False,
        "rmia and lira: the audited records join the references' pool, each in half of them (K even; the "
        "references are then specific to these records).",
        negatable=False,
    )
    reconstruction: ReconstructionOptions = field(default_factory=ReconstructionOptions)
    # a run whose records stay at its sites (a --dataset sites deployment): how to reach them (fedaudit attack
    # --superlink), a fedaudit.attacks.membership.site_audit.SiteConnection, or None
    sites: Any = None

    @property
    def membership_target(self) -> str:
        """The models the membership attacks and canary audits attack: ``--target``, final by default."""
        return "final" if self.target is None else self.target

    @property
    def membership(self) -> bool:
        """Whether a membership attack or a canary audit is asked for (anything but a reconstruction)."""
        return any(family_of(m) != RECONSTRUCTION for m in self.methods)

    def of(self, *families: str) -> list[str]:
        """The methods asked for of ``families`` (the registry's), in the order given (an unknown name is of none:
        :meth:`validate` names it)."""
        return [m for m in self.methods if family_of(m) in families]

    def validate(self) -> None:
        """Raise :class:`AttackError` with one sentence for the first invalid option."""
        from fedaudit.instruments.record_signals import MODEL_SIGNALS

        signals = (*MODEL_SIGNALS, SYNTHETIC_SIGNAL)
        for kind, given, known in (("signal", self.signals, signals), ("method", self.methods, tuple(ATTACKS))):
            if not given:
                raise AttackError(f"Give at least one --{kind}; choose from {', '.join(known)}.")
            for name in given:
                if name not in known:
                    raise AttackError(f"Unknown --{kind} {name!r}; choose from {', '.join(known)}.")
        if self.target is not None and not isinstance(self.target, str):
            raise AttackError(f"--target must be final, all or round:N, got {self.target!r}.")
        if self.of(RECONSTRUCTION):
            parse_reconstruction_target(self.target)
            self.reconstruction.validate()
        if self.membership:
            parse_target(self.membership_target)
            final_only = [name for name in self.methods if ATTACKS[name].final_only]
            if final_only and parse_target(self.membership_target) != "final":
                raise AttackError(
                    f"--method {' and '.join(final_only)} attack{'s' if len(final_only) == 1 else ''} only the final "
                    f"model: use --target final (or leave --target out), not {self.membership_target}."
                )
        if self.nonmembers not in NONMEMBER_SOURCES:
            raise AttackError(f"Unknown --nonmembers {self.nonmembers!r}; choose from {', '.join(NONMEMBER_SOURCES)}.")
        for each in dataclasses.fields(self):  # a choice the command line's click.Choice would refuse (--device)
            option, value = option_of(each), getattr(self, each.name)
            if option is not None and option.choices and not option.multiple and value not in option.choices:
                flag = option_name(each).replace("_", "-")
                raise AttackError(f"Unknown --{flag} {value!r}; choose from {', '.join(option.choices)}.")
        for option, value, least, why in (
            ("--max-records", self.max_records, 2, ""),
            ("--batch-size", self.batch_size, 1, ""),
            # a 95% interval reads the 2.5% and 97.5% quantiles of the resamples: one resample gave [0.495, 0.495]
            # around an AUC of 0.504
            (
                "--bootstrap",
                self.resamples,
                MIN_RESAMPLES,
                " (its 95% interval reads the resamples' 2.5% and 97.5% quantiles)",
            ),
            ("--seed", self.seed, 0, ""),
        ):
            if option == "--seed" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise AttackError(f"{option} must be an integer of at least {least}{why}, got {value!r}.")
        if self.of(REFERENCE):
            self._validate_references()
        if self.seed is not None and self.seed > MAX_SEED:
            raise AttackError(f"--seed must be an integer from 0 to {MAX_SEED}, got {self.seed!r}.")
        if isinstance(self.resamples, int) and self.resamples > MAX_RESAMPLES:
            raise AttackError(f"--bootstrap must be at most {MAX_RESAMPLES:,}, got {self.resamples:,}.")
        for option, value in (("--per-layer", self.per_layer), ("--online", self.online)):
            if not isinstance(value, bool):
                raise AttackError(f"{option} must be true or false, got {value!r}.")

    def _validate_references(self) -> None:
        """The reference-model attacks' options: K, --online and the signals and target they need."""
        from fedaudit.instruments.record_signals import OUTPUT_SIGNALS

        if not isinstance(self.references, int) or isinstance(self.references, bool) or self.references < 1:
            raise AttackError(f"--references must be an integer of at least 1, got {self.references!r}.")
        if self.references > MAX_REFERENCES:
            raise AttackError(f"--references must be at most {MAX_REFERENCES}, got {self.references}.")
        if self.online and self.references % 2:
            raise AttackError(
                f"--online needs an even number of --references (each audited record in half), got {self.references}."
            )
        for name in self.methods:
            if attack(name).output_signals_only and not set(self.signals) & set(OUTPUT_SIGNALS):
                raise AttackError(
                    f"--method {name} needs a signal of the model's output (loss, confidence or "
                    "logit-confidence), the probability of the true label it compares."
                )


def parse_target(text: str) -> str | int:
    """``final``, ``all`` or the round number of ``round:N`` (the membership attacks' ``--target``)."""
    value = text.strip().lower()
    if value in ("final", "all"):
        return value
    kind, _, number = value.partition(":")
    if kind == "round" and number.isdigit() and int(number) >= 1:
        return int(number)
    if value.startswith("round:") and ":client:" in value:
        raise AttackError(
            f"--target {text!r} names a client, which only --method {RECONSTRUCTION_METHOD} attacks; give the "
            "membership attacks final, all or round:N."
        )
    raise AttackError(f"--target {text!r} is not understood; use final, all or round:N with a round number N >= 1.")


def parse_reconstruction_target(text: str | None) -> tuple[str | int, int | None]:
    """(rounds, client) of ``--target`` for a reconstruction: ("first-final", None) by default; "final", "all" or a
    round number, with a client from ``round:N:client:K``."""
    if text is None:
        return "first-final", None
    value = str(text).strip().lower()
    if value in ("final", "all"):
        return value, None
    parts = value.split(":")
    if parts[0] == "round" and len(parts) in (2, 4) and parts[1].isdigit() and int(parts[1]) >= 1:
        if len(parts) == 2:
            return int(parts[1]), None
        if parts[2] == "client" and parts[3].isdigit():
            return int(parts[1]), int(parts[3])
    raise AttackError(
        f"--target {text!r} is not understood for a reconstruction; use final, all, round:N or round:N:client:K "
        "(N >= 1, K a client's number)."
    )
