"""mortal.workers.sync.weights: published weight versions are atomic, plain (LoRA merged),
loadable, pruned."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from actor_helpers import create_run, tensors_sha256, worker_context
from rollout_helpers import assets_available, make_tiny_model, training_spec

from mortal.state import paths
from mortal.state.errors import Fenced
from mortal.workers.sync import volume
from mortal.workers.sync.base import WeightsError
from mortal.workers.sync.ipc import IpcTransport
from mortal.workers.sync.publisher import WeightPublisher
from mortal.workers.sync.volume import load_published
from mortal.workers.sync.weights import plain_state_dict

pytestmark = pytest.mark.skipif(not assets_available(), reason="SmolLM2 assets missing")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _model(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)


def _publisher(store, tiny_dir: Path) -> WeightPublisher:
    run = create_run(store, "w", training_spec(str(tiny_dir)))
    ctx = worker_context(store, run, "actor")
    return WeightPublisher(ctx.store, ctx.worker)


def test_a_version_round_trips_bit_for_bit_with_ties_written_once(store, tiny_dir: Path) -> None:
    publisher = _publisher(store, tiny_dir)
    model = _model(tiny_dir)
    _perturb(model, 1)
    version = publisher.publish(model, step=3)
    row = store.latest_weights("w")
    assert (version, row.version, row.step) == (0, 0, 3)
    folder = Path(row.path)
    assert folder == paths.weights_dir("w") / "v0-i1" and (folder / "config.json").is_file()
    written = volume.read_published(folder)
    assert "lm_head.weight" not in written  # tied to the embeddings
    fresh = _model(tiny_dir)
    load_published(fresh, folder)
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()
    assert tensors_sha256(fresh.state_dict()) == tensors_sha256(model.state_dict())


def test_versions_only_grow_and_the_newest_three_stay(store, tiny_dir: Path) -> None:
    publisher = _publisher(store, tiny_dir)
    model = _model(tiny_dir)
    assert [publisher.publish(model, step=s) for s in range(5)] == [0, 1, 2, 3, 4]
    assert [r.version for r in store.list_weights("w")] == [2, 3, 4]
    assert sorted(p.name for p in paths.weights_dir("w").iterdir()) == ["v2-i1", "v3-i1", "v4-i1"]


def test_a_fenced_actor_still_writing_cannot_replace_its_successors_version(store, tiny_dir: Path) -> None:
    """Publishing checks no fence before it writes: directories carry the incarnation, the record is
    refused, and what the fenced actor left is swept by its successor's next prune."""
    run = create_run(store, "w", training_spec(str(tiny_dir)))
    old, new = (WeightPublisher(store, worker_context(store, run, "actor").worker) for _ in range(2))
    model = _model(tiny_dir)
    assert new.publish(model, step=0) == 0
    successors = Path(store.latest_weights("w").path)
    before = tensors_sha256(volume.read_published(successors))
    _perturb(model, 2)
    with pytest.raises(Fenced):
        old.publish(model, step=0, version=1)
    assert [r.version for r in store.list_weights("w")] == [0]
    assert tensors_sha256(volume.read_published(successors)) == before
    stray = paths.weights_dir("w") / "v1-i1"
    assert stray.is_dir()  # written before the refused record
    new.publish(model, step=1)
    assert not stray.exists() and sorted(p.name for p in paths.weights_dir("w").iterdir()) == [
        "v0-i2",
        "v1-i2",
    ]


def test_a_crash_mid_write_leaves_no_version(store, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    publisher = _publisher(store, tiny_dir)
    model = _model(tiny_dir)

    def half_written(state, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError("disk went away")

    monkeypatch.setattr(volume, "save_file", half_written)
    with pytest.raises(OSError):
        publisher.publish(model, step=0)
    assert store.latest_weights("w") is None
    assert list(paths.weights_dir("w").iterdir()) == []


def test_leftovers_of_a_killed_writer_are_cleared(mortal_home: Path, tiny_dir: Path, store) -> None:
    publisher = _publisher(store, tiny_dir)
    leftover = paths.weights_dir("w") / ".tmp-v7-deadbeef"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"partial")
    publisher.clear_partial()
    assert not leftover.exists()


def test_lora_is_published_merged_under_base_names_without_touching_the_model(tiny_dir: Path) -> None:
    from peft import LoraConfig, get_peft_model

    base = _model(tiny_dir)
    names = set(plain_state_dict(base))
    peft_model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    )
    _perturb(peft_model, 2)  # B != 0: the adapters change the outputs
    before = tensors_sha256(peft_model.state_dict())
    published = plain_state_dict(peft_model)
    assert tensors_sha256(peft_model.state_dict()) == before  # merged out of place
    assert set(published) == names
    merged = copy.deepcopy(peft_model).merge_and_unload()
    for name, tensor in published.items():
        torch.testing.assert_close(tensor, merged.state_dict()[name], rtol=0, atol=1e-6)
    fresh = _model(tiny_dir)
    fresh.load_state_dict(published, strict=False)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, peft_model(ids).logits, rtol=1e-4, atol=1e-4)


def test_weights_of_another_model_are_refused(tmp_path: Path, tiny_dir: Path) -> None:
    model = _model(tiny_dir)
    volume.write_weights(model, tmp_path / "v0", 0, 0)
    other = make_tiny_model(tmp_path / "other")
    import json

    config = json.loads((other / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match="missing"):
        load_published(_model(other), tmp_path / "v0")


def test_a_model_that_loaded_one_version_still_refuses_a_version_that_does_not_fit(
    tmp_path: Path, tiny_dir: Path
) -> None:
    """The fit is checked once per set of names and kept on the model: another set is checked again."""
    from safetensors.torch import load_file, save_file

    model = _model(tiny_dir)
    volume.write_weights(model, tmp_path / "v0", 0, 0)
    rollout = _model(tiny_dir)
    load_published(rollout, tmp_path / "v0")
    tensors = load_file(str(tmp_path / "v0" / volume.WEIGHTS_FILE))
    (tmp_path / "v1").mkdir()
    save_file(
        {k: v for k, v in tensors.items() if "layers.0." not in k}, str(tmp_path / "v1" / volume.WEIGHTS_FILE)
    )
    with pytest.raises(WeightsError, match="missing"):
        load_published(rollout, tmp_path / "v1")
    (tmp_path / "v2").mkdir()
    name = next(k for k in tensors if k.endswith("q_proj.weight"))
    save_file({**tensors, name: torch.zeros(1, 1)}, str(tmp_path / "v2" / volume.WEIGHTS_FILE))
    with pytest.raises(WeightsError, match="shapes differ"):
        load_published(rollout, tmp_path / "v2")


def test_a_ring_reuses_a_models_tensors_between_versions_but_not_across_models(tiny_dir: Path) -> None:
    ring = IpcTransport()  # either ring transport: the kept state is theirs
    model = _model(tiny_dir)
    first = ring._plain(model)
    _perturb(model, 2)  # the optimizer's in-place update: the kept tensors see it
    assert ring._plain(model) is first
    assert torch.equal(first["model.norm.weight"], model.model.norm.weight)
    other = _model(tiny_dir)
    assert ring._plain(other) is not first
    assert ring._plain(other)["model.norm.weight"].data_ptr() == other.model.norm.weight.data_ptr()


def test_a_ring_builds_its_tensors_again_when_a_parameter_is_replaced_or_moved(tiny_dir: Path) -> None:
    ring = IpcTransport()  # either ring transport: the kept state is theirs
    model = _model(tiny_dir)
    first = ring._plain(model)
    model.model.norm.weight = torch.nn.Parameter(torch.full_like(model.model.norm.weight, 3.0))
    replaced = ring._plain(model)
    assert replaced is not first and torch.equal(replaced["model.norm.weight"], model.model.norm.weight)
    model.model.norm.weight.data = torch.full_like(model.model.norm.weight, 4.0)  # what `model.to` does
    moved = ring._plain(model)
    assert moved is not replaced and torch.equal(moved["model.norm.weight"], model.model.norm.weight)
