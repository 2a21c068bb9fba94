"""The actor's snapshot ring: a snapshot is one flat buffer per dtype that later training does not
change, a slot says which version it holds, and a read is whole unless the slot may have been
written again (the ring rule). Runs on the CPU; the GPU paths are in test_ipc and
test_nccl."""

from __future__ import annotations

import pytest
import torch

from mortal.workers.sync import ring as weight_ring
from mortal.workers.sync.weights import copy_into


def test_a_snapshot_is_one_flat_buffer_per_dtype_and_its_slots_give_back_every_tensor() -> None:
    state = {
        "a": torch.arange(6.0).view(2, 3),
        "b": torch.ones(4, dtype=torch.bfloat16),
        "c": torch.full((2,), 7.0),
    }
    buffers, slots = weight_ring.snapshot(state)
    assert sorted(buffers) == ["bfloat16", "float32"] and buffers["float32"].numel() == 8
    assert weight_ring.sizes_of(slots) == {d: b.numel() for d, b in buffers.items()}
    for name, view in weight_ring.views(buffers, slots).items():
        assert torch.equal(view, state[name])
    state["a"].add_(1)  # the source changes after the snapshot: the snapshot does not
    assert buffers["float32"][0] == 0


def test_a_ring_that_casts_keeps_floating_weights_in_that_dtype_and_integer_buffers_in_theirs() -> None:
    """A sharded actor under mixedPrecision: float32 masters published in bfloat16, gathered already cast."""
    state = {"w": torch.randn(2, 3), "steps": torch.arange(4), "b": torch.ones(2, dtype=torch.float16)}
    sizes, slots = weight_ring.layout(state, cast=torch.bfloat16)
    assert sizes == {"bfloat16": 8, "int64": 4} and [s.dtype for s in slots] == [
        "bfloat16",
        "int64",
        "bfloat16",
    ]
    ring = weight_ring.SnapshotRing(ring=2)
    cast = [state["w"].bfloat16(), state["steps"], state["b"].bfloat16()]
    buffers = ring.write(state, 0, gather=lambda shards: iter(cast), cast=torch.bfloat16)
    held = weight_ring.views(buffers, ring.slots)
    assert held["w"].dtype == torch.bfloat16 and torch.equal(held["w"], cast[0])
    assert torch.equal(held["steps"], state["steps"]) and torch.equal(held["b"], cast[2])


def test_copy_into_writes_the_models_own_tensors_in_place() -> None:
    model = torch.nn.Linear(3, 2)
    weight = model.weight
    copy_into(model, {"weight": torch.ones(2, 3), "bias": torch.zeros(2)})
    assert model.weight is weight and torch.equal(model.weight, torch.ones(2, 3))


@pytest.mark.parametrize(("newest", "whole"), [(5, True), (6, True), (7, False), (9, False)])
def test_a_read_is_whole_unless_the_slot_may_have_been_written_again(newest: int, whole: bool) -> None:
    """Version 5 in a ring of 3 shares its slot with 8, written only after 7 is recorded."""
    assert weight_ring.intact(5, 3, newest_recorded=newest) is whole


def test_a_slot_holds_its_version_until_the_version_ring_later_replaces_it() -> None:
    ring = weight_ring.SnapshotRing(ring=2)
    for version in range(3):
        ring.write({"w": torch.full((2,), float(version))}, version)
    assert ring.holding(0) is None  # slot 0 now holds version 2
    assert torch.equal(ring.holding(1)["float32"], torch.full((2,), 1.0))
    assert torch.equal(ring.holding(2)["float32"], torch.full((2,), 2.0))
    assert ring.holding(3) is None  # not written yet
    first = ring.buffers
    ring.write({"w": torch.zeros(2)}, 3)
    assert ring.buffers is first  # allocated once: readers keep their mappings


def test_a_slots_stamp_is_minus_one_while_it_is_written_and_its_version_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stamps are what a reader in another process checks after its copy (ipc_weights.slot_holds)."""
    ring = weight_ring.SnapshotRing(ring=2)
    seen_while_filling = []
    fill = weight_ring.fill_views

    def watched(destinations, sources):
        seen_while_filling.append(ring.stamps.tolist())
        fill(destinations, sources)

    monkeypatch.setattr(weight_ring, "fill_views", watched)
    for version in range(3):
        ring.write({"w": torch.full((2,), float(version))}, version)
    assert seen_while_filling == [[-1, -1], [0, -1], [-1, 1]]
    assert ring.stamps.tolist() == [2, 1]


def test_views_are_made_once_per_buffers_and_layout_and_again_for_another_layout() -> None:
    buffers, slots = weight_ring.snapshot({"a": torch.arange(6.0), "b": torch.ones(2)})
    cache = weight_ring.ViewCache()
    first = cache.get(buffers, slots)
    assert cache.get(buffers, list(slots)) is first  # an equal layout (a fresh manifest's) reuses them
    buffers["float32"].add_(1)
    assert torch.equal(first["a"], torch.arange(6.0) + 1)  # views: they see the buffer's new contents
    other = [
        weight_ring.TensorSlot("a", "float32", 0, (2, 3)),
        weight_ring.TensorSlot("b", "float32", 6, (2,)),
    ]
    assert cache.get(buffers, other)["a"].shape == (2, 3)


def test_a_manifest_is_parsed_once_and_again_when_its_file_was_replaced(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pickle

    file = tmp_path / "ipc.pkl"
    file.write_bytes(pickle.dumps({"version": 1}))
    loads, parse = [], pickle.loads
    monkeypatch.setattr(weight_ring.pickle, "loads", lambda data: loads.append(data) or parse(data))
    assert weight_ring.read_manifest(file) == {"version": 1}
    assert weight_ring.read_manifest(file) == {"version": 1} and len(loads) == 1
    replacement = tmp_path / "new.pkl"  # a writer's retry renames a new file into place
    replacement.write_bytes(pickle.dumps({"version": 2}))
    replacement.rename(file)
    assert weight_ring.read_manifest(file) == {"version": 2} and len(loads) == 2
