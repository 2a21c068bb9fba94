"""Step throughput on one GPU: TRL's GRPOTrainer and mortal, same model and token counts, in one run.

    python bench/gpu_step.py [--steps 5] [--rollouts 2] [--only trl|mortal] [--json out.json]

The anchor's setting (DESIGN.md, Targets): a random-init model of Qwen2.5-0.5B's shape, 8 prompts x
8 generations x 256 completion tokens per step, bf16, beta 0. TRL generates with transformers'
`generate` inside its trainer (completions forced to 256 tokens, as the anchor did). mortal runs
through the controller on the same single GPU: the actor and `--rollouts` colocated rollout workers
(spec rollout.colocate) with the transformers engine, on-policy. A random-init model almost never
samples its EOS token, so mortal's completions are 256 tokens long too; the script reports the
tokens it actually trained on. Prints completion tokens per second for both and their ratio, from
the median step after the first (the first carries start-up and compilation).
Needs a CUDA GPU, TRL and datasets, and SmolLM2's tokenizer (MORTAL_TEST_ASSETS, as the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from through_controller import run_through_controller

REWARD = "mortal.workers.builtin_rewards:short_answer"  # any cheap reward: throughput is what is timed
TOPICS = ["rivers", "a lighthouse", "prime numbers", "a lost key", "winter markets", "the moon", "old trains"]


def make_model(folder: Path) -> Path:
    """Qwen2.5-0.5B's shape with random weights, and SmolLM2's tokenizer (its vocabulary size)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    assets = Path(os.environ.get("MORTAL_TEST_ASSETS", "/work/shared/anchors/assets"))
    config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(assets / "smollm2-tok").save_pretrained(folder)
    return folder


def prompt_rows(n: int = 64) -> list[dict]:
    return [{"prompt": f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]} number {i}."} for i in range(n)]


def run_trl(model: Path, args: argparse.Namespace, work: Path) -> list[dict]:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mortal.workers import builtin_rewards

    steps: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "step_time" in logs:
                tokens = logs.get("completions/mean_length", 0.0) * args.prompts * args.gens
                steps.append({"step": state.global_step, "seconds": logs["step_time"], "tokens": tokens})

    config = GRPOConfig(
        output_dir=str(work / "trl"), per_device_train_batch_size=args.prompts * args.gens,
        num_generations=args.gens, max_completion_length=args.tokens, learning_rate=1e-6, beta=0.0,
        max_steps=args.steps, logging_steps=1, report_to="none", save_strategy="no", bf16=True,
        generation_kwargs={"min_new_tokens": args.tokens}, gradient_checkpointing=False,
    )
    trainer = GRPOTrainer(model=str(model), reward_funcs=[builtin_rewards.short_answer], args=config,
                          train_dataset=Dataset.from_list(prompt_rows()), callbacks=[Record()])
    trainer.train()
    del trainer
    torch.cuda.empty_cache()
    return steps


def mortal_spec(model: Path, data: Path, args: argparse.Namespace) -> dict:
    return {
        "model": {"name": str(model), "dtype": "bfloat16"},
        "dataset": {"name": str(data)},
        "algorithm": {"numGenerations": args.gens, "batchSize": args.prompts * args.gens, "learningRate": 1e-6,
                      "beta": 0.0, "maxSteps": args.steps, "maxStaleness": 0},
        "generation": {"maxTokens": args.tokens, "engine": "transformers"},
        "rewards": [{"function": REWARD}],
        "actor": {"gpu": "H100"},
        "rollout": {"gpu": "H100", "replicas": args.rollouts, "colocate": True},
        "checkpoint": {"every": args.steps, "keep": 1},
        "logging": {"wandb": {"mode": "disabled"}},
    }


def run_mortal(model: Path, args: argparse.Namespace, work: Path) -> list[dict]:
    from mortal.specs import TrainingRun

    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in prompt_rows()))
    run = TrainingRun.model_validate({"metadata": {"name": "bench-gpu"}, "spec": mortal_spec(model, data, args)})
    by_step, _ = run_through_controller(run, work)
    return [{"step": s, "seconds": v["step_seconds"], "tokens": v["completion_tokens"]}
            for s, v in sorted(by_step.items()) if "step_seconds" in v]


def summarize(name: str, steps: list[dict]) -> dict:
    timed = steps[1:] or steps
    seconds = statistics.median(s["seconds"] for s in timed)
    tokens = statistics.median(s["tokens"] for s in timed)
    summary = {"median_step_seconds": seconds, "completion_tokens_per_step": tokens,
               "completion_tokens_per_second": tokens / seconds, "steps": steps}
    print(f"{name}: {seconds:.2f} s/step, {tokens:.0f} completion tokens/step, {tokens / seconds:.0f} tokens/s",
          flush=True)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--gens", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rollouts", type=int, default=2, help="colocated rollout workers of mortal")
    parser.add_argument("--only", choices=["trl", "mortal"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch

    out: dict = {"device": torch.cuda.get_device_name(0), **{k: v for k, v in vars(args).items() if k != "json"}}
    with tempfile.TemporaryDirectory(prefix="mortal-gpu-bench-") as tmp:
        work = Path(tmp)
        model = make_model(work / "model")
        if args.only != "mortal":
            out["trl"] = summarize("TRL GRPOTrainer", run_trl(model, args, work))
        if args.only != "trl":
            out["mortal"] = summarize(f"mortal (actor + {args.rollouts} colocated rollouts)",
                                      run_mortal(model, args, work))
    if "trl" in out and "mortal" in out:
        out["mortal_over_trl"] = (out["mortal"]["completion_tokens_per_second"]
                                  / out["trl"]["completion_tokens_per_second"])
        print(f"mortal / TRL throughput: {out['mortal_over_trl']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
