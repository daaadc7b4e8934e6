"""The query log against a slow, obviously correct loop: one query and one canary at a time, the likelihood ratio
from scipy's normal densities, and the whole queries it keeps."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
import torch

from fedaudit.instruments.canaries import canary_directions
from fedaudit.instruments.queries import QueryAudit, Space, subsampled_gaussian_llr
from fedaudit.privacy.primitive import Query, dp_gradient

SHAPES = {"w": torch.Size([7, 5]), "b": torch.Size([7])}
DIMENSION = 42


def _audit(canaries: np.ndarray, keep: float = 0.0, planned: int = 150) -> QueryAudit:
    return QueryAudit(
        seed=3,
        canaries=canaries,
        held=canaries[::2],
        shapes=SHAPES,
        keep_pairs=keep,
        planned_queries=planned,
    )


def _queries(count: int, seed: int) -> list[tuple[Query, float, np.ndarray]]:
    """Random released sums with varying sigma, C and q, as the primitive would hand them over."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        sigma, clip = float(rng.choice([0.5, 1.0, 2.0])), float(rng.choice([0.1, 1.0, 3.0]))
        released = {
            name: torch.from_numpy(rng.normal(0, sigma * clip, tuple(shape))).float() for name, shape in SHAPES.items()
        }
        own = {name: torch.from_numpy(rng.normal(0, clip, tuple(shape))).float() for name, shape in SHAPES.items()}
        query = Query(
            released=released,
            own_sum=own,
            params={name: torch.zeros(shape) for name, shape in SHAPES.items()},
            x=torch.zeros(3, 2),
            y=torch.zeros(3, dtype=torch.long),
            batch_size=3,
            noise_multiplier=sigma,
            max_grad_norm=clip,
            expected_batch_size=4.0,
        )
        out.append((query, float(rng.uniform(0.01, 0.5)), rng.choice(10, size=2, replace=False)))
    return out


def test_the_logs_sums_and_likelihood_ratios_equal_a_slow_loop():
    ids = np.array([4, 11, 12, 30, 31], dtype=np.int64)
    log = _audit(ids).log(client=2, round_index=1, device=torch.device("cpu"))
    queries = _queries(150, seed=0)  # more than one buffer of 64 queries
    for query, rate, drawn in queries:
        log.batch(torch.arange(3), drawn, rate)
        log.record(query)
    arrays = log.arrays()
    directions = canary_directions(3, ids, SHAPES)
    slow_sum, slow_llr = np.zeros(len(ids)), np.zeros(len(ids))
    for query, rate, _ in queries:
        flat = np.concatenate(
            [(query.released[name] - query.own_sum[name]).double().numpy().ravel() for name in SHAPES]
        )
        sigma, clip = query.noise_multiplier, query.max_grad_norm
        for i in range(len(ids)):
            u = np.concatenate([directions[name][i].double().numpy().ravel() for name in SHAPES])
            o = float(flat @ u) / clip
            slow_sum[i] += o
            ratio = scipy.stats.norm.pdf(o, 1, sigma) / scipy.stats.norm.pdf(o, 0, sigma)
            slow_llr[i] += math.log((1 - rate) + rate * ratio)
    np.testing.assert_allclose(arrays["sum"].numpy(), slow_sum, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(arrays["llr"].numpy(), slow_llr, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(arrays["canary_ids"].numpy(), ids)
    assert arrays["rate"].tolist() == pytest.approx([rate for _, rate, _ in queries])
    assert arrays["noise_multiplier"].tolist() == [q.noise_multiplier for q, _, _ in queries]
    assert arrays["canaries"].tolist() == [2.0] * len(queries)


def test_the_likelihood_ratio_is_the_neyman_pearson_statistic_of_the_subsampled_gaussian():
    o = torch.tensor([[-3.0, 0.0, 0.5, 1.0, 4.0]], dtype=torch.float64)
    for rate, sigma in ((0.01, 1.0), (0.3, 0.5), (1.0, 2.0)):
        rates, sigmas = torch.tensor([rate], dtype=torch.float64), torch.tensor([sigma], dtype=torch.float64)
        ours = subsampled_gaussian_llr(o, rates, sigmas).numpy().ravel()
        x = o.numpy().ravel()
        mixture = (1 - rate) * scipy.stats.norm.pdf(x, 0, sigma) + rate * scipy.stats.norm.pdf(x, 1, sigma)
        np.testing.assert_allclose(ours, np.log(mixture / scipy.stats.norm.pdf(x, 0, sigma)), rtol=1e-9, atol=1e-12)


def test_whole_queries_are_kept_in_consecutive_pairs_as_released():
    ids = np.array([1, 2], dtype=np.int64)
    log = _audit(ids, keep=1.0, planned=20).log(client=0, round_index=0, device=torch.device("cpu"))
    queries = _queries(20, seed=1)
    for query, rate, drawn in queries:
        log.batch(torch.arange(3), drawn, rate)
        log.record(query)
    arrays = log.arrays()
    steps = [int(arrays[f"kept{j}/step"]) for j in range(2)]
    assert steps[1] == steps[0] + 1 and "kept2/step" not in arrays
    for j, step in enumerate(steps):
        query, _, drawn = queries[step]
        flat = torch.cat([query.released[name].reshape(-1) for name in SHAPES])
        assert torch.equal(arrays[f"kept{j}/released"], flat)
        assert arrays[f"kept{j}/canaries"].tolist() == drawn.tolist()
        assert arrays[f"kept{j}/index"].tolist() == [0, 1, 2]  # the positions of the records the batch drew
        assert arrays[f"kept{j}/cuda"].tolist() == [0]  # drawn on the CPU


def test_a_query_without_its_batch_is_refused():
    log = _audit(np.array([1], dtype=np.int64)).log(client=0, round_index=0, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="without its batch"):
        log.record(_queries(1, seed=2)[0][0])


def test_input_canaries_are_projected_on_their_normalised_gradient_at_each_querys_point():
    """The slow loop: for each query and canary, autograd of the canary's loss at the query's parameters, normalised,
    dotted with the released sum, divided by C."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 7)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    ids = np.array([2, 5, 9], dtype=np.int64)
    inputs, labels = torch.randn(3, 5), torch.tensor([1, 4, 6])
    audit = QueryAudit(
        seed=1, canaries=ids, held=ids[:1], shapes=shapes, keep_pairs=0.0, planned_queries=10,
        inputs=inputs, labels=labels,
    )  # fmt: skip
    log = audit.log(client=0, round_index=0, device=torch.device("cpu"))
    rng = np.random.default_rng(3)
    queries = []
    for _ in range(10):
        params = {name: torch.from_numpy(rng.normal(size=tuple(shape))).float() for name, shape in shapes.items()}
        released = {name: torch.from_numpy(rng.normal(size=tuple(shape))).float() for name, shape in shapes.items()}
        own = {name: torch.from_numpy(rng.normal(size=tuple(shape))).float() for name, shape in shapes.items()}
        query = Query(
            released=released, own_sum=own, params=params, x=torch.zeros(0, 5), y=torch.zeros(0, dtype=torch.long),
            batch_size=0,
            noise_multiplier=1.3, max_grad_norm=0.5, expected_batch_size=4.0, model=model,
        )  # fmt: skip
        log.batch(torch.arange(0), np.empty(0, dtype=np.int64), 0.1)
        log.record(query)
        queries.append(query)
    arrays = log.arrays()
    slow_sum, slow_llr = np.zeros(3), np.zeros(3)
    for query in queries:
        flat = np.concatenate(
            [(query.released[name] - query.own_sum[name]).double().numpy().ravel() for name in shapes]
        )
        for i in range(3):
            weight = query.params["weight"].clone().requires_grad_(True)
            bias = query.params["bias"].clone().requires_grad_(True)
            loss = torch.nn.functional.cross_entropy(inputs[i : i + 1] @ weight.T + bias, labels[i : i + 1])
            g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, [weight, bias])]).double().numpy()
            o = float(flat @ (g / np.linalg.norm(g))) / 0.5
            slow_sum[i] += o
            ratio = scipy.stats.norm.pdf(o, 1, 1.3) / scipy.stats.norm.pdf(o, 0, 1.3)
            slow_llr[i] += math.log(0.9 + 0.1 * ratio)
    np.testing.assert_allclose(arrays["sum"].numpy(), slow_sum, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(arrays["llr"].numpy(), slow_llr, rtol=1e-5, atol=1e-5)
    assert list(model.parameters())[0].grad is None  # the audit leaves the model as it found it


class _Tap:
    """A recorder that keeps what the primitive hands it."""

    def __init__(self, own: int) -> None:
        self.own, self.queries = own, []

    def own_rows(self) -> int:
        return self.own

    def record(self, query: Query) -> None:
        self.queries.append(query)


@pytest.mark.parametrize("kind", ["input", "gradient"])
def test_the_primitive_hands_over_the_clean_clipped_sum_of_the_clients_own_records_only(kind):
    """A slow loop: each own record's gradient by autograd, clipped, summed; the canaries (rows after the own ones,
    or gradients passed as extra) are left out, and the released sum is the own sum, the canaries' and the noise."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4))
    x, y = torch.randn(9, 6) * 3, torch.randint(0, 4, (9,))
    clip, own = 0.3, 6 if kind == "input" else 9
    extra = None
    if kind == "gradient":
        extra = {name: torch.randn(3, *p.shape) for name, p in model.named_parameters()}
    tap = _Tap(own)
    dp_gradient(
        model, x, y, noise_multiplier=0.0, max_grad_norm=clip, expected_batch_size=5.0,
        generator=torch.Generator().manual_seed(0), extra=extra, recorder=tap,
    )  # fmt: skip
    (query,) = tap.queries
    slow = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    everything = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for i in range(9):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
        for name, g in grads.items():
            everything[name] += g * min(1.0, clip / float(norm))
            if i < own:
                slow[name] += g * min(1.0, clip / float(norm))
    if extra is not None:
        for j in range(3):
            norm = torch.sqrt(sum(g[j].pow(2).sum() for g in extra.values()))
            for name, g in extra.items():
                everything[name] += g[j] * min(1.0, clip / float(norm))
    for name in slow:
        torch.testing.assert_close(query.own_sum[name], slow[name], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(query.released[name], everything[name], rtol=1e-4, atol=1e-6)
        assert not torch.allclose(query.own_sum[name], everything[name])


def test_queries_in_another_space_project_on_directions_there_and_metadata_only_queries_project_nothing():
    """Fedssyn's generation round: a class-count query (metadata only), then queries of another model, projected on
    the canaries' directions in a subset of that model's parameters; then back in the model's space. The slow loop
    projects each query on directions drawn for exactly the parameters of its space; whole queries are kept only in
    the model's space."""
    ids = np.array([3, 8, 21], dtype=np.int64)
    log = _audit(ids, keep=1.0, planned=10).log(client=4, round_index=0, device=torch.device("cpu"))
    chosen = set(log.kept_steps)
    other = {"enc.weight": torch.Size([4, 6]), "enc.bias": torch.Size([4]), "dec.weight": torch.Size([9, 4])}
    span = {name: other[name] for name in ("enc.weight", "enc.bias")}
    rng = np.random.default_rng(5)

    def query(shapes: dict[str, torch.Size], sigma: float, clip: float) -> Query:
        def draw() -> dict[str, torch.Tensor]:
            return {name: torch.from_numpy(rng.normal(size=tuple(shape))).float() for name, shape in shapes.items()}

        return Query(
            released=draw(), own_sum=draw(), params=draw(), x=torch.zeros(2, 3), y=torch.zeros(2, dtype=torch.long),
            batch_size=2, noise_multiplier=sigma, max_grad_norm=clip, expected_batch_size=2.0,
        )  # fmt: skip

    plan = [(None, 1.0, 1.0, 1.0)] + [(span, 0.7, 2.0, 0.3)] * 5 + [(SHAPES, 1.1, 0.5, 0.2)] * 4
    recorded = []
    for space, sigma, clip, rate in plan:
        log.enter(None if space is None else Space(span) if space is span else _audit(ids).space)
        q = query(other if space in (None, span) else SHAPES, sigma, clip)
        log.batch(torch.tensor([5, 7]), ids[:1], rate)
        log.record(q)
        recorded.append((space, q, rate))
    arrays = log.arrays()
    assert arrays["projected"].tolist() == [0.0] + [1.0] * 9
    slow_sum, slow_llr = np.zeros(len(ids)), np.zeros(len(ids))
    for space, q, rate in recorded:
        if space is None:
            continue
        directions = canary_directions(3, ids, space)
        flat = np.concatenate([(q.released[n] - q.own_sum[n]).double().numpy().ravel() for n in space])
        for i in range(len(ids)):
            u = np.concatenate([directions[n][i].double().numpy().ravel() for n in space])
            o = float(flat @ u) / q.max_grad_norm
            slow_sum[i] += o
            sigma = q.noise_multiplier
            ratio = scipy.stats.norm.pdf(o, 1, sigma) / scipy.stats.norm.pdf(o, 0, sigma)
            slow_llr[i] += math.log((1 - rate) + rate * ratio)
    np.testing.assert_allclose(arrays["sum"].numpy(), slow_sum, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(arrays["llr"].numpy(), slow_llr, rtol=1e-5, atol=1e-4)
    kept = sorted(int(arrays[name]) for name in arrays if name.endswith("/step"))
    assert kept == sorted(step for step in chosen if step >= 6)  # never a query of the other model
    assert chosen == {5, 6}  # this seed chose a pair that starts among the other model's queries


def test_a_canary_gradient_in_some_parameters_only_is_zero_in_the_others():
    """Gradient canaries of a generator span a few of its parameters: the primitive clips and adds them there and
    leaves the other parameters' sums as the records made them."""
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4))
    x, y = torch.randn(5, 6), torch.randint(0, 4, (5,))
    extra = {"2.weight": torch.randn(2, 4, 5) * 10, "2.bias": torch.randn(2, 4) * 10}
    common = dict(noise_multiplier=0.0, max_grad_norm=0.7, expected_batch_size=1.0)
    with_extra = dp_gradient(model, x, y, **common, generator=torch.Generator().manual_seed(0), extra=extra)
    without = dp_gradient(model, x, y, **common, generator=torch.Generator().manual_seed(0))
    for name in ("0.weight", "0.bias"):
        torch.testing.assert_close(with_extra.grads[name], without.grads[name])
    for j in range(2):
        norm = float(torch.sqrt(extra["2.weight"][j].pow(2).sum() + extra["2.bias"][j].pow(2).sum()))
        assert with_extra.per_sample_norms[5 + j].item() == pytest.approx(norm, rel=1e-5)
    for name in extra:
        added = sum(extra[name][j] * min(1.0, 0.7 / float(with_extra.per_sample_norms[5 + j])) for j in range(2))
        torch.testing.assert_close(with_extra.grads[name] - without.grads[name], added, rtol=1e-4, atol=1e-6)


def test_a_round_keeps_as_many_pairs_of_whole_queries_as_asked_on_average():
    """--kept-queries above a pair per client round: whole pairs plus one more with the remainder's probability."""
    ids = np.arange(4, dtype=np.int64)
    for pairs in (0.3, 1.0, 2.5):
        audit = _audit(ids, keep=pairs, planned=400)
        kept = [len(audit.log(0, r, torch.device("cpu")).kept_steps) for r in range(400)]
        assert np.mean(kept) == pytest.approx(2 * pairs, rel=0.12), pairs
        assert all(count % 2 == 0 or count > 2 for count in kept)  # pairs of consecutive queries


def test_the_direction_cache_hands_out_what_is_drawn_and_keeps_within_its_bound() -> None:
    """Every client of a run projects on the same directions each round: the cache gives the rows canary_rows draws,
    for any ids, seed and layout it is asked (never another key's), evicts the least recently used past its bound, and
    never keeps a chunk larger than the bound."""
    from fedaudit.instruments.canaries import canary_rows
    from fedaudit.instruments.queries import _DirectionCache

    row_bytes = DIMENSION * 4
    cache = _DirectionCache(max_bytes=10 * row_bytes)
    asks = [(3, np.arange(4)), (3, np.arange(1, 5)), (4, np.arange(4)), (3, np.arange(4)), (3, np.arange(4, 10))]
    for seed, ids in asks * 2:
        for layout in ("model", "parts"):
            assert torch.equal(cache.rows(seed, ids, SHAPES, layout), canary_rows(seed, ids, SHAPES, layout))
            held = sum(r.numel() * r.element_size() for r in cache._rows.values())
            assert held <= cache.max_bytes
    first = cache.rows(5, np.arange(2), SHAPES, "model")
    assert cache.rows(5, np.arange(2), SHAPES, "model") is first  # drawn once while it fits
    assert cache.rows(5, np.arange(11), SHAPES, "model") is not cache.rows(5, np.arange(11), SHAPES, "model")
    assert all(len(rows) <= 10 for rows in cache._rows.values())
