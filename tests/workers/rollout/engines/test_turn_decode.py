"""TurnDecoder: conversations across turns in the static decoder's rows, the KV cache kept between turns.

A row whose turn ends waits with its cache; the tokens its future answers are appended to the row (one
eager forward for the rows resumed together) and the row samples on from there, while the other rows
decode. These tests run the eager step on the CPU
with a tiny random-init model (frequent end-of-turn ids, so turns are short): every model token's logprob
is that of one teacher-forced forward pass over the whole conversation (the cache holds exactly the
conversation), greedy turns equal re-prefilling the history each turn, and a conversation's tokens do not
depend on when its tools answer or which row it runs in."""

from __future__ import annotations

import concurrent.futures
import random
import time

import pytest
import torch
from rollout_helpers import FREQUENT_EOS, assets_available, left_padded, random_prompts

from mortal.workers.rollout.engines.base import cut_at_eos
from mortal.workers.rollout.engines.hashed_noise import (
    conversation_key,
)
from mortal.workers.rollout.engines.static_decode import Sampling, StaticDecoder, processed_logprobs
from mortal.workers.rollout.engines.turn_decode import APPENDS, ReadBack, TurnDecoder, TurnSchedule
from mortal.workers.rollout.engines.turn_state import TurnState

pytestmark = pytest.mark.skipif(not assets_available(), reason="SmolLM2 tokenizer/config assets not found")
PLAIN = Sampling(temperature=1.0, top_k=0, top_p=1.0)
GREEDY = Sampling(temperature=1.0, top_k=1, top_p=1.0)


def _fed(conversation: int, turn: int) -> list[int]:
    """What a scripted tool answers after a conversation's turn: 2 to 5 ids that never end a turn."""
    rng = random.Random(conversation * 100 + turn)
    return [rng.randrange(100, 5000) * 9 + 1 for _ in range(rng.randint(2, 5))]


class Scripted:
    """Records each conversation's completion (model and fed tokens, logprobs, mask) as the loop builds it;
    answers every turn with _fed after `delay` seconds (on a pool), up to `turns` turns, as long as the fed
    tokens fit in `max_tokens` (as the tool loop checks)."""

    def __init__(
        self, conversations: int, turns: int, pool=None, delay=lambda c, t: 0.0, max_tokens: int = 24
    ) -> None:
        self.max_tokens = max_tokens
        self.ids = [[] for _ in range(conversations)]
        self.logprobs = [[] for _ in range(conversations)]
        self.mask = [[] for _ in range(conversations)]
        self.turns = [0] * conversations
        self.max_turns, self.pool, self.delay = turns, pool, delay

    def on_turn_end(self, c: int, ids: list[int], logprobs: list[float]):
        self.ids[c] += ids
        self.logprobs[c] += logprobs
        self.mask[c] += [1] * len(ids)
        self.turns[c] += 1
        if self.turns[c] >= self.max_turns:
            return None
        fed = _fed(c, self.turns[c])

        def answer() -> list[int] | None:
            time.sleep(self.delay(c, self.turns[c]))
            if len(self.ids[c]) + len(fed) > self.max_tokens:
                return None
            self.ids[c] += fed
            self.logprobs[c] += [0.0] * len(fed)
            self.mask[c] += [0] * len(fed)
            return fed

        if self.pool is None:
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result(answer())
            return future
        return self.pool.submit(answer)


def _converse(decoder, prompts, script, max_tokens=24, sampling=PLAIN, seed=7, sync_every=2):
    ids, mask = left_padded(prompts)
    keys = [conversation_key(seed * 1000 + i) for i in range(len(prompts))]
    TurnDecoder(decoder, sync_every).converse(
        ids, mask, keys, max_tokens, sampling, FREQUENT_EOS, script.on_turn_end
    )
    return script


def test_every_model_token_has_the_logprob_of_one_forward_pass_over_the_whole_conversation(model) -> None:
    """The cache a row keeps between turns is exactly the conversation: prompt, the model's turns and the
    fed tokens at their positions. 6 conversations in 4 rows (two wait for a free row), up to 4 turns."""
    prompts = random_prompts([5, 11, 3, 8, 13, 6])
    decoder = StaticDecoder(model, compile=False, max_rows=4)
    script = _converse(decoder, prompts, Scripted(len(prompts), turns=4), sync_every=3)
    assert max(script.turns) > 1, "some conversation took more than one turn"
    for i, prompt in enumerate(prompts):
        ids, mask = script.ids[i], script.mask[i]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
        expected = processed_logprobs(logits, PLAIN).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
        model_tokens = torch.tensor(mask, dtype=torch.bool)
        torch.testing.assert_close(
            torch.tensor(script.logprobs[i])[model_tokens], expected[model_tokens], atol=1e-4, rtol=1e-4
        )
        assert all(lp == 0.0 for lp, m in zip(script.logprobs[i], mask, strict=True) if not m)


def test_greedy_turns_equal_re_prefilling_the_history_every_turn(model) -> None:
    """The re-prefill path (the lock-step tool loop's): each turn generated from the whole history. A random
    model's greedy turns repeat one token, so the ids each prompt's greedy turn opens with end a turn too."""
    prompts = random_prompts([5, 11, 3, 8])
    max_tokens = 24
    reference = StaticDecoder(model, compile=False, max_rows=1)

    def greedy_turn(history: list[int], room: int, stop: list[int]) -> list[int]:
        tokens, logprobs = reference.generate(
            torch.tensor([history]), torch.ones(1, len(history), dtype=torch.long), room, GREEDY, stop
        )
        return cut_at_eos(tokens[0].tolist(), logprobs[0].tolist(), stop).ids

    stop = FREQUENT_EOS + [greedy_turn(p, 1, [])[0] for p in prompts]
    decoder = StaticDecoder(model, compile=False, max_rows=4)
    ids, mask = left_padded(prompts)
    script = Scripted(len(prompts), turns=3)
    TurnDecoder(decoder, sync_every=1).converse(
        ids, mask, [1, 2, 3, 4], max_tokens, GREEDY, stop, script.on_turn_end
    )
    assert sum(turns > 1 for turns in script.turns) >= 2, "conversations of several turns"
    for i, prompt in enumerate(prompts):
        completion: list[int] = []
        for turn in range(1, 4):
            if len(completion) == max_tokens:  # the tool's tokens filled the budget: no turn after them
                break
            completion += greedy_turn(prompt + completion, max_tokens - len(completion), stop)
            fed = _fed(i, turn)
            if turn == 3 or len(completion) + len(fed) > max_tokens:
                break
            completion += fed
        assert script.ids[i] == completion, f"conversation {i}"


def test_a_conversation_s_tokens_do_not_depend_on_when_its_tools_answer(model) -> None:
    """Sampled (not greedy) turns, tools answering at once against after random delays (rows rejoin at
    other steps, in another order): the same tokens, since each row's noise is a function of its key and
    token index only."""
    prompts = random_prompts([5, 11, 3, 8, 13, 6, 9, 4])
    decoder = StaticDecoder(model, compile=False, max_rows=8)
    at_once = _converse(decoder, prompts, Scripted(len(prompts), turns=4))
    rng = random.Random(3)
    delays = {(c, t): rng.choice([0.0, 0.01, 0.05]) for c in range(8) for t in range(5)}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        late = _converse(
            decoder, prompts, Scripted(len(prompts), turns=4, pool=pool, delay=lambda c, t: delays[c, t])
        )
    assert late.ids == at_once.ids
    assert decoder.preparations == 1, "one shape served both"


def test_a_conversation_that_fills_its_budget_ends_there(model) -> None:
    """maxTokens counts model and fed tokens: a turn cut by the budget is handed over cut; fed tokens that
    would not fit end the conversation."""
    prompts = random_prompts([5, 7])
    decoder = StaticDecoder(model, compile=False, max_rows=2)
    script = _converse(decoder, prompts, Scripted(2, turns=50, max_tokens=10), max_tokens=10)
    assert all(len(ids) <= 10 for ids in script.ids)
    assert any(len(ids) >= 8 for ids in script.ids)


def test_a_failing_tool_future_raises_out_of_converse(model) -> None:
    prompts = random_prompts([5, 7])
    decoder = StaticDecoder(model, compile=False, max_rows=2)

    def broken(c, ids, logprobs):
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_exception(RuntimeError("environment broke"))
        return future

    ids, mask = left_padded(prompts)
    with pytest.raises(RuntimeError, match="environment broke"):
        TurnDecoder(decoder).converse(ids, mask, [1, 2], 16, PLAIN, FREQUENT_EOS, broken)


def test_the_schedule_gives_free_rows_the_next_conversations_in_order() -> None:
    schedule = TurnSchedule(rows=2, conversations=3)
    assert schedule.assign(next_reading=0) == [(0, 0), (1, 1)]
    future: concurrent.futures.Future = concurrent.futures.Future()
    schedule.park(0, future, t=4)
    assert schedule.assign(next_reading=1) == [] and not schedule.done
    schedule.release(1)
    assert schedule.assign(next_reading=1) == [(1, 2)]
    schedule.waiting.pop(future)
    schedule.release(0)
    schedule.release(1)
    assert schedule.done


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile_scope", ["model", "layer"])
def test_the_compiled_graph_continues_conversations_with_the_logprobs_of_a_plain_forward_pass(
    model, compile_scope
) -> None:
    """The CUDA path: the turn step captured as a graph (frozen rows, fed tokens, hashed noise); 6
    conversations in 4 rows, tools answering after random delays; every model token's logprob matches a
    teacher-forced forward over the whole conversation (float32), and answering at once gives the same
    tokens."""
    cuda_model = model.to("cuda")
    try:
        prompts = random_prompts([5, 11, 3, 8, 13, 6])
        decoder = StaticDecoder(cuda_model, compile=True, max_rows=4, compile_scope=compile_scope)
        ids, mask = left_padded(prompts)
        keys = [conversation_key(i) for i in range(len(prompts))]
        rng = random.Random(5)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            late = Scripted(len(prompts), turns=4, pool=pool, delay=lambda c, t: rng.choice([0.0, 0.02]))
            TurnDecoder(decoder).converse(
                ids.cuda(), mask.cuda(), keys, 24, PLAIN, FREQUENT_EOS, late.on_turn_end
            )
        at_once = Scripted(len(prompts), turns=4)
        TurnDecoder(decoder).converse(
            ids.cuda(), mask.cuda(), keys, 24, PLAIN, FREQUENT_EOS, at_once.on_turn_end
        )
        assert late.ids == at_once.ids and max(late.turns) > 1
        for i, prompt in enumerate(prompts):
            with torch.no_grad():
                logits = cuda_model(torch.tensor([prompt + late.ids[i]], device="cuda")).logits[
                    0, len(prompt) - 1 : -1
                ]
            expected = processed_logprobs(logits, PLAIN).gather(
                1, torch.tensor(late.ids[i], device="cuda")[:, None]
            )
            model_tokens = torch.tensor(late.mask[i], dtype=torch.bool)
            torch.testing.assert_close(
                torch.tensor(late.logprobs[i])[model_tokens],
                expected.squeeze(1).cpu()[model_tokens],
                atol=2e-3,
                rtol=2e-3,
            )
        assert decoder.preparations == 1
        (shape,) = decoder._shapes.values()
        assert shape.extras[APPENDS].recorded >= 1, "appends replayed as graphs"
    finally:
        model.to("cpu")


def test_a_read_back_taken_before_a_rows_prefill_or_append_says_nothing_of_its_turn() -> None:
    """Read-backs are read one interval after they are taken: by then a row may have been resumed with a
    tool's answer, and the older copy still shows its previous turn's end."""
    state = TurnState(
        rows=2, prompt_len=1, max_tokens=4, vocab=8, dtype=torch.float32, device=torch.device("cpu")
    )
    schedule = TurnSchedule(rows=2, conversations=2)
    schedule.assign(next_reading=0)
    state.ended[0] = True
    before = ReadBack(state, number=0)
    before.wait()
    assert [schedule.turn_ended(row, before) for row in (0, 1)] == [True, False]
    schedule.park(0, concurrent.futures.Future(), t=2)
    assert not schedule.turn_ended(0, before), "a waiting row hands nothing over"
    schedule.resume(0, turn_start=4, next_reading=1)
    assert not schedule.turn_ended(0, before), "resumed after this read-back was taken"
    after = ReadBack(state, number=1)
    after.wait()
    assert schedule.turn_ended(0, after)
    state.ended[1], state.t[1] = False, 4  # row 1 filled its budget
    budget = ReadBack(state, number=2)
    budget.wait()
    assert schedule.turn_ended(1, budget)


def test_shorter_intervals_between_read_backs_take_fewer_decode_steps_for_the_same_tokens(model) -> None:
    """A turn's end is seen one or two intervals after it: with read-backs every 2 steps the conversations
    finish in fewer decode steps than every 8, and each says the same (its noise is its key's)."""
    prompts = random_prompts([5, 11, 3, 8, 13, 6])
    steps, said = {}, {}
    for sync_every in (2, 8):
        decoder = StaticDecoder(model, compile=False, max_rows=8)
        turns = TurnDecoder(decoder, sync_every)
        ids, mask = left_padded(prompts)
        script = Scripted(len(prompts), turns=4, max_tokens=40)
        keys = [conversation_key(i) for i in range(len(prompts))]
        turns.converse(ids, mask, keys, 40, PLAIN, FREQUENT_EOS, script.on_turn_end)
        steps[sync_every], said[sync_every] = turns.last_stats.decode_steps, script.ids
        stats = turns.last_stats
        assert stats.checks * sync_every == stats.decode_steps
        assert 0 <= stats.read_wait_seconds < stats.seconds, "the waits are part of the call"
    assert said[2] == said[8]
    assert steps[2] < steps[8], steps


def test_the_stats_count_each_conversation_s_model_tokens(model) -> None:
    """Its turns' tokens, fed tokens not counted: the longest against the median shows a straggler."""
    prompts = random_prompts([5, 11, 3, 8, 13, 6])
    turns = TurnDecoder(StaticDecoder(model, compile=False, max_rows=4))
    ids, mask = left_padded(prompts)
    script = Scripted(len(prompts), turns=3, max_tokens=40)
    keys = [conversation_key(i) for i in range(len(prompts))]
    turns.converse(ids, mask, keys, 40, PLAIN, FREQUENT_EOS, script.on_turn_end)
    assert turns.last_stats.model_tokens == [sum(m) for m in script.mask]
    assert any(0 in m for m in script.mask), "some tokens were fed"


def test_the_call_s_timed_parts_add_up_to_no_more_than_the_call(model) -> None:
    """Where a call's wall time went (the worker's task line: waits on tools and on read-backs, queueing
    steps, handing turns over, appends, prefills) are parts of its seconds, waits on slow tools included."""
    prompts = random_prompts([5, 11, 3, 8])
    decoder = StaticDecoder(model, compile=False, max_rows=2)
    turns = TurnDecoder(decoder)
    ids, mask = left_padded(prompts)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        script = Scripted(len(prompts), turns=3, pool=pool, delay=lambda c, t: 0.05, max_tokens=40)
        keys = [conversation_key(i) for i in range(len(prompts))]
        turns.converse(ids, mask, keys, 40, PLAIN, FREQUENT_EOS, script.on_turn_end)
    stats = turns.last_stats
    # How long a wait lasts depends on how long decoding took beside the tools, so only that it happened.
    assert stats.waits > 0 and stats.wait_seconds > 0, "every row waited on the slow tools at times"
    parts = (
        stats.wait_seconds,
        stats.read_wait_seconds,
        stats.queue_seconds,
        stats.hand_over_seconds,
        stats.append_seconds,
        stats.prefill_seconds,
    )
    assert all(part > 0 for part in parts[1:]), parts
    assert sum(parts) <= stats.seconds, (parts, stats.seconds)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_compiled_graph_says_what_the_eager_step_says(model) -> None:
    """The compiled step (its sampling compiled, recorded as a CUDA graph, read-backs pipelined, appends
    replayed) against the eager step on the same GPU: a conversation's tokens are a function of its key,
    the weights and its tool results, so they agree wherever no near tie rounds the other way (float32)."""
    cuda_model = model.to("cuda")
    try:
        prompts = random_prompts([5, 11, 3, 8, 13, 6, 9, 4, 12, 7, 10, 2, 5, 8, 11, 6])

        def said(compile: bool) -> list[list[int]]:
            decoder = StaticDecoder(cuda_model, compile=compile, max_rows=8)
            ids, mask = left_padded(prompts)
            keys = [conversation_key(i) for i in range(len(prompts))]
            script = Scripted(len(prompts), turns=4, max_tokens=32)
            TurnDecoder(decoder).converse(
                ids.cuda(), mask.cuda(), keys, 32, PLAIN, FREQUENT_EOS, script.on_turn_end
            )
            return script.ids

        eager, compiled = said(False), said(True)
        agree = sum(a == b for a, b in zip(eager, compiled, strict=True))
        assert agree >= len(prompts) - 2, f"{agree} of {len(prompts)} conversations agree"
    finally:
        model.to("cpu")
