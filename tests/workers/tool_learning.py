"""Tiny models that can learn the tool examples on CPU, for tests/workers/test_tool_learning.py.

Why not SmolLM2 or a random tiny model: SmolLM2-135M as shipped never calls a tool, and one GRPO step of the
calculator example takes 113-390 s on CI's two cores; a random model never writes a tool call either, so
its reward has no signal to rise on. What a user does on a GPU (bench/multiturn_gpu.py) is done here in
miniature: fine-tune first on demonstrations, then let RL raise the reward.

    1. demonstrations rendered by mortal's own tool loop (mortal.workers.rollout.multiturn) with a scripted
       model (tool_helpers.ScriptedEngine) and the real tools: two behaviours per example, one that earns the
       reward and one that does not (the calculator: call it and answer with its result, or guess at once; the
       code agent: after its first failed run, fix the code and run it again, or give up)
    2. a byte-level BPE vocabulary fitted to those conversations (digits kept one per token, so copying a
       number is copying tokens): the calculator's conversation is about 60 tokens instead of SmolLM2's 295
    3. a two-layer Llama (0.13M parameters for the calculator, 0.6M for the code agent)
       fine-tuned on both behaviours, half and half (plain next-token loss on the model's
       tokens; tool results masked as the actor masks them)
    4. so the warm-started model earns the reward about half the time, and GRPO can raise it by choosing
       the rewarded behaviour more often

The fine-tuning loop is plain PyTorch rather than TRL's SFTTrainer: it is a few lines here, takes seconds,
and trains on exactly the token ids and masks the rollout worker's loop produces.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tool_helpers import (
    ArithScript,
    ScriptedEngine,
    scripted_turn,
    smollm2_tokenizer,
    tool_call,
    tool_results,
)

from mortal.workers.messages import RolloutRequest
from mortal.workers.rollout.builtin_tools import CodeAgentEnvironment, calculator
from mortal.workers.rollout.engines import GenerationParams
from mortal.workers.rollout.multiturn import MultiTurn
from mortal.workers.rollout.tools import Toolbox

CALCULATOR_PROMPT = "Use the calculator, then reply with its result."
CODE_AGENT_PROMPT = (
    "Write the function, check it with run_tests, fix it until the tests pass, then answer with one "
    "Python code block."
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
Demonstration = tuple[list[int], list[int], list[int]]  # prompt ids, completion ids, loss mask


def builtin_rows(name: str) -> list[dict[str, Any]]:
    """A shipped dataset's rows, as the run's dataset reads them."""
    from mortal.specs.training import DatasetSpec
    from mortal.workers.data import read_raw_rows

    return read_raw_rows(DatasetSpec(name=f"builtin:{name}"))


# -- the scripted behaviours -------------------------------------------------------------------------------
class GuessScript(ArithScript):
    """Answers at once with a number drawn from the conversation: no tool, mostly wrong."""

    def turn(self, history: list[int], limit: int) -> tuple[list[int], list[float]]:
        return scripted_turn(
            self.tokenizer, str(random.Random(len(history) * 7919 + sum(history)).randint(2, 40)), limit
        )


def first_attempt(solution: str) -> str:
    """The code agent's first try: the solution's signature returning None (it fails every task's tests)."""
    return solution.split("\n")[0] + "\n    return None\n"


class FixScript(ScriptedEngine):
    """A scripted code agent. It runs a first attempt that fails; then, with `fixes`, it runs the row's
    solution and answers with it (the reward), else it answers with the failing code (no reward). `solutions`
    maps each user message to its row's solution."""

    def __init__(self, tokenizer: Any, solutions: dict[str, str], fixes: bool) -> None:
        super().__init__(tokenizer)
        self.solutions, self.fixes = solutions, fixes

    def turn(self, history: list[int], limit: int) -> tuple[list[int], list[float]]:
        text = self.tokenizer.decode(history)
        solution = self.solutions[text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]]
        results = tool_results(text)
        if not results:
            return scripted_turn(self.tokenizer, tool_call("run_tests", code=first_attempt(solution)), limit)
        if len(results) == 1 and self.fixes:
            return scripted_turn(self.tokenizer, tool_call("run_tests", code=solution), limit)
        answer = solution if results[-1] == "All tests passed." else first_attempt(solution)
        return scripted_turn(self.tokenizer, f"```python\n{answer}```", limit)


# -- demonstrations, vocabulary, model -----------------------------------------------------------------------
def demonstrations(
    tokenizer: Any,
    rows: list[dict[str, Any]],
    script: Callable[[Any], ScriptedEngine],
    toolbox: Toolbox,
    system_prompt: str,
    max_tokens: int,
) -> list[Demonstration]:
    """What mortal's tool loop makes of each row with `script(tokenizer)` as the model: the rollout worker's
    ids and mask."""
    loop = MultiTurn(
        script(tokenizer), tokenizer, toolbox, GenerationParams(max_tokens=max_tokens), "qwen2_5"
    )
    requests = [
        RolloutRequest(
            prompt=[{"role": "system", "content": system_prompt}, *row["prompt"]],
            row=row,
            num_generations=1,
            seed=i,
        )
        for i, row in enumerate(rows)
    ]
    return [(r.prompt_ids, r.completion_ids, r.mask) for [r] in loop.rollouts(requests)]


def fit_tokenizer(folder: Path, conversations: list[str], vocab_size: int) -> Any:
    """A BPE vocabulary fitted to `conversations`, saved in `folder` as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        conversations,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = (
        smollm2_tokenizer().chat_template
    )  # the run's chatTemplate (qwen2_5) replaces it
    tokenizer.save_pretrained(folder)
    return tokenizer


def warm_start(
    folder: Path,
    behaviours: Callable[[Any], list[list[Demonstration]]],
    vocab_size: int,
    steps: int,
    hidden: int = 64,
    seed: int = 0,
) -> Path:
    """Vocabulary fitted to the behaviours' conversations, then a tiny Llama fine-tuned on
    them in equal parts."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    renderer = smollm2_tokenizer()
    tokenizer = fit_tokenizer(
        folder, [renderer.decode(p + c) for group in behaviours(renderer) for p, c, _ in group], vocab_size
    )
    data = [d for group in behaviours(tokenizer) for d in group]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 50))
    rng = random.Random(seed)
    for _ in range(steps):
        ids, labels, attention = _batch(rng.sample(data, min(32, len(data))), tokenizer.pad_token_id)
        model(input_ids=ids, attention_mask=attention, labels=labels).loss.backward()
        optimizer.step()
        warmup.step()
        optimizer.zero_grad()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    return folder


def _batch(examples: list[Demonstration], pad: int) -> tuple[Any, Any, Any]:
    """Right-padded ids, labels on the model's own tokens only (prompt and tool results -100), attention."""
    import torch

    width = max(len(p) + len(c) for p, c, _ in examples)
    ids = torch.full((len(examples), width), pad)
    labels = torch.full((len(examples), width), -100)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (prompt, completion, mask) in enumerate(examples):
        sequence = prompt + completion
        ids[i, : len(sequence)] = torch.tensor(sequence)
        attention[i, : len(sequence)] = 1
        labels[i, len(prompt) : len(sequence)] = torch.tensor(
            [t if m else -100 for t, m in zip(completion, mask, strict=True)]
        )
    return ids, labels, attention


# -- the two examples ----------------------------------------------------------------------------------------
def calculator_model(folder: Path, seed: int = 0) -> Path:
    """builtin:arith: half the rows call the calculator and answer with its result, half guess."""
    rows = builtin_rows("arith")
    half = len(rows) // 2
    toolbox = Toolbox(tools=[calculator], max_iterations=2)

    def behaviours(tokenizer: Any) -> list[list[Demonstration]]:
        return [
            demonstrations(tokenizer, rows[:half], ArithScript, toolbox, CALCULATOR_PROMPT, 64),
            demonstrations(tokenizer, rows[half:], GuessScript, toolbox, CALCULATOR_PROMPT, 64),
        ]

    return warm_start(folder, behaviours, vocab_size=1024, steps=800, seed=seed)


def code_agent_model(folder: Path, rows: list[dict[str, Any]], seed: int = 0) -> Path:
    """`rows` of builtin:mbpp-mini: every row once as a fix after the first failure, once
    as giving up. The model learns the rows' solutions by heart (what it can fix is only
    what it was shown), so keep them few."""
    solutions = {row["prompt"][-1]["content"]: row["solution"] for row in rows}
    toolbox = Toolbox(environments={None: CodeAgentEnvironment}, max_iterations=3)

    def behaviours(tokenizer: Any) -> list[list[Demonstration]]:
        return [
            demonstrations(
                tokenizer,
                rows,
                lambda t, f=fixes: FixScript(t, solutions, f),
                toolbox,
                CODE_AGENT_PROMPT,
                384,
            )
            for fixes in (True, False)
        ]

    return warm_start(folder, behaviours, vocab_size=2048, steps=200, hidden=128, seed=seed)
