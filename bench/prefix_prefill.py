"""The rollout's shared-prefix prefill against every row prefilling its whole prompt, same invocation.

    python bench/prefix_prefill.py --model PATH.gguf [--prompts 16] [--gens 4] [--max-tokens 8] [--rounds 3]
        [--prompts-per-task N]

The calculator example's prompts (tool schemas in the system turn, then each row's question), rendered with
its chat template as the rollouts render them, go through StaticDecoder.generate on the real model, split into
tasks of --prompts-per-task prompts (one engine call each; all of them in one by default; a CPU rollout's
tasks are one prompt each), three ways, alternating, `--rounds` times each:
  - kept: the shared prefix computed once per call, its message pieces kept from one task to the next
    (workers/rollout/engines/prefix_cache.py), as a rollout runs a step's tasks between two weight loads;
  - per_call: the same, the kept pieces dropped before each task (as if the weights changed between them);
  - whole: MORTAL_SHARED_PREFIX=0, every row prefilling its whole prompt.
Few new tokens per row, so the prefill is most of a call, as it is of a tool-calling turn's first step.
Prints one JSON line: each side's seconds for all the tasks (each round's and the lowest), the ratios of the
lowest, the prompt and shared lengths, and whether the sides sampled the same tokens (kept and per_call must,
bit for bit). On a GPU the decoder captures its step (--compile); on the CPU it runs eagerly.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "specs" / "examples" / "calculator-tools.yaml"


def tool_prompts(model: str, count: int) -> tuple[Any, list[list[int]]]:
    """(tokenizer, ids) of `count` of the calculator example's prompts, as its rollouts render them."""
    from mortal.specs.training import DatasetSpec, ModelSpec
    from mortal.workers.data import load_rows
    from mortal.workers.models import load_tokenizer
    from mortal.workers.references import resolve
    from mortal.workers.rollout.multiturn import resolve_chat_template
    from mortal.workers.rollout.tools import environment_methods

    spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    rollout = spec["rollout"]
    tokenizer = load_tokenizer(ModelSpec(name=model))
    tools = [resolve(ref) for ref in rollout.get("tools", [])]
    if rollout.get("environment"):
        tools += environment_methods(resolve(rollout["environment"])())
    template = resolve_chat_template(tokenizer, rollout.get("chatTemplate"))
    rows = load_rows(DatasetSpec.model_validate(spec["dataset"]))[:count]
    ids = [
        list(
            tokenizer.apply_chat_template(
                row["prompt"],
                tools=tools,
                chat_template=template,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        for row in rows
    ]
    return tokenizer, ids


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def timed_tasks(
    decoder: Any,
    tasks: list[tuple[torch.Tensor, torch.Tensor]],
    args: argparse.Namespace,
    eos: list[int],
    keep: bool,
) -> tuple[float, torch.Tensor]:
    """Seconds of one generate per task (the device synchronized at both ends), and their tokens; `keep`
    False drops the decoder's kept prefix pieces before each task."""
    from mortal.workers.rollout.engines.static_decode import Sampling

    sampling = Sampling(temperature=1.0, top_k=0, top_p=1.0)
    decoder.forget_weights()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    outputs = []
    started = time.perf_counter()
    for ids, mask in tasks:
        if not keep:
            decoder.forget_weights()
        torch.manual_seed(args.seed)
        tokens, _ = decoder.generate(ids, mask, args.max_tokens, sampling, eos)
        outputs.append(tokens[:, : args.max_tokens].cpu())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    took = time.perf_counter() - started
    width = max(t.shape[1] for t in outputs)
    return took, torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1) for t in outputs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a GGUF file or a Hugging Face folder")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--gens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="capture the decode step (CUDA)")
    parser.add_argument("--prompts-per-task", type=int, help="prompts in one engine call (default: all)")
    args = parser.parse_args()

    from mortal.specs.training import ModelSpec
    from mortal.workers.models import load_model
    from mortal.workers.prefix import ENV
    from mortal.workers.rollout.engines.prefix_cache import common_length
    from mortal.workers.rollout.engines.static_decode import StaticDecoder

    tokenizer, prompts = tool_prompts(args.model, args.prompts)
    per_task = args.prompts_per_task or len(prompts)
    tasks = [
        left_padded([p for p in prompts[i : i + per_task] for _ in range(args.gens)], tokenizer.pad_token_id)
        for i in range(0, len(prompts), per_task)
    ]
    model = load_model(ModelSpec(name=args.model, dtype="float32"))
    decoder = StaticDecoder(model, compile=args.compile, max_rows=per_task * args.gens)
    eos = [tokenizer.eos_token_id]
    sides = {"kept": ("1", True), "per_call": ("1", False), "whole": ("0", False)}
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    tokens: dict[str, torch.Tensor] = {}
    timed_tasks(decoder, tasks, args, eos, keep=True)  # warm-up (and the capture, with --compile)
    for _ in range(args.rounds):
        for side, (value, keep) in sides.items():
            os.environ[ENV] = value
            took, tokens[side] = timed_tasks(decoder, tasks, args, eos, keep)
            seconds[side].append(round(took, 4))
    lowest = {side: min(values) for side, values in seconds.items()}
    ids, mask = tasks[0]
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "gpus": 1 if torch.cuda.is_available() else 0,
                "rows": len(prompts) * args.gens,
                "tasks": len(tasks),
                "prompt_tokens": [min(len(p) for p in prompts), max(len(p) for p in prompts)],
                "shared_tokens": common_length(ids, mask.sum(-1).tolist()),
                "max_tokens": args.max_tokens,
                "seconds": seconds,
                "lowest": lowest,
                "whole_over_kept": round(lowest["whole"] / lowest["kept"], 3),
                "per_call_over_kept": round(lowest["per_call"] / lowest["kept"], 3),
                "same_tokens": bool(torch.equal(tokens["kept"], tokens["whole"])),
                "kept_equals_per_call": bool(torch.equal(tokens["kept"], tokens["per_call"])),
            }
        )
    )


if __name__ == "__main__":
    main()
