"""Where the actor's training step goes: TRL's GRPOTrainer step, the code mortal's actor runs, on a
fixed rollout, once per precision, in one process.

    python bench/train_step.py --model PATH.gguf [--precision fp32 tf32 bf16-autocast] [--loss fused full]
                               [--steps 6] [--prompts 8] [--gens 8] [--prompt-len 128] [--completion-len 96]
                               [--micro-batch N] [--profile] [--json out.json]
    python bench/train_step.py --shape 1.5b [--vocab 151936] ...   # Qwen2.5's shape, random weights
    python bench/train_step.py --cpu --model PATH.gguf     # a smoke test of the script, tiny sizes
    python bench/train_step.py --model ASSETS/smollm2-cfg --precision bf16 --kernels eager compile \
        --prompt-len 417 --shared-prefix 397 --completion-len 115 --actor-forward   # a tool-calling step

Why: on the learning bench (bench/learning_gpu.py) mortal's step on an H100 is bounded by the
actor's training step (TRL's loss, backward and optimizer step, about 0.97 s in float32 for 64
completions of SmolLM2-135M), the same code TRL's own trainer runs. This measures that step apart
from generation and the controller, so a change to it (precision, a chunked loss) is judged on
the step alone.

What runs: GRPOTrainer with a `rollout_func` that returns the same completions every step (prompts
of --prompt-len random tokens, completion lengths drawn once, seeded, uniformly between a quarter of
--completion-len and all of it, with sampling logprobs) and a reward that returns a seeded 0/1 per
completion, so advantages are not zero and the loss has a gradient. The settings are the learning
bench's: prompts x gens completions per optimizer step, one step per generation batch, lr 2e-5,
beta 0, loss dapo, float32 weights. Precisions:
- fp32: float32 matmuls (TF32 off), as the learning bench ran;
- tf32: float32 weights, TF32 matmuls (TrainingArguments' tf32, set here per variant because that
  flag is process-wide);
- bf16-autocast: float32 weights under bf16 autocast (TrainingArguments' bf16 on a float32 model);
- bf16: bfloat16 weights and TrainingArguments' bf16, as mortal's actor trains a `dtype: bfloat16` model
  (bench/gpu_step.py's setting).
Kernels (--kernels, each precision and loss with each): eager (what the actor runs); liger
(TrainingArguments' use_liger_kernel: Liger's fused RMSNorm, SwiGLU and RoPE; TRL keeps its own fused
LM head); compile (TrainingArguments' torch_compile on the model); compile-graphs (the same in torch's
"reduce-overhead" mode: CUDA graphs over the compiled forward and backward, replayed without the
host's per-kernel work). They say what the same step would
take with a kernel library or a compiler, before the actor is given either.
Losses (--loss, each precision with each):
- fused: TRL 1.16's own, what the actor runs: the completion tokens' logprobs and entropies from the
  final hidden states through lm_head in tiles (4,096 tokens x 32,768 vocabulary columns), recomputed
  in backward, never the [tokens x vocab] logits (mortal.workers.actor.trl_seam, assumption 6);
- full: the plain path it replaced, for comparison only: the model's logits over the whole vocabulary
  for every completion token, divided by the temperature, log-softmax, gather and entropy (what TRL
  before the fused head did, and what the figures of a memory-lean step are measured against).
Shapes (--shape, in place of --model): Qwen2.5's shapes of bench/gpu_step.py, random weights built on the
GPU, with SmolLM2's tokenizer; --vocab sets the vocabulary (49,152, SmolLM2's, as gpu_step.py; 151,936 is
Qwen2.5's own, where whole-vocabulary logits cost three times as much). Token ids are drawn from the
tokenizer's range whatever the vocabulary, so TRL can decode every completion.
A variant that runs out of GPU memory is a finding, not a failure of the bench: it is recorded with torch's
message (`out_of_memory`) and the next variant runs.
Timing: wall clock between consecutive steps' ends (on_step_end, after a CUDA synchronize), the first
--warmup steps left out; the median is reported. Peak GPU memory is torch's max_memory_allocated over
the timed steps. --profile adds torch.profiler over one timed step and prints the kernels that took
the most GPU time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

PRECISIONS = ("fp32", "tf32", "bf16-autocast", "bf16")
KERNELS = ("eager", "liger", "compile", "compile-graphs")
LOSSES = ("fused", "full")


def load_model(path: Path, device: str, dtype_name: str = "float32"):
    """A model in `dtype_name` (float32 unless --precision bf16) and its tokenizer: from a GGUF through
    mortal's own converter (cached), as bench/learning_gpu.py loads it on both sides; from a model folder; or,
    for a folder that holds only a config.json (MORTAL_TEST_ASSETS' smollm2-cfg), random weights of that shape
    with SmolLM2's tokenizer (the step's time does not depend on the weights' values)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, dtype_name)
    if path.suffix == ".gguf":
        from mortal.specs.training import ModelSpec
        from mortal.workers.models import model_location

        path = Path(model_location(ModelSpec(name=str(path))))
    if not any(path.glob("*.safetensors")):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
        assets = Path(os.environ.get("MORTAL_TEST_ASSETS", "/work/shared/anchors/assets"))
        return model.to(device), AutoTokenizer.from_pretrained(assets / "smollm2-tok")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    return model, AutoTokenizer.from_pretrained(path)


def fixed_rollout(args: argparse.Namespace, vocab: int):
    """rollout_func for TRL: the same completions and scores every step (module docstring)."""
    draw = random.Random(args.seed)
    n = args.prompts * args.gens
    shared = [draw.randrange(3, vocab) for _ in range(args.shared_prefix)]  # a system prompt and tool schemas
    own = args.prompt_len - args.shared_prefix
    prompt_ids = [shared + [draw.randrange(3, vocab) for _ in range(own)] for _ in range(args.prompts)]
    shortest = args.completion_len if args.fixed_lengths else max(1, args.completion_len // 4)
    lengths = [draw.randint(shortest, args.completion_len) for _ in range(n)]
    completions = [[draw.randrange(3, vocab) for _ in range(k)] for k in lengths]
    logprobs = [[-draw.random() for _ in range(k)] for k in lengths]
    scores = [float(draw.random() < 0.4) for _ in range(n)]

    def rollout(prompts, trainer):
        return {
            "prompt_ids": [prompt_ids[i // args.gens] for i in range(n)],
            "completion_ids": completions,
            "logprobs": logprobs,
            "score": scores,
        }

    def reward(completions, **kwargs):
        return kwargs["score"]

    return rollout, reward, sum(lengths)


def use_full_logits(trainer) -> None:
    """Replace TRL's fused LM head in this trainer's loss with full logits (the `full` loss; text only)."""
    import torch

    def full_logits(
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **unused,
    ):
        if compute_aux_loss or any(v is not None for v in unused.values()):
            raise ValueError("the full-logits loss of this bench scores text models only")
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            with trainer.accelerator.autocast():
                logits = model(input_ids=ids, attention_mask=mask).logits[:, -logits_to_keep - 1 : -1]
            log_softmax = torch.log_softmax(logits.float() / trainer.temperature, dim=-1)
            logps.append(log_softmax.gather(-1, ids[:, -logits_to_keep:, None]).squeeze(-1))
            if compute_entropy:
                entropies.append(-(log_softmax.exp() * log_softmax).sum(-1))
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    trainer._get_per_token_logps_and_entropies = full_logits


def shaped_model(shape: str, vocab: int, device: str, dtype_name: str):
    """A random-init model of Qwen2.5's `shape` (bench/gpu_step.py's SHAPES) with `vocab` embeddings, built on
    `device` (a 3B model's init takes a minute on the CPU, a second on the GPU), and SmolLM2's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_step import shape_config

    config = shape_config(shape, vocab)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype_name))
    assets = Path(os.environ.get("MORTAL_TEST_ASSETS", "/work/shared/anchors/assets"))
    return model, AutoTokenizer.from_pretrained(assets / "smollm2-tok")


def run_variant(
    precision: str, loss: str, kernels: str, args: argparse.Namespace, device: str, work: Path
) -> dict:
    """One variant's timed steps; out of GPU memory, what torch said (module docstring)."""
    import torch

    try:
        return train_variant(precision, loss, kernels, args, device, work)
    except torch.OutOfMemoryError as error:
        message = str(error).splitlines()[0]
    # out of the except block, the traceback's frames (the trainer, the model) are gone and their memory can
    # go
    print(f"{precision}, {loss} loss, {kernels} kernels: out of GPU memory: {message}", flush=True)
    peak = torch.cuda.max_memory_allocated() / 2**30
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "precision": precision,
        "loss": loss,
        "kernels": kernels,
        "out_of_memory": message,
        "median_step_seconds": None,
        "peak_memory_gib": peak,
    }


def train_variant(
    precision: str, loss: str, kernels: str, args: argparse.Namespace, device: str, work: Path
) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mortal.workers.actor.training import checkpointing_arg

    dtype_name = "bfloat16" if precision == "bf16" else "float32"
    if args.shape:
        model, tokenizer = shaped_model(args.shape, args.vocab, device, dtype_name)
    else:
        model, tokenizer = load_model(args.model, device, dtype_name)
    # ids TRL can decode: the tokenizer's range, which a --vocab larger than SmolLM2's exceeds
    rollout, reward, completion_tokens = fixed_rollout(args, min(model.config.vocab_size, len(tokenizer)))
    batch = args.prompts * args.gens
    micro = args.micro_batch or batch  # mortal's algorithm.microBatchSize: one rollout an optimizer step
    config = GRPOConfig(
        output_dir=str(work / f"{precision}-{loss}-{kernels}"),
        per_device_train_batch_size=micro,
        num_generations=args.gens,
        steps_per_generation=batch // micro,
        gradient_accumulation_steps=batch // micro,
        num_iterations=1,
        max_steps=args.steps,
        learning_rate=2e-5,
        loss_type="dapo",
        beta=0.0,
        max_completion_length=args.completion_len,
        bf16=precision in ("bf16-autocast", "bf16"),
        fp16=False,
        use_liger_kernel=kernels == "liger",
        torch_compile=kernels.startswith("compile"),
        torch_compile_mode="reduce-overhead" if kernels == "compile-graphs" else None,
        use_cpu=device == "cpu",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=args.seed,
        # the actor's default (spec.model.gradientCheckpointing: false), not GRPOConfig's (true); toggled
        # per step, checkpointing's embedding hooks also made the compile variants recompile at every step
        **checkpointing_arg(args.gradient_checkpointing),
    )
    if device != "cpu":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = precision == "tf32"
        _ = config.device
        config._n_gpu = 1
    ends: list[float] = []
    profiled: dict[str, object] = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, _args, state, control, **kwargs):
            if args.profile and state.global_step == args.steps - 1 and device != "cpu":
                profiled["profiler"] = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                    with_stack=True,
                )
                profiled["profiler"].__enter__()
            if state.global_step == args.warmup and device != "cpu":
                torch.cuda.reset_peak_memory_stats()

        def on_step_end(self, _args, state, control, **kwargs):
            if device != "cpu":
                torch.cuda.synchronize()
            ends.append(time.perf_counter())
            if "profiler" in profiled and state.global_step == args.steps:
                profiled["profiler"].__exit__(None, None, None)

    dataset = Dataset.from_dict({"prompt": [""] * (args.steps * args.prompts * args.gens)})
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
        rollout_func=rollout,
    )
    if loss == "full":
        use_full_logits(trainer)
    installed = False
    if args.actor_forward:  # as mortal.workers.actor.training does on a CUDA actor
        from mortal.workers.actor import padding_shift, trl_seam

        installed = padding_shift.install(trl_seam.patched_model(trainer))
        if not installed:
            print("--actor-forward: the model does not run sdpa; the loss's forward is TRL's own", flush=True)
    trainer.train()
    step_seconds = [b - a for a, b in zip(ends[args.warmup :], ends[args.warmup + 1 :], strict=False)]
    out = {
        "precision": precision,
        "loss": loss,
        "kernels": kernels,
        "actor_forward": installed,
        "micro_batch": micro,
        "step_seconds": step_seconds,
        "median_step_seconds": statistics.median(step_seconds) if step_seconds else None,
        "completion_tokens": completion_tokens,
        # equal across --loss up to float summation order: the same step computed two ways
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device != "cpu" else None,
    }
    if "profiler" in profiled:
        table = profiled["profiler"].key_averages().table(sort_by="self_cuda_time_total", row_limit=args.top)
        print(table, flush=True)
        out["profile"] = table
        out["host"] = host_summary(profiled["profiler"], args.top)
    del trainer, model
    if device != "cpu":
        torch.cuda.empty_cache()
    shown = f"{out['median_step_seconds']:.3f} s" if step_seconds else "n/a"
    memory = f", peak {out['peak_memory_gib']:.2f} GiB" if out["peak_memory_gib"] is not None else ""
    print(
        f"{precision}, {loss} loss, {kernels} kernels: median step {shown} "
        f"over {len(step_seconds)} steps{memory}",
        flush=True,
    )
    return out


SYNC_EVENTS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "aten::_local_scalar_dense",
)
PYTHON_FRAME = re.compile(r".+\(\d+\): ")  # how the profiler names a Python line: "file.py(12): function"
CALLER_EVENTS = (
    "aten::item",
    "aten::nonzero",
    "aten::to",
    "aten::_to_copy",
)  # ops whose Python caller a wait is traced to


def host_summary(profiler, top: int) -> dict:
    """Where the profiled step's host time goes: the ops by self CPU time, the points where the host waited
    for the GPU (a .item(), a synchronize: the GPU then idles until the host launches again), with the
    Python lines that asked for them, and how much of the step the GPU was busy."""
    import torch

    events = profiler.events()
    syncs = {}
    for event in events:
        if event.name in SYNC_EVENTS:
            count, micros = syncs.get(event.name, (0, 0.0))
            syncs[event.name] = (count + 1, micros + event.cpu_time_total)
    kernels = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    busy, reach = 0.0, None
    for start, end in kernels:  # union of kernel intervals
        if reach is None or start > reach:
            busy, reach = busy + (end - start), end
        elif end > reach:
            busy, reach = busy + (end - reach), end
    span = (kernels[-1][1] - kernels[0][0]) if kernels else 0.0
    cpu_table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    grouped: dict[tuple[str, ...], list[float]] = {}
    for event in events:
        if event.name in CALLER_EVENTS and _waits(event):
            key = (event.name, *_python_frames(event, 6))
            grouped.setdefault(key, []).append(event.cpu_time_total)
    callers = [
        {"event": key[0], "calls": len(us), "cpu_ms": sum(us) / 1e3, "stack": list(key[1:])}
        for key, us in sorted(grouped.items(), key=lambda kv: -sum(kv[1]))[:top]
    ]
    print(cpu_table, flush=True)
    print(
        "host waits for the GPU:",
        {k: f"{n} calls, {us / 1e3:.1f} ms" for k, (n, us) in syncs.items()},
        flush=True,
    )
    print(
        f"GPU busy {busy / 1e3:.1f} ms of the {span / 1e3:.1f} ms from its first kernel to its last",
        flush=True,
    )
    for caller in callers:
        print(f"  {caller['event']}: {caller['calls']} calls, {caller['cpu_ms']:.1f} ms, from", flush=True)
        for line in caller["stack"]:
            print(f"      {line}", flush=True)
    return {
        "syncs": {k: {"calls": n, "cpu_ms": us / 1e3} for k, (n, us) in syncs.items()},
        "gpu_busy_ms": busy / 1e3,
        "gpu_span_ms": span / 1e3,
        "cpu_table": cpu_table,
        "sync_callers": callers,
    }


def _waits(event) -> bool:
    """Whether the host waited for the GPU inside `event` (a synchronize or a scalar read below it)."""
    return event.name in SYNC_EVENTS or any(_waits(child) for child in event.cpu_children)


def _python_frames(event, depth: int) -> list[str]:
    """The Python lines (profiler's 'file.py(line): function' events) above `event`, innermost first."""
    frames, parent = [], event.cpu_parent
    while parent is not None and len(frames) < depth:
        if PYTHON_FRAME.match(parent.name):
            frames.append(parent.name)
        parent = parent.cpu_parent
    return frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--model",
        type=Path,
        help="the SmolLM2 GGUF file, a model folder, or a folder with only a config.json "
        "(random weights of that shape)",
    )
    source.add_argument(
        "--shape",
        choices=["tiny", "0.5b", "1.5b", "3b", "7b"],
        help="Qwen2.5's shape of this size, random weights (bench/gpu_step.py's SHAPES)",
    )
    parser.add_argument(
        "--vocab",
        type=int,
        default=49152,
        help="--shape's vocabulary: 49152 (SmolLM2's, gpu_step.py's) or 151936 (Qwen2.5's own)",
    )
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="completions per forward/backward pass, gradients accumulated to the step's batch "
        "(mortal's algorithm.microBatchSize)",
    )
    parser.add_argument("--precision", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument(
        "--loss",
        nargs="+",
        choices=LOSSES,
        default=["fused"],
        help="fused: TRL's own (the actor's); full: whole-vocabulary logits, for comparison",
    )
    parser.add_argument(
        "--kernels",
        nargs="+",
        choices=KERNELS,
        default=["eager"],
        help="eager: the actor's; liger, compile: TRL's own options, for comparison",
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--gens", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--completion-len", type=int, default=96)
    parser.add_argument(
        "--fixed-lengths",
        action="store_true",
        help="every completion --completion-len tokens (bench/gpu_step.py's forced lengths)",
    )
    parser.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="the first N tokens of every prompt the same (a tool-calling run's system prompt and schemas)",
    )
    parser.add_argument(
        "--actor-forward",
        action="store_true",
        help="the loss's forward as mortal's actor runs it on a GPU: padding moved to each row's end, a "
        "shared prompt prefix computed once (workers/actor/padding_shift.py; MORTAL_SHARED_PREFIX=0 "
        "leaves the prefix per row)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute activations in backward "
        "(spec.model.gradientCheckpointing; off by default, as in the actor)",
    )
    parser.add_argument("--profile", action="store_true", help="torch.profiler over the last step (GPU only)")
    parser.add_argument("--top", type=int, default=15, help="kernels listed by --profile")
    parser.add_argument(
        "--cpu", action="store_true", help="smoke test on the CPU: tiny sizes, figures meaningless"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch

    device = "cpu" if args.cpu else "cuda"
    if args.cpu:
        args.prompts, args.gens, args.prompt_len, args.completion_len, args.steps = 2, 2, 8, 8, 4
        args.shared_prefix = min(args.shared_prefix, args.prompt_len)
        args.precision, args.loss = ["fp32"], list(LOSSES)
    if args.micro_batch and (args.prompts * args.gens) % args.micro_batch:
        parser.error(
            f"--micro-batch {args.micro_batch} must divide the batch (--prompts x --gens = "
            f"{args.prompts * args.gens})"
        )
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("bench/train_step.py needs a CUDA GPU (or --cpu for a smoke test)")
    if not 0 <= args.shared_prefix <= args.prompt_len:
        parser.error(f"--shared-prefix {args.shared_prefix} must be within --prompt-len ({args.prompt_len})")
    if args.steps < args.warmup + 2:
        sys.exit(f"--steps ({args.steps}) must be at least --warmup ({args.warmup}) + 2 to time a step")
    with tempfile.TemporaryDirectory() as tmp:
        results = [
            run_variant(p, loss, k, args, device, Path(tmp))
            for p in args.precision
            for loss in args.loss
            for k in args.kernels
        ]
    out = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "gpus": int(device == "cuda"),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "variants": results,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
