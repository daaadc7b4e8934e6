"""Run configuration: one frozen dataclass per concern, validated, JSON/YAML round-trip.

A :class:`RunConfig` is what ``fedaudit train`` resolves from defaults, a
``--config`` file and command-line overrides; :meth:`RunConfig.resolved`
writes every algorithm-dependent default out, and that resolved form is what
``config.json`` in the run directory holds.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from fedaudit.algorithms.feddm_settings import FedDMConfig
from fedaudit.algorithms.fedgm_settings import FedGMConfig
from fedaudit.algorithms.fedlap_settings import FedLAPConfig
from fedaudit.algorithms.fedssyn_settings import FedssynConfig
from fedaudit.errors import ConfigError, is_int, is_number, require, require_positive_integers, require_positive_numbers
from fedaudit.options import option_name, option_of, setting
from fedaudit.registry import (
    ACCOUNTANT_HELP,
    ACCOUNTANTS,
    ALGORITHM_HELP,
    ALGORITHMS,
    DEFAULT_ACCOUNTANT,
    DEFAULT_ALGORITHM,
    DP_LEVELS,
    client_dp_algorithms,
    per_algorithm,
)

# Seeds are 32-bit: every random stream is derived from (seed, stream, keys) word by word (fedaudit.seeding).
MAX_SEED = 2**32 - 1
DEVICES = ("auto", "cpu", "cuda")
CLIPPINGS = ("fixed", "adaptive")  # client level: a fixed C, or C following a quantile of the update norms
NOISE_AT = ("server", "clients")  # client level: who adds the noise on the sum of the clipped updates
ENGINES = ("local", "flower")
WEIGHTINGS = ("num_examples", "uniform")
LR_SCHEDULES = ("constant", "cosine")

# Expected batch size B: the authors' 256 for the 60,000-record image datasets; the 1,797 records of digits
# leave about 250 per client of the default 5-client split, so B = 256 would make q = B / N_k exceed 1 there.
DEFAULT_BATCH_SIZE = {"digits": 32}
PAPER_BATCH_SIZE = 256
# Model width: the paper's 128 channels for 28x28 and 32x32 images; digits' 8x8 images need far fewer (width 32
# reaches the same accuracy there, 0.94 in the README's demo) and a study of it then runs in minutes, not hours.
DEFAULT_WIDTH = {"digits": 32}
PAPER_WIDTH = 128


@dataclass(frozen=True)
class DataConfig:
    """Which data, how it is split over clients, and how much is held out as non-members."""

    dataset: str = setting(
        "digits",
        "digits, mnist, fashion-mnist, cifar10, or your own data: npz:PATH (arrays x, y [, x_test, y_test]), "
        "csv:PATH (with --label-column) or folder:DIR (a sub-folder of images per class); sites: every client's "
        "records are its own site's (--site-data).",
    )
    data_dir: str | None = setting(
        None, "Directory holding the dataset files (torchvision root layout or flat).", path="dir"
    )
    download: bool = setting(False, "Allow torchvision to download the dataset into --data-dir.")
    partition: str = setting("classes:2", "iid, classes:K or dirichlet:ALPHA.")
    num_clients: int = setting(5, "Number of clients K.")
    holdout_fraction: float = setting(0.1, "Fraction of the training split held out as non-members for auditing.")
    label_column: str | None = setting(None, "--dataset csv:PATH: the column holding each record's class.")
    image_size: int | None = setting(None, "--dataset folder:DIR: square size images are resized to.", shown="32")
    sites: tuple[str, ...] = setting(
        (),
        "--dataset sites (a federation whose sites keep their records), local engine: one client's own data, "
        "npz:PATH, csv:PATH or folder:DIR, once per client in client order (docs/your-data.md). In a Flower "
        "deployment each site names its own in its node config instead.",
        name="site-data",
        multiple=True,
    )

    def check(self) -> None:
        """The section's own values (:class:`ConfigError` for the first invalid one)."""
        require(isinstance(self.download, bool), f"--download must be true or false, got {self.download!r}.")
        require(
            self.data_dir is None or isinstance(self.data_dir, str),
            f"--data-dir must be a path, got {self.data_dir!r}.",
        )
        require(
            self.label_column is None or (isinstance(self.label_column, str) and self.label_column != ""),
            f"--label-column must name a column, got {self.label_column!r}.",
        )
        require(
            self.image_size is None or (is_int(self.image_size) and 1 <= self.image_size <= 512),
            f"--image-size must be an integer from 1 to 512, got {self.image_size!r}.",
        )
        require(
            is_int(self.num_clients) and self.num_clients >= 1,
            f"--num-clients must be at least 1, got {self.num_clients!r}.",
        )
        require(
            is_number(self.holdout_fraction) and 0.0 <= self.holdout_fraction < 1.0,
            f"--holdout-fraction must be in [0, 1), got {self.holdout_fraction!r}.",
        )

    def __post_init__(self) -> None:
        """A list of site data (a JSON or YAML file's) is kept as a tuple, so that configurations compare equal."""
        if isinstance(self.sites, list):
            object.__setattr__(self, "sites", tuple(self.sites))


@dataclass(frozen=True)
class ModelConfig:
    """The global model's architecture."""

    arch: str = setting(
        "convnet",
        "convnet, mlp, or your own: package.module:factory, called with (input_shape, num_classes) and returning a"
        " torch.nn.Module (importable here and where the run is attacked).",
        name="model",
    )
    # None: the dataset's default (DEFAULT_WIDTH, else PAPER_WIDTH)
    width: int | None = setting(None, "Channels (ConvNet) or hidden units (MLP).", shown="128; 32 on digits")
    # None: fitted to the input size (see fedaudit.models.default_depth)
    depth: int | None = setting(
        None, "Blocks (ConvNet) or hidden layers (MLP).", shown="fitted to the input size: 3 for 32x32 images"
    )

    def check(self) -> None:
        """The section's own values (:class:`ConfigError` for the first invalid one)."""
        require_positive_integers(self, "width", optional=True)
        require(
            self.width is None or self.arch != "convnet" or self.width <= MAX_WIDTH,
            f"--width must be at most {MAX_WIDTH:,} for the ConvNet (of that width it already has hundreds of "
            f"millions of parameters), got {self.width!r}.",
        )
        require(
            self.depth is None or (is_int(self.depth) and self.depth >= 0),
            f"--depth must be a non-negative integer, got {self.depth!r}.",
        )


@dataclass(frozen=True)
class FederatedConfig:
    """The federated optimisation: algorithm, rounds, participation and client/server optimisers.

    ``None`` means "the algorithm's default", filled in by :meth:`RunConfig.resolved`.
    """

    algorithm: str = setting(DEFAULT_ALGORITHM, f"{ALGORITHM_HELP}.", choices=tuple(ALGORITHMS))
    rounds: int = setting(10, "Communication rounds M.")
    client_fraction: float = setting(1.0, "Fraction p of clients selected per round.")
    weighting: str = setting("num_examples", "Aggregation weights N_k/N or 1/K.", choices=WEIGHTINGS)
    server_lr: float = setting(1.0, "Server learning rate eta_s.")
    local_epochs: int = setting(5, "Local epochs E.")
    local_steps: int | None = setting(
        None, "Local steps per round instead of --local-epochs (DP queries per round under DP)."
    )
    client_lr: float | None = setting(None, "Client learning rate eta_c.", shown=per_algorithm("client_lr"), name="lr")
    momentum: float = setting(0.0, "Client SGD momentum.")
    # None: DEFAULT_BATCH_SIZE of the dataset
    batch_size: int | None = setting(
        None, "(Expected) batch size B; under DP the Poisson rate is B / N_k.", shown="256; 32 on digits"
    )
    mu: float = setting(0.1, "FedProx proximal weight.")
    lr_schedule: str | None = setting(None, "Client learning rate over rounds.", shown="cosine", choices=LR_SCHEDULES)

    def check(self) -> None:
        """The section's own values (:class:`ConfigError` for the first invalid one)."""
        require_positive_integers(self, "rounds")
        require(self.rounds <= MAX_ROUNDS, f"--rounds must be at most {MAX_ROUNDS:,}, got {self.rounds:,}.")
        require(
            is_number(self.client_fraction) and 0.0 < self.client_fraction <= 1.0,
            f"--client-fraction must be in (0, 1], got {self.client_fraction!r}.",
        )
        require(
            self.weighting in WEIGHTINGS,
            f"--weighting must be one of {', '.join(WEIGHTINGS)}, got '{self.weighting}'.",
        )
        require_positive_numbers(self, "server_lr")
        require_positive_integers(self, "local_epochs")
        require(
            self.local_epochs <= MAX_LOCAL_EPOCHS,
            f"--local-epochs must be at most {MAX_LOCAL_EPOCHS:,}, got {self.local_epochs:,}.",
        )
        require_positive_integers(self, "local_steps", optional=True)
        require(
            self.local_steps is None or self.local_steps <= MAX_LOCAL_STEPS,
            f"--local-steps must be at most {MAX_LOCAL_STEPS:,}, got {self.local_steps!r}.",
        )
        require(
            self.client_lr is None or (is_number(self.client_lr) and self.client_lr > 0),
            f"--lr must be positive, got {self.client_lr!r}.",
        )
        require(
            is_number(self.momentum) and 0.0 <= self.momentum < 1.0,
            f"--momentum must be in [0, 1), got {self.momentum!r}.",
        )
        require_positive_integers(self, "batch_size", optional=True)
        require(is_number(self.mu) and self.mu >= 0, f"--mu must be non-negative, got {self.mu!r}.")
        require(
            self.lr_schedule is None or self.lr_schedule in LR_SCHEDULES,
            f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got '{self.lr_schedule}'.",
        )


CANARY_KINDS = ("gradient", "input")


@dataclass(frozen=True)
class EvaluationConfig:
    """How the global model's test accuracy is measured while it trains: every ``eval_every`` rounds and after the
    last, on the whole test split or on a fixed random sample of ``eval_sample`` of its records (drawn from the seed;
    the report's interval is then over that many). A federation with many clients and rounds spends most of its time
    evaluating otherwise."""

    eval_every: int = setting(
        1,
        "Measure the test accuracy every K rounds and after the last (a long federation spends most of its time "
        "evaluating otherwise).",
    )
    eval_sample: int | None = setting(
        None,
        "Measure it on a fixed random sample of N test records, drawn from the seed (its interval is over N).",
        shown="the whole test split",
    )

    def check(self) -> None:
        """The section's own values (:class:`ConfigError` for the first invalid one)."""
        require_positive_integers(self, "eval_every")
        require_positive_integers(self, "eval_sample", optional=True)


@dataclass(frozen=True)
class AuditConfig:
    """Canaries planted at training time for a canary audit (docs/audit.md).

    Each of ``canaries`` canaries is included with probability 1/2 in the data of one client, sampled, clipped and
    noised like every record of its client. A gradient canary is a fixed random direction whose per-example gradient
    is 10 C times that unit direction (clipped to C); an input canary is a held-out record with a replaced label.
    The audit reads what every client sent (so canaries turn --save-transmitted on) and, for input canaries, the
    final model. Needs --dp.
    """

    canaries: int = setting(
        0,
        "Plant this many canaries for a canary audit (`fedaudit attack --method canary`): each included with "
        "probability 1/2 in one client's data, sampled, clipped and noised like its records. Needs --dp.",
    )
    canary_kind: str = setting(
        "gradient",
        "gradient: a random direction whose per-example gradient is 10 C times itself (clipped to C), audited on "
        "what every client sent (the server's white-box view). input: a held-out record with another class's "
        "label, audited on what clients sent and by its loss on the final model (black-box). Both keep what "
        "clients send.",
        choices=CANARY_KINDS,
    )
    canary_clients: int = setting(
        0,
        "Client-level DP: add this many canary clients (Andrew et al., ICLR 2024), each included with probability "
        "1/2, sampled like a real client and sending 10 C times a random direction; `fedaudit attack --method "
        "canary` bounds the client-level epsilon from their log. Needs --dp --dp-level client; at least 4.",
    )
    kept_queries: int = setting(
        12,
        "Whole DP queries (parameters, batch, released sum) a canary run's query log keeps, on average, in pairs "
        "of consecutive queries, so that `fedaudit verify` can recompute their clean sums (more: more power "
        "against clipping faults, a larger run directory and a slower verify; 0: none).",
    )

    def check(self) -> None:
        """The section's own values (:class:`ConfigError` for the first invalid one)."""
        require(  # the audit compares canaries inserted with canaries left out, each a coin flip
            is_int(self.canaries) and (self.canaries == 0 or self.canaries >= 4),
            f"--canaries must be 0 or an integer of at least 4 (the audit compares the inserted with the left out), "
            f"got {self.canaries!r}.",
        )
        require(
            self.canary_kind in CANARY_KINDS,
            f"--canary-kind must be one of {', '.join(CANARY_KINDS)}, got {self.canary_kind!r}.",
        )
        require(
            is_int(self.canary_clients) and (self.canary_clients == 0 or self.canary_clients >= 4),
            f"--canary-clients must be 0 or an integer of at least 4, got {self.canary_clients!r}.",
        )
        require(
            is_int(self.kept_queries) and self.kept_queries >= 0,
            f"--kept-queries must be a non-negative integer, got {self.kept_queries!r}.",
        )


@dataclass(frozen=True)
class FlowerConfig:
    """Where ``--engine flower`` runs the clients: Flower's simulation runtime (on this machine, or on an existing
    Ray cluster with ``ray_address``), or with ``superlink`` the SuperNodes of a Flower deployment, one per site,
    with fedaudit as the server (docs/deployment.md). The results do not depend on any of these settings.
    """

    ray_address: str | None = setting(
        None,
        "HOST:PORT of an existing Ray cluster's head for --engine flower's simulation runtime (docs/deployment.md).",
        shown="a Ray instance on this machine",
    )
    client_cpus: float = setting(1.0, "CPUs each simulated client reserves on Ray.")
    client_gpus: float | None = setting(
        None, "Share of a GPU each simulated client reserves on Ray.", shown="1/clients on CUDA, else 0"
    )
    superlink: str | None = setting(
        None,
        "HOST:PORT of a Flower SuperLink: with --engine flower, the clients run on the SuperNodes of that "
        "deployment, one per site (docs/deployment.md), instead of Flower's simulation runtime.",
    )
    root_certificates: str | None = setting(
        None, "The CA certificate (PEM) that signed the SuperLink's TLS certificate.", path="file"
    )
    insecure: bool = setting(False, "Talk to the SuperLink without TLS (only when asked).", negatable=False)
    wait_seconds: float = setting(300.0, "How long to wait for every client's SuperNode to connect.")
    round_timeout: float = setting(3600.0, "How long a round may wait for a site that neither answers nor dies.")


@dataclass(frozen=True)
class PrivacyConfig:
    """DP, record-level (DP-SGD on the clients) or client-level (clipped updates, noise at the server): the
    mechanism's parameters and how it is accounted."""

    dp: bool = setting(
        False,
        "Differential privacy: record-level DP-SGD on every client step (DP-FedAvg, DP-FedProx), or see --dp-level.",
    )
    dp_level: str = setting(
        "record",
        "What --dp protects: record (DP-SGD on every client step: one training record of a client) or client (each "
        "client's model update clipped to --max-update-norm, Gaussian noise sigma C added by the server to their "
        "sum, clients sampled by the server with probability --client-fraction: a client's data as a whole; "
        "McMahan et al. 2018).",
        choices=DP_LEVELS,
    )
    noise_multiplier: float | None = setting(
        None, "sigma: Gaussian noise std relative to the clipping norm.", shown="1.0", when="with --dp"
    )
    max_grad_norm: float | None = setting(
        None, "C: per-sample gradient clipping norm (record level).", shown=per_algorithm("max_grad_norm")
    )
    max_update_norm: float | None = setting(
        None, "C at client level: each client's model update is clipped to this L2 norm (--dp-level client needs it)."
    )
    clipping: str = setting(
        "fixed",
        "Client level: fixed (C = --max-update-norm throughout) or adaptive (Andrew et al. 2021: C starts at "
        "--max-update-norm and follows the --target-quantile of the clients' update norms, by a noisy count "
        "released with each round's update; the two together charged as one Gaussian of --noise-multiplier).",
        choices=CLIPPINGS,
    )
    noise_at: str = setting(
        "server",
        "Client level: who adds the noise. server: the server clips the updates and adds N(0, (sigma C)^2) to their "
        "sum (central DP: the server is trusted). clients: each sampled client clips its own update to C and adds "
        "its share N(0, (sigma C)^2 / m), m the clients of the round, from its own secret, so that the sum carries "
        "sigma C; this protects against the server only if it sees the sum alone: in a Flower deployment "
        "(--superlink) the sites' payloads are summed under Flower's SecAgg+; on the local engine and Flower's "
        "simulation the server sees each share, and the report says so.",
        choices=NOISE_AT,
    )
    target_quantile: float = setting(0.5, "Adaptive clipping: the quantile gamma of the update norms C follows.")
    clip_lr: float = setting(0.2, "Adaptive clipping: eta_C of C <- C exp(-eta_C (b - gamma)), b the noisy fraction.")
    count_noise: float | None = setting(
        None,
        "Adaptive clipping: sigma_b, the standard deviation of the noise on the count of updates under C.",
        shown="the expected clients of a round / 20",
    )
    target_epsilon: float | None = setting(
        None, "Calibrate sigma so that epsilon after the last round is at most this."
    )
    delta: float = setting(1e-5, "delta of (epsilon, delta)-DP.")
    accountant: str = setting(DEFAULT_ACCOUNTANT, f"{ACCOUNTANT_HELP}.", choices=tuple(ACCOUNTANTS))
    calibrated: bool = False
    noise_seed: int | None = setting(
        None,
        "Draw every client's DP noise and Poisson samples from this public seed, reproducibly, instead of from a "
        "secret that only the client holds: for experiments only, since whoever holds the seed can remove the "
        "noise (the report says so).",
        shown="each client's own secret",
    )
    secure_noise: bool = setting(
        False,
        "DP queries draw from a ChaCha20 keystream, each Gaussian coordinate the sum of four float64 draws, "
        "against floating-point attacks on the noise (docs/accounting.md; slower).",
    )

    @property
    def record_level(self) -> bool:
        """Whether the clients run DP-SGD (record-level DP)."""
        return bool(self.dp) and self.dp_level != "client"

    @property
    def client_level(self) -> bool:
        """Whether the clients' updates are clipped and their sum noised (client-level DP)."""
        return bool(self.dp) and self.dp_level == "client"

    @property
    def noise_in_shares(self) -> bool:
        """Whether, at client level, each client clips its own update and adds its share of the noise."""
        return self.client_level and self.noise_at == "clients"

    def count_noise_for(self, expected_clients: float) -> float:
        """Adaptive clipping's sigma_b: --count-noise, else the expected clients of a round / 20 (the paper's)."""
        return self.count_noise if self.count_noise is not None else expected_clients / 20

    def check(self) -> None:
        """The section's own values, and which of them need ``dp`` (:class:`ConfigError` for the first invalid
        one)."""
        for name, value in (("--dp", self.dp), ("privacy.calibrated", self.calibrated)):
            require(isinstance(value, bool), f"{name} must be true or false, got {value!r}.")
        require(self.dp_level in DP_LEVELS, f"--dp-level must be one of {', '.join(DP_LEVELS)}, got {self.dp_level!r}.")
        if self.dp_level == "client":
            require(self.dp, "--dp-level client needs --dp.")
            require(
                self.max_update_norm is not None,
                "--dp-level client needs --max-update-norm C, the L2 norm each client's update is clipped to.",
            )
            require(
                self.max_grad_norm is None,
                "--max-grad-norm clips each record's gradient (record-level DP); at client level the clients train "
                "without DP-SGD and --max-update-norm clips their updates.",
            )
        else:
            require(
                self.max_update_norm is None,
                "--max-update-norm clips client updates for client-level DP: add --dp --dp-level client.",
            )
        require(self.noise_at in NOISE_AT, f"--noise-at must be one of {', '.join(NOISE_AT)}, got {self.noise_at!r}.")
        require(
            self.noise_at == "server" or self.dp_level == "client",
            "--noise-at clients shares the noise of client-level DP among the clients: add --dp --dp-level client.",
        )
        require(
            self.max_update_norm is None or (is_number(self.max_update_norm) and 0 < self.max_update_norm < math.inf),
            f"--max-update-norm must be a positive number, got {self.max_update_norm!r}.",
        )
        self._check_clipping()

    def _check_clipping(self) -> None:
        """The adaptive clipping's settings, and that it is asked for at client level only."""
        require(self.clipping in CLIPPINGS, f"--clipping must be one of {', '.join(CLIPPINGS)}, got {self.clipping!r}.")
        require(
            self.clipping == "fixed" or self.dp_level == "client",
            "--clipping adaptive clips client updates: add --dp --dp-level client.",
        )
        require(
            self.clipping == "fixed" or self.noise_at == "server",
            "--clipping adaptive needs --noise-at server: its noisy count of the updates under C is the server's.",
        )
        require(
            is_number(self.target_quantile) and 0 < self.target_quantile < 1,
            f"--target-quantile must be in (0, 1), got {self.target_quantile!r}.",
        )
        require(
            is_number(self.clip_lr) and 0 < self.clip_lr < math.inf,
            f"--clip-lr must be positive, got {self.clip_lr!r}.",
        )
        require(
            self.count_noise is None or (is_number(self.count_noise) and 0 < self.count_noise < math.inf),
            f"--count-noise must be a positive number, got {self.count_noise!r}.",
        )
        require(
            self.accountant in ACCOUNTANTS,
            f"--accountant must be one of {', '.join(ACCOUNTANTS)}, got '{self.accountant}'.",
        )
        require(is_number(self.delta) and 0.0 < self.delta < 1.0, f"--delta must be in (0, 1), got {self.delta!r}.")
        if self.dp:
            require(
                self.noise_multiplier is None or (is_number(self.noise_multiplier) and self.noise_multiplier > 0),
                f"--noise-multiplier must be positive with --dp, got {self.noise_multiplier!r}.",
            )
            require(
                self.max_grad_norm is None or (is_number(self.max_grad_norm) and self.max_grad_norm > 0),
                f"--max-grad-norm must be positive with --dp, got {self.max_grad_norm!r}.",
            )
            require(
                self.target_epsilon is None or (is_number(self.target_epsilon) and self.target_epsilon > 0),
                f"--target-epsilon must be positive, got {self.target_epsilon!r}.",
            )
            require(
                not (self.target_epsilon is not None and self.noise_multiplier is not None and not self.calibrated),
                "Give either --noise-multiplier or --target-epsilon, not both.",
            )
        else:
            require(
                self.target_epsilon is None and self.noise_multiplier is None and self.max_grad_norm is None,
                "--noise-multiplier, --max-grad-norm and --target-epsilon need --dp.",
            )
        require(
            isinstance(self.secure_noise, bool), f"--secure-noise must be true or false, got {self.secure_noise!r}."
        )
        require(
            self.noise_seed is None or (is_int(self.noise_seed) and 0 <= self.noise_seed <= MAX_SEED),
            f"--noise-seed must be an integer from 0 to {MAX_SEED}, got {self.noise_seed!r}.",
        )


def _plain(value: Any, annotation: Any) -> Any:
    """A value given from Python as the command line would give it: numpy's scalars as Python's (a sweep over
    np.arange), and an integer for a float setting as a float (config.json would say 8 where the command line
    writes 8.0, and the same run would not be the same file)."""
    if isinstance(value, np.generic):
        value = value.item()
    text = str(annotation or "")
    if isinstance(value, int) and not isinstance(value, bool) and "float" in text and "int" not in text:
        return float(value)
    return value


@dataclass(frozen=True)
class RunConfig:
    """Everything that determines a run; the same config and seed give the same run."""

    seed: int = setting(
        0,
        "Seed of the run's public random choices (split, initial model, client selection); a DP run's noise and "
        "samples come from each client's own secret (see --noise-seed).",
        group="Run",
    )
    device: str = setting("auto", "Where to train.", choices=DEVICES, group="Engine")
    engine: str = setting(
        "local",
        "Who runs the clients: in this process, or Flower's simulation runtime (Ray; needs the flower extra); the "
        "same seed and client secrets give the same run on both.",
        choices=ENGINES,
        group="Engine",
    )
    parallel_clients: int | None = setting(
        None,
        "How many clients the local engine runs at once (threads, each with its own CUDA stream on a GPU), or how "
        "many sites of a Flower deployment are sent work at once (sites that share machines); the results do not "
        "depend on it.",
        shown="local: all of a round's clients on CUDA, 1 on CPU; deployment: all",
        group="Engine",
    )
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    federated: FederatedConfig = field(default_factory=FederatedConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    fedlap: FedLAPConfig = field(default_factory=FedLAPConfig)
    fedgm: FedGMConfig = field(default_factory=FedGMConfig)
    feddm: FedDMConfig = field(default_factory=FedDMConfig)
    fedssyn: FedssynConfig = field(default_factory=FedssynConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    flower: FlowerConfig = field(default_factory=FlowerConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    save_transmitted: bool = setting(False, "Store what every client sent each round under transmitted/.", group="Run")
    keep_checkpoints: int | None = setting(
        None,
        "Keep only the last N rounds' checkpoints (resume stays exact from the last).",
        shown="every round's",
        group="Run",
    )

    @property
    def dp_randomness(self) -> bool:
        """Whether the clients make random choices whose secrecy a guarantee rests on: record-level DP (noise and
        Poisson samples) or FedGM's label DP (randomized response)."""
        entry = ALGORITHMS.get(self.federated.algorithm)
        return bool(self.privacy.dp) or (entry is not None and entry.label_dp and self.fedgm.label_epsilon is not None)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (JSON/YAML serialisable; the site data as a list, as JSON reads it back)."""
        data = dataclasses.asdict(self)
        data["data"]["sites"] = list(data["data"]["sites"])
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunConfig:
        """Build from a nested dict; unknown sections or keys are errors (typos must not pass silently)."""
        if not isinstance(data, Mapping):
            raise ConfigError("The configuration must be a mapping of sections (data, model, federated, privacy).")
        sections = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key not in sections:
                raise ConfigError(f"Unknown configuration key '{key}'; expected one of: {', '.join(sections)}.")
            section_type = _SECTION_TYPES.get(key)
            if section_type is None:
                _check_text(key, sections[key].type, value)
                kwargs[key] = value
            else:
                kwargs[key] = _build_section(section_type, key, value)
        return cls(**kwargs)

    def with_overrides(self, overrides: Mapping[str, Any]) -> RunConfig:
        """Apply ``{"section.field": value}`` or ``{"field": value}`` overrides (``None`` values are ignored)."""
        config = self
        for dotted, value in overrides.items():
            if value is None:
                continue
            if "." in dotted:
                section, name = dotted.split(".", 1)
                current = getattr(config, section)
                value = _plain(value, {f.name: f.type for f in fields(current)}.get(name))
                try:
                    config = replace(config, **{section: replace(current, **{name: value})})
                except TypeError as exc:
                    raise ConfigError(f"Unknown configuration key '{dotted}'.") from exc
            else:
                value = _plain(value, {f.name: f.type for f in fields(config)}.get(dotted))
                config = replace(config, **{dotted: value})
        return config

    def resolved(self) -> RunConfig:
        """Fill in algorithm-dependent defaults and validate; the result has no ``None`` where a value is used."""
        fed = self.federated
        priv = self.privacy
        algorithm = fed.algorithm
        entry = ALGORITHMS.get(algorithm)
        if entry is None:
            raise ConfigError(f"Unknown algorithm '{algorithm}'; choose one of: {', '.join(ALGORITHMS)}.")
        fed = replace(
            fed,
            client_lr=fed.client_lr if fed.client_lr is not None else entry.default_client_lr(self.data.dataset),
            lr_schedule=fed.lr_schedule if fed.lr_schedule is not None else "cosine",
            batch_size=fed.batch_size
            if fed.batch_size is not None
            else DEFAULT_BATCH_SIZE.get(self.data.dataset, PAPER_BATCH_SIZE),
        )
        sections = {}
        settings = entry.settings_module()
        if settings is not None and hasattr(settings, "resolve"):  # the algorithm's own defaults, by dataset and DP
            sections[settings.SECTION] = settings.resolve(getattr(self, settings.SECTION), self)
        model = self.model
        if model.width is None:
            model = replace(model, width=DEFAULT_WIDTH.get(self.data.dataset, PAPER_WIDTH))
        if priv.dp:
            priv = replace(
                priv,
                max_grad_norm=priv.max_grad_norm
                if priv.max_grad_norm is not None or priv.client_level
                else entry.default_max_grad_norm(self.data.dataset),
                noise_multiplier=(
                    priv.noise_multiplier
                    if priv.noise_multiplier is not None or priv.target_epsilon is not None
                    else 1.0
                ),
            )
        config = replace(self, federated=fed, privacy=priv, model=model, **sections)
        if self.audit.canaries:
            config = replace(config, save_transmitted=True)
        config.validate()
        return config

    def _validate_flower(self) -> None:
        dep = self.flower
        require(
            self.engine == "flower" or (dep.ray_address is None and dep.client_gpus is None and dep.client_cpus == 1.0),
            "--ray-address, --client-cpus and --client-gpus are for --engine flower's simulation runtime.",
        )
        require(
            isinstance(dep.client_cpus, (int, float)) and not isinstance(dep.client_cpus, bool) and dep.client_cpus > 0,
            f"--client-cpus must be a positive number, got {dep.client_cpus!r}.",
        )
        require(
            dep.client_gpus is None
            or (
                isinstance(dep.client_gpus, (int, float))
                and not isinstance(dep.client_gpus, bool)
                and 0 <= dep.client_gpus <= 1
            ),
            f"--client-gpus must be a share of one GPU, from 0 to 1, got {dep.client_gpus!r}.",
        )
        if dep.ray_address is not None:
            require(dep.superlink is None, "--ray-address is for the simulation runtime; a deployment has --superlink.")
            require(_host_port(dep.ray_address), f"--ray-address must be HOST:PORT, got '{dep.ray_address}'.")
        if dep.superlink is None:
            require(
                dep.root_certificates is None and not dep.insecure,
                "--root-certificates and --insecure are for a Flower deployment: give --superlink HOST:PORT too.",
            )
            return
        require(self.engine == "flower", "--superlink needs --engine flower (the clients run on Flower SuperNodes).")
        require(_host_port(dep.superlink), f"--superlink must be HOST:PORT (no scheme), got '{dep.superlink}'.")
        require(
            not (dep.insecure and dep.root_certificates),
            "--insecure turns TLS off, so it cannot be given with --root-certificates; choose one.",
        )
        require(
            dep.insecure or dep.root_certificates is not None,
            "A Flower deployment talks TLS: give --root-certificates CA.crt (the CA that signed the SuperLink's "
            "certificate), or --insecure to send everything in the clear.",
        )
        if dep.root_certificates is not None:
            require(
                Path(dep.root_certificates).is_file(),
                f"--root-certificates {dep.root_certificates} is not a readable file.",
            )
        for name in ("wait_seconds", "round_timeout"):
            value = getattr(dep, name)
            require(
                isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                f"--{name.replace('_', '-')} must be a positive number of seconds, got {value!r}.",
            )

    def validate(self) -> None:
        """Raise :class:`ConfigError` with one clear sentence for the first invalid value."""
        require(self.device in DEVICES, f"--device must be one of {', '.join(DEVICES)}, got '{self.device}'.")
        require(self.engine in ENGINES, f"--engine must be one of {', '.join(ENGINES)}, got '{self.engine}'.")
        require_positive_integers(self, "parallel_clients", optional=True)
        self._validate_flower()
        require(
            self.engine == "local" or self.flower.superlink is not None or self.parallel_clients in (None, 1),
            "--parallel-clients is for the local engine and a Flower deployment; Flower's simulation runs clients "
            "in parallel itself (its client resources decide how many).",
        )
        require(
            is_int(self.seed) and 0 <= self.seed <= MAX_SEED,
            f"--seed must be an integer from 0 to {MAX_SEED}, got {self.seed!r}.",
        )
        for section in (self.data, self.model, self.federated, self.evaluation):
            section.check()
        d, f, p, a = self.data, self.federated, self.privacy, self.audit
        require(
            self.evaluation.eval_sample is None or str(d.dataset).strip().lower() != "sites",
            "--eval-sample does not apply to --dataset sites: each site evaluates the model on its own test records.",
        )
        require_positive_integers(self, "keep_checkpoints", optional=True)
        require(
            self.keep_checkpoints is None or not a.canaries,
            "--keep-checkpoints cannot be used with --canaries: the canary audit reads the model every round began "
            "from.",
        )
        p.check()
        require(
            self.dp_randomness or (p.noise_seed is None and not p.secure_noise),
            "--noise-seed and --secure-noise set how DP noise is drawn, and this run draws none: add --dp (or "
            "--label-epsilon for FedGM).",
        )
        for each in ALGORITHMS.values():  # every algorithm checks its own section, and refuses it unless chosen
            settings = each.settings_module()
            if settings is not None:
                selected = each.name == f.algorithm
                settings.validate(getattr(self, settings.SECTION), self, selected=selected)
        a.check()
        require(
            not a.canaries or p.dp,
            "--canaries needs --dp: a canary audit bounds the epsilon of a DP run's accountant.",
        )
        require(
            not a.canary_clients or p.client_level,
            "--canary-clients audits client-level DP: add --dp --dp-level client (record-level runs plant --canaries).",
        )
        if p.client_level:
            require(
                ALGORITHMS[f.algorithm].client_dp,
                f"--dp-level client is available for {', '.join(client_dp_algorithms())}; the other algorithms' "
                "clients send synthetic sets, which a server cannot clip and average as updates.",
            )
            require(
                not a.canaries,
                "--canaries plants records and gradients for a record-level audit; a client-level run takes "
                "--canary-clients.",
            )
            require(
                not ALGORITHMS[f.algorithm].control_variates or f.local_steps is not None,
                "SCAFFOLD at client level needs --local-steps K: the server moves its control variate by the released "
                "update alone, which needs every client's number of steps.",
            )
            _check_secure_sum(self)
            alone = sampled_alone(self)
            require(
                alone <= p.delta / 10,
                f"--noise-at clients with {self.data.num_clients} clients at --client-fraction "
                f"{f.client_fraction:g}: a client sampled alone in a round has no other client's share to hide it, "
                f"which happens with probability {alone:.2g} over the run, more than a tenth of --delta {p.delta:g}; "
                "add clients, raise --client-fraction or use --noise-at server.",
            )
        self._validate_sites()

    def _validate_sites(self) -> None:
        """--dataset sites: one data source per client, read at the sites (or here, each as its site would)."""
        d = self.data
        require(
            isinstance(d.sites, tuple) and all(isinstance(spec, str) and spec.strip() for spec in d.sites),
            f"--site-data must name each client's data (npz:PATH, csv:PATH or folder:DIR), got {d.sites!r}.",
        )
        if str(d.dataset).strip().lower() != "sites":
            require(not d.sites, "--site-data needs --dataset sites.")
            return
        deployed = self.flower.superlink is not None
        require(
            self.engine == "local" or deployed,
            "--dataset sites runs on the local engine or a Flower deployment (--superlink), where each site reads "
            "its own records; Flower's simulation runtime is not supported.",
        )
        if deployed:
            require(
                not d.sites,
                'In a Flower deployment each site names its own data in its node config (data="npz:PATH"); drop '
                "--site-data.",
            )
        else:  # none given: the sites' records are not here (prepare says so, unless the sites report them)
            require(
                not d.sites or len(d.sites) == d.num_clients,
                f"--dataset sites needs one --site-data per client: {len(d.sites)} given for --num-clients "
                f"{d.num_clients}.",
            )
        require(
            d.partition == DataConfig().partition,
            "--partition does not apply to --dataset sites: each site's records are its client's.",
        )
        require(
            self.audit.canary_kind != "input" or not self.audit.canaries,
            "--canary-kind input needs held-out records at the server, which a federation whose sites keep their "
            "records does not have; use gradient canaries.",
        )


def load_config_file(path: str | Path, *, validate: bool = True) -> RunConfig:
    """Read a YAML or JSON configuration file (nested sections, as config.json writes them); with ``validate=False``
    only its structure is checked, so that command-line overrides are applied before the values are judged."""
    path = Path(path)
    is_json = path.suffix.lower() == ".json"
    try:
        text = read_small_text(path, "configuration file")
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    try:
        data = load_json(text) if is_json else load_yaml(text)
    except RecursionError as exc:
        raise ConfigError(f"The configuration file {path} nests deeper than fedaudit reads.") from exc
    except (YAMLRefused, JSONRefused) as exc:
        raise ConfigError(f"The configuration file {path} {exc}.") from exc
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"The configuration file {path} is not valid {'JSON' if is_json else 'YAML'}.") from exc
    if data is None:
        data = {}
    config = RunConfig.from_dict(data)
    if validate:
        config.validate()
    return config


MAX_TEXT_BYTES = 1 << 20  # a configuration, policy or study file: far above any real one (a few kB)
MAX_YAML_DEPTH = 32  # nesting of mappings and lists: a configuration has 3 levels, a study 5


class YAMLRefused(yaml.YAMLError):
    """A YAML document fedaudit will not load (aliases, or nesting too deep); the message completes "The file ..."."""


def read_small_bytes(path: str | Path, what: str, limit: int) -> bytes:
    """A file of at most ``limit`` bytes, of which no more than ``limit + 1`` are ever read (a 500 MB file or
    ``/dev/zero`` is one sentence, not a full memory); a :class:`ValueError` with one sentence naming ``what`` it is
    otherwise."""
    try:
        with open(path, "rb") as file:
            data = file.read(limit + 1)
    except OSError as exc:
        raise ValueError(f"Cannot read the {what} {path}: {exc.strerror or exc}.") from exc
    if len(data) > limit:
        size = f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit >> 10} KiB"
        raise ValueError(f"The {what} {path} is larger than {size}, which no {what} needs.")
    return data


def read_small_text(path: Path, what: str) -> str:
    """A UTF-8 text file of at most :data:`MAX_TEXT_BYTES` (:func:`read_small_bytes`); a :class:`ValueError` with
    one sentence naming ``what`` it is otherwise."""
    data = read_small_bytes(path, what, MAX_TEXT_BYTES)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"The {what} {path} is not a UTF-8 text file.") from exc


class JSONRefused(ValueError):
    """A JSON document fedaudit will not load (a key twice, a number it cannot read); the message completes "The
    file ..."."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise JSONRefused(f"gives the key {key!r} twice (the last would win without a word)")
        found[key] = value
    return found


def load_json(text: str | bytes) -> Any:
    """``json.loads``, refusing a key given twice and a number Python will not read (an integer of thousands of
    digits): :class:`JSONRefused`; malformed JSON stays a :class:`json.JSONDecodeError`."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except (json.JSONDecodeError, JSONRefused):
        raise
    except ValueError as exc:
        raise JSONRefused(f"holds a number fedaudit cannot read ({str(exc).split(':')[0]})") from exc


def load_yaml(text: str) -> Any:
    """A YAML document with PyYAML's safe types (and YAML 1.2 floats; dates stay text), refusing aliases (whose
    expansion can multiply a small file into gigabytes), nesting beyond :data:`MAX_YAML_DEPTH`, a key given twice
    and a number Python will not read (:class:`YAMLRefused`)."""
    try:
        return yaml.load(text, Loader=_YAMLLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError:
        raise
    except ValueError as exc:
        raise YAMLRefused(f"holds a value fedaudit cannot read ({str(exc).split(':')[0]})") from exc


class _YAMLLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, but ``1e-5`` is a float (YAML 1.2) rather than the string YAML 1.1 makes of it, and
    without aliases or deep nesting (see :func:`load_yaml`)."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise YAMLRefused("uses a YAML alias (*name), which fedaudit does not expand; write the value out")
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise YAMLRefused(f"nests deeper than {MAX_YAML_DEPTH} levels, which no fedaudit file needs")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        keys = [self.construct_object(key, deep=True) for key, _ in node.value]
        twice = next((key for i, key in enumerate(keys) if _hashable(key) and key in keys[:i]), None)
        if twice is not None:
            raise YAMLRefused(f"gives the key {twice!r} twice (the last would win without a word)")
        return super().construct_mapping(node, deep=deep)


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


# Dates stay text: no setting is one, and a date that is not one (2001-13-45) made PyYAML raise instead.
_YAMLLoader.yaml_implicit_resolvers = {
    first: [entry for entry in resolvers if entry[0] != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


_YAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def mark_calibrated(config: RunConfig, noise_multiplier: float) -> RunConfig:
    """Record the noise multiplier found for ``target_epsilon``; config.json then keeps both."""
    return replace(config, privacy=replace(config.privacy, noise_multiplier=float(noise_multiplier), calibrated=True))


def _build_section(section_type: type, name: str, value: Any) -> Any:
    if value is None:
        return section_type()
    if not isinstance(value, Mapping):
        raise ConfigError(f"Configuration section '{name}' must be a mapping.")
    known = {f.name for f in fields(section_type)}
    for key in value:
        if key not in known:
            raise ConfigError(
                f"Unknown key '{key}' in configuration section '{name}'; expected one of: {', '.join(sorted(known))}."
            )
    for entry in fields(section_type):
        if entry.name in value:
            _check_text(f"{name}.{entry.name}", entry.type, value[entry.name])
    return section_type(**dict(value))


def _check_text(key: str, annotation: Any, value: Any) -> None:
    """A text field given something else (a list, a number, null where null is not allowed) is a
    :class:`ConfigError` here, before any code compares or hashes it."""
    if annotation == "str | None" and value is None:
        return
    if annotation in ("str", "str | None") and not isinstance(value, str):
        raise ConfigError(f"Configuration key '{key}' must be text, not {value!r}.")


def _host_port(address: Any) -> bool:
    host, _, port = str(address).rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536 and "/" not in host


MAX_ROUNDS = 100_000  # more is a typo, not a study: every round keeps a checkpoint unless --keep-checkpoints
MAX_LOCAL_EPOCHS = 10_000  # a client's epochs in one round (the paper's studies take 1 to 10)
MAX_LOCAL_STEPS = 1_000_000  # a client's steps in one round
MAX_WIDTH = 4096  # ConvNet channels or MLP units: 4096 is 450 million parameters at depth 3


_SECTION_TYPES: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "federated": FederatedConfig,
    "privacy": PrivacyConfig,
    **{
        settings.SECTION: settings.Section
        for settings in (entry.settings_module() for entry in ALGORITHMS.values())
        if settings is not None
    },
    "audit": AuditConfig,
    "flower": FlowerConfig,
    "evaluation": EvaluationConfig,
}


SECTION_TITLES = {
    "data": "Data",
    "model": "Model",
    "federated": "Federation",
    "privacy": "Privacy",
    "audit": "Audit",
    "flower": "Engine",
    "evaluation": "Evaluation",
}  # an algorithm's own section is titled by its settings module's TITLE


@functools.cache
def option_fields() -> tuple[tuple[str, dataclasses.Field, str], ...]:
    """Every configuration field that ``fedaudit train`` has an option for, as (``section.field`` or the top-level
    field's name, the field, the option's group in --help), sections in :data:`RunConfig`'s order (the sections are
    fixed when the configuration loads, so this is read once)."""
    found = []
    for top in fields(RunConfig):
        option = option_of(top)
        if option is not None:
            found.append((top.name, top, option.group or "Run"))
    for section, kind in _SECTION_TYPES.items():
        title = SECTION_TITLES.get(section) or _settings_title(section)
        for item in fields(kind):
            option = option_of(item)
            if option is not None:
                found.append((f"{section}.{item.name}", item, option.group or title))
    return tuple(found)


def _settings_title(section: str) -> str:
    """The --help group of an algorithm's own section: its settings module's TITLE."""
    modules = [e.settings_module() for e in ALGORITHMS.values() if e.settings]
    return next(module.TITLE for module in modules if module.SECTION == section)


@functools.cache
def _option_paths() -> dict[str, list[str]]:
    """Each option's name (as click names its parameter) -> the fields it would set (one, unless misdeclared)."""
    paths: dict[str, list[str]] = {}
    for path, item, _ in option_fields():
        paths.setdefault(option_name(item), []).append(path)
    return paths


def option_field(option: str) -> str:
    """The ``section.field`` (or top-level field) that the ``fedaudit train`` option ``option`` sets (its name as
    click names the parameter: ``lr`` sets federated.client_lr, ``local_epochs`` federated.local_epochs).

    Raises:
        KeyError: no field has that option.
    """
    found = _option_paths().get(option, [])
    if len(found) != 1:
        raise KeyError(f"The option {option!r} names {len(found)} configuration fields.")
    return found[0]


def sampled_alone(config: RunConfig) -> float:
    """With the noise in shares, a bound on the chance that some round samples a client with no other (T q
    (1 - q)^(K - 1)): then the release is the noise of its share alone, or nothing where it is absent, which no
    Gaussian mechanism covers, so the accountant spends --delta less this (0.0 otherwise)."""
    if not config.privacy.noise_in_shares:
        return 0.0
    q, clients = config.federated.client_fraction, config.data.num_clients
    return config.federated.rounds * q * (1.0 - q) ** (clients - 1)


SECURE_SUM_SITES = 1000  # SecAgg+ adds 2^22 levels a site modulo 2^32 (fedaudit.engine.secure_sum.MAX_SITES)


def secure_aggregation(config: RunConfig) -> bool:
    """Whether the server receives the clients' noise shares only added up: in a Flower deployment, under Flower's
    SecAgg+ (fedaudit.engine.secure_sum); the local engine and Flower's simulation have no such sum."""
    return config.privacy.noise_in_shares and config.engine == "flower" and config.flower.superlink is not None


def _check_secure_sum(config: RunConfig) -> None:
    """What a secure sum of the noise shares cannot carry: more sites than SecAgg+ adds without wrapping, and
    SCAFFOLD's control variates beside it."""
    if not secure_aggregation(config):
        return
    require(
        config.data.num_clients <= SECURE_SUM_SITES,
        f"--noise-at clients in a Flower deployment sums a round's sites under SecAgg+, which holds at most "
        f"{SECURE_SUM_SITES} sites a round; this run has {config.data.num_clients} clients.",
    )
    require(
        not ALGORITHMS[config.federated.algorithm].control_variates,
        "SCAFFOLD with --noise-at clients in a Flower deployment: each site's control variate would reach the "
        "server beside the secure sum of the updates; use --noise-at server, or DP-FedAvg or DP-FedProx.",
    )


def accountant_delta(config: RunConfig) -> float:
    """The delta the accountant computes epsilon at: --delta, less :func:`sampled_alone`."""
    return config.privacy.delta - sampled_alone(config)
