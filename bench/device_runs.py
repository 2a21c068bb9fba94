"""The benches' GPU runs as named groups, each sized for one call of a lent GPU machine (10 minutes).

Each headline figure in docs/benchmarks.md names the group that reproduces it. On the GPU machine, from the
repository root, after scripts/device-setup.sh has installed what its image lacks (it leaves the shell in
/tmp with $R the repository root):

    source scripts/device-setup.sh && python3 "$R/bench/device_runs.py" GROUP
    python3 bench/device_runs.py --list                 # the groups, what each needs, its steps
    python3 bench/device_runs.py GROUP --dry-run        # the commands, without running them (no GPU needed)
    python3 bench/device_runs.py GROUP --only STEP ...  # some steps of a group (those a cut-short call left)

Every bench step writes $OUT/STEP.json (the bench's own JSON); every step appends its whole output to
$OUT/all.log, and one that fails leaves mortal's controller and worker logs (or the tests' temporary
folders) in $OUT/logs-STEP.tgz. A step begins only while its
time limit still fits in the call (--call-seconds): the steps left out are printed, to run with --only in the
next call. A step past its limit gets SIGTERM first, on which the benches save what they measured and delete
their runs, and SIGKILL 30 s later. Copy what comes back into bench/results/ under a name that says the
device and the run, and record it in docs/benchmarks.md with its command.

A group's `needs` is checked before anything runs: the GPUs it uses, SmolLM2's tokenizer and configs
($MORTAL_TEST_ASSETS, as the tests), or the SmolLM2 GGUF ($MORTAL_BENCH_GGUF, by default the file
scripts/device-setup.sh joins from the parts scripts/device-gguf.sh cuts).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
GRACE_SECONDS = 30
# The lines of a bench's output worth seeing in the call's reply; the whole output is in all.log.
HIGHLIGHTS = re.compile(
    r"s/step|busy|peak|mortal / TRL|weight sync|limits|memory choices|median step"
    r"|final reward|passed|failed|Error|Traceback"
)


@dataclass(frozen=True)
class Bench:
    """One invocation of a script of bench/; its JSON is $OUT/NAME.json (the runner adds `--json`)."""

    name: str
    script: str
    args: tuple[str, ...]
    limit_s: int
    logs: bool = False  # the script copies mortal's logs with --logs: kept when the step fails
    env: tuple[tuple[str, str], ...] = ()  # variables set for this step alone

    def command(self, out: Path, logs: Path, gguf: Path, work: Path) -> list[str]:
        assets = os.environ.get("MORTAL_TEST_ASSETS", "$MORTAL_TEST_ASSETS")
        args = [arg.format(gguf=gguf, work=work, out=out, assets=assets) for arg in self.args]
        command = [sys.executable, str(BENCH / self.script), *args, "--json", str(out / f"{self.name}.json")]
        return command + (["--logs", str(logs / self.name)] if self.logs else [])


@dataclass(frozen=True)
class GpuTests:
    """The tests marked `gpu` in these files (paths from the repository root), `-k SELECT` when given."""

    name: str
    paths: tuple[str, ...]
    limit_s: int
    select: str = ""

    def command(self, out: Path, logs: Path, gguf: Path, work: Path) -> list[str]:
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "gpu",
            f"--basetemp={logs / self.name}",
            *(str(REPO / path) for path in self.paths),
        ]
        return command + (["-k", self.select] if self.select else [])


Step = Bench | GpuTests


@dataclass(frozen=True)
class Group:
    about: str
    steps: tuple[Step, ...]
    gpus: int = 1
    assets: bool = True  # SmolLM2's tokenizer and the shapes' configs ($MORTAL_TEST_ASSETS)
    gguf: bool = False  # the SmolLM2 GGUF (the learning and tool-calling benches train the real model)


def gpu_step(name: str, limit_s: int, *args: str) -> Bench:
    return Bench(name, "gpu_step.py", args, limit_s, logs=True)


def learning(name: str, seed: int, *args: str, limit_s: int = 180) -> Bench:
    """mortal's side of the learning bench, one seed alone on the GPU, TF32 matmuls (what a user turns on)."""
    args = ("--model", "{gguf}", "--only", "mortal", "--seed", str(seed), "--tf32", *args)
    return Bench(name, "learning_gpu.py", args, limit_s, logs=True)


ONE_GPU = ("--steps", "6", "--rollouts", "1")
TWO_GPUS = ("--steps", "6", "--gpus", "2", "--actor-gpus", "2", "--rollouts", "2", "--prompts", "16")
MORTAL = ("--only", "mortal")
SEVEN_B = ("--shape", "7b", "--micro-batch", "8", "--steps", "4")
SEVEN_B_LORA = ("--shape", "7b", "--lora", "16", "--micro-batch", "8", "--steps", "4")
# a tool-calling step's training (the calculator example's shape, bench/multiturn_gpu.py)
TOOL_STEP = (
    "--precision",
    "bf16",
    "--prompt-len",
    "417",
    "--shared-prefix",
    "397",
    "--completion-len",
    "115",
    "--actor-forward",
    "--steps",
    "8",
)
FUSED_LOSS = (
    "--precision",
    "bf16",
    "--loss",
    "fused",
    "full",
    "--prompt-len",
    "32",
    "--completion-len",
    "256",
    "--fixed-lengths",
    "--steps",
    "6",
)
LOSS_SHAPES = (
    ("0.5b", "151936", "64"),
    ("0.5b", "49152", "64"),
    ("1.5b", "151936", "16"),
    ("3b", "151936", "8"),
)  # shape, vocabulary, completions a pass

GROUPS: dict[str, Group] = {
    # -- one GPU: the 0.5B shape beside TRL ----------------------------------------------------------------
    "one-gpu": Group(
        "mortal / TRL tokens per second at the defaults (0.5B shape, one colocated rollout); also decode "
        "ms a step and the weight sync's publish + load",
        (gpu_step("one_gpu", 420, *ONE_GPU),),
    ),
    "one-gpu-compiled": Group(
        "the same with actor.compile (a layer at a time): mortal / TRL, the update's MFU, decode ms a step",
        (
            gpu_step(
                "one_gpu_compiled",
                420,
                "--steps",
                "7",
                "--rollouts",
                "1",
                "--compile",
                "mortal",
                "--actor-compile-scope",
                "layer",
            ),
        ),
    ),
    "staleness-liger": Group(
        "mortal alone: on-policy, maxStaleness 1, and maxStaleness 1 with Liger's kernels in the actor",
        (
            gpu_step("one_gpu", 170, *ONE_GPU, *MORTAL),
            gpu_step("one_gpu_st1", 170, *ONE_GPU, "--staleness", "1", *MORTAL),
            gpu_step("one_gpu_st1_liger", 170, *ONE_GPU, "--staleness", "1", *MORTAL, "--liger", "mortal"),
        ),
    ),
    # -- one GPU: larger models beside TRL -----------------------------------------------------------------
    "one-gpu-1.5b": Group(
        "Qwen2.5-1.5B's shape beside TRL, micro batch 16 on both sides",
        (gpu_step("one_gpu_1.5b_mb16", 400, "--shape", "1.5b", "--micro-batch", "16", "--steps", "6"),),
    ),
    "one-gpu-1.5b-checkpointing": Group(
        "the same with gradient checkpointing on both sides",
        (
            gpu_step(
                "one_gpu_1.5b_mb16_gc",
                400,
                "--shape",
                "1.5b",
                "--micro-batch",
                "16",
                "--gradient-checkpointing",
                "--steps",
                "4",
            ),
        ),
    ),
    "micro-batch-cost": Group(
        "what halving algorithm.microBatchSize costs at 1.5B (mortal alone): 8 against 16",
        tuple(
            gpu_step(
                f"one_gpu_1.5b_mb{micro}",
                250,
                *MORTAL,
                "--shape",
                "1.5b",
                "--micro-batch",
                micro,
                "--steps",
                "4",
            )
            for micro in ("8", "16")
        ),
    ),
    "one-gpu-3b": Group(
        "Qwen2.5-3B's shape beside TRL, micro batch 8 on both sides",
        (gpu_step("one_gpu_3b_mb8", 500, "--shape", "3b", "--micro-batch", "8", "--steps", "4"),),
    ),
    "seven-b-lora": Group(
        "Qwen2.5-7B's shape, rank-16 LoRA on both sides, beside TRL (the adapters through the ipc ring)",
        (gpu_step("seven_b_lora", 570, *SEVEN_B_LORA),),
    ),
    "seven-b-full-one-gpu": Group(
        "Qwen2.5-7B's shape, full fine-tune, actor and rollout on ONE GPU beside TRL: needs an H200",
        (gpu_step("seven_b_full_one_gpu", 570, *SEVEN_B),),
    ),
    # -- one GPU: the micro batch the operator chooses (no --micro-batch on mortal's side) -------------------
    "heal-1.5b": Group(
        "1.5B with the micro batch mortal chooses (apply's estimate, halved after an out-of-memory), "
        "beside TRL given 16 by hand",
        (gpu_step("heal_1.5b", 570, "--shape", "1.5b", "--steps", "4", "--trl-micro-batch", "16"),),
    ),
    "heal-3b": Group(
        "3B, the same, TRL given 8",
        (gpu_step("heal_3b", 570, "--shape", "3b", "--steps", "4", "--trl-micro-batch", "8"),),
    ),
    "heal-7b-lora": Group(
        "7B with rank-16 LoRA, the same, TRL given 8",
        (
            gpu_step(
                "heal_7b_lora", 570, "--shape", "7b", "--lora", "16", "--steps", "4", "--trl-micro-batch", "8"
            ),
        ),
    ),
    # -- one GPU: parts of the step alone --------------------------------------------------------------------
    "fused-loss": Group(
        "TRL's training step alone: its fused LM head against whole-vocabulary logits, at Qwen2.5's shapes",
        tuple(
            Bench(
                f"fused_loss_{shape}_v{vocab}",
                "train_step.py",
                ("--shape", shape, "--vocab", vocab, "--micro-batch", micro, *FUSED_LOSS),
                140,
            )
            for shape, vocab, micro in LOSS_SHAPES
        ),
        assets=False,
    ),
    "decode-lengths": Group(
        "generation alone, completions of drawn lengths: mortal's decoder against transformers' generate "
        "as TRL calls it",
        (Bench("decode_lengths_drawn", "decode_lengths.py", ("--source", "drawn"), 400),),
    ),
    "regional": Group(
        "the decode step compiled a layer for all against the whole model, twice: prepare seconds and ms "
        "a decode step",
        tuple(
            Bench(f"regional_compile_24l_run{run}", "regional_compile.py", ("--layers", "24"), 240)
            for run in (1, 2)
        ),
    ),
    "recovery": Group(
        "a rollout and then the actor killed with SIGKILL mid-run: seconds until each trains again",
        (Bench("recovery", "recovery_gpu.py", (), 560),),
    ),
    # -- one GPU: the real model (SmolLM2-135M) --------------------------------------------------------------
    "learning-trl": Group(
        "TRL's side of the learning bench, seed 0, TF32; its 200 steps outlast a call, so run this group "
        "twice on one warm machine (the second resumes TRL; its reload is not counted against TRL)",
        (
            Bench(
                "learning_trl_s0",
                "learning_gpu.py",
                (
                    "--model",
                    "{gguf}",
                    "--only",
                    "trl",
                    "--seed",
                    "0",
                    "--tf32",
                    "--max-seconds",
                    "480",
                    "--trl-resume-dir",
                    "{work}/trl-s0",
                ),
                580,
            ),
        ),
        gguf=True,
    ),
    "learning-mortal-a": Group(
        "mortal's side of the learning bench, on-policy seeds 0-2, each alone on the GPU",
        tuple(learning(f"learning_mortal_s{seed}_st0", seed, "--staleness", "0") for seed in (0, 1, 2)),
        gguf=True,
    ),
    "learning-mortal-b": Group(
        "the same, seeds 3-5",
        tuple(learning(f"learning_mortal_s{seed}_st0", seed, "--staleness", "0") for seed in (3, 4, 5)),
        gguf=True,
    ),
    "learning-mortal-overlap": Group(
        "the same with maxStaleness 1, seeds 0 and 1",
        tuple(learning(f"learning_mortal_s{seed}_st1", seed, "--staleness", "1") for seed in (0, 1)),
        gguf=True,
    ),
    "multiturn": Group(
        "tool-calling rollouts (the calculator example) beside TRL's own tool loop, both warm-started "
        "on demonstrations",
        (
            Bench(
                "multiturn",
                "multiturn_gpu.py",
                ("--model", "{gguf}", "--steps", "20", "--warm-start", "60"),
                590,
            ),
        ),
        gguf=True,
    ),
    "multiturn-overlap": Group(
        "the same with maxStaleness 1 (generation of step s+1 beside training of step s on the one GPU)",
        (
            Bench(
                "multiturn_overlap",
                "multiturn_gpu.py",
                ("--model", "{gguf}", "--steps", "20", "--warm-start", "60", "--staleness", "1"),
                590,
            ),
        ),
        gguf=True,
    ),
    "multiturn-overlap-compile": Group(
        "the same with the actor compiled (actor.compile: its shared prompt prefix trains as one packed "
        "row); mortal's logs (where its start-up goes) in multiturn_overlap_compile_logs/",
        (
            Bench(
                "multiturn_overlap_compile",
                "multiturn_gpu.py",
                (
                    "--model",
                    "{gguf}",
                    "--steps",
                    "20",
                    "--warm-start",
                    "60",
                    "--staleness",
                    "1",
                    "--actor-compile",
                    "--logs",
                    "{out}/multiturn_overlap_compile_logs",
                ),
                590,
            ),
        ),
        gguf=True,
    ),
    "multiturn-train": Group(
        "where mortal's training of the calculator example goes: a profiled optimizer step (its tables and "
        "mortal's logs in multiturn_train_profile_logs/), then the actor compiled, then Liger's kernels "
        "(mortal's side only)",
        (
            Bench(
                "multiturn_train_profile",
                "multiturn_gpu.py",
                (
                    "--model",
                    "{gguf}",
                    "--steps",
                    "8",
                    "--warm-start",
                    "60",
                    "--only",
                    "mortal",
                    "--profile-step",
                    "6",
                    "--logs",
                    "{out}/multiturn_train_profile_logs",
                ),
                200,
            ),
            Bench(
                "multiturn_train_compile",
                "multiturn_gpu.py",
                (
                    "--model",
                    "{gguf}",
                    "--steps",
                    "12",
                    "--warm-start",
                    "60",
                    "--only",
                    "mortal",
                    "--actor-compile",
                ),
                200,
            ),
            Bench(
                "multiturn_train_liger",
                "multiturn_gpu.py",
                ("--model", "{gguf}", "--steps", "12", "--warm-start", "60", "--only", "mortal", "--liger"),
                180,
            ),
        ),
        gguf=True,
    ),
    "multiturn-train-step": Group(
        "the actor's training step alone on the calculator example's shape (SmolLM2's, random weights, 8 x 8 "
        "rows of a 417-token prompt whose first 397 tokens every row shares, 115-token completions): the "
        "shared prefix as one packed row eager and compiled, then every row's whole prompt, twice",
        tuple(
            step
            for run in (1, 2)
            for step in (
                Bench(
                    f"train_step_packed_run{run}",
                    "train_step.py",
                    ("--model", "{assets}/smollm2-cfg", *TOOL_STEP, "--kernels", "eager", "compile"),
                    200,
                ),
                Bench(
                    f"train_step_rows_run{run}",
                    "train_step.py",
                    ("--model", "{assets}/smollm2-cfg", *TOOL_STEP, "--kernels", "eager"),
                    90,
                    env=(("MORTAL_SHARED_PREFIX", "0"),),
                ),
            )
        ),
    ),
    "multiturn-learning": Group(
        "the calculator example learning beside TRL's tool loop: reward against wall-clock, time to TRL's "
        "final reward (the learning block); a short warm start, so that the reward starts below its ceiling",
        (
            Bench(
                "multiturn_learning",
                "multiturn_gpu.py",
                ("--model", "{gguf}", "--steps", "60", "--warm-start", "6", "--reward-window", "10"),
                590,
            ),
        ),
        gguf=True,
    ),
    "multiturn-learning-mixed": Group(
        "the same learning in mixed precision on both sides (float32 weights, bf16 compute: TRL's bf16 "
        "over a float32 model, mortal's actor.mixedPrecision), where bf16 weights lost the updates; mortal "
        "with maxStaleness 1 (generation beside training)",
        (
            Bench(
                "multiturn_learning_mixed",
                "multiturn_gpu.py",
                (
                    "--model",
                    "{gguf}",
                    "--steps",
                    "60",
                    "--warm-start",
                    "6",
                    "--reward-window",
                    "10",
                    "--dtype",
                    "mixed",
                    "--staleness",
                    "1",
                ),
                590,
            ),
        ),
        gguf=True,
    ),
    "multiturn-slow-tool": Group(
        "tool-calling rollouts with every environment tool call waiting a second, beside TRL's tool loop: "
        "tokens per second and the GPU's busy fraction",
        (
            Bench(
                "multiturn_slow_tool",
                "multiturn_gpu.py",
                (
                    "--model",
                    "{gguf}",
                    "--steps",
                    "5",
                    "--warm-start",
                    "60",
                    "--prompts",
                    "4",
                    "--gens",
                    "4",
                    "--tool-delay",
                    "1",
                ),
                590,
            ),
        ),
        gguf=True,
    ),
    "turn-profile": Group(
        "where a tool-calling task's generation goes: the calculator example's rollouts through the "
        "rollout's engine and tool loop in one process, read-backs every 2 and every 8 decode steps, "
        "Python's thread switch interval as it is and a tenth of it, one task profiled",
        (
            Bench(
                "turn_profile",
                "turn_profile.py",
                (
                    "--model",
                    "{gguf}",
                    "--warm-start",
                    "60",
                    "--tasks",
                    "4",
                    "--sync-every",
                    "2",
                    "8",
                    "--switch-interval",
                    "0.005",
                    "0.0005",
                    "--profile",
                    "--trace",
                    "{out}/turn_profile_trace.json.gz",
                ),
                300,
            ),
        ),
        gguf=True,
    ),
    "turn-profile-scope": Group(
        "a tool-calling task's generation with the decode step compiled one layer for all against the "
        "whole model (generation.compileScope), each in its own process: read-backs every 2 decode steps, "
        "8 timed tasks each",
        tuple(
            Bench(
                f"turn_profile_scope_{scope}",
                "turn_profile.py",
                ("--model", "{gguf}", "--warm-start", "60", "--tasks", "8", "--sync-every", "2")
                + ("--compile-scope", scope),
                200,
            )
            for scope in ("layer", "model")
        ),
        gguf=True,
    ),
    "gpu-tests": Group(
        "the GPU-marked tests of one GPU: runs through the controller, the decoder, the loss's padding shift",
        (
            GpuTests(
                "gpu_tests",
                (
                    "tests/workers/test_gpu.py",
                    "tests/workers/actor/test_padding_shift.py",
                    "tests/workers/rollout/engines/test_static_decode.py",
                    "tests/workers/rollout/engines/test_turn_decode.py",
                    "tests/workers/rollout/engines/test_hashed_noise.py",
                    "tests/workers/rollout/engines/test_prefix_cache.py",
                ),
                560,
            ),
        ),
    ),
    # -- two GPUs of one host --------------------------------------------------------------------------------
    "two-gpus-ddp": Group(
        "two GPUs' tokens per second against one GPU's in one call: the actor replicated (ddp) with a "
        "rollout beside it on each GPU, on-policy and maxStaleness 1",
        (
            gpu_step("one_gpu", 170, *ONE_GPU, *MORTAL),
            gpu_step("two_gpus_ddp_st0", 200, *TWO_GPUS, "--strategy", "ddp", *MORTAL),
            gpu_step("two_gpus_ddp_st1", 180, *TWO_GPUS, "--strategy", "ddp", "--staleness", "1", *MORTAL),
        ),
        gpus=2,
    ),
    "two-gpus-fsdp": Group(
        "the same with the actor sharded (FSDP2)",
        (
            gpu_step("one_gpu", 170, *ONE_GPU, *MORTAL),
            gpu_step("two_gpus_fsdp_st0", 200, *TWO_GPUS, *MORTAL),
            gpu_step("two_gpus_fsdp_st1", 180, *TWO_GPUS, "--staleness", "1", *MORTAL),
        ),
        gpus=2,
    ),
    "two-gpus-split": Group(
        "the actor on one GPU and the rollout on the other, beside TRL on one GPU",
        (gpu_step("two_gpus_split", 420, "--steps", "6", "--gpus", "2", "--rollouts", "1"),),
        gpus=2,
    ),
    "sync-two-gpus": Group(
        "weight sync to a rollout on a GPU of its own, nccl then ipc (mortal alone): publish and load ms",
        tuple(
            gpu_step(
                f"sync_{method}",
                200,
                "--steps",
                "6",
                "--gpus",
                "2",
                "--rollouts",
                "1",
                *MORTAL,
                "--sync",
                method,
            )
            for method in ("nccl", "ipc")
        ),
        gpus=2,
    ),
    "seven-b-two-gpus": Group(
        "Qwen2.5-7B's shape, full fine-tune, sharded over two GPUs with a rollout on each, beside TRL with "
        "FSDP2: needs two H200s",
        (gpu_step("seven_b_two_gpus", 570, "--gpus", "2", "--actor-gpus", "2", "--rollouts", "2", *SEVEN_B),),
        gpus=2,
    ),
    "gpu-tests-two-gpus": Group(
        "the GPU-marked tests of two GPUs: the sharded and replicated actor, rollouts beside it",
        (
            GpuTests(
                "gpu_tests_two_gpus",
                ("tests/workers/actor/test_actor_sharded.py", "tests/workers/sync/test_ipc.py"),
                560,
            ),
        ),
        gpus=2,
    ),
}


class MissingNeed(Exception):
    """What a group needs is not on this machine: the message says what to carry or which machine to use."""


def default_gguf() -> Path:
    return Path(os.environ.get("MORTAL_BENCH_GGUF", str(Path.home() / "smol.gguf")))


def gpus_here() -> int:
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout
    except FileNotFoundError:  # no NVIDIA driver on this machine
        return 0
    return sum(line.startswith("GPU ") for line in listed.splitlines())


def check_needs(group: Group, gguf: Path) -> None:
    gpus = gpus_here()
    if gpus < group.gpus:
        raise MissingNeed(f"needs {group.gpus} GPU(s), this machine has {gpus}")
    assets = os.environ.get("MORTAL_TEST_ASSETS")
    if group.assets and not (assets and Path(assets).is_dir()):
        raise MissingNeed(
            "needs SmolLM2's tokenizer and the shapes' configs: carry .mortal/assets "
            "(MORTAL_TEST_ASSETS, set by scripts/device-setup.sh)"
        )
    if group.gguf and not gguf.is_file():
        raise MissingNeed(
            f"needs the SmolLM2 GGUF at {gguf}: carry .mortal/p1, p2 and p3 "
            "(scripts/device-gguf.sh), joined by scripts/device-setup.sh"
        )


def selected(group: Group, only: list[str]) -> list[Step]:
    names = [step.name for step in group.steps]
    unknown = sorted(set(only) - set(names))
    if unknown:
        raise SystemExit(f"no step {', '.join(unknown)} in this group; its steps: {', '.join(names)}")
    return [step for step in group.steps if not only or step.name in only]


def run_step(step: Step, command: list[str], out: Path, logs: Path) -> int:
    """Runs one step under its limit: SIGTERM at the limit (the benches save and clean up), SIGKILL after."""
    log = logs / f"{step.name}.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            command,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **dict(getattr(step, "env", ()))},
        )
        try:
            code = process.wait(timeout=step.limit_s)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGTERM)
            try:
                code = process.wait(timeout=GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                code = process.wait()
    text = log.read_text(errors="replace")
    print("\n".join([line for line in text.splitlines() if HIGHLIGHTS.search(line)][-12:]))
    with (out / "all.log").open("a") as everything:
        everything.write(f"== {step.name}: {' '.join(command)}\n{text}\n")
    kept = logs / step.name  # a bench's copy of mortal's logs, or the tests' temporary folders
    if code != 0 and kept.exists():
        with tarfile.open(out / f"logs-{step.name}.tgz", "w:gz") as archive:
            archive.add(kept, arcname=f"logs-{step.name}")
            archive.add(log, arcname=f"{step.name}.log")
    return code


def record_environment(out: Path) -> None:
    versions = (
        "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', "
        "transformers.__version__, 'trl', trl.__version__)"
    )
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout
    found = subprocess.run([sys.executable, "-c", versions], capture_output=True, text=True, check=False)
    text = listed + found.stdout + found.stderr[-500:]
    (out / "env.log").write_text(text)
    print(text, end="")


def run_group(name: str, only: list[str], call_seconds: int, dry_run: bool) -> int:
    group = GROUPS[name]
    steps = selected(group, only)
    out = Path(os.environ.get("OUT") or ("$OUT" if dry_run else tempfile.mkdtemp(prefix="mortal-bench-out-")))
    logs = Path(tempfile.gettempdir()) / "mortal-bench-logs"
    work = Path.home() / "mortal-bench-work"
    gguf = default_gguf()
    if dry_run:
        for step in steps:
            print(f"# {step.name} (limit {step.limit_s} s)")
            print(
                " ".join(
                    [*(f"{k}={v}" for k, v in getattr(step, "env", ())), *step.command(out, logs, gguf, work)]
                )
            )
        return 0
    try:
        check_needs(group, gguf)
    except MissingNeed as missing:
        print(f"{name}: {missing}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    record_environment(out)
    started, failed, left = time.monotonic(), [], []
    for step in steps:
        elapsed = time.monotonic() - started
        if elapsed + step.limit_s > call_seconds:
            left.append(step.name)
            continue
        print(f"== {step.name} at {elapsed:.0f} s (limit {step.limit_s} s)", flush=True)
        began = time.monotonic()
        code = run_step(step, step.command(out, logs, gguf, work), out, logs)
        print(f"== {step.name}: exit {code} after {time.monotonic() - began:.0f} s", flush=True)
        if code != 0:
            failed.append(step.name)
    if left:
        print(f"left for the next call (run it with --only): {' '.join(left)}")
    return 1 if failed or left else 0


def describe_groups() -> str:
    lines = []
    for name, group in GROUPS.items():
        needs = [f"{group.gpus} GPU(s)"] + ["assets"] * group.assets + ["gguf"] * group.gguf
        lines.append(f"{name} ({', '.join(needs)}): {group.about}")
        lines.extend(
            f"    {step.name}: {getattr(step, 'script', 'pytest')} (limit {step.limit_s} s)"
            for step in group.steps
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("group", nargs="?", choices=sorted(GROUPS), metavar="GROUP", help="a group (--list)")
    parser.add_argument("--list", action="store_true", help="the groups, what each needs, and their steps")
    parser.add_argument(
        "--only", nargs="+", default=[], metavar="STEP", help="run only these steps of the group"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands instead of running them")
    parser.add_argument(
        "--call-seconds",
        type=int,
        default=590,
        help="the call's time: a step begins only while its limit still fits in it",
    )
    args = parser.parse_args(argv)
    if args.list or not args.group:
        print(describe_groups())
        return 0
    return run_group(args.group, args.only, args.call_seconds, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
