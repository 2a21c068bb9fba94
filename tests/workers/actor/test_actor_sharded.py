"""actor.count: 2 (issue 19, CPU): the actor worker trains with FSDP2 over 2 ranks (gloo), rank 0 alone
talking to the store. The actor runs as the local backend runs it (`python -m mortal.workers.main`, which
spawns rank 1), the real rollout worker in a thread of this test; a tiny random-init model, on-policy, so
both runs of a pair get the same rollouts.

- one sharded step equals one unsharded step: TRL's logged grad norm (the norm of the whole gradient,
  which FSDP computes from the shards) and loss, and the weights (rank 0's gathered publish, and the
  sharded checkpoint read back with torch's DCP converter); so does one in micro-batches (2 per rank);
- a rank killed mid-run makes the worker exit 75 with the rank named (the controller relaunches it), and
  the relaunched actor resumes from its sharded checkpoint (torch.distributed.checkpoint) and ends with
  the weights of the same run never interrupted, bit for bit;
- the same under the real controller (local backend, marked slow): it relaunches the actor on its own and
  the run ends bit for bit where the uninterrupted one did;
- SIGTERM while rank 0 waits for rollouts: every rank writes its shards of that step's checkpoint and ends;
- a rank whose rank 0 was SIGKILLed exits at once;
- a checkpoint resumes on another count (2 ranks -> 1, 1 -> 2) and the next step trains as the run it came
  from does: the weights and the AdamW moments were restored, resharded.
The runs are made once for the module (each actor process costs ~20 s of imports on 2 cores).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from actor_helpers import RolloutThread, actor_spec, create_run, final_weights_hash, run_actor_with_rollout
from rollout_helpers import assets_available, make_tiny_model
from run_helpers import needs_two_gpus, train_through_controller
from safetensors.torch import load_file

from mortal.client.fork import fork_run
from mortal.state import open_store
from mortal.state.store import Store, WorkerRef
from mortal.workers.actor.checkpoint import is_complete, read_marker
from mortal.workers.sync.volume import read_published

pytestmark = pytest.mark.skipif(not assets_available(), reason="SmolLM2 assets missing")
HERE = Path(__file__).resolve().parents[1]  # tests/workers: the helpers a worker imports
DEADLINE = 240.0


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("sharded")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MORTAL_HOME", str(folder / "home"))
        patch.setenv("WANDB_MODE", "disabled")
        patch.delenv("MORTAL_STATE_URL", raising=False)
        # the helpers importable where mortal runs, as an installed package is: a fork's admission imports
        # the runs' reward in a child process
        patch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        yield folder / "home"


@pytest.fixture(scope="module")
def store(home: Path) -> Iterator[Store]:
    home.mkdir(parents=True, exist_ok=True)
    opened = open_store(f"sqlite:///{home / 'state.db'}")
    yield opened
    opened.close()


@pytest.fixture(scope="module")
def tiny_dir(home: Path) -> Path:
    return make_tiny_model(home.parent / "model")


SHARDED = {
    "algorithm": {"maxSteps": 3, "batchSize": 8},
    "actor": {"count": 2},
    "checkpoint": {"every": 1, "keep": 3},
}


@pytest.fixture(scope="module")
def straight(store: Store, home: Path, tiny_dir: Path) -> str:
    """A sharded run of 3 steps, never interrupted; its first step profiled (MORTAL_PROFILE_STEPS)."""
    run = create_run(store, "straight", actor_spec(str(tiny_dir), **SHARDED))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MORTAL_PROFILE_STEPS", "1")
        assert train(store, run, home) == 0, _log_tail(home, "straight")
    return run.name


@pytest.fixture(scope="module")
def whole(store: Store, tiny_dir: Path) -> str:
    """One unsharded step, in this process: the actor as it runs with count 1."""
    run = create_run(store, "whole", actor_spec(str(tiny_dir), algorithm={"maxSteps": 1, "batchSize": 8}))
    assert run_actor_with_rollout(store, run) == 0
    return run.name


def launch_actor(store: Store, run, home: Path) -> tuple[WorkerRef, subprocess.Popen]:
    """The actor slot's next incarnation, started as the local backend starts a worker."""
    row = store.create_worker(run.name, "actor", 0, "local", lease_seconds=60.0)
    ref = WorkerRef(run=run.name, role="actor", replica=0, incarnation=row.incarnation)
    env = {
        **os.environ,
        "MORTAL_RUN": run.name,
        "MORTAL_ROLE": "actor",
        "MORTAL_REPLICA": "0",
        "MORTAL_INCARNATION": str(row.incarnation),
        "MORTAL_HOME": str(home),
        "MORTAL_THREADS": "2",
        "MORTAL_STATE_URL": f"sqlite:///{home / 'state.db'}",
        "MORTAL_WORKER_ID": ref.id,
        "HF_HUB_OFFLINE": "1",
    }
    log = open(home / f"{run.name}-actor-{row.incarnation}.log", "ab")  # noqa: SIM115 - closed with the process
    return ref, subprocess.Popen(
        [sys.executable, "-m", "mortal.workers.main"], env=env, stdout=log, stderr=log
    )


def train(store: Store, run, home: Path) -> int:
    """Run the actor process with a rollout thread to its end; its exit code."""
    _, proc = launch_actor(store, run, home)
    with RolloutThread(store, run):
        try:
            return proc.wait(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(_log_tail(home, run.name)) from None


def _log_tail(home: Path, name: str) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(home.glob(f"{name}-actor-*.log")))


def _step_metrics(store: Store, name: str, step: int) -> dict[str, float]:
    return {m.name: m.value for m in store.list_metrics(name) if m.step == step}


def _checkpointed_weights(store: Store, name: str, step: int, scratch: Path) -> dict[str, torch.Tensor]:
    """The model of a sharded checkpoint, as full tensors (torch's own DCP -> torch.save converter)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    [row] = [c for c in store.list_checkpoints(name) if c.step == step]
    dcp_to_torch_save(Path(row.path) / "dcp", scratch / f"{name}-{step}.pt")
    return torch.load(scratch / f"{name}-{step}.pt", weights_only=False)["model"]


def test_one_sharded_step_equals_one_unsharded_step(
    store: Store, home: Path, tiny_dir: Path, straight: str, whole: str
) -> None:
    held, total = map(
        int,
        re.search(
            r"rank 0 of 2 holds (\d+) of the model's (\d+) weights", _log_tail(home, straight)
        ).groups(),
    )
    assert abs(held - total / 2) < total / 100, (held, total)  # sharded: each rank holds its half
    a, b = _step_metrics(store, whole, 1), _step_metrics(store, straight, 1)
    assert a["completion_tokens"] == b["completion_tokens"]  # the same rollouts
    assert a["grad_norm"] > 0
    assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4), (a["grad_norm"], b["grad_norm"])
    assert math.isclose(a["loss"], b["loss"], rel_tol=1e-4, abs_tol=1e-6), (a["loss"], b["loss"])
    start = load_file(tiny_dir / "model.safetensors")
    wa = read_published(store.latest_weights(whole).path)  # after step 1
    wb = _checkpointed_weights(store, straight, 1, home.parent)
    assert wa.keys() == start.keys() and wa.keys() <= wb.keys()
    moved = max(float((wb[k] - start[k]).abs().max()) for k in wa)
    # AdamW's first step moves each weight by about learningRate (1e-2) in its gradient's sign: a rank's
    # half of the batch left out or counted twice would move many weights the other way
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert moved > 5e-3 and worst < 1e-4, (moved, worst)


def test_a_sharded_step_in_micro_batches_equals_the_whole_batch_unsharded(
    store: Store, home: Path, tiny_dir: Path, whole: str, monkeypatch
) -> None:
    """microBatchSize 4 over 2 ranks: each rank trains 2 completions a pass, 2 passes (TRL's accumulation).
    The step is profiled (MORTAL_PROFILE_STEPS): each rank leaves its table and timeline in the run's logs."""
    micro = create_run(
        store,
        "micro",
        actor_spec(
            str(tiny_dir), algorithm={"maxSteps": 1, "batchSize": 8, "microBatchSize": 4}, actor={"count": 2}
        ),
    )
    monkeypatch.setenv("MORTAL_PROFILE_STEPS", "1")
    assert train(store, micro, home) == 0, _log_tail(home, "micro")
    for rank in (0, 1):
        table = home / "runs/micro/logs" / f"profile-actor-rank{rank}-steps1-1.txt"
        assert "aten::mm" in table.read_text() and table.with_suffix(".json.gz").stat().st_size > 0, rank
    a, b = _step_metrics(store, whole, 1), _step_metrics(store, "micro", 1)
    assert a["completion_tokens"] == b["completion_tokens"] and a["grad_norm"] > 0
    assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4), (a["grad_norm"], b["grad_norm"])
    wa, wb = (
        read_published(store.latest_weights(whole).path),
        read_published(store.latest_weights("micro").path),
    )
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert worst < 1e-4, worst


def _all_gathers(home: Path, name: str) -> int:
    """How many all-gathers of parameters FSDP2 made on rank 0 in its profiled step 1: the calls of
    `fsdp::all_gather_copy_in`, its op that packs a module's shards for each one (on gloo as on NCCL), in
    the step's timeline (the tables show only the costliest operators)."""
    trace = home / "runs" / name / "logs" / "profile-actor-rank0-steps1-1.json.gz"
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    return sum(1 for event in events if event.get("name") == "fsdp::all_gather_copy_in")


def test_weights_kept_from_forward_to_backward_train_the_same_step_with_fewer_all_gathers(
    store: Store, home: Path, tiny_dir: Path, straight: str, whole: str, monkeypatch
) -> None:
    """actor.reshardAfterForward false: no layer is gathered again for its backward, and
    the step is the same."""
    kept = create_run(
        store,
        "kept",
        actor_spec(
            str(tiny_dir),
            algorithm={"maxSteps": 1, "batchSize": 8},
            actor={"count": 2, "reshardAfterForward": False},
        ),
    )
    monkeypatch.setenv("MORTAL_PROFILE_STEPS", "1")
    assert train(store, kept, home) == 0, _log_tail(home, "kept")
    a, b = _step_metrics(store, whole, 1), _step_metrics(store, "kept", 1)
    assert a["completion_tokens"] == b["completion_tokens"] and a["grad_norm"] > 0
    assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4), (a["grad_norm"], b["grad_norm"])
    wa, wb = (
        read_published(store.latest_weights(whole).path),
        read_published(store.latest_weights("kept").path),
    )
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-4
    gathered, regathered = _all_gathers(home, "kept"), _all_gathers(home, straight)
    assert gathered < regathered, (gathered, regathered)


def test_a_replicated_actor_trains_the_unsharded_step_and_checkpoints_its_weights(
    store: Store, home: Path, tiny_dir: Path, whole: str
) -> None:
    """actor.strategy ddp: each rank holds the whole model and trains its half of the batch, the gradients
    averaged (DistributedDataParallel, told that a dense model uses every parameter: no search after each
    forward; its gradients views of the all-reduce buckets: no copy in and out; no broadcast of the buffers
    before each forward, which every rank computes alike): one step equals the
    unsharded one, and the checkpoint it writes (torch.distributed.checkpoint, as for FSDP2) holds those
    weights, whole."""
    replicated = create_run(
        store,
        "replicated",
        actor_spec(
            str(tiny_dir), algorithm={"maxSteps": 1, "batchSize": 8}, actor={"count": 2, "strategy": "ddp"}
        ),
    )
    assert train(store, replicated, home) == 0, _log_tail(home, "replicated")
    log = _log_tail(home, "replicated")
    held, total = map(
        int, re.search(r"rank 0 of 2 holds (\d+) of the model's (\d+) weights \(DDP\)", log).groups()
    )
    assert held == total
    assert (
        "DistributedDataParallel: gradients as views of its all-reduce buckets, every parameter used, "
        "buffers the rank's own" in log
    ), log
    a, b = _step_metrics(store, whole, 1), _step_metrics(store, "replicated", 1)
    assert a["completion_tokens"] == b["completion_tokens"] and a["grad_norm"] > 0
    assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4), (a["grad_norm"], b["grad_norm"])
    wa, wb = (
        read_published(store.latest_weights(whole).path),
        read_published(store.latest_weights("replicated").path),
    )
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-4
    saved = _checkpointed_weights(store, "replicated", 1, home.parent)
    assert max(float((wb[k] - saved[k]).abs().max()) for k in wb) == 0.0


def test_mixed_precision_computes_in_bfloat16_and_keeps_float32_shards(
    store: Store, home: Path, tiny_dir: Path, whole: str
) -> None:
    """actor.mixedPrecision: the step's gradient is the float32 one up to bfloat16's rounding (further from it
    than the float32 sharded step, which agrees to 1e-4), the checkpointed shards stay float32, and the
    weights the rollouts load are those cast to bfloat16, the dtype they generate in."""
    mixed = create_run(
        store,
        "mixed",
        actor_spec(
            str(tiny_dir),
            algorithm={"maxSteps": 1, "batchSize": 8},
            actor={"count": 2, "mixedPrecision": True},
        ),
    )
    assert train(store, mixed, home) == 0, _log_tail(home, "mixed")
    a, b = _step_metrics(store, whole, 1), _step_metrics(store, "mixed", 1)
    assert a["completion_tokens"] == b["completion_tokens"] and a["grad_norm"] > 0
    off = abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"]
    assert 1e-4 < off < 5e-2, (a["grad_norm"], b["grad_norm"])
    weights = _checkpointed_weights(store, "mixed", 1, home.parent)
    assert {t.dtype for t in weights.values()} == {torch.float32}
    published = read_published(store.latest_weights("mixed").path)
    assert {t.dtype for t in published.values()} == {torch.bfloat16}
    for name, tensor in published.items():
        assert torch.equal(tensor, weights[name].to(torch.bfloat16)), name


def test_a_rank_killed_mid_run_exits_the_worker_and_the_relaunch_resumes_exactly(
    store: Store, home: Path, tiny_dir: Path, straight: str
) -> None:
    run = create_run(store, "killed", actor_spec(str(tiny_dir), **SHARDED))
    with RolloutThread(store, run):
        ref, proc = launch_actor(store, run, home)
        deadline = time.monotonic() + DEADLINE
        while not any(c.step >= 1 for c in store.list_checkpoints("killed")):
            assert proc.poll() is None and time.monotonic() < deadline, _log_tail(home, "killed")
            time.sleep(0.05)
        [rank1] = [
            c
            for c in psutil.Process(proc.pid).children()
            if "spawn_main" in " ".join(c.cmdline()) and "resource_tracker" not in " ".join(c.cmdline())
        ]
        rank1.kill()
        assert proc.wait(timeout=60) == 75, _log_tail(home, "killed")
        [row] = [r for r in store.list_workers("killed") if r.incarnation == ref.incarnation]
        assert (row.state, row.exit_code) == ("Failed", 75), row
        assert "actor rank 1 of 2 ended with exit code -9" in (row.message or ""), row.message
        checkpoint = store.list_checkpoints("killed")[-1]
        assert checkpoint.step < 3 and is_complete(checkpoint.path), checkpoint
        assert (
            read_marker(checkpoint.path)["ranks"] == 2
            and (Path(checkpoint.path) / "dcp" / ".metadata").is_file()
        )
        _, again = launch_actor(store, run, home)  # as the controller relaunches the slot
        assert again.wait(timeout=DEADLINE) == 0, _log_tail(home, "killed")
    assert f"resuming from {checkpoint.path}" in _log_tail(home, "killed")
    a, b = (
        read_published(store.latest_weights(straight).path),
        read_published(store.latest_weights("killed").path),
    )
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert final_weights_hash(store, "killed") == final_weights_hash(store, straight), worst
    last = store.list_checkpoints("killed")[-1]
    assert json.loads((Path(last.path) / "trainer_state.json").read_text())["global_step"] == 3


def test_a_stop_while_rank_0_waits_for_rollouts_checkpoints_every_rank_and_ends_them(
    store: Store, home: Path, tiny_dir: Path
) -> None:
    run = create_run(
        store,
        "stopped",
        actor_spec(
            str(tiny_dir),
            algorithm={"maxSteps": 3, "batchSize": 8},
            actor={"count": 2},
            checkpoint={"every": 5, "keep": 2},
        ),
    )
    ref, proc = launch_actor(store, run, home)
    with RolloutThread(store, run):
        deadline = time.monotonic() + DEADLINE
        while not _step_metrics(store, "stopped", 1):
            assert proc.poll() is None and time.monotonic() < deadline, _log_tail(home, "stopped")
            time.sleep(0.05)
    # the rollouts are gone and step 1's log has passed (no checkpoint due before step 3): rank 0 waits
    # for step 2's rollouts while rank 1 waits for rank 0's batch
    time.sleep(2.0)
    assert not store.list_checkpoints("stopped")
    ranks = psutil.Process(proc.pid).children()
    proc.send_signal(signal.SIGTERM)  # the local backend signals the group: rank 1 ignores it
    for rank in ranks:
        rank.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, _log_tail(home, "stopped")
    assert psutil.wait_procs(ranks, timeout=10)[1] == []  # every rank ended with rank 0
    [checkpoint] = store.list_checkpoints("stopped")
    assert checkpoint.step == 1 and is_complete(checkpoint.path), checkpoint
    assert {p.name for p in Path(checkpoint.path).glob("rng_state_*.pth")} == {
        "rng_state_0.pth",
        "rng_state_1.pth",
    }


def test_a_sharded_checkpoint_resumes_on_one_rank_and_trains_on_as_the_sharded_run_did(
    store: Store, home: Path, straight: str
) -> None:
    """`mortalctl fork straight:step-2 down --set spec.actor.count=1`: the unsharded actor reads the
    2 ranks' DCP shards whole (model and AdamW state) and its step 3 is the sharded run's step 3.
    The actor runs in a process of its own, as a worker does: run in this test's process, its thread and the
    rollout thread shared torch's global generator, and once under CI's load the rollouts differed (step 3's
    gradient norm 0.77 against 0.0; alone it passed every time), most likely the actor's seeding landing
    inside a rollout's seeded sampling."""
    fork_run(store, straight, 2, "down", sets=["spec.actor.count=1"])
    assert train(store, store.get_run("down").document(), home) == 0, _log_tail(home, "down")
    _trains_on_as(store, "down", straight, step=3)
    [warning] = [e for e in store.list_events("down") if e.reason == "ActorCountChanged"]
    assert "written by an actor of 2 rank(s) and this one has actor.count 1" in warning.message


def test_a_sharded_checkpoint_resumes_replicated_and_trains_on_as_the_sharded_run_did(
    store: Store, home: Path, straight: str
) -> None:
    """A fork of the FSDP2 run's step 2 with `spec.actor.strategy=ddp`: each of the 2 ranks reads the shards
    whole (model and AdamW state) into its own copy, and step 3 is the sharded run's step 3."""
    fork_run(store, straight, 2, "replicated-fork", sets=["spec.actor.strategy=ddp"])
    assert train(store, store.get_run("replicated-fork").document(), home) == 0, _log_tail(
        home, "replicated-fork"
    )
    _trains_on_as(store, "replicated-fork", straight, step=3)


def test_an_unsharded_checkpoint_resumes_on_two_ranks_and_trains_on_as_the_unsharded_run_does(
    store: Store, home: Path, whole: str
) -> None:
    """A fork of the unsharded run's step 1 onto 2 ranks (the Trainer's model.safetensors and optimizer.pt,
    each rank keeping its shards) against the same fork on 1 rank."""
    fork_run(store, whole, 1, "onwards", sets=["spec.algorithm.maxSteps=2"])
    assert train(store, store.get_run("onwards").document(), home) == 0, _log_tail(
        home, "onwards"
    )  # a process: above
    fork_run(store, whole, 1, "up", sets=["spec.algorithm.maxSteps=2", "spec.actor.count=2"])
    assert train(store, store.get_run("up").document(), home) == 0, _log_tail(home, "up")
    assert "resumed on 2 rank(s) from a checkpoint of 1" in _log_tail(home, "up")
    _trains_on_as(store, "up", "onwards", step=2)


def _trains_on_as(store: Store, resumed: str, reference: str, step: int) -> None:
    """`resumed` trained `step` as `reference` did: the same rollouts (so the same weights were restored),
    the same gradient, and an update that needed the restored AdamW moments (a fresh optimizer's first
    step moves every weight by about learningRate, 1e-2)."""
    a, b = _step_metrics(store, reference, step), _step_metrics(store, resumed, step)
    assert a["completion_tokens"] == b["completion_tokens"]
    assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4, abs_tol=1e-9), (
        a["grad_norm"],
        b["grad_norm"],
    )
    wa, wb = (
        read_published(store.latest_weights(reference).path),
        read_published(store.latest_weights(resumed).path),
    )
    assert store.latest_weights(resumed).step == step
    far = sum(int(((wa[k] - wb[k]).abs() > 1e-4).sum()) for k in wa) / sum(wa[k].numel() for k in wa)
    assert far < 1e-2, far


@pytest.mark.slow
def test_through_the_controller_a_killed_rank_is_relaunched_and_the_run_ends_exactly(
    home: Path, tiny_dir: Path, store: Store, straight: str
) -> None:
    """The same, with the real controller (local backend) doing the relaunch: ~40 s."""
    killed: list[int] = []

    def kill_rank_1(runs: Store) -> None:
        actors = [
            w
            for w in runs.list_workers("ctl")
            if w.role == "actor" and w.state == "Running" and w.handle and (w.step or 0) >= 1
        ]
        if actors and not killed:
            children = psutil.Process(int(actors[0].handle.split(":")[0])).children()
            [rank1] = [c for c in children if "resource_tracker" not in " ".join(c.cmdline())]
            rank1.kill()
            killed.append(actors[0].incarnation)

    spec = actor_spec(
        str(tiny_dir), **SHARDED, sync={"method": "volume"}, restartPolicy={"backoffSeconds": 1}
    )
    train_through_controller(home.parent / "ctl", "ctl", spec, gpus="", while_running=kill_rank_1)
    runs = open_store(f"sqlite:///{home.parent / 'ctl' / 'state.db'}")
    try:
        [first] = [w for w in runs.list_workers("ctl") if w.role == "actor" and w.incarnation == killed[0]]
        assert (first.state, first.exit_code) == (
            "Failed",
            75,
        ) and "RankLost: actor rank 1 of 2" in first.message
        assert any(e.reason == "Restarted" for e in runs.list_events("ctl"))
        assert final_weights_hash(runs, "ctl") == final_weights_hash(store, straight)
    finally:
        runs.close()


PARENT = """
import multiprocessing, os, sys, time
from mortal.workers.actor import sharded
if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(
        target=sharded._exit_with_parent, args=(os.getpid(),)
    )
    child.start()
    print(child.pid, flush=True)
    time.sleep(4)  # imports done: the child watches its parent, alive while the parent is
    print(child.is_alive(), flush=True)
    time.sleep(600)
"""


def test_a_sharded_model_reaches_a_rollout_through_the_ring_a_bucket_at_a_time(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """Sync ipc and nccl from a sharded actor: rank 0 gathers the weights whole a bucket at a time (the other
    rank joining each gather in the same order) into its ring's slot, and a rollout receives the whole
    model, tied weight once, equal to the unsharded model bit for bit (nccl's protocol, over gloo between
    CPU tensors)."""
    import torch.multiprocessing as mp
    from sharded_helpers import RECEIVED, publish_into_ring

    from mortal.specs.training import ModelSpec
    from mortal.workers import models
    from mortal.workers.actor import sharded
    from mortal.workers.sync import nccl as nccl_weights
    from mortal.workers.sync.weights import plain_state_dict

    ranks = mp.start_processes(
        publish_into_ring,
        args=(str(tiny_dir), sharded.free_port(), str(tmp_path)),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    try:
        version = tmp_path / "v0"
        deadline = time.monotonic() + 120
        while not (version / nccl_weights.NCCL_FILE).exists():
            assert time.monotonic() < deadline and all(p.exitcode in (None, 0) for p in ranks.processes)
            time.sleep(0.1)
        received = {k: v.clone() for k, v in nccl_weights.receive(version, torch.device("cpu")).items()}
        nccl_weights._Peer.drop()
    finally:
        (tmp_path / RECEIVED).touch()
        ranks.join(timeout=120)
    expected = plain_state_dict(models.load_model(ModelSpec.model_validate({"name": str(tiny_dir)}), "cpu"))
    assert received.keys() == expected.keys()  # the tied LM head once, under the embedding's name
    assert all(torch.equal(received[name], tensor) for name, tensor in expected.items())


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize(
    "sync, strategy",
    [
        ("ipc", "fsdp"),
        pytest.param(
            "nccl",
            "fsdp",
            marks=pytest.mark.skipif(
                torch.cuda.device_count() < 3,
                reason="sync nccl needs its rollout on a GPU of its own: a third GPU",
            ),
        ),
        ("volume", "fsdp"),
        ("ipc", "ddp"),
    ],
)
def test_on_two_gpus_a_sharded_actor_trains_as_the_unsharded_one_with_rollouts_beside_it(
    tmp_path: Path, sync: str, strategy: str
) -> None:
    """actor {gpu, count: 2} under the real controller: a GPU a rank (NCCL), two rollouts colocated one a GPU
    (ipc, volume; nccl needs its rollout on a GPU of its own, the third), weights through the ring from the
    shards (strategy fsdp) or from rank 0's whole copy (ddp); its first step is the unsharded actor's on one
    GPU (the same rollouts: one prompt a task on both, and the same weights), TRL's gradient norm and loss
    within float32 noise."""
    model = str(make_tiny_model(tmp_path / "model", seed=0))
    colocated = sync != "nccl"
    gpus = "0,1" if colocated else "0,1,2"
    common = dict(
        model={"dtype": "float32"},
        generation={"engine": "transformers"},
        sync={"method": sync},
        algorithm={"maxSteps": 3, "batchSize": 8},
        checkpoint={"every": 2, "keep": 1},
    )
    sharded_spec = actor_spec(
        model,
        actor={"gpu": "H100", "count": 2, "strategy": strategy},
        rollout={
            "gpu": "H100",
            "replicas": 2 if colocated else 1,
            "colocate": colocated,
            "promptsPerTask": 1,
        },
        **common,
    )
    whole_spec = actor_spec(
        model,
        actor={"gpu": "H100"},
        rollout={"gpu": "H100", "replicas": 1, "colocate": True, "promptsPerTask": 1},
        **{**common, "sync": {"method": "ipc" if sync == "nccl" else sync}},
    )
    firsts = []
    for name, spec, visible in (("fsdp-gpu", sharded_spec, gpus), ("whole-gpu", whole_spec, "0")):
        (tmp_path / name).mkdir()
        assert sorted(train_through_controller(tmp_path / name, name, spec, gpus=visible)) == [1, 2, 3]
        with contextlib.closing(open_store(f"sqlite:///{tmp_path / name / 'state.db'}")) as done:
            firsts.append(_step_metrics(done, name, 1))
    sharded_first, whole_first = firsts
    for metric in ("grad_norm", "loss"):
        assert math.isclose(sharded_first[metric], whole_first[metric], rel_tol=1e-3, abs_tol=1e-5), (
            metric,
            sharded_first,
            whole_first,
        )


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("offload", [False, True])
def test_on_two_gpus_mixed_precision_trains_float32_shards_beside_bfloat16_rollouts(
    tmp_path: Path, offload: bool
) -> None:
    """actor {gpu, count: 2, mixedPrecision} (and cpuOffload: the shards in host memory) under the real
    controller, a rollout colocated on each GPU generating in bfloat16 from the ring's bfloat16 weights."""
    model = str(make_tiny_model(tmp_path / "model", seed=0))
    spec = actor_spec(
        model,
        model={"dtype": "float32"},
        generation={"engine": "transformers"},
        actor={"gpu": "H100", "count": 2, "mixedPrecision": True, "cpuOffload": offload},
        rollout={"gpu": "H100", "replicas": 2, "colocate": True, "promptsPerTask": 1},
        sync={"method": "ipc"},
        algorithm={"maxSteps": 3, "batchSize": 8},
        checkpoint={"every": 2, "keep": 1},
    )
    home = tmp_path / "mixed-gpu"
    home.mkdir()
    losses = train_through_controller(home, "mixed-gpu", spec, gpus="0,1")
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(loss) for loss in losses.values())
    logs = "\n".join(p.read_text() for p in home.rglob("*rollout*.log"))
    assert logs.count("on cuda in bfloat16 ready") >= 2 and "in float32 ready" not in logs, logs[-2000:]


def test_a_rank_whose_rank_0_is_gone_exits_at_once(tmp_path: Path) -> None:
    (tmp_path / "parent.py").write_text(PARENT)
    parent = subprocess.Popen(
        [sys.executable, str(tmp_path / "parent.py")], stdout=subprocess.PIPE, text=True
    )
    child = psutil.Process(int(parent.stdout.readline()))
    assert parent.stdout.readline().strip() == "True"  # it waits while rank 0 lives
    parent.kill()  # SIGKILL: rank 0 gets no chance to end its children
    parent.wait()
    gone, alive = psutil.wait_procs([child], timeout=10)  # not our child: its exit code is not ours to read
    assert not alive, alive


RANK = """
import os, sys, time
from mortal.workers.actor.sharded import Ranks, rank_environment
rank, port = int(sys.argv[1]), int(sys.argv[2])
os.environ.update(rank_environment(rank, 2, port))
ranks = Ranks(rank, 2, "cpu", None, collective_seconds=1.0)
ranks.join()
print("joined", flush=True)
if rank == 0:
    time.sleep(60)  # stuck: never sends rank 1 its next message
started = time.monotonic()
try:
    ranks.channel.recv()
except Exception as exc:
    print(f"raised after {time.monotonic() - started:.1f} s: {type(exc).__name__}", flush=True)
"""


def test_a_rank_waiting_past_spec_deadlines_collective_seconds_fails_instead_of_hanging(
    tmp_path: Path,
) -> None:
    """With deadlines.collectiveSeconds set, the actor's process group carries it: a rank whose peer is stuck
    raises (the worker fails and is relaunched from its checkpoint) instead of waiting forever."""
    from mortal.workers.actor.sharded import free_port

    (tmp_path / "rank.py").write_text(RANK)
    port = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, str(tmp_path / "rank.py"), str(r), port], stdout=subprocess.PIPE, text=True
        )
        for r in (0, 1)
    ]
    try:
        out, _ = ranks[1].communicate(timeout=60)
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()
    assert "joined" in out
    found = re.search(r"raised after ([\d.]+) s", out)
    assert found, out
    assert float(found.group(1)) < 10
