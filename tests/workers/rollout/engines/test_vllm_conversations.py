"""Conversations across turns on vLLM's engine (vllm_conversations.py), against a fake of the four engine
calls it makes: a turn that ends leaves the batch and its next turn rejoins it with the whole history and the
budget left; one conversation waiting on its tool holds up no other; what a conversation samples does not
depend on when its tools answered; a tool's exception aborts every running request; nothing runs past the
budget. vLLM itself runs only on a GPU with vLLM installed (test_engines.py's vLLM test)."""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import types
from typing import Any

import pytest

from mortal.workers.rollout.engines.base import GenerationParams
from mortal.workers.rollout.engines.vllm_conversations import Conversations, VllmDroppedRequests

EOS = 2


class FakeEngine:
    """vLLM's LLMEngine as Conversations drives it: `add_request(id, prompt, params)`; `step()` samples one
    token for every running request and returns their RequestOutputs (finished or not); a request's k-th
    token is a function of its prompt and seed (vLLM's seeded sampling), and it ends with EOS after
    2 + seed % 3 tokens, or at its max_tokens (EOS kept, as vLLM keeps a stop token)."""

    def __init__(self) -> None:
        self.running: dict[str, tuple[list[int], Any, list[int]]] = {}
        self.added: list[tuple[str, list[int], Any]] = []
        self.aborted: list[str] = []
        self.steps = 0

    def add_request(self, request_id: str, prompt: dict[str, list[int]], params: Any) -> None:
        assert request_id not in self.running and all(request_id != r for r, _, _ in self.added)
        self.added.append((request_id, prompt["prompt_token_ids"], params))
        self.running[request_id] = (prompt["prompt_token_ids"], params, [])

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def step(self) -> list[Any]:
        self.steps += 1
        outputs = []
        for request_id, (prompt, params, ids) in list(self.running.items()):
            k = len(ids)
            sampled = 100 + (sum(prompt) * 31 + params.seed * 7 + k) % 50
            ids.append(EOS if k == 2 + params.seed % 3 else sampled)
            finished = ids[-1] == EOS or len(ids) >= params.max_tokens
            logprobs = [{token: types.SimpleNamespace(logprob=-0.1 * (j + 1))} for j, token in enumerate(ids)]
            child = types.SimpleNamespace(token_ids=list(ids), logprobs=logprobs)
            outputs.append(types.SimpleNamespace(request_id=request_id, finished=finished, outputs=[child]))
            if finished:
                del self.running[request_id]
        return outputs

    def abort_request(self, request_ids: list[str]) -> None:
        self.aborted += request_ids
        for request_id in request_ids:
            self.running.pop(request_id, None)


def _params(seed: int, max_tokens: int) -> Any:
    return types.SimpleNamespace(seed=seed, max_tokens=max_tokens)


def _converse(engine: FakeEngine, prompts, on_turn_end, max_tokens: int = 40) -> None:
    conversations = Conversations(
        engine, _params, lambda ids: {"prompt_token_ids": list(ids)}, [EOS], max_tokens
    )
    conversations.run(prompts, [11, 12, 13][: len(prompts)], on_turn_end)


def _done(value: list[int] | None) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(value)
    return future


PROMPTS = [[1, 5, 7], [1, 8], [1, 9, 9, 4]]
FED = [7, 8]


def _tool_each_turn(turns: int, transcript: dict[int, list[list[int]]]):
    """on_turn_end: each conversation gets FED after each of its first `turns` turns, then is over."""

    def on_turn_end(i: int, ids: list[int], logprobs: list[float]):
        transcript.setdefault(i, []).append(ids)
        assert len(logprobs) == len(ids)
        return _done(FED if len(transcript[i]) <= turns else None)

    return on_turn_end


def test_a_turn_rejoins_with_the_whole_history_as_its_prompt_and_the_budget_left() -> None:
    engine, transcript = FakeEngine(), {}
    _converse(engine, PROMPTS, _tool_each_turn(2, transcript))
    assert [len(turns) for _, turns in sorted(transcript.items())] == [3, 3, 3]
    for i, prompt in enumerate(PROMPTS):
        requests = [(p, params) for request, p, params in engine.added if request.split("-")[2] == str(i)]
        first, second, third = transcript[i]
        assert [p for p, _ in requests] == [prompt, prompt + first + FED, prompt + first + FED + second + FED]
        assert [params.max_tokens for _, params in requests] == [
            40,
            40 - len(first) - 2,
            40 - len(first) - len(second) - 4,
        ]
        assert all(turn[-1] == EOS for turn in transcript[i])


def _within(seconds: float, run) -> None:
    """`run()` on a thread of its own, failed if it has not returned in `seconds` (a loop that waited for
    every tool before stepping would hang: the thread is left behind, a daemon)."""
    raised: list[BaseException] = []

    def target() -> None:
        try:
            run()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    if raised:
        raise raised[0]


def test_a_conversation_waiting_on_its_tool_holds_up_no_other() -> None:
    """Conversation 0's first tool answers only once conversation 1 has ended all three of its turns."""
    engine, order = FakeEngine(), []
    slow: concurrent.futures.Future = concurrent.futures.Future()
    turns = {0: 0, 1: 0}

    def on_turn_end(i: int, ids: list[int], logprobs: list[float]):
        turns[i] += 1
        order.append(i)
        if i == 0 and turns[0] == 1:
            return slow
        if i == 1 and turns[1] == 3:
            slow.set_result(FED)
        return _done(FED if turns[i] < 3 else None)

    _within(10, lambda: _converse(engine, PROMPTS[:2], on_turn_end))
    assert order.count(0) == order.count(1) == 3
    second_of_0 = [k for k, i in enumerate(order) if i == 0][1]
    assert order[:second_of_0].count(1) == 3


def test_what_a_conversation_samples_does_not_depend_on_when_its_tools_answered() -> None:
    quick: dict[int, list[list[int]]] = {}
    _converse(FakeEngine(), PROMPTS, _tool_each_turn(2, quick))
    late: dict[int, list[list[int]]] = {}

    def answered_later(i: int, ids: list[int], logprobs: list[float]):
        late.setdefault(i, []).append(ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        value = FED if len(late[i]) <= 2 else None
        threading.Timer(0.003 * (3 - i) * len(late[i]), future.set_result, [value]).start()  # other orders
        return future

    _within(10, lambda: _converse(FakeEngine(), PROMPTS, answered_later))
    assert late == quick


def test_a_tools_exception_aborts_every_running_request_and_is_raised() -> None:
    engine = FakeEngine()

    def on_turn_end(i: int, ids: list[int], logprobs: list[float]):
        future: concurrent.futures.Future = concurrent.futures.Future()
        if i == 0:
            future.set_exception(ValueError("the environment broke"))
        else:
            future.set_result(FED)
        return future

    with pytest.raises(ValueError, match="the environment broke"):
        _converse(engine, PROMPTS, on_turn_end)
    assert engine.aborted and not engine.running


def test_a_request_vllm_dropped_without_finishing_it_is_an_error_not_a_spin() -> None:
    class Dropping(FakeEngine):
        def step(self):
            self.running.pop(next(iter(self.running)))  # gone, with no finished output
            return super().step()

    with pytest.raises(VllmDroppedRequests, match="mortal-"):
        _converse(Dropping(), PROMPTS, _tool_each_turn(1, {}))


def test_no_turn_is_asked_for_past_the_budget() -> None:
    engine, transcript = FakeEngine(), {}
    _converse(engine, PROMPTS, _tool_each_turn(10, transcript), max_tokens=9)
    for i in range(len(PROMPTS)):
        used = sum(len(turn) for turn in transcript[i]) + len(FED) * (len(transcript[i]) - 1)
        assert used <= 9
    assert all(params.max_tokens >= 1 for _, _, params in engine.added)


def test_vllm_engine_converses_on_its_llm_engine_with_one_completion_a_request(monkeypatch) -> None:
    from mortal.workers.rollout.engines.vllm_engine import VllmEngine

    vllm = types.ModuleType("vllm")
    inputs = types.ModuleType("vllm.inputs")
    vllm.SamplingParams = lambda **kwargs: types.SimpleNamespace(**kwargs)
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    vllm.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    fake = FakeEngine()
    llm, tokenizer = types.SimpleNamespace(llm_engine=fake), types.SimpleNamespace(eos_token_id=EOS)
    engine = VllmEngine(llm, tokenizer, [EOS, 9])
    assert engine.continues_turns()
    transcript: dict[int, list[list[int]]] = {}
    engine.converse(PROMPTS, [11, 12, 13], GenerationParams(max_tokens=30), _tool_each_turn(1, transcript))
    assert [len(turns) for _, turns in sorted(transcript.items())] == [2, 2, 2]
    first = fake.added[0][2]
    assert (first.n, first.seed, first.max_tokens, first.logprobs) == (1, 11, 30, 0)
    assert first.stop_token_ids == [EOS, 9]
