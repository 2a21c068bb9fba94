"""TRL's preparation of a step's batch on the actor's host: with the rollouts' texts handed over, and without.

    python bench/trl_prepare.py [--completions 64] [--tokens 256] [--steps 8] [--rounds 2] [--json out.json]

What it measures: the actor's actor/prepare_seconds, the host time from rollout_func's return to TRL's first
compute_loss of the step (padding, decoding the completions' texts, rewards, advantages, metrics), for one
batch of the forced bench's shape (64 completions of 256 tokens after 13-token prompts, SmolLM2's tokenizer
and vocabulary). Two settings, alternated `--rounds` times in one invocation: `decode` (TRL decodes the
completion ids itself, as before 2026-11-28) and `reuse` (trl_seam.reuse_rollout_texts: the texts the
rollouts decoded already). The update is left out on purpose: compute_loss is replaced by a zero loss on one
weight, so a step costs its preparation and nothing of the model's size (the model is a 2-layer one of
SmolLM2's vocabulary). The rollout_func decodes its texts outside the timed span, as a rollout worker does
in its own process.

On a CPU this is the host's own work with no GPU in it: the figure says how much host time a step saves, not
a GPU step's length (bench/gpu_step.py's actor/prepare_seconds is that). Median over the steps after the
first of each round. Needs TRL, datasets and SmolLM2's tokenizer (MORTAL_TEST_ASSETS, as the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "workers"))
from rollout_helpers import assets_dir  # noqa: E402

PROMPT_TOKENS = 13


def prepare_seconds(reuse: bool, args: argparse.Namespace, tokenizer: Any, work: Path) -> list[float]:
    """One trainer's --steps steps; the seconds from rollout_func's return to the first compute_loss of
    each."""
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from mortal.workers.actor import trl_seam

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
    )
    n, length = args.completions, args.tokens
    returned: list[float] = []
    seconds: list[float] = []
    hand = None

    def rollout(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        generator = torch.Generator().manual_seed(trainer.state.global_step)
        completion_ids = torch.randint(100, len(tokenizer) - 100, (n, length), generator=generator).tolist()
        output = trl_seam.rollout_output(
            [[5] * PROMPT_TOKENS] * n,
            completion_ids,
            [[-1.0] * length] * n,
            [{"r": float(i % 3)} for i in range(n)],
            [0] * n,
        )
        if hand is not None:
            hand(
                output["completion_ids"],
                [tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids],
            )
        returned.append(time.perf_counter())
        return output

    def stamp() -> None:
        if returned:
            seconds.append(time.perf_counter() - returned.pop())

    config = GRPOConfig(
        output_dir=str(work),
        per_device_train_batch_size=n,
        num_generations=8,
        steps_per_generation=1,
        max_steps=args.steps,
        learning_rate=1e-6,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        seed=0,
        max_completion_length=length,
        loss_type="dapo",
        beta=0.0,
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        args=config,
        reward_funcs=[trl_seam.PrecomputedReward("r")],
        train_dataset=Dataset.from_dict({"prompt": [""] * (n * args.steps)}),
        rollout_func=rollout,
    )
    weight = model.get_output_embeddings().weight
    trainer.compute_loss = lambda *a, **k: weight.sum() * 0.0  # the update left out (module docstring)
    trl_seam.time_loss_start(trainer, stamp)
    if reuse:
        hand = trl_seam.reuse_rollout_texts(trainer)
    trainer.train()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--completions", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets_dir() / "smollm2-tok")
    runs: dict[str, list[list[float]]] = {"decode": [], "reuse": []}
    with tempfile.TemporaryDirectory(prefix="mortal-trl-prepare-") as tmp:
        for round_ in range(args.rounds):
            for name in runs:
                steps = prepare_seconds(name == "reuse", args, tokenizer, Path(tmp) / f"{name}{round_}")
                runs[name].append(steps)
                print(
                    f"round {round_ + 1}, {name}: " + ", ".join(f"{s * 1000:.1f}" for s in steps) + " ms",
                    flush=True,
                )
    medians = {name: [statistics.median(steps[1:]) for steps in rounds] for name, rounds in runs.items()}
    for round_ in range(args.rounds):
        saved = medians["decode"][round_] - medians["reuse"][round_]
        print(
            f"round {round_ + 1}: TRL's preparation "
            f"{medians['decode'][round_] * 1000:.1f} ms decoding itself, "
            f"{medians['reuse'][round_] * 1000:.1f} ms with the rollouts' texts ({saved * 1000:.1f} ms saved)"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": "cpu",
                    "gpus": 0,
                    "cpu": os.cpu_count(),
                    "completions": args.completions,
                    "tokens": args.tokens,
                    "steps": args.steps,
                    "seconds": runs,
                    "medians": medians,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
