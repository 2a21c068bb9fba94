"""Test helpers of the actor-side tests: runs in a store, worker contexts, an in-process rollout.

Imported by tests/workers/actor/ (test_actor*.py, test_checkpoint.py, test_trl_seam.py,
test_padding_shift.py), sync/test_weights.py and test_exact_resume.py.
`run_actor_with_rollout` runs the real actor `main(ctx)` in this thread and the real rollout
worker loop in a background thread, against one store, so a whole run of a tiny model takes
seconds; the subprocess tests in test_exact_resume.py run both as `python -m mortal.workers.main`.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any

import torch

from mortal.specs import TrainingRun
from mortal.state.store import Store, WorkerRef
from mortal.workers.runtime import WorkerContext

# A task lease short enough that a killed worker's task is taken again within seconds (the kill tests).
SHORT_TASK_LEASE = {"mortal.dev/task-lease-seconds": "4"}


def create_run(
    store: Store, name: str, spec: dict[str, Any], annotations: dict[str, str] | None = None
) -> TrainingRun:
    """Apply a run (validated through TrainingRun first) and return it as workers see it."""
    run = TrainingRun.model_validate(
        {"metadata": {"name": name, "annotations": annotations or {}}, "spec": spec}
    )
    row, _ = store.apply_run(name, run.spec_dict(), annotations=annotations or {})
    return row.document()  # as workers read it (mortal.workers.runtime.load_run): generation and all


def worker_context(
    store: Store, run: TrainingRun, role: str, replica: int = 0, lease: float = 60.0
) -> WorkerContext:
    """A new incarnation of the slot (as the controller would create it) and its context."""
    row = store.create_worker(run.name, role, replica, "local", lease_seconds=lease)
    ref = WorkerRef(run=run.name, role=role, replica=replica, incarnation=row.incarnation)
    return WorkerContext(store, ref, run, heartbeat_seconds=0.5)


class RolloutThread:
    """The real rollout worker loop (mortal.workers.rollout) in a daemon thread."""

    def __init__(self, store: Store, run: TrainingRun, replica: int = 0) -> None:
        from mortal.workers.rollout import loop as rollout

        self.ctx = worker_context(store, run, "rollout", replica)
        self.ctx.check_fence()
        self.worker = rollout.build(self.ctx)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="test-rollout", daemon=True)

    def _run(self) -> None:
        try:
            self.worker.run()
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def __enter__(self) -> RolloutThread:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        self.ctx.stopping.set()
        self.thread.join(timeout=60)
        if self.error is not None:
            raise self.error


def run_actor_with_rollout(store: Store, run: TrainingRun, stop_after_step: int | None = None) -> int:
    """Run the actor to its end (or until it is asked to stop after `stop_after_step`); its exit code."""
    from mortal.workers.actor import loop as actor

    ctx = worker_context(store, run, "actor")
    ctx.check_fence()
    if stop_after_step is not None:
        _stop_after(ctx, stop_after_step)
    with RolloutThread(store, run):
        return actor.main(ctx)


def _stop_after(ctx: WorkerContext, step: int) -> None:
    """Set ctx.stopping once the actor reports `step` (as SIGTERM would, between two steps)."""
    report = ctx.report

    def watching(step: int | None = None, weight_version: int | None = None, _at: int = step) -> None:
        report(step, weight_version)
        if step is not None and step >= _at:
            ctx.stopping.set()

    ctx.report = watching  # type: ignore[method-assign]


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def final_weights_hash(store: Store, run: str) -> tuple[int, str]:
    """(step, sha256 of the tensors) of the newest published weights; tensors only, so a file
    header that differs (version numbers) does not count."""
    from mortal.workers.sync.volume import read_published

    latest = store.latest_weights(run)
    assert latest is not None, "no weights were published"
    return latest.step, tensors_sha256(read_published(latest.path))


def final_checkpoint_hash(store: Store, run: str, step: int) -> str:
    """sha256 of the tensors of the run's newest checkpoint, which must be of `step` (a local path or a
    file:// storage URL)."""
    from safetensors.torch import load_file

    from mortal.workers.actor.storage import local_path

    row = store.latest_checkpoint(run)
    assert row is not None and row.step == step, (run, row)
    return tensors_sha256(load_file(str(local_path(row.path) / "model.safetensors")))


def tensors_sha256(state: dict[str, Any]) -> str:
    """sha256 over names, dtypes and raw bytes: equal only for bit-for-bit equal weights."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def parity_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """A reward that varies within a group even for a random model (so every step has a gradient)."""
    return [float(sum(ids) % 2) for ids in completion_ids]


FREEZE_COUNTS: list[int] = []


def freeze_probe_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """parity_reward that also records how many objects the garbage collector has frozen as it scores (an
    in-process rollout scores while the actor's loop runs: see test_actor.py)."""
    import gc

    FREEZE_COUNTS.append(gc.get_freeze_count())
    return parity_reward(completion_ids)


def actor_spec(model_dir: str, **overrides: Any) -> dict[str, Any]:
    """A tiny CPU run: 2 prompts x 4 completions of 6 tokens per step, a reward with variance."""
    from rollout_helpers import training_spec

    spec = training_spec(
        model_dir,
        rewards=[
            {"function": "actor_helpers:parity_reward"},
            {"function": "mortal.workers.rewards.builtin:correct_answer", "weight": 0.5},
        ],
        generation={"maxTokens": 6, "engine": "transformers"},
        algorithm={"numGenerations": 4, "batchSize": 8, "maxSteps": 3, "learningRate": 1e-2},
        checkpoint={"every": 2, "keep": 2},
        logging={"wandb": {"mode": "disabled"}},
    )
    for key, value in overrides.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec


def randomize_lora_b(model: Any) -> None:
    """LoRA's B matrices start at zero, which leaves A without a gradient: give every B small seeded values,
    so that a gradient comparison compares both."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1, generator=torch.Generator().manual_seed(len(name)))


def assert_same_gradients(grads: dict[str, Any], want: dict[str, Any], tolerance: float = 1e-4) -> None:
    """The same parameters' gradients, each within `tolerance` of its own scale (float32 sums in another
    order); a zero expected gradient would compare nothing, so it fails."""
    assert set(grads) == set(want)
    for name, grad in grads.items():
        scale = want[name].abs().max().item()
        assert scale > 0, f"{name}: a zero gradient compares nothing"
        torch.testing.assert_close(
            grad, want[name], rtol=tolerance, atol=tolerance * scale, msg=lambda m, n=name: f"{n}: {m}"
        )
