"""Per-example membership signals as the audit reads them: loss, confidence, logit-scaled confidence (black-box) and
gradient norm (white-box), computed by :mod:`fedaudit.instruments.record_signals` (here, or at the sites of a
federation whose sites keep their records, where the computation is described), oriented so that higher means member.
``synthetic-distance`` does not look at a model: it is the distance from a record to the nearest synthetic image
that crossed the wire (FedLAP's and FedGM's sets, kept with ``--save-transmitted``), the server's view of
algorithms that share synthetic data. A synthetic image distilled from few records sits close to them.
"""

from __future__ import annotations

import numpy as np
import torch

from fedaudit.attacks.options import DEFAULT_SIGNALS, SYNTHETIC_SIGNAL
from fedaudit.instruments.record_signals import (
    MODEL_SIGNALS,
    OUTPUT_SIGNALS,
    PER_LAYER_PREFIX,
    Signals,
    compute_signals,
    float64_values,
    layer_groups,
    output_signals,
)

__all__ = [
    "DEFAULT_SIGNALS",
    "MEMBERS_HIGHER",
    "OUTPUT_SIGNALS",
    "PER_LAYER_PREFIX",
    "SIGNALS",
    "SYNTHETIC_SIGNAL",
    "Signals",
    "compute_signals",
    "layer_groups",
    "nearest_distance",
    "oriented",
    "output_signals",
]

SIGNALS: tuple[str, ...] = (*MODEL_SIGNALS, SYNTHETIC_SIGNAL)

# Whether members tend to have *higher* values of the signal than non-members
# (a model fits its training records: lower loss and gradient norm, higher confidence).
MEMBERS_HIGHER: dict[str, bool] = {
    "loss": False,
    "confidence": True,
    "logit-confidence": True,
    "grad-norm": False,
    "synthetic-distance": False,
}


def oriented(signal: str, values: np.ndarray) -> np.ndarray:
    """The signal as a membership score (higher means more likely a member): -signal for loss and gradient norm."""
    return values if MEMBERS_HIGHER[signal] else -values


def nearest_distance(x: torch.Tensor, synthetic: torch.Tensor, *, batch_size: int = 1024) -> np.ndarray:
    """For each record of ``x``, the Euclidean distance (over all pixels, as the model sees them) to the nearest
    image of ``synthetic``, in float64."""
    flat = synthetic.reshape(len(synthetic), -1).to(torch.float64)
    chunks = []
    for start in range(0, len(x), batch_size):
        rows = x[start : start + batch_size].reshape(-1, flat.shape[1]).to(torch.float64)
        chunks.append(torch.cdist(rows, flat, compute_mode="donot_use_mm_for_euclid_dist").min(dim=1).values)
    return float64_values(chunks)
