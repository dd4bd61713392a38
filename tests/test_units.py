"""The shard arithmetic of zero/units.py, tested directly."""

from __future__ import annotations

import pytest
from torch import nn

from meshzero.zero.units import build_layout, choose_units, padded_shard_numel
from tests.models import MLPStack, TrickyModel


@pytest.mark.parametrize("numel, shards, want", [
    (0, 4, 0), (1, 1, 4), (4, 1, 4), (5, 1, 8), (213, 2, 108), (840, 4, 212), (840, 3, 280),
])
def test_padded_shard_numel(numel, shards, want):
    assert padded_shard_numel(numel, shards) == want
    assert want * shards >= numel and want % 4 == 0


def test_default_units_are_the_repeated_blocks_and_the_root():
    assert choose_units(MLPStack()) == ["", "blocks.0", "blocks.1", "blocks.2"]


def test_unit_classes_override_and_unknown_class_fails():
    assert choose_units(MLPStack(), ["Linear"]) == [
        "", "input", "blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2",
        "blocks.2.fc1", "blocks.2.fc2", "head"]
    with pytest.raises(ValueError, match="zero_optimization.unit_classes"):
        choose_units(MLPStack(), ["Conv2d"])


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 7])
def test_fragments_partition_every_group_exactly(shards):
    layout = build_layout(TrickyModel(), num_shards=shards, persistence_threshold=50)
    for group in layout.groups():
        seen = {slot.name: 0 for slot in group.slots}
        for rank in range(shards):
            lo, hi = group.shard_range(rank)
            for frag in group.fragments(lo, hi):
                assert 0 <= frag.local_offset < hi - lo
                assert frag.slot.offset + frag.start == lo + frag.local_offset
                seen[frag.slot.name] += frag.numel
        assert seen == {slot.name: slot.numel for slot in group.slots}
        assert group.padded_numel == group.shard_numel * shards >= group.numel


def test_tied_frozen_and_persistent_params_are_grouped():
    model = TrickyModel()
    layout = build_layout(model, num_shards=2, persistence_threshold=20)
    # the tied embedding/head weight is one slot, owned by the root (lowest common unit)
    assert "head.weight" not in layout.slots
    assert layout.slots["embed.weight"].unit == 0
    frozen = layout.slots["frozen.weight"]
    group = layout.units[frozen.unit].groups[frozen.group]
    assert not group.requires_grad
    bias = layout.slots["blocks.1.fc1.bias"]  # 17 elements <= 20: persistent
    assert layout.units[bias.unit].groups[bias.group].persistent
    assert layout.numel == sum(p.numel() for p in model.parameters())


def test_nested_units_claim_their_own_params():
    model = nn.Sequential(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)),
                          nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)))
    layout = build_layout(model, num_shards=2, unit_classes=["Sequential", "Linear"])
    assert [u.path for u in layout.units] == ["", "0", "0.0", "0.1", "1", "1.0", "1.1"]
    assert layout.units[0].numel == 0 and layout.units[1].numel == 0
    assert layout.slots["0.1.weight"].unit == 3


def test_default_units_stop_at_the_outermost_repeated_block():
    block = lambda: nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))  # noqa: E731
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(block(), block()), nn.Linear(4, 4))
    # the two outer Linears repeat at the top level; the blocks repeat inside model[1]
    assert choose_units(model) == ["", "0", "1.0", "1.1", "2"]
