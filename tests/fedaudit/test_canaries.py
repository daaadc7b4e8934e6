"""Where gradient canaries lie: the parts of a model, each canary's part, and directions restricted to it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedaudit.instruments.canaries import (
    CANARIES_PER_PART,
    Canaries,
    canary_directions,
    canary_groups,
    group_of,
    layout_for,
)
from fedaudit.seeding import Stream, make_generator

SHAPES = {
    "features.0.weight": torch.Size([4, 1, 3, 3]),
    "features.0.bias": torch.Size([4]),
    "features.1.weight": torch.Size([4]),
    "features.1.bias": torch.Size([4]),
    "classifier.weight": torch.Size([3, 16]),
    "classifier.bias": torch.Size([3]),
}


def test_the_parts_of_a_model():
    names = [g.name for g in canary_groups(list(SHAPES))]
    assert names[0] == "model"
    assert names[1:7] == [f"tensor {name}" for name in SHAPES]
    assert names[7:] == ["layer features.0", "layer features.1", "layer classifier", "kind weight", "kind bias"]
    kinds = {g.name: g.members for g in canary_groups(list(SHAPES))}
    assert kinds["kind bias"] == ("features.0.bias", "features.1.bias", "classifier.bias")
    assert [g.name for g in canary_groups(["w"])] == ["model", "tensor w"]  # no layer, no kind shared by two


def test_every_other_canary_spans_the_model_and_the_rest_go_round_the_parts():
    groups = canary_groups(list(SHAPES))
    assert [group_of(i, groups).name for i in range(0, 40, 2)] == ["model"] * 20
    odd = [group_of(i, groups).name for i in range(1, 2 * (len(groups) - 1), 2)]
    assert odd == [g.name for g in groups[1:]]


@pytest.mark.parametrize("layout", ["model", "parts"])
def test_directions_are_unit_vectors_inside_their_part(layout):
    ids = np.arange(60)
    directions = canary_directions(7, ids, SHAPES, layout=layout)
    flat = torch.cat([directions[name].reshape(len(ids), -1) for name in SHAPES], dim=1)
    torch.testing.assert_close(flat.norm(dim=1), torch.ones(len(ids)))
    groups = canary_groups(list(SHAPES))
    for row, i in enumerate(ids):
        members = group_of(int(i), groups).members if layout == "parts" else tuple(SHAPES)
        for name in SHAPES:
            nonzero = bool(directions[name][row].abs().sum() > 0)
            assert nonzero == (name in members), (i, name)
        drawn = torch.randn(flat.shape[1], generator=make_generator(7, Stream.CANARY, int(i)))
        mask = torch.cat([torch.full((int(s.numel()),), n in members) for n, s in SHAPES.items()])
        torch.testing.assert_close(flat[row], drawn * mask / (drawn * mask).norm())


def test_the_layout_is_kept_with_the_canaries_and_older_runs_read_as_the_whole_model():
    drawn = Canaries.draw(count=10, kind="gradient", seed=1, num_clients=2, layout="parts")
    assert drawn.layout == "parts"
    assert Canaries.from_arrays(drawn.to_arrays()).layout == "parts"
    older = {k: v for k, v in drawn.to_arrays().items() if k != "layout"}
    assert Canaries.from_arrays(older).layout == "model"
    with pytest.raises(ValueError, match="layout"):
        canary_directions(1, np.arange(2), SHAPES, layout="tensors")


def test_canaries_are_laid_out_in_parts_only_where_every_part_gets_enough():
    parts = len(canary_groups(list(SHAPES))) - 1  # 11 besides the whole model
    enough = 2 * CANARIES_PER_PART * parts
    assert layout_for(enough, list(SHAPES)) == "parts"
    assert layout_for(enough - 2, list(SHAPES)) == "model"
    assert layout_for(10**6, ["w"]) == "parts" and layout_for(10**6, []) == "model"
