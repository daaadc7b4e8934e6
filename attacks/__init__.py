"""Membership inference attacks on trained runs (signals, attacks, metrics)."""

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
