"""Canary audits: epsilon estimated and bounded from below by canaries, each included with probability 1/2.

- ``estimators``: the one-run estimators (the Gaussian estimate, the bound from abstaining guesses, the split audit).
- ``audit``: ``fedaudit attack --method canary``, the run's canaries scored in every view its records allow.
- ``flower_log``: ``fedaudit attack --flower-log``, the audit of a Flower app's canary log.
"""
