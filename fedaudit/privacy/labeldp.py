"""Label differential privacy: randomized response on labels, optionally steered by a prior (Ghazi et al., 2021).

These mechanisms protect a record's *label* against the substitution of that label (two datasets are neighbours
when one example's label differs), with pure epsilon-DP (delta = 0). They say nothing about the record's features:
FedGM sends its synthetic images in clear and randomizes only their labels. This is a different guarantee from the
record-level (epsilon, delta)-DP of DP-SGD, and the two epsilons are not comparable (docs/accounting.md).

- **RR** over K classes: keep the label with probability e^eps / (e^eps + K - 1), else report each other label
  with probability 1 / (e^eps + K - 1).
- **RRTop-k** with a prior p over the classes: Y_k is the k most likely classes under p (ties to the smaller class
  index). A label in Y_k is kept with probability e^eps / (e^eps + k - 1), else one of the other k - 1 members
  of Y_k is reported uniformly; a label outside Y_k is replaced by a uniform member of Y_k. It is eps-DP for every
  k, because Y_k depends on the prior and never on the label.
- **RRWithPrior**: RRTop-k with the k that maximises the chance of reporting the true label when it is drawn from
  p, w_k = e^eps / (e^eps + k - 1) * p(Y_k). With a uniform prior it is RR (k = K).

A label released once by any of these is eps-label-DP. FedGM releases each synthetic label exactly once, in one of
T stages, with a prior computed from earlier stages' already-randomized labels: the whole release is eps-label-DP,
not T eps (parallel composition over disjoint examples, adaptively; Ghazi et al., Theorem 4).
"""

from __future__ import annotations

import math

import torch

from fedaudit.privacy.randomness import Source, uniform


def keep_probability(epsilon: float, k: int) -> float:
    """P(report the true label) of randomized response over k labels: e^eps / (e^eps + k - 1)."""
    if k < 1:
        raise ValueError(f"randomized response needs at least one label, got k={k}")
    if epsilon == math.inf:
        return 1.0
    return 1.0 / (1.0 + (k - 1) * math.exp(-epsilon))


def top_classes(prior: torch.Tensor) -> torch.Tensor:
    """The classes of each row of ``prior`` [n, K] from most to least likely (ties to the smaller class index)."""
    return torch.sort(prior, dim=1, descending=True, stable=True).indices


def best_k(prior: torch.Tensor, epsilon: float) -> torch.Tensor:
    """RRWithPrior's k* for each row of ``prior`` [n, K]: argmax_k e^eps / (e^eps + k - 1) * p(Y_k) (smallest k on a
    tie)."""
    classes = prior.shape[1]
    mass = torch.sort(prior.to(torch.float64), dim=1, descending=True, stable=True).values.cumsum(dim=1)
    keep = torch.tensor([keep_probability(epsilon, k) for k in range(1, classes + 1)], dtype=torch.float64)
    return (mass * keep.to(mass.device)).argmax(dim=1) + 1


def rr_top_k(
    labels: torch.Tensor, prior: torch.Tensor, k: torch.Tensor | int, epsilon: float, generator: Source
) -> torch.Tensor:
    """RRTop-k of each label with its own prior row and k (an int applies to every row); returns the reported labels.

    Two uniform draws per label from ``generator`` whatever the outcome, so the stream does not depend on labels.
    """
    n, classes = prior.shape
    device = labels.device
    k = torch.full((n,), int(k), device=device) if isinstance(k, int) else k.to(device)
    if n and (int(k.min()) < 1 or int(k.max()) > classes):
        raise ValueError(f"k must lie in 1..{classes}")
    order = top_classes(prior).to(device)
    rank = order.argsort(dim=1).gather(1, labels.long()[:, None])[:, 0]  # where the true label stands in the order
    inside = rank < k
    keep = torch.tensor([keep_probability(epsilon, j) for j in range(1, classes + 1)], dtype=torch.float64)
    keep = keep.to(device)[k - 1]
    u = uniform(generator, n, dtype=torch.float64).to(device)
    v = uniform(generator, n, dtype=torch.float64).to(device)
    # inside Y_k and not kept: a uniform member of Y_k other than the label (positions 0..k-2, skipping its rank)
    other = torch.clamp((v * (k - 1)).long(), max=(k - 2).clamp_min(0))
    other = other + (other >= rank).long()
    # outside Y_k: a uniform member of Y_k
    anywhere = torch.clamp((v * k).long(), max=k - 1)
    position = torch.where(inside, torch.where(u < keep, rank, other), anywhere)
    return order.gather(1, position[:, None])[:, 0].to(labels.dtype)


def randomized_response(labels: torch.Tensor, num_classes: int, epsilon: float, generator: Source) -> torch.Tensor:
    """RR over ``num_classes`` labels (RRTop-k with a uniform prior and k = K)."""
    prior = torch.full((labels.shape[0], num_classes), 1.0 / num_classes, device=labels.device)
    return rr_top_k(labels, prior, num_classes, epsilon, generator)


def rr_with_prior(labels: torch.Tensor, prior: torch.Tensor, epsilon: float, generator: Source) -> torch.Tensor:
    """RRWithPrior: RRTop-k* of each label with k* from its own prior row (:func:`best_k`)."""
    return rr_top_k(labels, prior, best_k(prior, epsilon), epsilon, generator)


def output_distribution(label: int, prior: torch.Tensor, k: int, epsilon: float) -> torch.Tensor:
    """The exact distribution [K] of RRTop-k's report for one true ``label`` and one prior row (float64)."""
    classes = prior.shape[0]
    members = top_classes(prior[None])[0, :k]
    result = torch.zeros(classes, dtype=torch.float64)
    if label in members.tolist():
        keep = keep_probability(epsilon, k)
        result[members] = (1.0 - keep) / (k - 1) if k > 1 else 0.0
        result[label] = keep
    else:
        result[members] = 1.0 / k
    return result
