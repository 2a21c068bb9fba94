"""Where a tool-calling task's generation goes: the calculator example's rollouts through the rollout's own
engine and tool loop, in this process, timed per read-back interval and profiled.

    python bench/turn_profile.py --model PATH.gguf [--warm-start 60] [--tasks 4] [--sync-every 2 8]
                                 [--switch-interval S ...] [--profile [--trace T.json.gz]] [--top 15]
                                 [--compile-scope layer|model] [--json out.json]
    # a smoke test, no figures:
    python bench/turn_profile.py --model FOLDER --cpu --warm-start 0 --tasks 1 --prompts 1 --gens 2

Why: bench/multiturn_gpu.py times whole steps through a controller, its rollout in another process; its
decode figures (from the rollout's log) say how many decode steps, appends and read-backs a task took, not
what a decode step costs on the GPU, nor how much of a task the GPU sat idle while Python handed turns over.
The steps:
  1. The model: the GGUF dequantized and warm-started as bench/multiturn_gpu.py does (its local_model,
     bench_spec and warm_start: the same demonstrations and SFT), so that it calls the tools.
  2. The engine and the tool loop as the rollout worker builds them from the example's spec
     (TransformersEngine with its CUDA graphs, MultiTurn over Toolbox.from_spec, the spec's generation).
  3. For each --sync-every (decode steps between the turn decoder's read-backs) and each --switch-interval
     (Python's: how long the decoding thread may wait for the GIL while the tool loop's threads parse and
     render turns): one untimed task (the shape's graphs are captured), then --tasks tasks of --prompts
     rows x --gens rollouts (the dataset's first rows, new seeds each task), each one engine call: wall
     seconds and the decoder's figures (decode steps, read-backs, appends, prefill, waits on tools) per
     task, and their medians.
  4. --profile (CUDA): one more task of the first --sync-every, Python's own switch interval, under torch's
     profiler: GPU kernel time against the task's wall time (the rest is the GPU idle), kernels a decode
     step, and the kernels by name; --trace writes its timeline.
Medians are over the timed tasks; compare sides within one invocation only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from learning_gpu import local_model  # noqa: E402
from multiturn_gpu import add_compile_scope, bench_spec, warm_start  # noqa: E402
from tool_loop_paths import timed  # noqa: E402


def build(model: Path, args: argparse.Namespace) -> tuple[Any, Any, list[dict[str, Any]]]:
    """(engine, multiturn, rows): what a rollout worker of the example holds, and the rows of a task."""
    from mortal.specs import TrainingRun
    from mortal.workers.data import load_rows
    from mortal.workers.models import load_tokenizer
    from mortal.workers.rollout.engines import GenerationParams, select_engine
    from mortal.workers.rollout.multiturn import MultiTurn
    from mortal.workers.rollout.tools import Toolbox

    run = TrainingRun.model_validate({"metadata": {"name": "bench-turns"}, "spec": bench_spec(model, args)})
    spec = run.spec
    device = "cpu" if args.cpu else "cuda"
    tokenizer = load_tokenizer(spec.model)
    engine = select_engine(spec.generation.engine, device).create(spec.model, tokenizer, device=device)
    params = GenerationParams.from_spec(spec.generation)
    multiturn = MultiTurn(
        engine, tokenizer, Toolbox.from_spec(spec.rollout), params, spec.rollout.chat_template
    )
    rows = load_rows(spec.dataset)[: args.prompts]
    return engine, multiturn, rows


def one_task(multiturn: Any, engine: Any, rows: list[dict[str, Any]], gens: int, seed: int) -> dict[str, Any]:
    """One engine call of every row's rollouts, as a rollout task: its wall seconds and decode figures."""
    from mortal.workers.messages import RolloutRequest

    requests = [
        RolloutRequest(prompt=row["prompt"], row=row, num_generations=gens, seed=seed * 1000 + k)
        for k, row in enumerate(rows)
    ]
    seconds, tokens, tool_calls = timed(multiturn, requests)
    return {"seconds": seconds, "tokens": tokens, "tool_calls": tool_calls, **engine.generation_stats()}


def profiled_task(multiturn: Any, engine: Any, rows: list[dict[str, Any]], args: argparse.Namespace) -> dict:
    """One task under torch's profiler: GPU kernel time, its share of the task's wall, kernels by name."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        task = one_task(multiturn, engine, rows, args.gens, seed=10_000)
    if args.trace is not None:
        write_trace(prof, args.trace)
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.device_time)
    by_time = sorted(((name, sum(t), len(t)) for name, t in kernels.items()), key=lambda r: -r[1])
    kernel_us = sum(us for _, us, _ in by_time)
    steps = max(task.get("decode_steps", 0), 1)
    return {
        "task": task,
        "gpu_kernel_seconds": kernel_us / 1e6,
        "gpu_kernel_share": kernel_us / 1e6 / task["seconds"],
        "kernels_per_decode_step": sum(n for _, _, n in by_time) / steps,
        "top": [
            {"name": name[:160], "ms": us / 1e3, "calls": n, "us_each": us / n}
            for name, us, n in by_time[: args.top]
        ],
    }


def write_trace(prof: Any, path: Path) -> None:
    """The profile's Chrome trace, gzipped at `path` (the JSON is many times larger than what a device call
    brings back)."""
    import gzip
    import shutil

    with tempfile.TemporaryDirectory(prefix="mortal-trace-") as tmp:
        plain = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(plain))
        with plain.open("rb") as source, gzip.open(path, "wb", compresslevel=9) as target:
            shutil.copyfileobj(source, target)
    print(f"trace: {path} ({path.stat().st_size / 2**20:.1f} MiB)", flush=True)


def medians(tasks: list[dict[str, Any]]) -> dict[str, float]:
    keys = sorted({k for t in tasks for k, v in t.items() if isinstance(v, (int, float))})
    return {k: statistics.median(t[k] for t in tasks if k in t) for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True, help="the SmolLM2 GGUF file (or a model folder)")
    parser.add_argument("--warm-start", type=int, default=60, metavar="N", help="SFT steps first (0: none)")
    parser.add_argument(
        "--demonstrations", type=int, default=400, help="dataset rows (its last) to demonstrate"
    )
    parser.add_argument("--prompts", type=int, default=8, help="dataset rows a task")
    parser.add_argument("--gens", type=int, default=8, help="rollouts of each row")
    parser.add_argument("--tasks", type=int, default=4, help="timed tasks for each --sync-every")
    parser.add_argument(
        "--sync-every",
        type=int,
        nargs="+",
        default=[2, 8],
        help="decode steps between read-backs, each a side",
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        nargs="+",
        default=[sys.getswitchinterval()],
        metavar="S",
        help="Python's thread switch interval during the timed tasks (sys.setswitchinterval), each a side "
        "with each --sync-every: how long the decode thread may wait for the GIL while the tool loop's "
        "threads parse and render turns",
    )
    parser.add_argument("--profile", action="store_true", help="one more task under torch's profiler (CUDA)")
    parser.add_argument("--top", type=int, default=15, help="kernels listed by the profile")
    parser.add_argument(
        "--trace",
        type=Path,
        help="with --profile: the profiled task's timeline (host calls and GPU kernels), a gzipped Chrome "
        "trace for chrome://tracing or Perfetto: where the GPU sits idle and what the host did meanwhile",
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cpu", action="store_true", help="a smoke test of the script on the CPU (no figures)"
    )
    add_compile_scope(parser)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    # what bench_spec and warm_start read, as bench/multiturn_gpu.py's defaults
    args.tool_delay, args.lr, args.steps, args.staleness = 0.0, 2e-5, 1, 0
    args.actor_compile, args.liger = False, False

    import torch

    model = local_model(args.model) if args.model.suffix == ".gguf" else args.model
    out: dict[str, Any] = {
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
        **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "json"},
        "sides": {},
    }
    with tempfile.TemporaryDirectory(prefix="mortal-turns-") as tmp:
        if args.warm_start:
            model = warm_start(model, bench_spec(model, args), args, Path(tmp))
        engine, multiturn, rows = build(model, args)
        try:
            python_default = sys.getswitchinterval()
            for sync_every, switch in itertools.product(args.sync_every, args.switch_interval):
                # untimed: the shape's graphs captured (on a CPU, the engine's turn decoder made)
                one_task(multiturn, engine, rows, args.gens, seed=99)
                engine.turns.sync_every = sync_every
                sys.setswitchinterval(switch)
                try:
                    tasks = [one_task(multiturn, engine, rows, args.gens, seed=s) for s in range(args.tasks)]
                finally:
                    sys.setswitchinterval(python_default)
                side = {"tasks": tasks, "medians": medians(tasks)}
                out["sides"][f"sync_every_{sync_every}_switch_{switch:g}"] = side
                print(
                    f"sync_every {sync_every}, switch {switch:g} s: {json.dumps(side['medians'])}", flush=True
                )
            if args.profile and not args.cpu:
                engine.turns.sync_every = args.sync_every[0]
                out["profile"] = profiled_task(multiturn, engine, rows, args)
                shown = {k: v for k, v in out["profile"].items() if k != "top"}
                print(f"profile (sync_every {args.sync_every[0]}): {json.dumps(shown)}", flush=True)
                for kernel in out["profile"]["top"]:
                    print(
                        f"  {kernel['ms']:9.2f} ms {kernel['calls']:6d} x {kernel['us_each']:7.2f} us  "
                        f"{kernel['name'][:100]}",
                        flush=True,
                    )
        finally:
            engine.close()
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
