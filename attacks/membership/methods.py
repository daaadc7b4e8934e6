"""Membership attack methods (the registry's membership family): turn a per-record signal into membership scores, and
say which records they are judged on. Each takes ``(signal, score, member, attack_train, *, seed)``.

- ``threshold``: the oriented signal itself, every threshold (the ROC); judged on all records.
- ``classifier``: the paper's trained attack, a small neural network fitted on the
  standardised signal of the attack-training half; judged on the audit half. The
  signal is standardised by its ranks (mapped to N(0, 1) quantiles) rather than by a
  z-score: losses of well-fitted records span orders of magnitude below 1e-2, which a
  z-score squashes into one point, and rank standardisation makes the classifier see
  the loss, the confidence and the logit-scaled confidence alike.
- ``population``: Privacy Meter's population attack, thresholds at quantiles of the
  attack-training non-members' signal chosen for fixed false-positive tolerances;
  judged on the audit half.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedaudit.attacks.metrics import rates_at_fpr
from fedaudit.attacks.registry import ATTACKS, MEMBERSHIP, of_family

FPR_TOLERANCES: tuple[float, ...] = (0.001, 0.01, 0.05, 0.1, 0.2, 0.5)
CLASSIFIER_HIDDEN: tuple[int, ...] = (32, 32)
CLASSIFIER_MAX_ITER = 500


@dataclass(frozen=True)
class MethodOutput:
    """Scores of every record (higher: more likely a member), the records to report on, and extra results."""

    scores: np.ndarray
    audit: np.ndarray
    details: dict[str, Any] = field(default_factory=dict)


def run_method(
    method: str, signal: np.ndarray, score: np.ndarray, member: np.ndarray, attack_train: np.ndarray, *, seed: int
) -> MethodOutput:
    """Apply the membership attack ``method`` (its entry in attacks/registry.py) to one signal.

    Args:
        signal: the raw signal of every record (the classifier's input).
        score: the signal oriented so that higher means member (see ``fedaudit.attacks.membership.signals.oriented``).
        member: 1 for members, 0 for non-members.
        attack_train: the records an attack may fit on (classifier, population).
        seed: seeds the classifier.
    """
    entry = ATTACKS.get(method)
    if entry is None or entry.family != MEMBERSHIP:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(of_family(MEMBERSHIP))}")
    return entry.load()(signal, score, member, attack_train, seed=seed)


def threshold_attack(
    signal: np.ndarray, score: np.ndarray, member: np.ndarray, attack_train: np.ndarray, *, seed: int
) -> MethodOutput:
    """The oriented signal itself as the score: every threshold of it is the ROC, judged on every record."""
    return MethodOutput(scores=score, audit=np.ones(score.size, dtype=bool))


def classifier_attack(
    signal: np.ndarray, score: np.ndarray, member: np.ndarray, attack_train: np.ndarray, *, seed: int
) -> MethodOutput:
    """Fit an MLP on the rank-standardised signal of the attack-training half; score every record with P(member).
    scikit-learn is imported here, by the one method that needs it (2-3 s of start-up the others do not pay)."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import QuantileTransformer

    features = signal.reshape(-1, 1)
    random_state = seed % 2**32
    model = make_pipeline(
        QuantileTransformer(
            n_quantiles=min(1000, int(attack_train.sum())), output_distribution="normal", random_state=random_state
        ),
        MLPClassifier(hidden_layer_sizes=CLASSIFIER_HIDDEN, max_iter=CLASSIFIER_MAX_ITER, random_state=random_state),
    )
    with warnings.catch_warnings():
        # A network stopped at max_iter is still a valid attack; whether it converged goes into metrics.json.
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(features[attack_train], member[attack_train])
    mlp = model[-1]
    return MethodOutput(
        scores=model.predict_proba(features)[:, list(mlp.classes_).index(1)],
        audit=~attack_train,
        details={
            "classifier": {
                "model": "MLPClassifier on the signal's normal scores (QuantileTransformer)",
                "hidden_layer_sizes": list(CLASSIFIER_HIDDEN),
                "iterations": int(mlp.n_iter_),
                "converged": bool(mlp.n_iter_ < CLASSIFIER_MAX_ITER),
                "training_records": int(attack_train.sum()),
            }
        },
    )


def population_attack(
    signal: np.ndarray,
    score: np.ndarray,
    member: np.ndarray,
    attack_train: np.ndarray,
    *,
    seed: int = 0,
    tolerances: Sequence[float] = FPR_TOLERANCES,
) -> MethodOutput:
    """Thresholds at the (1 - alpha) quantiles of the attack-training non-members' scores, evaluated on the audit half.

    A record is called a member when its score is strictly above the threshold; the
    "higher" quantile makes at most a fraction alpha of the reference non-members do so
    (:func:`attacks.metrics.rates_at_fpr`, which also gives each rate its interval and n).
    """
    rows = [{"fpr_tolerance": alpha, **rates_at_fpr(member, score, attack_train, alpha)} for alpha in tolerances]
    reference = int((attack_train & (member == 0)).sum())
    return MethodOutput(
        scores=score, audit=~attack_train, details={"population": rows, "reference_nonmembers": reference}
    )
