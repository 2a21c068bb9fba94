"""Feasibility spike of issue 19: can TRL 1.16's GRPOTrainer train with FSDP2 over 2 CPU processes (gloo)?

    python bench/fsdp_spike.py [--mode trl-fsdp|trl-plugin|pre-sharded] [--steps 1]

Who runs it: a person, by hand; nothing imports it. It builds a tiny random-init Llama (SmolLM2's
tokenizer, 2 layers of width 64), takes `--steps` GRPO steps with a rollout_func that returns fixed
completions and scores, once on 1 process without FSDP (the reference), then on 2 spawned ranks
(torch.multiprocessing, gloo) with the chosen way of sharding, gathers each parameter to a full tensor
on rank 0 and prints the largest difference from the reference. A mode that a layer refuses prints
that layer's exception (type and message) and the frame that raised it.

Modes:
  trl-fsdp     GRPOConfig(fsdp="full_shard", fsdp_config={"fsdp_version": 2}): TRL's documented route
  trl-plugin   ACCELERATE_USE_FSDP=true + FSDP_VERSION=2 in the environment (what `accelerate launch
               --use_fsdp` sets): accelerate's FullyShardedDataParallelPlugin from the environment
  hf-distributed  transformers' own FSDP2 at load time, from_pretrained(distributed_config=
               DistributedConfig(fsdp_size=2)); Trainer then skips accelerate's DDP wrap
               (`is_distributed_loading_by_transformers`)
  pre-sharded  torch's fully_shard applied to each decoder layer and the root by this script, then the
               model handed to GRPOTrainer with no fsdp setting (accelerate sees plain MULTI_CPU)
It must not be mistaken for a test: it asserts nothing; it reports.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "workers"))

BATCH, GENERATIONS = 8, 4
# plain SGD by default: its step is linear in the gradient, so a difference in weights is one in gradients.
# AdamW's first step is lr * g / (|g| + eps): a gradient element of ~1e-9 whose float sum differs in the
# last bits (DDP's all-reduce adds in another order) moves by anything between 0 and lr.
OPTIM = os.environ.get("SPIKE_OPTIM", "sgd")


def fixed_rollout(step: int, prompts: list, trainer) -> dict:
    """The same completions and scores for every call of a step, sliced to this process's share.

    TRL (accelerate's sampler) gives each process len(prompts) = batch / world of the step's
    generation batch, in rank order; this returns the same rank-ordered slice of one fixed batch."""
    from mortal.workers.actor import trl_seam

    g = torch.Generator().manual_seed(1000 + step)
    ids = [[int(t) for t in torch.randint(5, 400, (6,), generator=g)] for _ in range(BATCH // GENERATIONS)]
    prompt_ids = [ids[i // GENERATIONS] for i in range(BATCH)]
    completion_ids = [
        [int(t) for t in torch.randint(5, 400, (4 + i % 3,), generator=g)] for i in range(BATCH)
    ]
    logprobs = [[-1.0] * len(c) for c in completion_ids]
    rewards = [{"score": float(torch.rand((), generator=g))} for _ in range(BATCH)]
    n, rank = len(prompts), trainer.accelerator.process_index
    part = slice(rank * n, (rank + 1) * n)
    return trl_seam.rollout_output(
        prompt_ids[part], completion_ids[part], logprobs[part], rewards[part], [0] * n
    )


def build(model_dir: Path, out: Path, world: int, mode: str, steps: int):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from mortal.workers.actor import trl_seam

    if mode == "hf-distributed" and world > 1:
        from transformers.distributed import DistributedConfig

        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, distributed_config=DistributedConfig(fsdp_size=world)
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    extra = {}
    if mode == "trl-fsdp":
        extra = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": True}}
    if mode == "pre-sharded" and world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    args = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=BATCH // world,
        num_generations=GENERATIONS,
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        max_steps=steps,
        learning_rate=1e-2,
        loss_type="dapo",
        beta=0.0,
        max_completion_length=8,
        use_cpu=True,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        optim=OPTIM,
        **extra,
    )

    def rollout(prompts, trainer):
        return fixed_rollout(trainer.state.global_step, prompts, trainer)

    return GRPOTrainer(
        model=model,
        reward_funcs=[trl_seam.PrecomputedReward("score")],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [""] * (steps * BATCH // GENERATIONS * 4)}),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        rollout_func=rollout,
    )


def full_weights(model) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor under the plain model's names (DTensors gathered: a collective,
    so every rank calls it; a DDP wrapper's `module.` prefix dropped)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in model.named_parameters():
        tensor = param.detach()
        out[name.removeprefix("module.")] = (
            tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        ).clone()
    return out


def rank_main(rank: int, world: int, port: int, mode: str, steps: int, model_dir: str, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
        TRL_EXPERIMENTAL_SILENCE="1",
    )
    if mode == "trl-plugin":
        os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2")
    torch.set_num_threads(1)
    report = {"rank": rank, "mode": mode}
    try:
        if mode == "pre-sharded":
            dist.init_process_group("gloo", rank=rank, world_size=world)
        trainer = build(Path(model_dir), Path(out) / f"rank{rank}", world, mode, steps)
        state = trainer.accelerator.state
        report["distributed_type"] = str(state.distributed_type)
        report["fsdp_plugin"] = repr(getattr(state, "fsdp_plugin", None))[:200]
        report["is_fsdp_enabled"] = bool(getattr(trainer, "is_fsdp_enabled", False))
        trainer.train()
        report["model_type"] = type(trainer.model_wrapped).__name__
        report["sharded"] = any(type(p).__name__ == "DTensor" for p in trainer.model.parameters())
        weights = full_weights(trainer.model)
        report["loss"] = [h.get("loss") for h in trainer.state.log_history if "loss" in h]
        if rank == 0:
            torch.save(weights, Path(out) / "weights.pt")
    except Exception as exc:
        tb = traceback.extract_tb(exc.__traceback__)
        report["error"] = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"[:1500]
        report["raised_in"] = [
            f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in tb[-4:]
        ]
    (Path(out) / f"report{rank}.json").write_text(json.dumps(report, indent=1, default=str))
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, mode: str, steps: int, model_dir: Path, out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(
        rank_main,
        args=(world, free_port(), mode, steps, str(model_dir), str(out)),
        nprocs=world,
        start_method="spawn",
        join=True,
    )
    return [json.loads((out / f"report{r}.json").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--mode", choices=["trl-fsdp", "trl-plugin", "pre-sharded", "hf-distributed"], default="trl-fsdp"
    )
    parser.add_argument("--steps", type=int, default=1)
    opts = parser.parse_args()
    from rollout_helpers import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model")
        # the reference: 1 rank, where "pre-sharded" shards nothing (accelerate wraps it in a 1-rank DDP)
        ref = run(1, "pre-sharded", opts.steps, model_dir, Path(tmp) / "ref")
        print("reference (1 process):", json.dumps(ref[0]))
        got = run(2, opts.mode, opts.steps, model_dir, Path(tmp) / "sharded")
        for report in got:
            print(f"rank {report['rank']}:", json.dumps(report, indent=1))
        if (Path(tmp) / "sharded" / "weights.pt").exists() and (Path(tmp) / "ref" / "weights.pt").exists():
            a, b = (
                torch.load(Path(tmp) / "ref" / "weights.pt"),
                torch.load(Path(tmp) / "sharded" / "weights.pt"),
            )
            from transformers import AutoModelForCausalLM

            start = dict(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())
            print("names equal:", sorted(a) == sorted(b), "| missing:", sorted(set(a) ^ set(b))[:4])
            common = [k for k in a if k in b]
            worst = max(float((a[k] - b[k]).abs().max()) for k in common)
            print(f"max |sharded - unsharded| over {len(common)} parameters: {worst:.3e} (optim {OPTIM})")
            for k in common:
                d = (a[k] - b[k]).abs()
                if float(d.max()) > 1e-5:
                    print(
                        f"  {k}: max {float(d.max()):.2e}, "
                        f"{int((d > 1e-5).sum())}/{d.numel()} elements > 1e-5"
                    )
            moved = max(float((a[k] - start[k].detach()).abs().max()) for k in common if k in start)
            print(f"max |step - initial| (how far the step moved a weight): {moved:.3e}")


if __name__ == "__main__":
    main()
