"""Membership inference: was this record in a client's training data?

- ``evaluation``: the audited members and non-members, drawn from the run's membership.npz.
- ``signals``: per-record signals of the attacked models (loss, confidence, logit-scaled confidence, gradient norm,
  distance to the synthetic records).
- ``methods``: the registry's membership attacks (threshold, classifier, population), signal to score.
- ``references`` and ``reference_attacks``: RMIA and LiRA, with reference models trained like the run.
- ``sites``: the same audit where the sites keep their records (computed where the data is).
"""
