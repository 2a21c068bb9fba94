"""Recovery on a GPU: kill -9 a rollout worker, then the actor, of a run training through the controller,
and time each part of getting back to training, with the compile cache cold (the run's first launch) and
warm (every relaunch: the run's folder keeps what the first workers compiled).

    python bench/recovery_gpu.py [--size 0.5b|1.5b] [--kill-at 3] [--rollouts 1] [--gpus 1]
                                 [--task-lease S] [--backoff S] [--cold-relaunch] [--json out.json]
                                 [--work DIR]
    python bench/recovery_gpu.py --device cpu --tiny      # smoke test: the CPU decoder does not compile

The run (bench/gpu_step.py's recipe): a random-init model of Qwen2.5's shape (0.5B or 1.5B; --tiny: two
layers) with SmolLM2's tokenizer, 8 prompts x 8 generations x 256 tokens a step, bf16 on a GPU, through a
`python -m mortal.controller` subprocess and a fresh SQLite store (bench/through_controller.py). Events:

    start         the run's first launch (compile cache empty: cold)
    rollout_kill  at step --kill-at, os.killpg(SIGKILL) of rollout 0's process group (its worker row's pid)
    actor_kill    two steps after training resumed, the same to the actor

For each: seconds from the kill (start: from apply) until the controller noticed (the old row left
Running), the new incarnation's row was created (relaunch) and its first heartbeat (up); from that
launch to the worker's first finished task (rollout) or the run's first step after the kill (actor);
from the kill to the next step's end; and what the relaunched rollout logged of its decode step's
first preparation ("prepared in 4.1 s (compile cache hit ...)"). `--cold-relaunch` empties the run's
compile cache just before each kill: the relaunch then pays the whole compile, as before the cache.
The controller runs with its defaults (restartPolicy backoff included: --backoff changes it). A task
the killed rollout held is queued again when the controller marks the rollout Lost (end_worker
releases its leases), not when its lease would have expired (60 s unless --task-lease): the JSON says
when that would have been, for comparison with the measured next step.
Needs a CUDA GPU (unless --device cpu), transformers, and SmolLM2's tokenizer (MORTAL_TEST_ASSETS).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from through_controller import controller_running, local_gpu

REWARD = "mortal.workers.rewards.builtin:short_answer"  # any cheap reward: recovery is what is timed
TOPICS = ["rivers", "a lighthouse", "prime numbers", "a lost key", "winter markets", "the moon", "old trains"]
SHAPES = {  # Qwen2.5's shapes (the anchor's 0.5B, and 1.5B), and a tiny one for the CPU smoke test
    "0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
    },
    "1.5b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
}
PREPARED = re.compile(r"decode shape (\d+) rows x (\d+)\+(\d+) tokens prepared in ([\d.]+) s \(([^:)]+)")
POLL = 0.05


def make_model(folder: Path, size: str, dtype: str) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    assets = Path(os.environ.get("MORTAL_TEST_ASSETS", "/work/shared/anchors/assets"))
    config = Qwen2Config(
        **SHAPES[size],
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(assets / "smollm2-tok").save_pretrained(folder)
    return folder


def spec(model: Path, data: Path, args: argparse.Namespace) -> dict:
    gpu = local_gpu() if args.device == "cuda" else "none"
    out = {
        "model": {"name": str(model), "dtype": args.dtype},
        "dataset": {"name": str(data)},
        "algorithm": {
            "numGenerations": args.gens,
            "batchSize": args.prompts * args.gens,
            "learningRate": 1e-6,
            "beta": 0.0,
            "maxSteps": args.steps,
            "maxStaleness": 0,
        },
        "generation": {"maxTokens": args.tokens, "engine": "transformers"},
        "rewards": [{"function": REWARD}],
        "actor": {"gpu": gpu},
        "rollout": {
            "gpu": gpu,
            "replicas": args.rollouts,
            "colocate": args.device == "cuda" and args.gpus == 1,
        },
        "checkpoint": {"every": 2, "keep": 2},
        "logging": {"wandb": {"mode": "disabled"}},
    }
    if args.backoff is not None:
        out["restartPolicy"] = {"backoffSeconds": args.backoff, "maxRestarts": 10}
    return out


def annotations(args: argparse.Namespace) -> dict[str, str]:
    return {} if args.task_lease is None else {"mortal.dev/task-lease-seconds": str(args.task_lease)}


class Watch:
    """The run as the store and the workers' logs show it, polled every POLL seconds."""

    def __init__(self, store: Any, name: str, home: Path) -> None:
        self.store, self.name, self.home = store, name, home

    def until(self, what: str, check: Any, timeout: float) -> Any:
        deadline = time.time() + timeout
        while time.time() < deadline:
            found = check()
            if found:
                return found
            phase = self.store.get_run(self.name).phase
            if phase in ("Failed", "Succeeded"):
                raise SystemExit(
                    f"the run ended {phase} while waiting for {what}: {self.store.get_run(self.name).status}"
                )
            time.sleep(POLL)
        raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what} (see {self.home})")

    def rows(self, role: str, replica: int) -> list[Any]:
        return sorted(
            (w for w in self.store.list_workers(self.name) if w.role == role and w.replica == replica),
            key=lambda w: w.incarnation,
        )

    def step(self) -> int:
        return self.store.get_run(self.name).status.get("step") or 0

    def step_ends(self) -> list[tuple[int, float]]:
        """(step, when its step_seconds metric was recorded): when each step ended, in epoch seconds."""
        return sorted(
            (m.step, m.time.timestamp()) for m in self.store.list_metrics(self.name, name="step_seconds")
        )

    def first_task_done(self, worker_id: str, from_step: int) -> float | None:
        """When the worker `worker_id` finished its first task (epoch seconds), looking from `from_step`
        on."""
        done = []
        for step in range(from_step, self.step() + 2):
            done += [
                t.done_at.timestamp()
                for t in self.store.step_results(self.name, step)
                if t.lease_holder == worker_id and t.state == "done" and t.done_at is not None
            ]
        return min(done) if done else None

    def prepared(self, role: str, replica: int, incarnation: int) -> list[dict]:
        """What the worker logged of its decode shapes' first preparations (compile seconds, cache
        verdict)."""
        from mortal.state import paths

        log = self.home / paths.worker_log(self.name, role, replica, incarnation).relative_to(
            paths.mortal_home()
        )
        if not log.exists():
            return []
        return [
            {"shape": f"{m[1]}x{m[2]}+{m[3]}", "seconds": float(m[4]), "verdict": m[5]}
            for m in PREPARED.finditer(log.read_text(errors="replace"))
        ]


def _pid(row: Any) -> int:
    return int(row.handle.partition(":")[0])


def measure_start(watch: Watch, applied: float, timeout: float) -> dict:
    """The run's first launch: from apply to each worker up, rollout 0's first task, the first step's end."""
    watch.until("the first step", lambda: watch.step_ends(), timeout)
    actor, rollout = watch.rows("actor", 0)[0], watch.rows("rollout", 0)[0]
    first_task = watch.first_task_done(f"{watch.name}/rollout-0#{rollout.incarnation}", 0)
    first_step = watch.step_ends()[0][1]
    return {
        "actor_launched_s": round(actor.started_at.timestamp() - applied, 3),
        "rollout_launched_s": round(rollout.started_at.timestamp() - applied, 3),
        "rollout_launch_to_first_task_s": first_task
        and round(first_task - rollout.started_at.timestamp(), 3),
        "actor_launch_to_first_step_s": round(first_step - actor.started_at.timestamp(), 3),
        "apply_to_first_step_end_s": round(first_step - applied, 3),
        "rollout_prepared": watch.prepared("rollout", 0, rollout.incarnation),
    }


def measure_kill(watch: Watch, role: str, cache: Path, cold: bool, timeout: float) -> dict:
    """kill -9 the live `role`-0 worker and time its way back: noticed, relaunched, up, first work, next
    step."""
    [old] = [w for w in watch.rows(role, 0) if w.state == "Running"][-1:]
    if cold:
        shutil.rmtree(cache, ignore_errors=True)  # the relaunch compiles from nothing, as before the cache
    step_at_kill = watch.step()
    old_id = f"{watch.name}/{role}-0#{old.incarnation}"
    os.killpg(_pid(old), signal.SIGKILL)
    killed = time.time()
    held = [
        t.lease_expires_at.timestamp()
        for step in range(max(0, step_at_kill - 1), step_at_kill + 2)
        for t in watch.store.step_results(watch.name, step)
        if t.lease_holder == old_id and t.state == "leased" and t.lease_expires_at is not None
    ]

    def noticed() -> float | None:
        [row] = [w for w in watch.rows(role, 0) if w.incarnation == old.incarnation]
        if row.state == "Running":
            return None
        return row.ended_at.timestamp() if row.ended_at else time.time()

    t_noticed = watch.until(f"the {role}'s death to be noticed", noticed, timeout)
    new = watch.until(
        f"a new {role}", lambda: [w for w in watch.rows(role, 0) if w.incarnation > old.incarnation], timeout
    )[0]
    t_launched = new.started_at.timestamp()
    watch.until(
        f"the new {role}'s first heartbeat",
        lambda: next(w for w in watch.rows(role, 0) if w.id == new.id).state == "Running",
        timeout,
    )
    t_up = time.time()
    t_next_step = watch.until(
        "a step to end after the kill",
        lambda: next((t for _, t in watch.step_ends() if t > killed), None),
        timeout,
    )
    out = {
        "step_at_kill": step_at_kill,
        "cache": "emptied before the kill (cold relaunch)" if cold else "kept (warm relaunch)",
        "kill_to_noticed_s": round(t_noticed - killed, 3),
        "noticed_to_relaunched_s": round(t_launched - t_noticed, 3),
        "launch_to_up_s": round(t_up - t_launched, 3),
        "kill_to_next_step_end_s": round(t_next_step - killed, 3),
        # when the dead worker's task lease would have run out (the controller releases it sooner, at Lost)
        "kill_to_dead_workers_task_lease_expiry_s": round(max(held) - killed, 3) if held else None,
    }
    if role == "rollout":
        worker_id = f"{watch.name}/rollout-0#{new.incarnation}"
        t_task = watch.until(
            "the new rollout's first task", lambda: watch.first_task_done(worker_id, step_at_kill), timeout
        )
        out["launch_to_first_task_s"] = round(t_task - t_launched, 3)
        out["rollout_prepared"] = watch.prepared("rollout", 0, new.incarnation)
    else:
        out["launch_to_first_step_s"] = round(t_next_step - t_launched, 3)
        out["rollout_prepared"] = []  # colocated rollouts that were relaunched with the actor
        for row in watch.store.list_workers(watch.name):
            if row.role == "rollout" and row.started_at.timestamp() > killed:
                out["rollout_prepared"] += watch.prepared("rollout", row.replica, row.incarnation)
    return out


def kill_leftovers(home: Path) -> None:
    """SIGKILL worker processes of this home still alive (a run cut short by a timeout)."""
    for proc in psutil.process_iter(["environ"]):
        env = proc.info.get("environ") or {}
        if "MORTAL_WORKER_ID" in env and os.path.realpath(env.get("MORTAL_HOME", "")) == os.path.realpath(
            home
        ):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--size", choices=["0.5b", "1.5b"], default="0.5b")
    parser.add_argument(
        "--tiny", action="store_true", help="a two-layer model (with --device cpu: a smoke test)"
    )
    parser.add_argument("--kill-at", type=int, default=3, help="kill rollout 0 once the run is at this step")
    parser.add_argument("--rollouts", type=int, default=1)
    parser.add_argument("--gpus", type=int, default=1, help="1: rollouts colocated on the actor's GPU")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--gens", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--backoff", type=float, default=None, help="spec.restartPolicy.backoffSeconds")
    parser.add_argument(
        "--task-lease",
        type=float,
        default=None,
        help="seconds a rollout's task lease lasts (annotation mortal.dev/task-lease-seconds; default 60)",
    )
    parser.add_argument(
        "--cold-relaunch", action="store_true", help="empty the compile cache before each kill"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for any one thing")
    parser.add_argument(
        "--work", type=Path, default=None, help="keep the run's files here (default: a temp dir)"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.device == "cpu":  # what a CPU run can afford; the figures are only a smoke test there
        args.prompts, args.gens, args.tokens = min(args.prompts, 2), min(args.gens, 4), min(args.tokens, 16)
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    args.steps = (
        args.kill_at + 8
    )  # the rollout's recovery, two steps, the actor's (from a checkpoint), a margin

    from mortal.specs import TrainingRun
    from mortal.state import paths

    work = args.work or Path(tempfile.mkdtemp(prefix="mortal-recovery-"))
    work.mkdir(parents=True, exist_ok=True)
    size = "tiny" if args.tiny else args.size
    model = make_model(work / "model", size, args.dtype)
    data = work / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"Write a long, detailed story about {TOPICS[i % 7]} number {i}."}) + "\n"
            for i in range(64)
        )
    )
    run = TrainingRun.model_validate(
        {
            "metadata": {"name": "bench-recovery", "annotations": annotations(args)},
            "spec": spec(model, data, args),
        }
    )
    home = work / "mortal-home"
    cache = paths.compile_cache_dir(home)
    result: dict[str, Any] = {
        "device": args.device,
        "model": size,
        "rollouts": args.rollouts,
        "gpus": args.gpus,
        "task_lease_seconds": args.task_lease,
        "backoff_seconds": args.backoff,
        "prompts_x_gens_x_tokens": [args.prompts, args.gens, args.tokens],
        "work": str(work),
        "compile_cache": str(cache),
    }
    print(f"work folder {work}; compile cache {cache}", flush=True)
    try:
        applied = time.time()
        with controller_running(run, work) as store:
            watch = Watch(store, run.name, home)
            result["start"] = measure_start(watch, applied, args.timeout)
            print("start (cold cache):", json.dumps(result["start"]), flush=True)
            watch.until(f"step {args.kill_at}", lambda: watch.step() >= args.kill_at, args.timeout)
            result["rollout_kill"] = measure_kill(watch, "rollout", cache, args.cold_relaunch, args.timeout)
            print("rollout kill:", json.dumps(result["rollout_kill"]), flush=True)
            resumed = watch.step()
            watch.until(f"step {resumed + 2}", lambda: watch.step() >= resumed + 2, args.timeout)
            result["actor_kill"] = measure_kill(watch, "actor", cache, args.cold_relaunch, args.timeout)
            print("actor kill:", json.dumps(result["actor_kill"]), flush=True)
            watch.until(
                "the run to succeed", lambda: store.get_run(run.name).phase == "Succeeded", args.timeout
            )
            result["restarts"] = store.get_run(run.name).status.get("restarts")
    finally:
        kill_leftovers(home)
    print(json.dumps(result, indent=2), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
