"""The audits of trained runs (``fedaudit attack`` and ``fedaudit verify``), one sub-package per family.

- ``registry``: every attack of ``--method``: its family, what it needs from a run, what it writes.
- ``options``: what ``fedaudit attack`` can be asked (AttackOptions, ReconstructionOptions), torch-free; the
  command line builds its options from these fields.
- ``runner``: ``fedaudit attack``: check the runs, run the registry's attacks family by family, write the results.
- ``metrics``: what every family reports: ROC and AUC with intervals, TPR at low FPR, epsilon lower bounds.
- ``membership/``: membership inference (evaluation sets, signals, methods, reference models, sites).
- ``canary/``: canary audits of fedaudit's runs and of Flower apps' canary logs.
- ``reconstruction/``: rebuilding a client's records from what it sent.
- ``conformance/``: ``fedaudit verify``: the mechanism checked against its ledger.
"""

import enum

from fedaudit.errors import UserError


class AttackError(UserError):
    """An attack that cannot be run as asked (one clear sentence for the user)."""


class Draw(enum.IntEnum):
    """Sub-streams of ``fedaudit.seeding.Stream.ATTACK``: every random choice of an audit has its own generator.

    Separate generators keep each choice independent of the others, so the same seed
    gives the same evaluation set whatever signals, methods or rounds are attacked.
    """

    MEMBERS = 0
    NONMEMBERS = 1
    HALVES = 2
    BOOTSTRAP = 3
    CLASSIFIER = 4
    CLIENT_BOOTSTRAP = 5
    CANARY_SPLIT = 6  # the halves of the canaries that choose and judge a threshold
    REFERENCES = 7  # the reference models' seeds and training records
    POPULATION = 8  # the population records RMIA compares with
    RECONSTRUCTION = 9  # the dummy records, their restarts and the nulls of a reconstruction audit
    CLIENT_MEMBERSHIP = 10  # which records of each client, their held-out twins and the halves of the clients
