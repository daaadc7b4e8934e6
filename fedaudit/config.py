"""Run configuration: one frozen dataclass per concern, validated, JSON/YAML round-trip.

A :class:`RunConfig` is what ``fedaudit train`` resolves from defaults, a
``--config`` file and command-line overrides; :meth:`RunConfig.resolved`
writes every algorithm-dependent default out, and that resolved form is what
``config.json`` in the run directory holds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from fedaudit.errors import UserError
from fedaudit.registry import ACCOUNTANTS, ALGORITHMS, DEFAULT_ACCOUNTANT, DEFAULT_ALGORITHM

# Seeds are 32-bit: every random stream is derived from (seed, stream, keys) word by word (fedaudit.seeding).
MAX_SEED = 2**32 - 1
DEVICES = ("auto", "cpu", "cuda")
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


class ConfigError(UserError):
    """An invalid configuration value (one clear sentence for the user)."""


@dataclass(frozen=True)
class DataConfig:
    """Which data, how it is split over clients, and how much is held out as non-members."""

    dataset: str = "digits"
    data_dir: str | None = None
    download: bool = False
    partition: str = "classes:2"
    num_clients: int = 5
    holdout_fraction: float = 0.1
    label_column: str | None = None  # --dataset csv:PATH: the column holding each record's class
    image_size: int | None = None  # --dataset folder:DIR: images are resized to this square size (default 32)
    # --dataset sites with the local engine: each client's own data (npz:, csv: or folder:), in client order; in a
    # Flower deployment each site names its own in its node config instead
    sites: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        """A list of site data (a JSON or YAML file's) is kept as a tuple, so that configurations compare equal."""
        if isinstance(self.sites, list):
            object.__setattr__(self, "sites", tuple(self.sites))


@dataclass(frozen=True)
class ModelConfig:
    """The global model's architecture."""

    arch: str = "convnet"
    width: int | None = None  # None: the dataset's default (DEFAULT_WIDTH, else PAPER_WIDTH)
    depth: int | None = None  # None: fitted to the input size (see fedaudit.models.default_depth)


@dataclass(frozen=True)
class FederatedConfig:
    """The federated optimisation: algorithm, rounds, participation and client/server optimisers.

    ``None`` means "the algorithm's default", filled in by :meth:`RunConfig.resolved`.
    """

    algorithm: str = DEFAULT_ALGORITHM
    rounds: int = 10
    client_fraction: float = 1.0
    weighting: str = "num_examples"
    server_lr: float = 1.0
    local_epochs: int = 5
    local_steps: int | None = None
    client_lr: float | None = None
    momentum: float = 0.0
    batch_size: int | None = None  # None: DEFAULT_BATCH_SIZE of the dataset
    mu: float = 0.1
    lr_schedule: str | None = None


CANARY_KINDS = ("gradient", "input")


@dataclass(frozen=True)
class EvaluationConfig:
    """How the global model's test accuracy is measured while it trains: every ``eval_every`` rounds and after the
    last, on the whole test split or on a fixed random sample of ``eval_sample`` of its records (drawn from the seed;
    the report's interval is then over that many). A federation with many clients and rounds spends most of its time
    evaluating otherwise."""

    eval_every: int = 1
    eval_sample: int | None = None


@dataclass(frozen=True)
class AuditConfig:
    """Canaries planted at training time for a canary audit (docs/audit.md).

    Each of ``canaries`` canaries is included with probability 1/2 in the data of one client, sampled, clipped and
    noised like every record of its client. A gradient canary is a fixed random direction whose per-example gradient
    is 10 C times that unit direction (clipped to C); an input canary is a held-out record with a replaced label.
    The audit reads what every client sent (so canaries turn --save-transmitted on) and, for input canaries, the
    final model. Needs --dp.
    """

    canaries: int = 0
    canary_kind: str = "gradient"
    kept_queries: int = 12  # whole DP queries the query log keeps per run on average, for verify's recomputations


@dataclass(frozen=True)
class FlowerConfig:
    """Where ``--engine flower`` runs the clients: Flower's simulation runtime (on this machine, or on an existing
    Ray cluster with ``ray_address``), or with ``superlink`` the SuperNodes of a Flower deployment, one per site,
    with fedaudit as the server (docs/deployment.md). The results do not depend on any of these settings.
    """

    ray_address: str | None = None  # an existing Ray cluster's head (HOST:PORT) for the simulation runtime
    client_cpus: float = 1.0  # Ray resources each simulated client reserves
    client_gpus: float | None = None  # None: 1 / clients on a CUDA run, else 0
    superlink: str | None = None  # HOST:PORT of the SuperLink (its one HTTPS port)
    root_certificates: str | None = None  # the CA certificate (PEM) that signed the SuperLink's certificate
    insecure: bool = False  # plain HTTP instead of TLS (only when asked for)
    wait_seconds: float = 300.0  # how long to wait for every client's SuperNode to connect
    round_timeout: float = 3600.0  # how long a round may wait for a site that neither answers nor dies


@dataclass(frozen=True)
class PrivacyConfig:
    """Record-level DP: the mechanism's parameters and how it is accounted."""

    dp: bool = False
    noise_multiplier: float | None = None
    max_grad_norm: float | None = None
    target_epsilon: float | None = None
    delta: float = 1e-5
    accountant: str = DEFAULT_ACCOUNTANT
    calibrated: bool = False
    # None: every client draws its noise and samples from a secret only it holds (the default); an integer: from this
    # public seed instead, reproducibly, for experiments (whoever holds it can remove the noise)
    noise_seed: int | None = None
    secure_noise: bool = False  # DP queries draw from ChaCha20, each Gaussian the sum of four float64 draws


@dataclass(frozen=True)
class FedLAPConfig:
    """FedLAP / FedLAP-DP local approximation and global optimisation (docs/algorithms.md).

    ``None`` means the authors' default for the DP or non-DP setting, filled in by :meth:`RunConfig.resolved`.
    """

    ipc: int | None = None
    trajectories: int | None = None
    max_loops: int = 5
    real_batches: int | None = None
    image_steps: int = 5
    model_epochs: int | None = None
    radius: float | None = None
    image_lr: float = 100.0
    mse_weight: float | None = None
    init: str | None = None
    augment: bool = False
    server_batch_size: int = 512
    server_epochs: int = 100
    radius_strategy: str = "min"


# Authors' defaults for FedLAP-DP (dp=True) and FedLAP (dp=False).
FEDLAP_DEFAULTS = {
    True: {
        "ipc": 10,
        "trajectories": 4,
        "real_batches": 10,
        "model_epochs": 2,
        "radius": 1.5,
        "mse_weight": 0.0,
        "init": "noise",
    },
    False: {
        "ipc": 50,
        "trajectories": 1,
        "real_batches": 40,
        "model_epochs": 0,
        "radius": 10.0,
        "mse_weight": 0.1,
        "init": "real",
    },
}
# FedLAP-DP on digits, measured (docs/algorithms.md): its ~230 records per client and 8x8 images move the width-32
# model far less per round than the authors' Fashion-MNIST settings expect. A synthetic-set learning rate of 0.02
# (the learning rate of FedLAP is that of training on the synthetic sets and of the server) lifts noise-free FedLAP-DP
# from 0.52 to 0.86 test accuracy in 3 rounds, with the trust region at 5 (1.5 held it back; 10 adds nothing);
# under DP one trajectory of two real batches per loop (T = 10 queries per round, not 200) costs the least noise for
# the same accuracy and runs a round in about 4 s instead of 40.
FEDLAP_DATASET_DEFAULTS = {"digits": {True: {"trajectories": 1, "real_batches": 2, "radius": 5.0}, False: {}}}
FEDLAP_INITS = ("noise", "previous", "real")
RADIUS_STRATEGIES = ("min", "median", "max", "fixed")
LABEL_MECHANISMS = ("rr", "rr-top-k", "rr-with-prior")
DISTILL_INITS = ("real", "noise")


@dataclass(frozen=True)
class FedDMConfig:
    """FedDM: each round, synthetic sets matched to the real data's mean embeddings and mean logits on networks
    sampled around the global model; the server trains inside a ball of that radius (docs/algorithms.md)."""

    dm_ipc: int = 10  # synthetic images per class a client holds
    dm_iterations: int = 100  # sampled networks (one image step each)
    dm_lr: float = 1.0  # SGD (momentum 0.5) on the synthetic images
    dm_batch: int = 256  # real images per class in one step
    dm_radius: float = 5.0  # rho: networks are sampled on the sphere of this radius around w_g; the server's ball


FEDSSYN_INNER = ALGORITHMS["fedssyn"].inner_algorithms


@dataclass(frozen=True)
class FedssynConfig:
    """Fedssyn: in its first round every client trains a class-conditional generator on a fraction of its records
    and sends generated records; the server shuffles them and deals every client an equal share, which the client
    then trains on with its own records under the inner algorithm, every later round (docs/algorithms.md)."""

    inner_algorithm: str = "fedavg"  # the federated algorithm of the rounds after the generation round
    generator_fraction: float = 0.75  # rho: the share of a client's records its generator trains on
    synthetic_per_client: int | None = None  # n~: records each client generates; None: the mean client's size
    generator_epochs: int = 30
    generator_batch: int = 64  # minibatch (expected Poisson batch under DP)
    generator_lr: float = 1e-3  # Adam
    generator_clip: float = 1.0  # DP clipping norm of the generator's per-record gradients


@dataclass(frozen=True)
class FedGMConfig:
    """FedGM: one-shot distillation by class-wise gradient matching, the labels sent under label DP
    (docs/algorithms.md). The run's rounds are FedGM's stages T: each client releases 1/T of its synthetic set per
    round, its labels randomized with a prior from the server's model of the stages before."""

    distill_ipc: int = 10  # synthetic images per class a client holds
    distill_iterations: int = 20  # fresh random networks the matching runs on (outer loop)
    distill_steps: int = 10  # matching steps per network (inner loop), each followed by one network step
    distill_lr: float = 0.1  # SGD (momentum 0.5) on the synthetic images
    distill_batch: int = 128  # real images per class in one matching step
    distill_init: str = "real"  # real: start from randomly drawn real images of the class (the paper); noise
    label_epsilon: float | None = None  # label DP of every label sent; None: labels are sent in clear
    label_mechanism: str = "rr-with-prior"
    top_k: int | None = None  # k of rr-top-k
    server_steps: int = 500  # SGD steps of the server on the union of what it received


@dataclass(frozen=True)
class RunConfig:
    """Everything that determines a run; the same config and seed give the same run."""

    seed: int = 0
    device: str = "auto"
    engine: str = "local"  # who runs the clients: in-process, or Flower's simulation runtime (same results)
    # How many clients the local engine runs at once (threads; CUDA streams on a GPU); None: all of a round's
    # clients on CUDA, one at a time on CPU. Results do not depend on it.
    parallel_clients: int | None = None
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
    save_transmitted: bool = False
    keep_checkpoints: int | None = None  # the last N rounds' checkpoints are kept; None: every round's

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
                try:
                    config = replace(config, **{section: replace(current, **{name: value})})
                except TypeError as exc:
                    raise ConfigError(f"Unknown configuration key '{dotted}'.") from exc
            else:
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
        lap = self.fedlap
        if algorithm == "fedlap":
            own = FEDLAP_DATASET_DEFAULTS.get(self.data.dataset, {}).get(bool(priv.dp), {})
            defaults = {**FEDLAP_DEFAULTS[bool(priv.dp)], **own}
            lap = replace(lap, **{name: value for name, value in defaults.items() if getattr(lap, name) is None})
        model = self.model
        if model.width is None:
            model = replace(model, width=DEFAULT_WIDTH.get(self.data.dataset, PAPER_WIDTH))
        if priv.dp:
            priv = replace(
                priv,
                max_grad_norm=priv.max_grad_norm
                if priv.max_grad_norm is not None
                else entry.default_max_grad_norm(self.data.dataset),
                noise_multiplier=(
                    priv.noise_multiplier
                    if priv.noise_multiplier is not None or priv.target_epsilon is not None
                    else 1.0
                ),
            )
        config = replace(self, federated=fed, privacy=priv, fedlap=lap, model=model)
        if self.audit.canaries:
            config = replace(config, save_transmitted=True)
        config.validate()
        return config

    def _validate_feddm(self) -> None:
        """FedDM's section; its options with another algorithm; FedDM has no DP variant here."""
        dm = self.feddm
        for name in ("dm_ipc", "dm_iterations", "dm_batch"):
            value = getattr(dm, name)
            _check(
                _is_int(value) and value >= 1, f"--{name.replace('_', '-')} must be a positive integer, got {value!r}."
            )
        for name in ("dm_lr", "dm_radius"):
            value = getattr(dm, name)
            _check(_is_number(value) and value > 0, f"--{name.replace('_', '-')} must be positive, got {value!r}.")
        if self.federated.algorithm != "feddm":
            _check(dm == FedDMConfig(), "The FedDM options (--dm-*) need --algorithm feddm.")
            return
        _check(
            not self.privacy.dp,
            "FedDM runs without DP here: its paper's DP variant protects class-wise statistics and is not specified "
            "precisely enough to account; use --algorithm fedlap --dp for DP synthetic sets.",
        )

    def _validate_fedssyn(self) -> None:
        """Fedssyn's section; its options with another algorithm; what Fedssyn needs of the run."""
        fs = self.fedssyn
        _check(
            fs.inner_algorithm in FEDSSYN_INNER,
            f"--inner-algorithm must be one of {', '.join(FEDSSYN_INNER)}, got {fs.inner_algorithm!r}.",
        )
        _check(
            _is_number(fs.generator_fraction) and 0 < fs.generator_fraction <= 1,
            f"--generator-fraction must be in (0, 1], got {fs.generator_fraction!r}.",
        )
        _check(
            fs.synthetic_per_client is None or (_is_int(fs.synthetic_per_client) and fs.synthetic_per_client >= 1),
            f"--synthetic-per-client must be a positive integer, got {fs.synthetic_per_client!r}.",
        )
        for name in ("generator_epochs", "generator_batch"):
            value = getattr(fs, name)
            _check(
                _is_int(value) and value >= 1, f"--{name.replace('_', '-')} must be a positive integer, got {value!r}."
            )
        for name in ("generator_lr", "generator_clip"):
            value = getattr(fs, name)
            _check(_is_number(value) and value > 0, f"--{name.replace('_', '-')} must be positive, got {value!r}.")
        if self.federated.algorithm != "fedssyn":
            _check(
                fs == FedssynConfig(),
                "The Fedssyn options (--inner-algorithm, --generator-*, --synthetic-per-client) need "
                "--algorithm fedssyn.",
            )
            return
        _check(
            self.federated.rounds >= 2,
            "Fedssyn's first round makes and deals the synthetic records and the inner algorithm trains from the "
            "second on: give --rounds 2 or more.",
        )

    def _validate_fedgm(self) -> None:
        """FedGM's section, and what FedGM cannot do; its options with another algorithm."""
        gm = self.fedgm
        _validate_fedgm_section(gm)
        if self.federated.algorithm != "fedgm":
            _check(
                gm == FedGMConfig(),
                "The FedGM options (--label-epsilon, --label-mechanism, --top-k, --distill-*, --server-steps) need "
                "--algorithm fedgm.",
            )
            return
        _check(
            not self.privacy.dp,
            "FedGM protects the labels it sends (label DP, --label-epsilon), not the records: --dp (record-level "
            "DP-SGD) does not apply to it.",
        )
        _check(
            self.federated.client_fraction == 1.0,
            "FedGM releases every client's synthetic set in stages, one per round, so every client must take part "
            "in every round (--client-fraction 1).",
        )

    def _validate_flower(self) -> None:
        dep = self.flower
        _check(
            self.engine == "flower" or (dep.ray_address is None and dep.client_gpus is None and dep.client_cpus == 1.0),
            "--ray-address, --client-cpus and --client-gpus are for --engine flower's simulation runtime.",
        )
        _check(
            isinstance(dep.client_cpus, (int, float)) and not isinstance(dep.client_cpus, bool) and dep.client_cpus > 0,
            f"--client-cpus must be a positive number, got {dep.client_cpus!r}.",
        )
        _check(
            dep.client_gpus is None
            or (
                isinstance(dep.client_gpus, (int, float))
                and not isinstance(dep.client_gpus, bool)
                and 0 <= dep.client_gpus <= 1
            ),
            f"--client-gpus must be a share of one GPU, from 0 to 1, got {dep.client_gpus!r}.",
        )
        if dep.ray_address is not None:
            _check(dep.superlink is None, "--ray-address is for the simulation runtime; a deployment has --superlink.")
            _check(_host_port(dep.ray_address), f"--ray-address must be HOST:PORT, got '{dep.ray_address}'.")
        if dep.superlink is None:
            _check(
                dep.root_certificates is None and not dep.insecure,
                "--root-certificates and --insecure are for a Flower deployment: give --superlink HOST:PORT too.",
            )
            return
        _check(self.engine == "flower", "--superlink needs --engine flower (the clients run on Flower SuperNodes).")
        _check(_host_port(dep.superlink), f"--superlink must be HOST:PORT (no scheme), got '{dep.superlink}'.")
        _check(
            not (dep.insecure and dep.root_certificates),
            "--insecure turns TLS off, so it cannot be given with --root-certificates; choose one.",
        )
        _check(
            dep.insecure or dep.root_certificates is not None,
            "A Flower deployment talks TLS: give --root-certificates CA.crt (the CA that signed the SuperLink's "
            "certificate), or --insecure to send everything in the clear.",
        )
        if dep.root_certificates is not None:
            _check(
                Path(dep.root_certificates).is_file(),
                f"--root-certificates {dep.root_certificates} is not a readable file.",
            )
        for name in ("wait_seconds", "round_timeout"):
            value = getattr(dep, name)
            _check(
                isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                f"--{name.replace('_', '-')} must be a positive number of seconds, got {value!r}.",
            )

    def validate(self) -> None:
        """Raise :class:`ConfigError` with one clear sentence for the first invalid value."""
        _check(self.device in DEVICES, f"--device must be one of {', '.join(DEVICES)}, got '{self.device}'.")
        _check(self.engine in ENGINES, f"--engine must be one of {', '.join(ENGINES)}, got '{self.engine}'.")
        _check(
            self.parallel_clients is None or (_is_int(self.parallel_clients) and self.parallel_clients >= 1),
            f"--parallel-clients must be a positive integer, got {self.parallel_clients!r}.",
        )
        self._validate_flower()
        _check(
            self.engine == "local" or self.flower.superlink is not None or self.parallel_clients in (None, 1),
            "--parallel-clients is for the local engine and a Flower deployment; Flower's simulation runs clients "
            "in parallel itself (its client resources decide how many).",
        )
        _check(
            _is_int(self.seed) and 0 <= self.seed <= MAX_SEED,
            f"--seed must be an integer from 0 to {MAX_SEED}, got {self.seed!r}.",
        )
        d, m, f, p = self.data, self.model, self.federated, self.privacy
        for name, value in (("--dp", p.dp), ("--download", d.download), ("privacy.calibrated", p.calibrated)):
            _check(isinstance(value, bool), f"{name} must be true or false, got {value!r}.")
        _check(d.data_dir is None or isinstance(d.data_dir, str), f"--data-dir must be a path, got {d.data_dir!r}.")
        _check(
            d.label_column is None or (isinstance(d.label_column, str) and d.label_column != ""),
            f"--label-column must name a column, got {d.label_column!r}.",
        )
        _check(
            d.image_size is None or (_is_int(d.image_size) and 1 <= d.image_size <= 512),
            f"--image-size must be an integer from 1 to 512, got {d.image_size!r}.",
        )
        _check(
            _is_int(d.num_clients) and d.num_clients >= 1, f"--num-clients must be at least 1, got {d.num_clients!r}."
        )
        _check(
            _is_number(d.holdout_fraction) and 0.0 <= d.holdout_fraction < 1.0,
            f"--holdout-fraction must be in [0, 1), got {d.holdout_fraction!r}.",
        )
        _check(
            m.width is None or (_is_int(m.width) and m.width >= 1),
            f"--width must be a positive integer, got {m.width!r}.",
        )
        _check(
            m.depth is None or (_is_int(m.depth) and m.depth >= 0),
            f"--depth must be a non-negative integer, got {m.depth!r}.",
        )
        _check(_is_int(f.rounds) and f.rounds >= 1, f"--rounds must be a positive integer, got {f.rounds!r}.")
        _check(f.rounds <= MAX_ROUNDS, f"--rounds must be at most {MAX_ROUNDS:,}, got {f.rounds:,}.")
        ev = self.evaluation
        _check(
            _is_int(ev.eval_every) and ev.eval_every >= 1,
            f"--eval-every must be a positive integer, got {ev.eval_every!r}.",
        )
        _check(
            ev.eval_sample is None or (_is_int(ev.eval_sample) and ev.eval_sample >= 1),
            f"--eval-sample must be a positive integer, got {ev.eval_sample!r}.",
        )
        _check(
            ev.eval_sample is None or str(d.dataset).strip().lower() != "sites",
            "--eval-sample does not apply to --dataset sites: each site evaluates the model on its own test records.",
        )
        _check(
            self.keep_checkpoints is None or (_is_int(self.keep_checkpoints) and self.keep_checkpoints >= 1),
            f"--keep-checkpoints must be a positive integer, got {self.keep_checkpoints!r}.",
        )
        _check(
            self.keep_checkpoints is None or not self.audit.canaries,
            "--keep-checkpoints cannot be used with --canaries: the canary audit reads the model every round began "
            "from.",
        )
        _check(
            _is_number(f.client_fraction) and 0.0 < f.client_fraction <= 1.0,
            f"--client-fraction must be in (0, 1], got {f.client_fraction!r}.",
        )
        _check(f.weighting in WEIGHTINGS, f"--weighting must be one of {', '.join(WEIGHTINGS)}, got '{f.weighting}'.")
        _check(_is_number(f.server_lr) and f.server_lr > 0, f"--server-lr must be positive, got {f.server_lr!r}.")
        _check(
            _is_int(f.local_epochs) and f.local_epochs >= 1,
            f"--local-epochs must be a positive integer, got {f.local_epochs!r}.",
        )
        _check(
            f.local_steps is None or (_is_int(f.local_steps) and f.local_steps >= 1),
            f"--local-steps must be a positive integer, got {f.local_steps!r}.",
        )
        _check(
            f.client_lr is None or (_is_number(f.client_lr) and f.client_lr > 0),
            f"--lr must be positive, got {f.client_lr!r}.",
        )
        _check(_is_number(f.momentum) and 0.0 <= f.momentum < 1.0, f"--momentum must be in [0, 1), got {f.momentum!r}.")
        _check(
            f.batch_size is None or (_is_int(f.batch_size) and f.batch_size >= 1),
            f"--batch-size must be a positive integer, got {f.batch_size!r}.",
        )
        _check(_is_number(f.mu) and f.mu >= 0, f"--mu must be non-negative, got {f.mu!r}.")
        _check(
            f.lr_schedule is None or f.lr_schedule in LR_SCHEDULES,
            f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got '{f.lr_schedule}'.",
        )
        _check(
            p.accountant in ACCOUNTANTS, f"--accountant must be one of {', '.join(ACCOUNTANTS)}, got '{p.accountant}'."
        )
        _check(_is_number(p.delta) and 0.0 < p.delta < 1.0, f"--delta must be in (0, 1), got {p.delta!r}.")
        if p.dp:
            _check(
                p.noise_multiplier is None or (_is_number(p.noise_multiplier) and p.noise_multiplier > 0),
                f"--noise-multiplier must be positive with --dp, got {p.noise_multiplier!r}.",
            )
            _check(
                p.max_grad_norm is None or (_is_number(p.max_grad_norm) and p.max_grad_norm > 0),
                f"--max-grad-norm must be positive with --dp, got {p.max_grad_norm!r}.",
            )
            _check(
                p.target_epsilon is None or (_is_number(p.target_epsilon) and p.target_epsilon > 0),
                f"--target-epsilon must be positive, got {p.target_epsilon!r}.",
            )
            _check(
                not (p.target_epsilon is not None and p.noise_multiplier is not None and not p.calibrated),
                "Give either --noise-multiplier or --target-epsilon, not both.",
            )
        else:
            _check(
                p.target_epsilon is None and p.noise_multiplier is None and p.max_grad_norm is None,
                "--noise-multiplier, --max-grad-norm and --target-epsilon need --dp.",
            )
        _check(isinstance(p.secure_noise, bool), f"--secure-noise must be true or false, got {p.secure_noise!r}.")
        _check(
            p.noise_seed is None or (_is_int(p.noise_seed) and 0 <= p.noise_seed <= MAX_SEED),
            f"--noise-seed must be an integer from 0 to {MAX_SEED}, got {p.noise_seed!r}.",
        )
        _check(
            self.dp_randomness or (p.noise_seed is None and not p.secure_noise),
            "--noise-seed and --secure-noise set how DP noise is drawn, and this run draws none: add --dp (or "
            "--label-epsilon for FedGM).",
        )
        _validate_fedlap(self.fedlap, dp=p.dp)
        self._validate_fedgm()
        self._validate_feddm()
        self._validate_fedssyn()
        a = self.audit
        _check(
            _is_int(a.canaries) and a.canaries >= 0, f"--canaries must be a non-negative integer, got {a.canaries!r}."
        )
        _check(
            a.canary_kind in CANARY_KINDS,
            f"--canary-kind must be one of {', '.join(CANARY_KINDS)}, got {a.canary_kind!r}.",
        )
        _check(
            _is_int(a.kept_queries) and a.kept_queries >= 0,
            f"--kept-queries must be a non-negative integer, got {a.kept_queries!r}.",
        )
        _check(
            not a.canaries or p.dp,
            "--canaries needs --dp: a canary audit bounds the epsilon of a DP run's accountant.",
        )
        self._validate_sites()

    def _validate_sites(self) -> None:
        """--dataset sites: one data source per client, read at the sites (or here, each as its site would)."""
        d = self.data
        _check(
            isinstance(d.sites, tuple) and all(isinstance(spec, str) and spec.strip() for spec in d.sites),
            f"--site-data must name each client's data (npz:PATH, csv:PATH or folder:DIR), got {d.sites!r}.",
        )
        if str(d.dataset).strip().lower() != "sites":
            _check(not d.sites, "--site-data needs --dataset sites.")
            return
        deployed = self.flower.superlink is not None
        _check(
            self.engine == "local" or deployed,
            "--dataset sites runs on the local engine or a Flower deployment (--superlink), where each site reads "
            "its own records; Flower's simulation runtime is not supported.",
        )
        if deployed:
            _check(
                not d.sites,
                'In a Flower deployment each site names its own data in its node config (data="npz:PATH"); drop '
                "--site-data.",
            )
        else:  # none given: the sites' records are not here (prepare says so, unless the sites report them)
            _check(
                not d.sites or len(d.sites) == d.num_clients,
                f"--dataset sites needs one --site-data per client: {len(d.sites)} given for --num-clients "
                f"{d.num_clients}.",
            )
        _check(
            d.partition == DataConfig().partition,
            "--partition does not apply to --dataset sites: each site's records are its client's.",
        )
        _check(
            self.audit.canary_kind != "input" or not self.audit.canaries,
            "--canary-kind input needs held-out records at the server, which a federation whose sites keep their "
            "records does not have; use gradient canaries.",
        )


def _validate_fedgm_section(gm: FedGMConfig) -> None:
    for name in ("distill_ipc", "distill_iterations", "distill_steps", "distill_batch", "server_steps"):
        value = getattr(gm, name)
        _check(_is_int(value) and value >= 1, f"--{name.replace('_', '-')} must be a positive integer, got {value!r}.")
    _check(_is_number(gm.distill_lr) and gm.distill_lr > 0, f"--distill-lr must be positive, got {gm.distill_lr!r}.")
    _check(
        gm.distill_init in DISTILL_INITS,
        f"--distill-init must be one of {', '.join(DISTILL_INITS)}, got {gm.distill_init!r}.",
    )
    _check(
        gm.label_epsilon is None or (_is_number(gm.label_epsilon) and gm.label_epsilon > 0),
        f"--label-epsilon must be positive, got {gm.label_epsilon!r}.",
    )
    _check(
        gm.label_mechanism in LABEL_MECHANISMS,
        f"--label-mechanism must be one of {', '.join(LABEL_MECHANISMS)}, got {gm.label_mechanism!r}.",
    )
    _check(
        (gm.top_k is None) == (gm.label_mechanism != "rr-top-k"),
        "--top-k is needed by --label-mechanism rr-top-k, and by no other mechanism.",
    )
    _check(gm.top_k is None or (_is_int(gm.top_k) and gm.top_k >= 1), f"--top-k must be at least 1, got {gm.top_k!r}.")


def _validate_fedlap(lap: FedLAPConfig, *, dp: bool) -> None:
    """Check the FedLAP section (values left at None are filled in by resolved())."""
    for name in (
        "ipc",
        "trajectories",
        "max_loops",
        "real_batches",
        "image_steps",
        "server_batch_size",
        "server_epochs",
    ):
        value = getattr(lap, name)
        _check(
            value is None or (_is_int(value) and value >= 1),
            f"--{name.replace('_', '-')} must be a positive integer, got {value!r}.",
        )
    _check(
        lap.model_epochs is None or (_is_int(lap.model_epochs) and lap.model_epochs >= 0),
        f"--model-epochs must be a non-negative integer, got {lap.model_epochs!r}.",
    )
    _check(
        lap.radius is None or (_is_number(lap.radius) and lap.radius > 0),
        f"--radius must be positive, got {lap.radius!r}.",
    )
    _check(_is_number(lap.image_lr) and lap.image_lr > 0, f"--image-lr must be positive, got {lap.image_lr!r}.")
    _check(
        lap.mse_weight is None or (_is_number(lap.mse_weight) and lap.mse_weight >= 0),
        f"--mse-weight must be non-negative, got {lap.mse_weight!r}.",
    )
    _check(
        lap.init is None or lap.init in FEDLAP_INITS,
        f"--init must be one of {', '.join(FEDLAP_INITS)}, got '{lap.init}'.",
    )
    _check(
        not (dp and lap.init == "real"),
        "--init real is refused with --dp: the synthetic set would start as real records and be published.",
    )
    _check(
        lap.radius_strategy in RADIUS_STRATEGIES,
        f"--radius-strategy must be one of {', '.join(RADIUS_STRATEGIES)}, got '{lap.radius_strategy}'.",
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
        data = json.loads(text) if is_json else load_yaml(text)
    except RecursionError as exc:
        raise ConfigError(f"The configuration file {path} nests deeper than fedaudit reads.") from exc
    except YAMLRefused as exc:
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


def load_yaml(text: str) -> Any:
    """A YAML document with PyYAML's safe types (and YAML 1.2 floats), refusing aliases (whose expansion can
    multiply a small file into gigabytes) and nesting beyond :data:`MAX_YAML_DEPTH` (:class:`YAMLRefused`)."""
    return yaml.load(text, Loader=_YAMLLoader)  # noqa: S506 - a SafeLoader


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


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


MAX_ROUNDS = 100_000  # more is a typo, not a study: every round keeps a checkpoint unless --keep-checkpoints


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_SECTION_TYPES: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "federated": FederatedConfig,
    "privacy": PrivacyConfig,
    "fedlap": FedLAPConfig,
    "fedgm": FedGMConfig,
    "feddm": FedDMConfig,
    "fedssyn": FedssynConfig,
    "audit": AuditConfig,
    "flower": FlowerConfig,
    "evaluation": EvaluationConfig,
}


# Command-line options whose names differ from their configuration field; every other option of ``fedaudit train``
# is named after its field (``--local-epochs`` sets federated.local_epochs), so a new field needs only its option.
OPTION_RENAMES = {"lr": "federated.client_lr", "model": "model.arch", "site_data": "data.sites"}


def option_field(option: str) -> str:
    """The ``section.field`` (or top-level field) that the ``fedaudit train`` option ``option`` sets.

    Raises:
        KeyError: no field, or more than one, has that name.
    """
    if option in OPTION_RENAMES:
        return OPTION_RENAMES[option]
    top = {f.name for f in fields(RunConfig) if f.name not in _SECTION_TYPES}
    found = [option] if option in top else []
    found += [
        f"{section}.{option}" for section, kind in _SECTION_TYPES.items() if option in {f.name for f in fields(kind)}
    ]
    if len(found) != 1:
        raise KeyError(f"The option {option!r} names {len(found)} configuration fields.")
    return found[0]
