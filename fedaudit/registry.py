"""One registry of the federated algorithms and the privacy accountants: names, labels, defaults, implementations.

Everything that lists algorithms or accountants (the configuration's validation and defaults, the command line's
choices and ``[default: ...]`` texts, the study planner, the report's labels) reads this module, and the training
core builds an algorithm from its entry. It imports nothing heavy, so ``fedaudit --help`` stays fast; an entry names
its implementation as ``"module:attribute"``, imported when first used. Adding an algorithm means one module under
``fedaudit/algorithms/`` and one line in :data:`ALGORITHMS`. See docs/algorithms.md and docs/accounting.md.
"""

from __future__ import annotations

import fnmatch
import importlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from fedaudit.errors import UserError

# Gradient-sharing clients on datasets where the authors' Fashion-MNIST step and DP-SGD clipping norm barely move the
# model under DP. On digits (8x8 images, ~290 records per client) lr 0.1 with C = 0.1 left a width-16 ConvNet at 10%
# test accuracy after 3 rounds (53% with these), and the default DP run at 69% (83%), at the same epsilon. The step is
# the same with and without DP, so a study's no-DP reference differs from its DP runs in the privacy settings alone.
_DP_SGD_DATASET_CLIENT_LR = MappingProxyType({"digits": 0.5})
_DP_SGD_DATASET_MAX_GRAD_NORM = MappingProxyType({"digits": 1.0})

# What a client sends the server (``AlgorithmEntry.wire``): model updates, or synthetic sets (images and labels).
WIRE_UPDATES = "updates"
WIRE_SYNTHETIC = "synthetic"
# What a run's guarantee protects (``AlgorithmEntry.dp_unit``): a record (record-level DP-SGD, ``--dp``), a label
# (FedGM's label DP), or nothing (no DP variant).
DP_RECORD = "record"
DP_LABEL = "label"
DP_NONE = "none"
# The unit ``--dp`` protects (``--dp-level``): one record (DP-SGD on every client step) or one client's data as a whole
# (each client's update clipped, Gaussian noise on their sum: McMahan et al. 2018).
DP_LEVELS = ("record", "client")
CLIENT_LEVEL_LABEL = "(client level)"  # what a client-level run's algorithm label ends with (algorithm_label)


class RegistryError(UserError):
    """An entry that cannot be registered, or whose implementation cannot be imported (one sentence)."""


NAME = re.compile(r"[a-z][a-z0-9-]*")  # an algorithm's or attack's name: what --algorithm and --method take
TARGET = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")  # "package.module:attribute"


def load(target: str) -> Any:
    """The object that ``"package.module:attribute"`` names (a :class:`RegistryError` when nothing importable is)."""
    module, _, attribute = target.partition(":")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise RegistryError(f"The implementation {target!r} cannot be imported ({exc}).") from exc


def check_entry(name: str, implementation: str, taken: Mapping[str, Any], replace: bool, kind: str) -> None:
    """The rules every registered entry follows: a lower-case name with dashes, an implementation named as
    ``package.module:attribute``, and a name not taken unless ``replace`` says so."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise RegistryError(f"{kind.capitalize()} name {name!r} must be lower-case letters, digits and dashes.")
    if not isinstance(implementation, str) or not TARGET.fullmatch(implementation):
        raise RegistryError(f"{kind.capitalize()} {name}'s implementation {implementation!r} is not module:attribute.")
    if name in taken and not replace:
        raise RegistryError(f"An {kind} called {name!r} is registered already; pass replace=True to replace it.")


@dataclass(frozen=True)
class AlgorithmEntry:
    """One federated algorithm family member: what it is called and what it defaults to.

    Attributes:
        name: the configuration and command-line name (``--algorithm NAME``).
        label: the literature's name without DP; ``dp_label`` with record-level DP.
        summary: one line for help texts.
        implementation: ``"module:Class"``; the class takes the resolved run configuration (``Class(config)``).
        client_lr: the client learning rate when ``--lr`` is not given.
        max_grad_norm: the DP clipping norm C when ``--max-grad-norm`` is not given (the authors' configurations).
        dataset_client_lr: per-dataset overrides of ``client_lr``.
        dataset_max_grad_norm: per-dataset overrides of ``max_grad_norm``.
        options: the configuration fields (``section.field``) that only this algorithm reads.
        colour: its colour in every figure of a report.
        wire: what its clients send (:data:`WIRE_UPDATES` or :data:`WIRE_SYNTHETIC`) once the rounds of
            ``generation_rounds`` are over.
        generation_rounds: the first rounds, in which its clients send synthetic records instead (Fedssyn's one).
        dp_unit: what its guarantee protects (:data:`DP_RECORD`, :data:`DP_LABEL` or :data:`DP_NONE`).
        client_dp: it also has a client-level DP variant (``--dp --dp-level client``): its clients send model
            updates that the server clips and noises as a whole.
        local_sgd: its clients take local SGD steps on the server's model (``--local-epochs``, ``--local-steps``).
        one_step: its clients take one step, on their whole data without DP (FedSGD).
        proximal: its local steps add the proximal term mu (FedProx).
        control_variates: its local steps are corrected by control variates (SCAFFOLD).
        inner_algorithms: the algorithms it can run after its generation rounds (``--inner-algorithm``).
        queries_note: how its worst-case DP queries per round are made up, in words, where the report should say it.
        sent_in_clear: what its DP clients send outside the guarantee, in words, for the report's "not counted".
        settings: the module of its own configuration section (``"package.module"``, torch-free), or "" when it
            has none: ``SECTION`` (the section's key), ``Section`` (its dataclass), ``validate(section, config,
            selected=...)`` (its rules, and its refusal when another algorithm is chosen) and, where its defaults
            depend on the dataset or DP, ``resolve(section, config)``.
    """

    name: str
    label: str
    dp_label: str
    summary: str
    implementation: str
    client_lr: float
    max_grad_norm: float
    dataset_client_lr: Mapping[str, float] = field(default_factory=dict)
    dataset_max_grad_norm: Mapping[str, float] = field(default_factory=dict)
    options: tuple[str, ...] = ()
    colour: str = ""
    wire: str = WIRE_UPDATES
    generation_rounds: int = 0
    dp_unit: str = DP_RECORD
    client_dp: bool = False
    local_sgd: bool = False
    one_step: bool = False
    proximal: bool = False
    control_variates: bool = False
    inner_algorithms: tuple[str, ...] = ()
    queries_note: str = ""
    sent_in_clear: str = ""
    settings: str = ""

    def settings_module(self) -> Any:
        """The module named by :attr:`settings`, imported when first asked for; None when it has none."""
        return importlib.import_module(self.settings) if self.settings else None

    @property
    def record_dp(self) -> bool:
        """Whether it has a record-level DP variant (``--dp``); FedGM's guarantee is label DP instead."""
        return self.dp_unit == DP_RECORD

    @property
    def label_dp(self) -> bool:
        """Whether its guarantee is label DP (FedGM's ``--label-epsilon``)."""
        return self.dp_unit == DP_LABEL

    @property
    def shares_synthetic(self) -> bool:
        """Whether its clients send synthetic sets in some round."""
        return self.wire == WIRE_SYNTHETIC or self.generation_rounds > 0

    def sends_synthetic(self, round_number: int) -> bool:
        """Whether its clients send a synthetic set (not a model update) in round ``round_number`` (from 1)."""
        return self.wire == WIRE_SYNTHETIC or round_number <= self.generation_rounds

    def default_client_lr(self, dataset: str) -> float:
        return self.dataset_client_lr.get(dataset, self.client_lr)

    def default_max_grad_norm(self, dataset: str) -> float:
        return self.dataset_max_grad_norm.get(dataset, self.max_grad_norm)

    def display_name(self, dp: bool) -> str:
        """DP-FedAvg, FedLAP-DP, ... with DP; FedAvg, FedLAP, ... without."""
        return self.dp_label if dp else self.label

    def build(self, config: Any) -> Any:
        """The algorithm object for a resolved :class:`fedaudit.config.RunConfig`."""
        return load(self.implementation)(config)


def _sgd(
    name: str, label: str, summary: str, implementation: str, max_grad_norm: float, **extra: Any
) -> AlgorithmEntry:
    return AlgorithmEntry(
        name=name,
        label=label,
        dp_label=f"DP-{label}",
        summary=summary,
        implementation=implementation,
        client_lr=0.1,
        max_grad_norm=max_grad_norm,
        dataset_client_lr=_DP_SGD_DATASET_CLIENT_LR,
        dataset_max_grad_norm=_DP_SGD_DATASET_MAX_GRAD_NORM,
        **extra,
    )


# The entries themselves: everything reads them through the read-only view ALGORITHMS, which shows an entry added
# here (a new algorithm's one line, or a test's) wherever ALGORITHMS was imported.
_ALGORITHMS: dict[str, AlgorithmEntry] = {
    entry.name: entry
    for entry in (
        _sgd(
            "fedavg",
            "FedAvg",
            "local SGD, mean model delta",
            "fedaudit.algorithms.fedavg:FedAvg",
            0.1,
            colour="#1f77b4",
            local_sgd=True,
            client_dp=True,
        ),
        _sgd(
            "fedprox",
            "FedProx",
            "FedAvg with a proximal term mu",
            "fedaudit.algorithms.fedavg:FedProx",
            0.2,
            options=("federated.mu",),
            colour="#ff7f0e",
            local_sgd=True,
            proximal=True,
            client_dp=True,
        ),
        _sgd(
            "fedsgd",
            "FedSGD",
            "one local step per round",
            "fedaudit.algorithms.fedavg:FedSGD",
            0.1,
            colour="#2ca02c",
            one_step=True,
            client_dp=True,
        ),
        _sgd(
            "scaffold",
            "SCAFFOLD",
            "FedAvg with control variates against client drift (twice the upload)",
            "fedaudit.algorithms.scaffold:Scaffold",
            0.1,
            colour="#d62728",
            local_sgd=True,
            control_variates=True,
            client_dp=True,
        ),
        _sgd(
            "fedssyn",
            "Fedssyn",
            "a generation round of shuffled synthetic records (a class-conditional generator per client), then "
            "the inner algorithm (--inner-algorithm) on real plus shuffled records",
            "fedaudit.algorithms.fedssyn:Fedssyn",
            0.1,
            options=("fedssyn.*", "federated.mu"),
            colour="#9467bd",
            generation_rounds=1,
            inner_algorithms=("fedavg", "fedprox", "scaffold", "fedsgd"),
            settings="fedaudit.algorithms.fedssyn_settings",
        ),
        AlgorithmEntry(
            name="fedlap",
            label="FedLAP",
            dp_label="FedLAP-DP",
            summary="clients send small synthetic sets matched to their gradients in a trust region",
            implementation="fedaudit.algorithms.fedlap:FedLAP",
            client_lr=0.002,
            max_grad_norm=1.0,
            dataset_client_lr=MappingProxyType({"digits": 0.02}),  # measured: see FEDLAP_DATASET_DEFAULTS
            options=("fedlap.*",),
            colour="#8c564b",
            wire=WIRE_SYNTHETIC,
            queries_note="R_i * L * R_b, as if the trust region never ended a loop early",
            sent_in_clear="each client's set of classes, the labels of its synthetic set (a record that is the only "
            "one of its class at its client shows)",
            settings="fedaudit.algorithms.fedlap_settings",
        ),
        AlgorithmEntry(
            name="fedgm",
            label="FedGM",
            dp_label="FedGM",
            summary="one shot in stages: synthetic sets made by class-wise gradient matching, labels under label "
            "DP (--label-epsilon), images in clear",
            implementation="fedaudit.algorithms.fedgm:FedGM",
            client_lr=0.01,
            max_grad_norm=1.0,
            options=("fedgm.*",),
            colour="#e377c2",
            wire=WIRE_SYNTHETIC,
            dp_unit=DP_LABEL,
            settings="fedaudit.algorithms.fedgm_settings",
        ),
        AlgorithmEntry(
            name="feddm",
            label="FedDM",
            dp_label="FedDM",
            summary="synthetic sets matched to mean embeddings and logits on networks near the global model, "
            "every round (no DP)",
            implementation="fedaudit.algorithms.feddm:FedDM",
            client_lr=0.01,
            max_grad_norm=1.0,
            options=("feddm.*", "fedlap.server_epochs"),
            colour="#17becf",
            wire=WIRE_SYNTHETIC,
            dp_unit=DP_NONE,
            settings="fedaudit.algorithms.feddm_settings",
        ),
    )
}
ALGORITHMS: Mapping[str, AlgorithmEntry] = MappingProxyType(_ALGORITHMS)
DEFAULT_ALGORITHM = "fedavg"
# The algorithm whose DP queries per round a study's equal data access gives the local-SGD baselines (the FedLAP-DP
# paper's comparison).
EQUAL_ACCESS_REFERENCE = "fedlap"


def register_algorithm(entry: AlgorithmEntry, *, replace: bool = False) -> None:
    """Add ``entry`` to :data:`ALGORITHMS` (a plug-in's algorithm; docs/python-api.md, "Your own algorithm or
    attack"): train, attack, report and compare then know it by ``entry.name``. Raises :class:`RegistryError` for an
    entry that breaks the registry's rules or a name already taken (``replace=True`` replaces it)."""
    if not isinstance(entry, AlgorithmEntry):
        raise RegistryError(f"An algorithm is registered as an AlgorithmEntry, not {type(entry).__name__}.")
    check_entry(entry.name, entry.implementation, _ALGORITHMS, replace, "algorithm")
    if entry.wire not in (WIRE_UPDATES, WIRE_SYNTHETIC) or entry.dp_unit not in (DP_RECORD, DP_LABEL, DP_NONE):
        raise RegistryError(
            f"Algorithm {entry.name}'s wire must be {WIRE_UPDATES!r} or {WIRE_SYNTHETIC!r} and its dp_unit one of "
            f"{DP_RECORD!r}, {DP_LABEL!r}, {DP_NONE!r}."
        )
    _ALGORITHMS[entry.name] = entry


def unregister_algorithm(name: str) -> None:
    """Remove a registered algorithm (a plug-in's, when it is done)."""
    _ALGORITHMS.pop(name, None)


def algorithm(name: str) -> AlgorithmEntry:
    """The entry of ``name``; an unknown name is a ``KeyError`` (callers turn it into their own user error)."""
    return ALGORITHMS[name]


def algorithm_label(name: str, dp: bool, level: str = "record") -> str:
    """The literature's name of ``name`` with or without DP (at client level: "DP-FedAvg (client level)"); an
    unknown name is returned as it is."""
    entry = ALGORITHMS.get(name)
    if entry is None:
        return name
    label = entry.display_name(dp)
    return f"{label} {CLIENT_LEVEL_LABEL}" if dp and level == "client" else label


def option_readers(field_name: str) -> tuple[str, ...]:
    """The algorithms that claim the configuration field ``section.field`` as theirs alone
    (:attr:`AlgorithmEntry.options`, ``section.*`` for a whole section); empty for a field every algorithm reads."""
    return tuple(
        entry.name
        for entry in ALGORITHMS.values()
        if any(fnmatch.fnmatchcase(field_name, pattern) for pattern in entry.options)
    )


def client_dp_algorithms() -> tuple[str, ...]:
    """The algorithms with a client-level DP variant."""
    return tuple(name for name, entry in ALGORITHMS.items() if entry.client_dp)


@dataclass(frozen=True)
class AccountantEntry:
    """One privacy accountant of the Sampled Gaussian Mechanism.

    Attributes:
        name: the configuration and command-line name (``--accountant NAME``).
        label: what reports call it.
        summary: one line for help texts.
        implementation: ``"module:function"`` with signature ``(history, delta) -> epsilon``, where ``history`` is a
            tuple of ``(noise_multiplier, sample_rate, steps)``.
    """

    name: str
    label: str
    summary: str
    implementation: str

    def epsilon(self, history: tuple[tuple[float, float, int], ...], delta: float) -> float:
        return load(self.implementation)(history, delta)


ACCOUNTANTS: Mapping[str, AccountantEntry] = MappingProxyType(
    {
        entry.name: entry
        for entry in (
            AccountantEntry(
                "rdp",
                "RDP (Rényi DP, Opacus' orders)",
                "Rényi DP of the Sampled Gaussian Mechanism, converted to (epsilon, delta)",
                "fedaudit.privacy.accounting:rdp_epsilon",
            ),
            AccountantEntry(
                "prv",
                "PRV (privacy random variables)",
                "numerical composition of privacy loss distributions; tighter than RDP",
                "fedaudit.privacy.accounting:prv_epsilon",
            ),
        )
    }
)
DEFAULT_ACCOUNTANT = "rdp"


def per_algorithm(setting: str, dataset: str = "digits") -> str:
    """The registry's default ``setting`` (client_lr or max_grad_norm) of each algorithm in words, with the dataset's
    overrides: "0.1 fedavg/fedsgd, 0.2 fedprox, 1 fedlap; 1 on digits (fedavg/fedprox/fedsgd)"."""
    by_value: dict[float, list[str]] = {}
    for entry in ALGORITHMS.values():
        by_value.setdefault(getattr(entry, setting), []).append(entry.name)
    text = ", ".join(f"{value:g} {'/'.join(names)}" for value, names in by_value.items())
    on_dataset: dict[float, list[str]] = {}
    for entry in ALGORITHMS.values():
        value = getattr(entry, f"default_{setting}")(dataset)
        if value != getattr(entry, setting):
            on_dataset.setdefault(value, []).append(entry.name)
    overrides = ", ".join(f"{value:g} on {dataset} ({'/'.join(names)})" for value, names in on_dataset.items())
    return f"{text}; {overrides}" if overrides else text


# What --help says of the choices (fedaudit train's --algorithm and --accountant)
ALGORITHM_HELP = "Federated algorithm: " + "; ".join(f"{e.name} ({e.label}: {e.summary})" for e in ALGORITHMS.values())
ACCOUNTANT_HELP = "Privacy accountant: " + "; ".join(f"{e.name} ({e.summary})" for e in ACCOUNTANTS.values())
