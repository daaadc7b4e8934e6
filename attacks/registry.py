"""One registry of the attacks ``fedaudit attack --method NAME`` runs: their names, families, what each needs from a
run, what results each writes, and where its implementation lives.

The runner (attacks/runner.py) loops over these entries: it validates ``--method`` against them, runs each family's
entries together, and predicts the result directories a run will hold from their facts (``expected_results``), so
that adding an attack to a family means one new function and one entry here. The module imports nothing heavy (an
entry names its implementation as ``"module:attribute"``, loaded when first used), so the command line's help and
the study planner can read it. See docs/audit.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedaudit.registry import RegistryError, check_entry, load

# Families: the attacks of one family are run together by one part of the runner.
MEMBERSHIP = "membership"  # a per-record signal of the attacked models turned into membership scores
REFERENCE = "reference"  # membership scores that compare the signal with reference models trained like the run
CANARY = "canary"  # the run's canaries scored and turned into epsilon lower bounds
RECONSTRUCTION = "reconstruction"  # a client's records rebuilt from what it sent
CLIENT = "client"  # whether a client's data as a whole took part: the unit is a client
FAMILIES = (MEMBERSHIP, REFERENCE, CANARY, RECONSTRUCTION, CLIENT)

# The names of the two attacks that are families of their own: their result directories and metrics.json say them.
CANARY_METHOD = "canary"
RECONSTRUCTION_METHOD = "reconstruction"
CLIENT_METHOD = "client"
CLIENT_RESULT = "loss-client"  # its one result directory


@dataclass(frozen=True)
class AttackEntry:
    """One attack of ``fedaudit attack --method NAME``.

    Attributes:
        name: the ``--method`` name, and the last part of its result directories' names.
        family: :data:`MEMBERSHIP`, :data:`REFERENCE`, :data:`CANARY`, :data:`RECONSTRUCTION` or :data:`CLIENT`.
        summary: one line for help texts and docs.
        needs: what it needs from a run.
        writes: the result directories it writes under ``RUN_DIR/attacks/``.
        implementation: ``"module:function"``: a membership attack's takes ``(signal, score, member, attack_train,
            *, seed)`` (attacks/membership/methods.py), a reference attack's ``(compared, signal, target)``
            (attacks/membership/references.py), both returning a ``MethodOutput``; the canary audit's and the
            reconstruction's are the functions their families run (attacks/canary/audit.py,
            attacks/reconstruction/attack.py).
        default: run when no ``--method`` is given.
        final_only: attacks the final model only (its recipe is what the reference models repeat).
        output_signals_only: needs a signal of the model's output (the probability of the true label it compares).
        synthetic_signal: takes the distance to the synthetic records as a signal.
    """

    name: str
    family: str
    summary: str
    needs: str
    writes: str
    implementation: str
    default: bool = False
    final_only: bool = False
    output_signals_only: bool = False
    synthetic_signal: bool = True

    def load(self) -> Any:
        """The implementation, imported now."""
        return load(self.implementation)

    @property
    def per_signal(self) -> bool:
        """Whether it writes one result per ``--signal`` (and per attacked round)."""
        return self.family in (MEMBERSHIP, REFERENCE)


_RECORDS = "the run's records and membership, and the attacked models"
ATTACKS: dict[str, AttackEntry] = {
    entry.name: entry
    for entry in (
        AttackEntry(
            "threshold",
            MEMBERSHIP,
            "the signal itself as the score, at every threshold (the ROC); judged on every audited record",
            _RECORDS,
            "<signal>-threshold[-round-N]",
            "fedaudit.attacks.membership.methods:threshold_attack",
            default=True,
        ),
        AttackEntry(
            "classifier",
            MEMBERSHIP,
            "a small neural network fitted on the rank-standardised signal of the attack-training half",
            _RECORDS,
            "<signal>-classifier[-round-N]",
            "fedaudit.attacks.membership.methods:classifier_attack",
            default=True,
        ),
        AttackEntry(
            "population",
            MEMBERSHIP,
            "thresholds at quantiles of the attack-training non-members' signal, for fixed false-positive rates",
            _RECORDS,
            "<signal>-population[-round-N]",
            "fedaudit.attacks.membership.methods:population_attack",
        ),
        AttackEntry(
            "rmia",
            REFERENCE,
            "RMIA: the record's probability of its label on the target against the reference models and population",
            f"{_RECORDS}; reference models trained with the run's recipe on population records",
            "<signal>-rmia",
            "fedaudit.attacks.membership.references:rmia_attack",
            final_only=True,
            output_signals_only=True,
            synthetic_signal=False,
        ),
        AttackEntry(
            "lira",
            REFERENCE,
            "LiRA: the record's signal on the target against Gaussians fitted on the reference models' signals",
            f"{_RECORDS}; reference models trained with the run's recipe on population records",
            "<signal>-lira",
            "fedaudit.attacks.membership.references:lira_attack",
            final_only=True,
            synthetic_signal=False,
        ),
        AttackEntry(
            CANARY_METHOD,
            CANARY,
            "the run's canaries scored in every view the run allows, with epsilon estimates and lower bounds",
            "a run trained with --canaries (its canaries and, for the query views, its query log)",
            "<view>-canary",
            "fedaudit.attacks.canary.audit:canary_audit",
        ),
        AttackEntry(
            CLIENT_METHOD,
            CLIENT,
            "client-level membership: each client's mean loss on the final model against a held-out twin of its "
            "class mix; the unit is a client",
            "the run's clients and enough held-out records for their twins (--holdout-fraction)",
            CLIENT_RESULT,
            "fedaudit.attacks.membership.client_audit:client_membership",
            final_only=True,
        ),
        AttackEntry(
            RECONSTRUCTION_METHOD,
            RECONSTRUCTION,
            "rebuild a client's records from what it sent, with PSNR and SSIM against its real records",
            "a run trained with --save-transmitted (what crossed the wire)",
            "reconstruction-round-N-client-K",
            "fedaudit.attacks.reconstruction.attack:reconstruct",
        ),
    )
}
DEFAULT_METHODS: tuple[str, ...] = tuple(name for name, entry in ATTACKS.items() if entry.default)


def register_attack(entry: AttackEntry, *, replace: bool = False) -> None:
    """Add ``entry`` to :data:`ATTACKS` (a plug-in's attack, run when ``--method`` names it): a
    :class:`~fedaudit.registry.RegistryError` for an entry of no family the runner knows, one run by default (the
    default methods are fixed), or a name already taken (``replace=True`` replaces it)."""
    if not isinstance(entry, AttackEntry):
        raise RegistryError(f"An attack is registered as an AttackEntry, not {type(entry).__name__}.")
    check_entry(entry.name, entry.implementation, ATTACKS, replace, "attack")
    if entry.family not in FAMILIES:
        raise RegistryError(f"Attack {entry.name}'s family {entry.family!r} is none of {', '.join(FAMILIES)}.")
    if entry.default:
        raise RegistryError(f"Attack {entry.name} cannot run by default; it runs when --method names it.")
    ATTACKS[entry.name] = entry


def unregister_attack(name: str) -> None:
    """Remove a registered attack (a plug-in's, when it is done)."""
    ATTACKS.pop(name, None)


def attack(name: str) -> AttackEntry:
    """The entry of ``--method NAME`` (KeyError for an unknown name: the runner checks names first)."""
    return ATTACKS[name]


def of_family(family: str) -> tuple[str, ...]:
    """The names of ``family``'s attacks, in the registry's order."""
    return tuple(name for name, entry in ATTACKS.items() if entry.family == family)


def family_of(method: str) -> str | None:
    """The registry's family of ``method``, None for a name it does not know."""
    entry = ATTACKS.get(method)
    return None if entry is None else entry.family
