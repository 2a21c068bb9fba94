"""The GPU path: the actor trains on CUDA in bfloat16 and a CUDA rollout engine loads what it publishes;
the transformers engine samples on CUDA deterministically per seed. Skipped without a CUDA device
(except the device-choice checks at the end, which run everywhere)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from actor_helpers import RolloutThread, actor_spec, create_run, worker_context
from rollout_helpers import assets_available, budget_for_rows, make_tiny_model

from mortal.specs.training import ModelSpec
from mortal.workers.actor import loop as actor
from mortal.workers.errors import FatalWorkerError
from mortal.workers.models import encode_prompt, load_model, load_tokenizer, worker_device
from mortal.workers.rollout.engines import GenerationParams
from mortal.workers.rollout.engines.transformers_engine import TransformersEngine
from mortal.workers.runtime import EXIT_SUCCEEDED
from mortal.workers.sync.volume import read_published

pytestmark = pytest.mark.skipif(not assets_available(), reason="SmolLM2 assets missing")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CHAT = [{"role": "user", "content": "What is 2 + 3? Reply with only the number."}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gpu") / "model")


@pytest.fixture
def store(sqlite_store):
    """SQLite only (tests/workers/conftest.py)."""
    return sqlite_store


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("sync", ["volume", "ipc"])
def test_actor_trains_on_cuda_and_a_cuda_rollout_loads_its_weights(
    store, tiny_dir: Path, monkeypatch, sync: str
) -> None:
    """ipc with the rollout in the actor's own process: it reads the actor's snapshot ring directly. The
    start's overlaps are off here (actor.queues_ahead, actor.warms_up): in one process the rollout thread's
    first CUDA graph capture would run beside the actor thread's model load and warm-up, which a capture does
    not allow; a worker has its own process (the controller tests below run them)."""
    monkeypatch.setattr(actor, "queues_ahead", lambda spec: False)
    monkeypatch.setattr(actor, "warms_up", lambda spec, world: False)
    spec = actor_spec(
        str(tiny_dir),
        model={"dtype": "bfloat16"},
        actor={"gpu": "H100"},
        rollout={"gpu": "H100"},
        algorithm={"maxSteps": 2},
        checkpoint={"every": 10, "keep": 1},
        sync={"method": sync},
    )
    run = create_run(store, "gpu", spec)
    trainers = []
    build = actor.build_trainer
    monkeypatch.setattr(actor, "build_trainer", lambda *a: trainers.append(build(*a)) or trainers[-1])
    ctx = worker_context(store, run, "actor")
    ctx.check_fence()
    with RolloutThread(store, run) as rollout:
        assert actor.main(ctx) == EXIT_SUCCEEDED
    param = next(trainers[0].model.parameters())
    assert (param.device.type, param.dtype) == ("cuda", torch.bfloat16)
    assert not torch.backends.cuda.cudnn_sdp_enabled()  # a new batch length costs cuDNN a plan (models.py)
    losses = {row.step: row.value for row in store.list_metrics("gpu") if row.name == "loss"}
    assert sorted(losses) == [1, 2] and all(math.isfinite(v) for v in losses.values())
    weights = store.list_weights("gpu")
    assert [(w.version, w.step, w.method) for w in weights] == [(0, 0, sync), (1, 1, sync), (2, 2, sync)]
    if sync == "volume":
        first, last = read_published(weights[0].path), read_published(weights[-1].path)
        assert any(not torch.equal(first[k], last[k]) for k in first), "training did not change the weights"
    else:
        last = {k: v.detach().cpu() for k, v in trainers[0].model.state_dict().items()}
    assert all(t.dtype == torch.bfloat16 for t in last.values())

    worker = rollout.worker
    worker.refresh_weights()  # the thread may have stopped before it saw the last version
    assert worker.published_version == 2
    model = worker.engine.model
    assert (next(model.parameters()).device.type, model.dtype) == ("cuda", torch.bfloat16)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k].cpu(), v) for k, v in last.items())
    params = GenerationParams(max_tokens=6)
    [outs] = worker.engine.generate([encode_prompt(worker.tokenizer, CHAT)], 2, [3], params)
    assert all(1 <= len(c.ids) == len(c.logprobs) <= 6 for c in outs)


@pytest.mark.gpu
@needs_cuda
def test_transformers_engine_on_cuda_is_deterministic_and_leaves_the_cuda_rng_alone(tiny_dir: Path) -> None:
    spec = ModelSpec(name=str(tiny_dir), dtype="bfloat16")
    tokenizer = load_tokenizer(spec)
    prompt = encode_prompt(tokenizer, CHAT)
    params = GenerationParams(max_tokens=16, temperature=0.9)
    engine = TransformersEngine.create(spec, tokenizer, device="cuda")
    assert engine.device.type == "cuda" and engine.model.dtype == torch.bfloat16
    torch.cuda.manual_seed(123)
    before = torch.rand(1, device="cuda")
    torch.cuda.manual_seed(123)
    [first] = engine.generate([prompt], 4, [7], params)
    assert torch.equal(torch.rand(1, device="cuda"), before)  # the worker's CUDA RNG is not consumed
    fresh = TransformersEngine.create(spec, tokenizer, device="cuda")
    assert [c.ids for c in fresh.generate([prompt], 4, [7], params)[0]] == [c.ids for c in first]
    assert [c.ids for c in engine.generate([prompt], 4, [8], params)[0]] != [c.ids for c in first]
    assert len({tuple(c.ids) for c in first}) > 1
    assert all(len(c.ids) == len(c.logprobs) and all(lp <= 0 for lp in c.logprobs) for c in first)


@pytest.mark.gpu
@needs_cuda
def test_cuda_logprobs_are_the_sampling_distribution_before_and_after_new_weights(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """float32 on CUDA, compiled decoding over a static cache: the engine's logprobs match one plain
    forward pass of the sampled tokens, and still do once other weights are loaded (the compiled graphs
    read the same parameter tensors, refilled in place)."""
    spec = ModelSpec(name=str(tiny_dir), dtype="float32")
    tokenizer = load_tokenizer(spec)
    engine = TransformersEngine.create(spec, tokenizer, device="cuda")
    assert engine.compiled
    prompt = encode_prompt(tokenizer, CHAT)

    def check() -> list:
        [outs] = engine.generate([prompt], 3, [3], GenerationParams(max_tokens=10, temperature=0.7))
        for c in outs:
            full = torch.tensor([prompt + c.ids], device="cuda")
            with torch.no_grad():
                logits = engine.model(full).logits[0, len(prompt) - 1 : -1].float() / 0.7
            expected = torch.log_softmax(logits, -1).gather(1, full[0, len(prompt) :, None]).squeeze(1).cpu()
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-3, rtol=1e-3)
        return outs

    before = check()
    engine.load_weights(str(make_tiny_model(tmp_path / "other", seed=1)))
    after = check()
    assert [c.ids for c in after] != [c.ids for c in before], "the new weights were not used"


@pytest.mark.gpu
@needs_cuda
def test_a_cuda_task_of_several_prompts_is_one_batch_matching_each_prompts_forward_pass(
    tiny_dir: Path,
) -> None:
    """The compiled path's batch holds every prompt x n of a task, left-padded: each
    group's logprobs match a plain forward pass of its own unpadded prompt, and the same
    task with the same seeds gives the same tokens."""
    spec = ModelSpec(name=str(tiny_dir), dtype="float32")
    tokenizer = load_tokenizer(spec)
    engine = TransformersEngine.create(spec, tokenizer, device="cuda")
    assert engine.compiled
    long = [{"role": "user", "content": "Add these up: " + " + ".join(str(i) for i in range(40))}]
    prompts = [
        encode_prompt(tokenizer, "What is 2 + 3?"),
        encode_prompt(tokenizer, CHAT),
        encode_prompt(tokenizer, long),
    ]
    assert len({len(p) for p in prompts}) == 3
    params = GenerationParams(max_tokens=12, temperature=0.8)
    groups = engine.generate(prompts, 3, [5, 6, 7], params)
    assert [len(group) for group in groups] == [3, 3, 3]
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            full = torch.tensor([prompt + c.ids], device="cuda")
            with torch.no_grad():
                logits = engine.model(full).logits[0, len(prompt) - 1 : -1].float() / 0.8
            expected = torch.log_softmax(logits, -1).gather(1, full[0, len(prompt) :, None]).squeeze(1).cpu()
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-3, rtol=1e-3)
    again = engine.generate(prompts, 3, [5, 6, 7], params)
    assert [[c.ids for c in g] for g in again] == [[c.ids for c in g] for g in groups]


def test_worker_device_follows_the_spec_not_the_machine() -> None:
    assert worker_device("none", "spec.rollout.gpu") == "cpu"  # even where a GPU is visible
    if torch.cuda.is_available():
        assert worker_device("H100", "spec.rollout.gpu") == "cuda"
    else:
        with pytest.raises(FatalWorkerError, match="spec.rollout.gpu is 'H100'"):
            worker_device("H100", "spec.rollout.gpu")


@pytest.mark.gpu
@needs_cuda
def test_a_colocated_run_trains_on_one_gpu_through_the_controller(mortal_home: Path, tiny_dir: Path) -> None:
    """rollout.colocate on a machine's first GPU: the actor and both rollouts see the same device."""
    from mortal.state import paths

    spec = actor_spec(
        str(tiny_dir),
        model={"dtype": "bfloat16"},
        actor={"gpu": "H100"},
        rollout={"gpu": "H100", "replicas": 2, "colocate": True},
        algorithm={"maxSteps": 3},
    )
    row, events = _run_through_a_controller(mortal_home, "colo", spec)
    assert row.phase == "Succeeded", (row.status, [e.message for e in events])
    for role, replica in (("actor", 0), ("rollout", 0), ("rollout", 1)):
        logs = sorted(paths.run_dir("colo").rglob(f"{role}-{replica}-*.log"))
        assert logs and "CUDA_VISIBLE_DEVICES='0'" in logs[0].read_text(), (
            f"{role}-{replica} was not on GPU 0"
        )
    assert "engine transformers on cuda" in logs[0].read_text()


@pytest.mark.gpu
@needs_cuda
def test_a_real_cuda_out_of_memory_is_diagnosed_relaunched_once_then_fails_the_run(
    mortal_home: Path, tiny_dir: Path
) -> None:
    """A colocated rollout whose share of the GPU (rollout.gpuMemoryUtilization) cannot hold the model: the
    CUDA caching allocator refuses its weights (a real torch out-of-memory, not a simulated one), the
    worker reports the figures torch gave, MemoryFits turns False with one Warning event naming the
    field to change, the slot is relaunched once and the run then ends Failed instead of looping."""
    # 4 MiB of whatever GPU this is (0.0001 was 8 MB of an H100 but 14 MB of an H200, which held the tiny
    # model's 12 MB embedding and refused only the KV cache: engines/static_decode.py's budget refusal)
    share = float(f"{4 * 2**20 / torch.cuda.get_device_properties(0).total_memory:.1g}")
    spec = actor_spec(
        str(tiny_dir),
        actor={"gpu": "H100"},
        rollout={"gpu": "H100", "replicas": 1, "colocate": True, "gpuMemoryUtilization": share},
        restartPolicy={"maxRestarts": 10, "backoffSeconds": 0.2},
    )
    row, events = _run_through_a_controller(mortal_home, "oom", spec)
    assert row.phase == "Failed", (row.status, [e.message for e in events])
    failed = next(c for c in row.status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "OutOfMemory"
    assert re.match(
        r"rollout-0 #\d+ ran out of GPU memory: tried to allocate [\d.]+ MiB on GPU 0 \(total ",
        failed["message"],
    ), failed["message"]
    assert f"raise rollout.gpuMemoryUtilization (now {share})" in failed["message"]
    memory = next(c for c in row.status["conditions"] if c["type"] == "MemoryFits")
    assert (memory["status"], memory["reason"]) == ("False", "OutOfMemory")
    assert [e.type for e in events if e.reason == "OutOfMemory"] == ["Warning"]
    assert sum(1 for e in events if e.reason == "Restarted") == 1


def _run_through_a_controller(mortal_home: Path, name: str, spec: dict) -> tuple[Any, list[Any]]:
    """Apply `spec` as run `name`, run a controller process on GPU 0 until the run ends (4 minutes at
    most), stop it; returns the run's row and its events."""
    import os
    import subprocess
    import sys
    import time

    from mortal.specs import TrainingRun
    from mortal.state import open_store

    url = f"sqlite:///{mortal_home / 'state.db'}"
    store = open_store(url)
    run = TrainingRun.model_validate({"metadata": {"name": name}, "spec": spec})
    store.apply_run(name, run.spec_dict())
    env = dict(
        os.environ,
        MORTAL_HOME=str(mortal_home),
        MORTAL_STATE_URL=url,
        CUDA_VISIBLE_DEVICES="0",
        WANDB_MODE="disabled",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    )
    with open(mortal_home / "controller.log", "ab") as log:
        controller = subprocess.Popen(
            [sys.executable, "-m", "mortal.controller"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 240
        while store.get_run(name).phase not in ("Succeeded", "Failed") and time.monotonic() < deadline:
            time.sleep(0.5)
        return store.get_run(name), store.list_events(name, limit=200)
    finally:
        controller.terminate()
        controller.wait(timeout=30)
        store.close()


def _decode_under_a_share(model_dir: str) -> tuple[int, int, bool]:
    """In a process of its own: a share sized for three rows; returns (completions, rows, whether an
    allocation past the cap raised torch's out-of-memory)."""
    from mortal.workers.rollout.engines.static_decode import (
        DEFAULT_KEPT_SHAPES,
        SAMPLING_COPIES,
        StaticDecoder,
        kv_bytes_per_token,
    )

    spec = ModelSpec(name=model_dir, dtype="float32")
    tokenizer = load_tokenizer(spec)
    prompt = encode_prompt(tokenizer, CHAT)
    sizes = StaticDecoder(
        load_model(spec, "cpu", for_training=False), compile=False
    )  # sizes only, off the GPU
    width = -(-len(prompt) // 64) * 64  # the engine's prompt bucket
    row = (width + 12) * kv_bytes_per_token(sizes.model) + SAMPLING_COPIES * 4 * sizes.vocab
    need = budget_for_rows(sizes.weight_bytes, row, DEFAULT_KEPT_SHAPES, 3)
    engine = TransformersEngine.create(
        spec, tokenizer, device="cuda", memory_share=need / torch.cuda.get_device_properties(0).total_memory
    )
    [outs] = engine.generate([prompt], 8, [5], GenerationParams(max_tokens=12, temperature=1.0))
    try:
        torch.empty(need, dtype=torch.uint8, device="cuda")  # past the cap, though the GPU has room
        capped = False
    except torch.OutOfMemoryError:
        capped = True
    return len(outs), engine.decoder.last_stats.rows, capped


@pytest.mark.gpu
@needs_cuda
def test_a_memory_share_caps_the_rollout_and_plans_its_decode_rows_on_cuda(tiny_dir: Path) -> None:
    """rollout.gpuMemoryUtilization on the transformers engine: the process's allocator is capped at the
    share, and a share sized for three rows decodes a task's eight sequences three rows at a time. In a
    fresh process, as a rollout worker is: the cap counts all the memory its process's allocator holds,
    and earlier tests' compiled graphs keep theirs in this one."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        completions, rows, capped = pool.submit(_decode_under_a_share, str(tiny_dir)).result(timeout=600)
    assert (completions, rows, capped) == (8, 3, True)


@pytest.mark.gpu
@needs_cuda
def test_liger_kernels_train_the_first_step_as_the_plain_model_does(
    mortal_home: Path, tiny_dir: Path
) -> None:
    """actor.liger through the controller (each worker a process of its own, as a user runs it: Liger patches
    the actor's process only): the actor says its model has Liger's kernels, and its first step (the same
    rollouts: the rollout samples each seed alike) has the plain model's loss and gradient norm within float32
    kernel noise."""
    pytest.importorskip("liger_kernel.transformers", reason="actor.liger needs liger-kernel (and Triton)")
    from mortal.state import open_store, paths

    firsts = {}
    for liger in (False, True):
        name = f"liger-{str(liger).lower()}"
        spec = actor_spec(
            str(tiny_dir),
            model={"dtype": "float32"},
            actor={"gpu": "H100", "liger": liger},
            rollout={"gpu": "H100", "replicas": 1, "colocate": True},
            algorithm={"maxSteps": 1},
        )
        row, events = _run_through_a_controller(mortal_home, name, spec)
        assert row.phase == "Succeeded", (row.status, [e.message for e in events])
        actor_log = "".join(p.read_text() for p in paths.run_dir(name).rglob("actor-0-*.log"))
        assert ("Liger's kernels patched into the llama model" in actor_log) is liger, actor_log[-2000:]
        store = open_store(f"sqlite:///{mortal_home / 'state.db'}")
        firsts[liger] = {m.name: m.value for m in store.list_metrics(name) if m.step == 1}
        store.close()
    for metric in ("loss", "grad_norm"):
        plain, fused = firsts[False][metric], firsts[True][metric]
        assert math.isclose(plain, fused, rel_tol=1e-3, abs_tol=1e-6), (metric, plain, fused)
