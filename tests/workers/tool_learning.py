"""A tiny model that can learn the calculator example on CPU, for tests/workers/test_tool_learning.py.

Why not SmolLM2 or a random tiny model: SmolLM2-135M as shipped never calls a tool, and one GRPO step of the
calculator example takes 113-390 s on CI's two cores; a random model never writes a tool call either, so
its reward has no signal to rise on. What a user does on a GPU (bench/multiturn_gpu.py) is done here in
miniature: fine-tune first on demonstrations, then let RL raise the reward.

    1. a byte-level BPE vocabulary fitted to the example's conversations (digits kept one per token, so
       copying a number is copying tokens): about 60 tokens a conversation instead of SmolLM2's 295
    2. a Llama of about 0.13M parameters, fine-tuned (plain next-token loss on the model's tokens, tool
       results masked as the actor masks them) on demonstrations rendered by mortal's own tool loop: a
       share of them call the calculator and answer with its result, the rest answer at once with a guess
    3. so the warm-started model calls the tool about as often as the demonstrations did and is right
       when it does: GRPO has a reward to raise, by calling the tool more often

The fine-tuning loop is plain PyTorch rather than TRL's SFTTrainer: it is 20 lines here, takes about 20 s,
and keeps the demonstrations exactly the token ids the rollout worker's loop produces.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from tool_helpers import ArithScript, smollm2_tokenizer

from mortal.workers.builtin_tools import calculator
from mortal.workers.engines import GenerationParams
from mortal.workers.messages import RolloutRequest
from mortal.workers.multiturn import MultiTurn
from mortal.workers.tools import Toolbox

SYSTEM_PROMPT = "Use the calculator, then reply with its result."
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def arith_rows() -> list[dict[str, Any]]:
    """The shipped builtin:arith rows (what the run's dataset reads)."""
    from mortal.specs.training import DatasetSpec
    from mortal.workers.data import read_raw_rows

    return read_raw_rows(DatasetSpec(name="builtin:arith"))


class GuessScript(ArithScript):
    """A demonstration that answers at once with a number drawn from the row's seed: no tool, mostly wrong."""

    def turn(self, history: list[int], limit: int) -> tuple[list[int], list[float]]:
        guess = random.Random(len(history) * 7919 + sum(history)).randint(2, 40)
        ids = self.tokenizer(str(guess), add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return ids[:limit], [-0.5] * len(ids[:limit])


def _requests(rows: list[dict[str, Any]]) -> list[RolloutRequest]:
    return [RolloutRequest(prompt=[{"role": "system", "content": SYSTEM_PROMPT}, *row["prompt"]], row=row,
                           num_generations=1, seed=i) for i, row in enumerate(rows)]


def demonstrations(tokenizer: Any, rows: list[dict[str, Any]], script: type[ArithScript]) -> list[tuple[list[int], ...]]:
    """(prompt ids, completion ids, loss mask) of each row, made by mortal's tool loop with `script` as model."""
    loop = MultiTurn(script(tokenizer), tokenizer, Toolbox(tools=[calculator], max_iterations=2),
                     GenerationParams(max_tokens=64), "qwen2_5")
    return [(r.prompt_ids, r.completion_ids, r.mask) for [r] in loop.rollouts(_requests(rows))]


def fit_tokenizer(folder: Path, rows: list[dict[str, Any]]) -> Any:
    """A BPE vocabulary fitted to the example's rendered conversations, saved as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    renderer = smollm2_tokenizer()  # its chat template is replaced by TRL's qwen2_5 in the loop
    corpus = []
    for script in (ArithScript, GuessScript):
        for prompt, completion, _ in demonstrations(renderer, rows, script):
            corpus.append(renderer.decode(prompt + completion))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=1024, special_tokens=SPECIAL_TOKENS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = renderer.chat_template
    tokenizer.save_pretrained(folder)
    return tokenizer


def warm_started_model(folder: Path, tool_share: float = 0.5, steps: int = 800, seed: int = 0) -> Path:
    """Tokenizer, then a tiny Llama fine-tuned on demonstrations of which `tool_share` call the calculator."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    rows = arith_rows()
    tokenizer = fit_tokenizer(folder, rows)
    split = int(len(rows) * tool_share)
    data = demonstrations(tokenizer, rows[:split], ArithScript) + demonstrations(tokenizer, rows[split:], GuessScript)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 50))
    rng = random.Random(seed)
    for _ in range(steps):
        ids, labels, attention = _batch(rng.sample(data, 32), tokenizer.pad_token_id)
        model(input_ids=ids, attention_mask=attention, labels=labels).loss.backward()
        optimizer.step()
        warmup.step()
        optimizer.zero_grad()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    (folder / "warm_start.json").write_text(json.dumps({"tool_share": tool_share, "steps": steps, "seed": seed}))
    return folder


def _batch(examples: list[tuple[list[int], ...]], pad: int) -> tuple[Any, Any, Any]:
    """Right-padded ids, labels on the model's own tokens only (prompt and tool results -100), attention."""
    import torch

    width = max(len(p) + len(c) for p, c, _ in examples)
    ids = torch.full((len(examples), width), pad)
    labels = torch.full((len(examples), width), -100)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (prompt, completion, mask) in enumerate(examples):
        sequence = prompt + completion
        ids[i, :len(sequence)] = torch.tensor(sequence)
        attention[i, :len(sequence)] = 1
        labels[i, len(prompt):len(sequence)] = torch.tensor([t if m else -100 for t, m in zip(completion, mask, strict=True)])
    return ids, labels, attention
