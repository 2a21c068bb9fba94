"""Scripted stand-ins for a model that calls tools, shared by the tool-calling tests.

Imported by tests/workers/rollout/test_multiturn.py, tests/workers/tool_learning.py and
tests/controller/cli/test_cli_components.py. A ScriptedEngine implements the Engine interface and answers from
the conversation's text, so a test can run mortal's tool loop (and TRL's) on turns that really call tools,
which a random tiny model never does.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rollout_helpers import assets_dir

from mortal.workers.rollout.builtin_tools import ArithEnvironment
from mortal.workers.rollout.engines import Completion, Engine, GenerationParams

MAX_MODEL_LEN = 2048


def tool_call(name: str, **arguments: Any) -> str:
    """What a qwen2_5-template model writes to call a tool."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# What the scripted model says: by the task word in the user's message, then by how many tool results
# the conversation already holds. No entry left: a final answer.
SCRIPTS = {
    "plain": ["The answer is 5."],
    "chain": [
        tool_call("calculator", expression="2 + 3"),
        tool_call("calculator", expression="5 * 2"),
        "It is 10.",
    ],
    "broken": [tool_call("nope", x=1), tool_call("calculator", expression="import os"), "I give up."],
    "double": [
        tool_call("calculator", expression="1 + 1") + "\n" + tool_call("calculator", expression="2 + 2"),
        "2 and 4.",
    ],
    "long": [tool_call("calculator", expression="7 - 1"), "six " * 200],
    "loop": [tool_call("calculator", expression="1 + 1")] * 10,
}


def tool_results(text: str) -> list[str]:
    """The tool results a conversation rendered by the qwen2_5 template holds, in order."""
    return re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.S)


def scripted_turn(tokenizer: Any, said: str, limit: int) -> tuple[list[int], list[float]]:
    """A scripted model turn: `said`'s ids and EOS, cut to `limit`, each with logprob -0.5."""
    ids = (tokenizer(said, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])[:limit]
    return ids, [-0.5] * len(ids)


def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer (its own chat template, which cannot call tools)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(assets_dir() / "smollm2-tok")


class ScriptedEngine(Engine):
    """A deterministic stand-in for a model: each turn's text comes from SCRIPTS (ids end with EOS unless cut
    by max_tokens); token i's logprob is -(i + 1) / 100 + the turn, so misplaced logprobs show."""

    name = "scripted"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.calls: list[tuple[int, int]] = []  # (prompts, n) per generate

    @classmethod
    def create(cls, *args: Any, **kwargs: Any) -> Engine:
        raise NotImplementedError

    def turn(self, history: list[int], limit: int) -> tuple[list[int], list[float]]:
        text = self.tokenizer.decode(history)
        user = text.split("<|im_start|>user\n")[1]
        task = next(word for word in SCRIPTS if word in user.split("<|im_end|>")[0])
        done = text.count("<tool_response>")
        said = SCRIPTS[task][done] if done < len(SCRIPTS[task]) else "Done."
        ids = self.tokenizer(said, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        ids = ids[:limit]
        return ids, [-(i + 1) / 100 + done for i in range(len(ids))]

    def generate(
        self, prompts: list[list[int]], n: int, seeds: list[int], params: GenerationParams
    ) -> list[list[Completion]]:
        self.calls.append((len(prompts), n))
        return [[Completion(*self.turn(p, params.max_tokens)) for _ in range(n)] for p in prompts]

    def converse(
        self, prompts: list[list[int]], seeds: list[int], params: GenerationParams, on_turn_end: Any
    ) -> None:
        """The scripted turns as conversations (Engine.converse): every live conversation's turn handed
        over, then each one's fed tokens appended to its history, until none goes on."""
        histories = [list(p) for p in prompts]
        used = [0] * len(prompts)
        live = list(range(len(prompts)))
        while live:
            futures = {}
            for i in live:
                ids, logprobs = self.turn(histories[i], params.max_tokens - used[i])
                histories[i] += ids
                used[i] += len(ids)
                futures[i] = on_turn_end(i, ids, logprobs)
            live = []
            for i, future in futures.items():
                fed = future.result() if future is not None else None
                if fed:
                    histories[i] += fed
                    used[i] += len(fed)
                    live.append(i)

    def max_model_len(self) -> int | None:
        return MAX_MODEL_LEN

    def load_weights(self, path: str, transport: object = None) -> None:
        raise NotImplementedError

    def close(self) -> None:
        return None


class ArithScript(ScriptedEngine):
    """A scripted model for builtin:arith: it asks the calculator for the sum in the question, then answers
    with the tool's result (by construction right: this checks the plumbing, not learning). When its tools
    include ArithEnvironment's `submit`, it submits the result before answering."""

    @classmethod
    def create(
        cls,
        model_spec: Any,
        tokenizer: Any,
        device: str | None = None,
        max_num_seqs: int | None = None,
        memory_share: float | None = None,
        compile_scope: str = "auto",
    ):
        return cls(tokenizer)

    def load_weights(self, path: str, transport: object = None) -> None:
        """The script has no weights: each version the actor publishes is taken and ignored."""

    def turn(self, history: list[int], limit: int) -> tuple[list[int], list[float]]:
        text = self.tokenizer.decode(history)
        results = tool_results(text)
        submits = '"name": "submit"' in text.split("<|im_start|>user")[0]
        if results and submits and len(results) == 1:
            said = tool_call("submit", answer=results[0])
        elif results:
            said = results[0]
        else:
            a, b = re.search(r"What is (\d+) \+ (\d+)\?", text).groups()
            said = tool_call("calculator", expression=f"{a} + {b}")
        return scripted_turn(self.tokenizer, said, limit)


class HintingArith(ArithEnvironment):
    """ArithEnvironment whose `reset` returns a hint, which the tool loop appends to the rollout's prompt
    (TRL's environment_factory contract)."""

    HINT = " (Use the calculator.)"

    def reset(self, answer: Any = None, **row: Any) -> str:
        super().reset(answer, **row)
        return self.HINT


def saw_the_hint(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 for each completion whose prompt, as the reward got it, ends its last message with the hint."""
    return [float(str(p[-1]["content"]).endswith(HintingArith.HINT)) for p in prompts]
