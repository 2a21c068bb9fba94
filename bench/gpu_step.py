"""Step throughput: TRL's GRPOTrainer on one GPU and mortal, same model and token counts, in one run.

    python bench/gpu_step.py [--steps 6] [--gpus 1] [--rollouts 1] [--staleness 0] [--sync auto]
                             [--only trl|mortal] [--json out.json] [--logs DIR [--profile-steps 4]]
    python bench/gpu_step.py --cpu      # a smoke test of the script: a tiny model, no figures

The anchor's setting (DESIGN.md, Targets): a random-init model of Qwen2.5-0.5B's shape, 8 prompts x
8 generations x 256 completion tokens per step, bf16, beta 0. `--shape 1.5b|3b|7b` takes Qwen2.5's
larger shapes (SmolLM2's vocabulary on all); `--micro-batch` trains the batch in parts on both sides (without
it TRL trains it in one pass and mortal's micro batch is the operator's own: `mortalctl apply`'s estimate of
what fits, then halved after each out-of-memory; the JSON's "mortal_memory" says which it trained with and
why); `--lora R` trains rank-R adapters on both (peft's LoraConfig on TRL's side, model.lora on mortal's);
`--compile` compiles the trained model on both (TRL's torch_compile, mortal's actor.compile); `--compile
mortal` on mortal's side only, against TRL at its defaults (compiled, TRL's step was not faster:
docs/benchmarks.md). `--liger` (or `--liger mortal`) puts Liger's fused layer kernels in the trained model the
same way. A step's seconds, on both sides, are the wall clock between its end and the previous step's end
(TRL: the Trainer's on_step_end, after the optimizer step; mortal: when the store recorded the
step's end); TRL's own step_time metric, which leaves the optimizer step out, is kept beside it.
Peak GPU memory is nvidia-smi's memory used on each GPU while each side trains (every process's
CUDA context and reserved memory). A TRL run that runs out of GPU memory is recorded as such. TRL generates
with transformers' `generate` inside its trainer (completions forced to 256 tokens, as the anchor did). mortal
runs through the controller: with `--gpus 1` the actor and `--rollouts` rollout workers colocated on its
GPU (spec rollout.colocate; sync auto = ipc); with `--gpus N` > 1 the actor on one GPU and
`--rollouts` rollout workers on GPUs of their own (sync auto = ipc: GPU to GPU; `--sync nccl`: the actor
sends each version over NCCL). Transformers engine, each
step's prompts split evenly over the rollouts (one batch each), `--staleness` = maxStaleness.
Per step it prints where mortal's time went: the actor waiting for rollouts, training (TRL's loss,
backward, optimizer step), publishing weights, the rollouts' generation and reward seconds (summed
over tasks) and their weight loads, and the GPUs' busy fraction (nvidia-smi, sampled every 100 ms
while mortal trains). A random-init model almost never
samples its EOS token, so mortal's completions are 256 tokens long too; the script reports the
tokens it actually trained on. Prints completion tokens per second for both and their ratio, from
the median step from the third on (the first two carry start-up, compilation and graph capture),
without a maxStaleness k run's last k steps (they have no later generation to overlap: steady_steps).

Figures against the physical limit (issue 14 §4), printed after the throughput and under "limits"
in the JSON, from mortal's steps from the third on:
- decode ms per step at the bench's batch: each rollout task's generation seconds over its decode
  steps, both read from the rollout's log line ("task s.k: ... in Y s ... [decode rows=R
  decode_steps=D ...]"); Y is the engine's whole generate (prefill, the decoder's read-backs, the copy
  to Python), so this is an upper bound on one step replay. Median over tasks.
- the HBM floor for a decode step: weight bytes (parameters, tied ones once, x bytes per bf16) over
  the GPU's memory bandwidth; every step reads every weight once (the KV cache reads come on top).
- training MFU: 6 x parameters x trained tokens per step (completion tokens, as the actor logs them,
  plus the real prompt tokens of every sequence; padding left out) / actor/train_seconds / (the GPU's
  dense bf16 peak x the actor's GPUs). 6N per token counts forward and backward matmuls (attention's own
  FLOPs, small at these lengths, left out), so this is model FLOPs, not hardware FLOPs. With `--lora` it is
  4N: the frozen weights get no gradient (the adapters' own FLOPs, under 1% at rank 16, left out).
  Beside it, the update's MFU: the same FLOPs over actor/update_seconds, TRL's step without its
  preparation of the batch (padding, texts, rewards, advantages, metrics), i.e. forward, loss, backward,
  clipping and the optimizer's step, as veRL reports its actor's MFU over the policy update.
The GPU's figures come from GPU_LIMITS, keyed by torch.cuda.get_device_name: NVIDIA's H100 and H200
datasheets (H100 SXM5 80GB HBM3: 3.35 TB/s, 989 TFLOPS dense bf16 (1,979 with sparsity); H200:
4.8 TB/s, 989 TFLOPS dense bf16). A GPU not in the table prints n/a for the floor and MFU.
Needs a CUDA GPU, TRL and datasets, and SmolLM2's tokenizer (MORTAL_TEST_ASSETS, as the tests).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from through_controller import (
    compile_scopes,
    copy_logs,
    exit_on_sigterm,
    local_gpu,
    memory_record,
    run_through_controller,
    task_timeline,
)

BREAKDOWN = {
    "wait": "actor/wait_seconds",
    "bookkeeping": "actor/bookkeeping_seconds",
    "gc": "actor/gc_seconds",
    "train": "actor/train_seconds",
    "prepare": "actor/prepare_seconds",
    "update": "actor/update_seconds",
    "publish": "weights/publish_seconds",
    "generate": "rollout/generation_seconds",
    "reward": "rollout/reward_seconds",
    "load": "weights/load_seconds",
}

REWARD = "mortal.workers.rewards.builtin:short_answer"  # any cheap reward: throughput is what is timed
TOPICS = ["rivers", "a lighthouse", "prime numbers", "a lost key", "winter markets", "the moon", "old trains"]


# Qwen2.5's published configs (hidden, MLP, layers, heads, key/value heads), vocabulary aside: the bench uses
# SmolLM2's tokenizer, so every shape has its 49,152-token vocabulary. "tiny" is the --cpu smoke test's.
SHAPES = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
    ),
    "1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
    ),
    "3b": dict(
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
    ),
    "7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
}


def shape_config(shape: str, vocab_size: int = 49152):
    """Qwen2.5's config of `shape` (SHAPES) with `vocab_size` embeddings (SmolLM2's by default: its tokenizer
    is the benches'); bench/train_step.py takes Qwen's own 151,936 too."""
    from transformers import Qwen2Config

    return Qwen2Config(
        **{"tie_word_embeddings": True, **SHAPES[shape]},
        vocab_size=vocab_size,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def make_model(folder: Path, shape: str = "0.5b") -> Path:
    """A random-init model of one of SHAPES, and SmolLM2's tokenizer (its vocabulary size)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assets = Path(os.environ.get("MORTAL_TEST_ASSETS", "/work/shared/anchors/assets"))
    config = shape_config(shape)
    torch.manual_seed(0)
    # initialised on the GPU where there is one: a 7B model's random init takes minutes on the CPU, seconds
    # there
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # nothing of it stays reserved in this process beside TRL's or mortal's runs
    AutoTokenizer.from_pretrained(assets / "smollm2-tok").save_pretrained(folder)
    return folder


# name fragment of torch.cuda.get_device_name -> (memory bandwidth B/s, dense bf16 peak FLOP/s); NVIDIA's
# datasheets (H100 SXM5: 3.35 TB/s, 989.4 TFLOPS bf16 dense; H200 SXM: 4.8 TB/s, 989 TFLOPS bf16 dense)
GPU_LIMITS = {"H100 80GB HBM3": (3.35e12, 989e12), "H200": (4.8e12, 989e12)}
DECODE_LOG = re.compile(r"task (\d+)\.(\d+): .*? in ([\d.]+) s .*\[decode [^]]*decode_steps=(\d+)")


def gpu_limits(device_name: str) -> tuple[float, float] | None:
    """(bandwidth B/s, dense bf16 FLOP/s) of the GPU named, or None when it is not in GPU_LIMITS."""
    return next((v for k, v in GPU_LIMITS.items() if k in device_name), None)


def model_parameters(model: Path) -> int:
    """Parameters of the model folder (tied ones once), counted on the meta device (nothing allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return sum(
            p.numel()
            for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).parameters()
        )


def prompt_tokens_per_step(model: Path, args: argparse.Namespace) -> int:
    """Real prompt tokens in one step's sequences (prompts x gens), the step's prompts taken as the first
    rows."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return args.gens * sum(len(tokenizer(r["prompt"])["input_ids"]) for r in prompt_rows()[: args.prompts])


def smoke_sizes(args: argparse.Namespace, sizes: dict[str, int]) -> None:
    """`--cpu`'s smoke-test sizes, each where its flag was not given on the command line."""
    given = set(sys.argv)
    for name, value in sizes.items():
        if f"--{name}" not in given:
            setattr(args, name, value)


def use_compile_cache(folder: Path) -> None:
    """torch.compile's caches in `folder` for this process and the workers it starts (who inherit it: a user's
    own TORCHINDUCTOR_CACHE_DIR wins over MORTAL_HOME's compile-cache folder), so a later invocation with
    the same folder finds what an earlier one compiled, on both sides."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder.resolve() / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(folder.resolve() / "triton")


def decode_ms_from_logs(logs: list[Path], first_step: int) -> list[float]:
    """Per rollout task from `first_step` on: its generation seconds / its decode steps, in ms."""
    out = []
    for log in logs:
        for match in DECODE_LOG.finditer(log.read_text(errors="replace")):
            step, _, seconds, steps = match.groups()
            if int(step) >= first_step and int(steps) > 0:
                out.append(1000 * float(seconds) / int(steps))
    return out


def limits(
    device_name: str,
    parameters: int,
    decode_ms: list[float],
    steps: list[dict],
    prompt_tokens: int,
    lora: bool = False,
    actor_gpus: int = 1,
    staleness: int = 0,
) -> dict:
    """Decode ms per step against the HBM floor, and training MFU (module docstring); n/a where unknown.
    With LoRA a token costs 4N, not 6N: the frozen weights get no gradient (forward 2N, input grads 2N).
    An actor over several GPUs trains the step's tokens on all of them at once, so its MFU is against
    all of their peaks (before 2026-11-28 it was against one GPU's: twice the per-GPU figure on two)."""
    known = gpu_limits(device_name)
    timed = [s for s in steady_steps(steps, staleness) if s.get("train")]
    out: dict = {
        "parameters": parameters,
        "weight_bytes": 2 * parameters,
        "bandwidth_bytes_per_second": known[0] if known else None,
        "peak_bf16_flops": known[1] if known else None,
        "decode_ms_per_step": statistics.median(decode_ms) if decode_ms else None,
        "hbm_floor_ms_per_step": 1000 * 2 * parameters / known[0] if known else None,
    }
    if timed:
        tokens = statistics.median(s["tokens"] + prompt_tokens for s in timed)
        train = statistics.median(s["train"] for s in timed)
        flops = (4 if lora else 6) * parameters * tokens
        out.update(
            trained_tokens_per_step=tokens,
            train_seconds=train,
            model_flops_per_step=flops,
            mfu=flops / train / (known[1] * actor_gpus) if known else None,
            actor_gpus=actor_gpus,
        )
        updates = [s["update"] for s in timed if s.get("update")]
        if updates:
            update = statistics.median(updates)
            out.update(
                update_seconds=update,
                prepare_seconds=statistics.median(s.get("prepare", 0.0) for s in timed),
                update_mfu=flops / update / (known[1] * actor_gpus) if known else None,
            )

    def shown(value: float | None, form: str, unit: str = "") -> str:
        return "n/a" if value is None else format(value, form) + unit

    trained = (
        f" ({out['trained_tokens_per_step']:.0f} tokens in {out['train_seconds']:.2f} s)" if timed else ""
    )
    print(
        f"limits ({device_name}): decode {shown(out['decode_ms_per_step'], '.2f', ' ms')} per step "
        f"(HBM floor {shown(out['hbm_floor_ms_per_step'], '.2f', ' ms')}: "
        f"{2 * parameters / 1e9:.2f} GB of weights); training "
        f"MFU {shown(out.get('mfu'), '.1%')}{trained}"
        + (
            f", of the update alone {shown(out.get('update_mfu'), '.1%')} "
            f"({out['update_seconds']:.3f} s; TRL's "
            f"preparation of the batch {out['prepare_seconds']:.3f} s)"
            if "update_seconds" in out
            else ""
        ),
        flush=True,
    )
    return out


def prompt_rows(n: int = 64) -> list[dict]:
    return [
        {"prompt": f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]} number {i}."}
        for i in range(n)
    ]


def run_trl(model: Path, args: argparse.Namespace, work: Path) -> list[dict]:
    """TRL's GRPOTrainer in this process on one GPU, or, with --actor-gpus N > 1, in N processes of one GPU
    each with FSDP2 (TRL's documented route, GRPOConfig's fsdp and fsdp_config through accelerate), as
    `accelerate launch --num_processes N` runs it."""
    if args.actor_gpus == 1:
        with GpuBusy(enabled=not args.cpu) as busy:
            steps = train_trl(model, args, work)
        args.peak_memory_mib["trl"] = busy.memory_mib
        return steps
    import torch
    import torch.multiprocessing as mp

    from mortal.workers.actor.sharded import free_port

    with GpuBusy(enabled=not args.cpu) as busy:
        try:
            mp.start_processes(
                trl_rank,
                args=(args.actor_gpus, free_port(), model, args, work),
                nprocs=args.actor_gpus,
                join=True,
                start_method="spawn",
            )
        except Exception:  # a rank failed and the others were ended with it: its note says what happened
            notes = sorted(work.glob("trl_rank*_error.json"))
            if not notes:
                raise
            error = json.loads(notes[0].read_text())
            if "out_of_memory" in error:
                raise torch.OutOfMemoryError(error["out_of_memory"]) from None
            raise TrlFailed(error["failed"]) from None
        finally:
            args.peak_memory_mib["trl"] = busy.memory_mib
    return json.loads((work / TRL_RESULT).read_text())["steps"]


class TrlFailed(RuntimeError):
    """TRL's run over several processes ended with an error (not out of memory): recorded, and mortal still
    runs."""


TRL_RESULT = "trl_steps.json"  # rank 0 of a TRL run over several GPUs writes its steps here


def trl_rank(rank: int, world: int, port: int, model: Path, args: argparse.Namespace, work: Path) -> None:
    """One process of TRL over `world` GPUs: the rendezvous accelerate reads, this rank's GPU, the trainer;
    rank 0 writes the steps for the bench process, a rank that fails a note of why before it exits (which
    makes torch.multiprocessing end the others, as they would wait in a collective for it)."""
    import torch

    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
        }
    )
    if not args.cpu:
        torch.cuda.set_device(rank)
    try:
        steps = train_trl(model, args, work, world)
    except Exception as error:
        kind = "out_of_memory" if isinstance(error, torch.OutOfMemoryError) else "failed"
        said = (
            str(error).splitlines()[0]
            if kind == "out_of_memory"
            else f"{type(error).__name__}: {error}"[:1000]
        )
        (work / f"trl_rank{rank}_error.json").write_text(json.dumps({kind: f"rank {rank}: {said}"}))
        raise
    if rank == 0:
        (work / TRL_RESULT).write_text(json.dumps({"steps": steps}))


def train_trl(model: Path, args: argparse.Namespace, work: Path, world: int = 1) -> list[dict]:
    """TRL's GRPOTrainer trained to --steps in this process (one of `world`, each training its share of a
    step's completions); each step's wall-clock end and tokens."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mortal.workers.rewards import builtin as builtin_rewards

    steps: list[dict] = []

    class Record(TrainerCallback):
        """Each step's wall-clock end (on_step_end, after the optimizer step) and, from its log, TRL's own
        step_time (which leaves the optimizer step out) and the completion tokens."""

        def on_train_begin(self, _args, state, control, **kwargs):
            self.last_end = time.time()

        def on_step_end(self, _args, state, control, **kwargs):
            now = time.time()
            steps.append(
                {"step": state.global_step, "seconds": now - self.last_end, "ended_at": now, "tokens": 0.0}
            )
            self.last_end = now

        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "step_time" in logs and steps and steps[-1]["step"] == state.global_step:
                steps[-1]["tokens"] = logs.get("completions/mean_length", 0.0) * args.prompts * args.gens
                steps[-1]["step_time"] = logs["step_time"]

    batch = args.prompts * args.gens
    # the same split as mortal's microBatchSize (or TRL's own, --trl-micro-batch): one generation batch a step
    micro = args.trl_micro_batch or args.micro_batch or batch
    # FSDP2, parameters resharded after forward (full_shard) unless --keep-gathered (shard_grad_op), as
    # transformers >= 5.20 spells it
    sharded = (
        {
            "fsdp": True,
            "fsdp_config": {
                "version": 2,
                "reshard_after_forward": not args.keep_gathered,
                "cpu_offload": args.cpu_offload,
            },
        }
        if world > 1 and not args.cpu and args.strategy == "fsdp"
        else {}
    )  # else accelerate's DDP
    config = GRPOConfig(
        output_dir=str(work / "trl"),
        per_device_train_batch_size=micro // world,
        gradient_accumulation_steps=batch // micro,
        **sharded,
        num_generations=args.gens,
        max_completion_length=args.tokens,
        learning_rate=1e-6,
        beta=0.0,
        max_steps=args.steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=not args.cpu,
        use_cpu=args.cpu,
        generation_kwargs={"min_new_tokens": args.tokens},
        gradient_checkpointing=args.gradient_checkpointing,
        torch_compile=args.compile == "both",
        use_liger_kernel=args.liger
        == "both",  # TRL applies Liger's layer kernels only, as mortal's actor.liger
    )
    peft = None
    if args.lora:  # the same adapters as mortal's model.lora (alpha 2r, every linear layer but the LM head)
        from peft import LoraConfig

        peft = LoraConfig(
            r=args.lora, lora_alpha=2 * args.lora, target_modules="all-linear", task_type="CAUSAL_LM"
        )
    trainer = GRPOTrainer(
        model=str(model),
        reward_funcs=[builtin_rewards.short_answer],
        args=config,
        train_dataset=Dataset.from_list(prompt_rows()),
        callbacks=[Record()],
        peft_config=peft,
    )
    trainer.train()
    del trainer
    gc.collect()  # the trainer's reference cycles (callbacks, accelerator) hold its model and AdamW state
    torch.cuda.empty_cache()
    return steps


def mortal_spec(model: Path, data: Path, args: argparse.Namespace) -> dict:
    return {
        "model": {
            "name": str(model),
            "dtype": "float32" if args.cpu else "bfloat16",
            "gradientCheckpointing": args.gradient_checkpointing,
            **({"lora": {"r": args.lora, "alpha": 2.0 * args.lora}} if args.lora else {}),
        },
        "dataset": {"name": str(data)},
        "algorithm": {
            "numGenerations": args.gens,
            "batchSize": args.prompts * args.gens,
            "learningRate": 1e-6,
            "beta": 0.0,
            "maxSteps": args.steps,
            "maxStaleness": args.staleness,
            **({"microBatchSize": args.micro_batch} if args.micro_batch else {}),
        },
        "generation": {
            "maxTokens": args.tokens,
            "engine": "transformers",
            "compileScope": args.compile_scope,
        },
        "rewards": [{"function": REWARD}],
        "actor": {
            "gpu": "none" if args.cpu else local_gpu(),
            "count": args.actor_gpus,
            "compile": args.compile is not None,
            "compileScope": args.actor_compile_scope,
            "liger": args.liger is not None,
            **({"reshardAfterForward": False} if args.keep_gathered else {}),
            **({"cpuOffload": True} if args.cpu_offload else {}),
            **({"strategy": args.strategy} if args.actor_gpus > 1 else {}),
        },
        "rollout": {
            "gpu": "none" if args.cpu else local_gpu(),
            "replicas": args.rollouts,
            "colocate": args.gpus == args.actor_gpus and not args.cpu,
            **({"colocatedReplicas": args.colocated_replicas} if args.colocated_replicas else {}),
        },
        "sync": {"method": args.sync, **({"keepVersions": args.keep_versions} if args.keep_versions else {})},
        "checkpoint": {"every": args.steps, "keep": 1},
        "logging": {"wandb": {"mode": "disabled"}},
    }


def run_mortal(model: Path, args: argparse.Namespace, work: Path) -> list[dict]:
    from mortal.specs import TrainingRun

    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in prompt_rows()))
    run = TrainingRun.model_validate(
        {"metadata": {"name": "bench-gpu"}, "spec": mortal_spec(model, data, args)}
    )
    with GpuBusy(enabled=not args.cpu) as busy:
        by_step, _ = run_through_controller(run, work)
    args.peak_memory_mib["mortal"] = busy.memory_mib
    # A step's tasks are queued under the trainer's global step as the step begins: the step that ends as s
    tasks = {
        s + 1: step_tasks
        for s, step_tasks in task_timeline(work, run.metadata.name, [s - 1 for s in by_step]).items()
    }
    steps = []
    last_end = None
    for s, v in sorted(by_step.items()):
        if "step_seconds" not in v:
            continue
        parts = {part: round(v.get(name, 0.0), 4) for part, name in BREAKDOWN.items()}
        # wall clock between this step's end and the last one's, as for TRL; the first step has only its
        # metric
        between = v["step_seconds"] if last_end is None else v["ended_at"] - last_end
        last_end = v["ended_at"]
        steps.append(
            {
                "step": s,
                "seconds": between,
                "step_seconds": v["step_seconds"],
                "ended_at": v["ended_at"],
                "tokens": v["completion_tokens"],
                **parts,
                "tasks": tasks.get(s, []),
            }
        )
        print(
            f"  step {s}: {between:.2f} s between step ends; step_seconds {v['step_seconds']:.2f} s = "
            f"bookkeeping {parts['bookkeeping']:.3f} + wait {parts['wait']:.2f} + "
            f"train {parts['train']:.2f} (gc {parts['gc']:.3f}) + "
            f"publish {parts['publish']:.4f}; rollouts: generate {parts['generate']:.2f}, reward "
            f"{parts['reward']:.3f}, load {parts['load']:.4f}",
            flush=True,
        )
        print(f"           {task_summary(tasks.get(s, []), v['ended_at'], parts)}", flush=True)
    args.decode_ms = decode_ms_from_logs(sorted(work.glob("mortal-home/runs/*/logs/*.log")), first_step=3)
    ended = [v for s, v in sorted(by_step.items()) if "ended_at" in v]
    timed = steady_steps(ended, args.staleness)
    if timed:  # the steps the summary's median is taken over
        args.gpu_busy = busy.fractions(timed[0]["ended_at"] - timed[0]["step_seconds"], timed[-1]["ended_at"])
        print(f"  GPU busy fraction over the steady steps: {args.gpu_busy}", flush=True)
    return steps


def task_summary(tasks: list[dict[str, float]], ended_at: float, parts: dict[str, float]) -> str:
    """Where a step's wait went, task by task (bench/through_controller.task_timeline): each task's time from
    queued to done, and of it generation, scoring and loading; the rest is the way to the rollout and back.
    Then the time from the last task's end to the step's end, less the actor's train and publish: how late
    the actor saw it (its poll) and took it up (reading the results, TRL's batch)."""
    done = [t for t in tasks if t["done"] is not None]
    if not done:
        return "tasks: none recorded"
    spans = " / ".join(
        f"{t['done'] - t['queued']:.3f} (generate {t['generate']:.3f}, reward {t['reward']:.3f}, "
        f"load {t['load']:.3f}, rest {t['done'] - t['queued'] - t['generate'] - t['reward'] - t['load']:.3f})"
        for t in done
    )
    after = ended_at - max(t["done"] for t in done)
    return (
        f"tasks queued -> done (s): {spans}; last done -> step end {after:.3f} s, less train and publish: "
        f"{after - parts['train'] - parts['publish']:.3f} s"
    )


class GpuBusy:
    """Samples nvidia-smi's utilization and memory used of every GPU every 100 ms while the block runs, each
    sample stamped with this process's clock as it arrives; `enabled` False samples nothing (no GPU).
    Memory is nvidia-smi's, not torch's allocator's, so that TRL (in this process) and mortal (in worker
    processes) are measured alike: every process's CUDA context and reserved memory on that GPU."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    def __enter__(self) -> GpuBusy:
        import subprocess
        import threading
        import time

        self.samples: list[tuple[float, str, float]] = []
        self.memory_mib: dict[str, float] = {}  # GPU index -> the most memory used in any sample
        if not self.enabled:
            return self
        self.proc = subprocess.Popen(
            [
                "nvidia-smi",
                "--query-gpu=index,utilization.gpu,memory.used",
                "--format=csv,noheader,nounits",
                "-lms",
                "100",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )

        def read() -> None:
            for line in self.proc.stdout:
                index, busy, used = (field.strip() for field in (line.split(",") + ["", ""])[:3])
                if busy.isdigit():
                    self.samples.append((time.time(), index, float(busy) / 100))
                if used.isdigit():
                    self.memory_mib[index] = max(self.memory_mib.get(index, 0.0), float(used))

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        self.proc.terminate()
        self.reader.join(5)

    def fractions(self, start: float, end: float) -> dict[str, float]:
        """GPU index -> mean busy fraction (the share of time a kernel ran) between two epoch times."""
        by_gpu: dict[str, list[float]] = {}
        for stamp, index, value in self.samples:
            if start <= stamp <= end:
                by_gpu.setdefault(index, []).append(value)
        return {k: round(sum(v) / len(v), 3) for k, v in by_gpu.items()}


def steady_steps(steps: list, staleness: int = 0) -> list:
    """The steps a figure is taken over: from the third on (the first two carry start-up, compilation and
    graph capture) and, with maxStaleness k, without the run's last k, whose training has no later
    generation to share the GPU with, so they are shorter than the steady state (7B full on one H200: 2.09 s
    against 3.62 s; before 2026-12-01 four-step runs' medians mixed the two). A run too short to leave its
    last steps out keeps them; one of two steps or fewer has none (the callers say what they fall back to)."""
    return steps[2 : len(steps) - staleness] or steps[2:]


def steady_medians(steps: list[dict], staleness: int = 0) -> tuple[float, float]:
    """Median wall-clock seconds between step ends and completion tokens over the steady steps (all of them
    when a run is too short to have any)."""
    timed = steady_steps(steps, staleness) or steps
    return statistics.median(s["seconds"] for s in timed), statistics.median(s["tokens"] for s in timed)


def summarize(name: str, steps: list[dict], staleness: int = 0) -> dict:
    """steady_medians, printed and kept with the steps."""
    seconds, tokens = steady_medians(steps, staleness)
    summary = {
        "median_step_seconds": seconds,
        "completion_tokens_per_step": tokens,
        "completion_tokens_per_second": tokens / seconds,
        "steps": steps,
    }
    print(
        f"{name}: {seconds:.2f} s/step, {tokens:.0f} completion tokens/step, {tokens / seconds:.0f} tokens/s",
        flush=True,
    )
    return summary


def resummarize(paths: list[Path]) -> None:
    """Recorded runs' figures over their steady steps, from the steps each JSON keeps: how the maxStaleness
    figures recorded before steady_steps were recomputed (docs/benchmarks.md, 2026-12-01)."""
    for path in paths:
        recorded = json.loads(path.read_text())
        staleness = recorded.get("staleness") or 0
        figures = {}
        for side, lag in (("trl", 0), ("mortal", staleness)):
            if (recorded.get(side) or {}).get("steps"):
                seconds, tokens = steady_medians(recorded[side]["steps"], lag)
                figures[side] = (seconds, tokens / seconds)
                print(
                    f"{path.name}: {side} (maxStaleness {lag}) {seconds:.3f} s/step, "
                    f"{figures[side][1]:,.0f} tokens/s "
                    f"(recorded: {recorded[side]['median_step_seconds']:.3f} s/step)",
                    flush=True,
                )
        if len(figures) == 2:
            print(
                f"{path.name}: mortal / TRL {figures['mortal'][1] / figures['trl'][1]:.2f}x "
                f"(recorded: {recorded.get('mortal_over_trl', float('nan')):.2f}x)",
                flush=True,
            )


def sync_summary(steps: list[dict], method: str, staleness: int = 0) -> dict:
    """Weight sync per version over the steady steps, in ms: the actor's publish (snapshot, manifest,
    store record) and the rollout's load (fetch or copy into its model), and their sum."""
    timed = steady_steps(steps, staleness) or steps
    out = {}
    for part in ("publish", "load"):
        values = [s[part] * 1000 for s in timed if part in s]
        if values:
            out[part] = {"median": round(statistics.median(values), 2), "max": round(max(values), 2)}
    if len(out) == 2:
        out["sum_median"] = round(out["publish"]["median"] + out["load"]["median"], 2)
        print(
            f"weight sync ({method}): publish {out['publish']['median']:.1f} ms "
            f"(max {out['publish']['max']:.1f}), "
            f"load {out['load']['median']:.1f} ms (max {out['load']['max']:.1f}), "
            f"together {out['sum_median']:.1f} ms",
            flush=True,
        )
    return out


def build_parser() -> argparse.ArgumentParser:
    """The bench's flags; bench/sync_parts.py builds its spec from their defaults too."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--gens", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rollouts", type=int, default=1, help="rollout workers of mortal")
    parser.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="1: rollouts colocated with the actor; N: 1 actor GPU "
        "+ rollouts on their own GPUs (with --actor-gpus K: K actor GPUs + rollouts on the N - K others; "
        "N = K: rollouts colocated on the actor's K GPUs, replica r on its GPU r %% K)",
    )
    parser.add_argument(
        "--actor-gpus",
        type=int,
        default=1,
        help="GPUs of the trainer on both sides: mortal's "
        "actor.count (FSDP2 over them) and TRL in as many processes with FSDP2 (fsdp, version 2, "
        "resharded after forward); --cpu: CPU processes (TRL then runs DDP: accelerate shards only on "
        "accelerators)",
    )
    parser.add_argument(
        "--colocated-replicas",
        type=int,
        default=0,
        metavar="N",
        help="with --gpus above --actor-gpus: mortal's first N rollouts beside the actor on its GPU(s), "
        "the others on the other GPUs (rollout.colocatedReplicas)",
    )
    parser.add_argument(
        "--strategy",
        choices=["fsdp", "ddp"],
        default="fsdp",
        help="with --actor-gpus above 1: "
        "shard the trainer (FSDP2) or replicate it on each GPU (DDP), on both sides (mortal's "
        "actor.strategy; TRL with or without fsdp)",
    )
    parser.add_argument(
        "--keep-gathered",
        action="store_true",
        help="with --actor-gpus above 1: each layer's "
        "gathered weights kept from its forward to its backward on both sides (mortal's "
        "actor.reshardAfterForward false, TRL's fsdp_config reshard_after_forward false)",
    )
    parser.add_argument(
        "--cpu-offload",
        action="store_true",
        help="with --actor-gpus above 1 (FSDP2): the shards, "
        "gradients and AdamW state in host memory on both sides (mortal's actor.cpuOffload, TRL's "
        "fsdp_config cpu_offload)",
    )
    parser.add_argument(
        "--staleness",
        type=int,
        default=0,
        help="mortal's maxStaleness (1: generate step s+1 while training step s)",
    )
    parser.add_argument("--sync", default="auto", choices=["auto", "volume", "ipc", "nccl"])
    parser.add_argument(
        "--keep-versions",
        type=int,
        default=None,
        metavar="N",
        help="mortal's sync.keepVersions: snapshots of the weights in the actor's ring (default: the "
        "spec's, 3; 2 saves a copy of the weights on the actor's GPU)",
    )
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="completions per forward/backward pass on both sides (mortal's microBatchSize, TRL's "
        "per_device_train_batch_size with gradient accumulation up to the batch); default: TRL the "
        "batch in one pass, mortal the operator's own choice (mortal_memory in the JSON)",
    )
    parser.add_argument(
        "--trl-micro-batch",
        type=int,
        default=None,
        help="TRL's per_device_train_batch_size alone (mortal's side keeps --micro-batch, or the "
        "operator's choice): TRL given the micro batch that fits, mortal none",
    )
    parser.add_argument("--gradient-checkpointing", action="store_true", help="on both sides")
    parser.add_argument(
        "--compile",
        nargs="?",
        const="both",
        choices=["both", "mortal"],
        help="torch.compile the trained model: on both sides (TRL's torch_compile, mortal's "
        "actor.compile), or on mortal's only, against TRL at its defaults (compiled, TRL's step was not "
        "faster: docs/benchmarks.md)",
    )
    parser.add_argument(
        "--liger",
        nargs="?",
        const="both",
        choices=["both", "mortal"],
        help="Liger's Triton kernels (RMSNorm, rotary, SwiGLU) in the trained model: on both sides "
        "(TRL's use_liger_kernel, mortal's actor.liger), or on mortal's only",
    )
    parser.add_argument("--only", choices=["trl", "mortal"])
    parser.add_argument(
        "--compile-scope",
        choices=compile_scopes(),
        default="auto",
        help="mortal's generation.compileScope: what the rollout's decode step compiles (default: the "
        "spec's, auto)",
    )
    parser.add_argument(
        "--actor-compile-scope",
        choices=["model", "layer"],
        default="layer",
        help="mortal's actor.compileScope with --compile: each decoder layer (the spec's default), or "
        "the whole model",
    )
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="R",
        help="train LoRA adapters of rank R on both sides (mortal syncs the adapters only)",
    )
    parser.add_argument(
        "--shape",
        choices=[k for k in SHAPES if k != "tiny"],
        default="0.5b",
        help="Qwen2.5's shape of this size, random weights (the anchor's is 0.5b)",
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="smoke test: a tiny model on the CPU, tiny settings "
        "unless given (figures meaningless, limits n/a)",
    )
    parser.add_argument(
        "--compile-cache",
        type=Path,
        help="torch.compile's caches (both sides') in this folder, "
        "kept across invocations; default: TRL's in torch's default folder, mortal's fresh per invocation",
    )
    parser.add_argument(
        "--no-padding-shift",
        action="store_true",
        help="mortal's actor passes TRL's padding mask to the loss's attention (MORTAL_PADDING_SHIFT=0, "
        "mortal.workers.actor.padding_shift), to measure the shift against it",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--logs", type=Path, help="copy mortal's controller and worker logs into this folder")
    parser.add_argument(
        "--profile-steps",
        metavar="A[-B]",
        help="profile mortal's actor over these optimizer steps, every rank (MORTAL_PROFILE_STEPS, "
        "mortal.workers.actor.step_profile); the tables come with --logs. A profiled step is slower: "
        "the throughput of such a run is not a figure to report",
    )
    parser.add_argument(
        "--resummarize",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="no run: each recorded JSON's s/step, tokens/s and mortal / TRL again over its steady "
        "steps (steady_steps), beside what it recorded",
    )
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.resummarize:
        resummarize(args.resummarize)
        return
    if args.profile_steps:
        os.environ["MORTAL_PROFILE_STEPS"] = args.profile_steps  # the controller's workers inherit it
    if args.no_padding_shift:
        from mortal.workers.actor.padding_shift import ENV

        os.environ[ENV] = "0"  # as MORTAL_PROFILE_STEPS: the workers inherit it
    if args.gpus < args.actor_gpus:
        parser.error(f"--gpus {args.gpus} is fewer than the actor's --actor-gpus {args.actor_gpus}")
    if args.colocated_replicas and (args.gpus == args.actor_gpus or args.colocated_replicas >= args.rollouts):
        parser.error(
            "--colocated-replicas colocates some rollouts beside the actor and leaves the others GPUs of "
            "their own: it needs --gpus above --actor-gpus and more --rollouts than it"
        )
    if args.cpu_offload and (args.actor_gpus < 2 or args.strategy != "fsdp" or args.cpu):
        parser.error(
            "--cpu-offload keeps FSDP2's shards in host memory: it needs --actor-gpus above 1 with "
            "--strategy fsdp, on GPUs (the spec's actor.cpuOffload refuses it otherwise)"
        )
    for flag, value in (("--micro-batch", args.micro_batch), ("--trl-micro-batch", args.trl_micro_batch)):
        if value and (args.prompts * args.gens) % value:
            parser.error(
                f"{flag} {value} must divide the batch (--prompts x --gens = {args.prompts * args.gens})"
            )
    import torch

    if args.cpu:
        smoke_sizes(args, {"steps": 4, "prompts": 2, "gens": 2, "tokens": 8})
    out: dict = {
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
        "gpus_visible": 0 if args.cpu else torch.cuda.device_count(),
        **{
            k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
            if k not in ("json", "logs")
        },
    }
    args.decode_ms, args.gpu_busy, args.peak_memory_mib = [], {}, {}
    if args.compile_cache:
        use_compile_cache(args.compile_cache)
    exit_on_sigterm()

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(out, indent=2))

    try:
        measure(args, out, save)
    except (
        BaseException
    ) as exc:  # a time limit (SIGTERM), an error: what was measured is written all the same
        out["interrupted"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        save()


def measure(args: argparse.Namespace, out: dict, save: Callable[[], None]) -> None:
    """Both sides in a scratch folder whose logs `--logs` keeps (a run cut short too), then the ratio. What
    was measured is saved before the folder is removed: a 7B run's checkpoints take a while to delete, and a
    time limit that ends the script then must not cost its figures."""
    with tempfile.TemporaryDirectory(prefix="mortal-gpu-bench-") as tmp:
        work = Path(tmp)
        try:
            run_both_sides(work, args, out)
            compare(args, out)
            save()
        finally:
            if args.logs:
                copy_logs(work, args.logs)


def compare(args: argparse.Namespace, out: dict) -> None:
    """Each side's peak GPU memory, and mortal's throughput over TRL's where both ran."""
    out["peak_gpu_memory_mib"] = args.peak_memory_mib  # side -> GPU index -> MiB (nvidia-smi, every process)
    print(f"peak GPU memory (MiB, nvidia-smi): {args.peak_memory_mib}")
    if "completion_tokens_per_second" in out.get("trl", {}) and "mortal" in out:
        out["mortal_over_trl"] = (
            out["mortal"]["completion_tokens_per_second"] / out["trl"]["completion_tokens_per_second"]
        )
        print(f"mortal / TRL throughput: {out['mortal_over_trl']:.2f}x")


def run_both_sides(work: Path, args: argparse.Namespace, out: dict) -> None:
    """TRL, then mortal, each into `out` as it ends (a run cut short keeps what had ended)."""
    import torch

    model = make_model(work / "model", "tiny" if args.cpu else args.shape)
    if args.only != "mortal":
        try:
            out["trl"] = summarize("TRL GRPOTrainer", run_trl(model, args, work))
        except torch.OutOfMemoryError as error:  # a finding at the larger shapes, not a failure of the bench
            out["trl"] = {"out_of_memory": str(error).splitlines()[0]}
            print(f"TRL GRPOTrainer ran out of GPU memory: {out['trl']['out_of_memory']}", flush=True)
        except (
            TrlFailed
        ) as error:  # TRL over several GPUs: its error is a finding too; mortal's side still runs
            out["trl"] = {"failed": str(error)}
            print(f"TRL GRPOTrainer failed: {error}", flush=True)
        # Only here, after the except blocks: the caught error's traceback holds TRL's frames, and with them
        # its model and AdamW state, until its block ends; mortal's workers would start on a full GPU.
        gc.collect()
        torch.cuda.empty_cache()
    if args.only != "trl":
        where = (
            "on the CPU"
            if args.cpu
            else f"colocated on its {args.actor_gpus} GPU(s)"
            if args.gpus == args.actor_gpus
            else f"on {args.gpus - args.actor_gpus} GPU(s) of their own"
            + (
                f", {args.colocated_replicas} of them beside the actor instead"
                if args.colocated_replicas
                else ""
            )
        )
        if not args.cpu:  # what TRL's side left behind in this process is memory mortal's workers lack
            out["bench_reserved_mib_before_mortal"] = torch.cuda.memory_reserved() / 2**20
            print(
                f"this process holds {out['bench_reserved_mib_before_mortal']:.0f} MiB of GPU memory as "
                f"mortal starts",
                flush=True,
            )
        try:
            steps = run_mortal(model, args, work)
        # the micro batch the controller chose (and its heals) are a finding even when the run failed
        finally:
            out["mortal_memory"] = memory_record(work, "bench-gpu")
            print(f"mortal's memory choices: {json.dumps(out['mortal_memory'])}", flush=True)
        out["mortal"] = summarize(
            f"mortal (actor of {args.actor_gpus} rank(s) + {args.rollouts} rollouts {where}, maxStaleness "
            f"{args.staleness})",
            steps,
            args.staleness,
        )
        out["gpu_busy"] = args.gpu_busy
        out["sync_ms"] = sync_summary(out["mortal"]["steps"], args.sync, args.staleness)
        out["limits"] = limits(
            out["device"],
            model_parameters(model),
            args.decode_ms,
            out["mortal"]["steps"],
            prompt_tokens_per_step(model, args),
            lora=bool(args.lora),
            actor_gpus=args.actor_gpus,
            staleness=args.staleness,
        )


if __name__ == "__main__":
    main()
