"""The prompt prefix every conversation of a call shares is prefilled once and copied into each row.

With a tool-calling run's prompts (one long shared start, then each prompt's own message), the decoder's
rows hold the same K/V as when every row prefilled its whole prompt: greedy tokens are equal, logprobs equal
up to summation order (sampled with the same noise, so a different logprob would show), single-turn and
across turns, with rows refilled; each row's prefill computes only
the columns after the prefix; MORTAL_SHARED_PREFIX=0 (the reference here) turns it off. CPU, a tiny
random-init model."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch
from rollout_helpers import FREQUENT_EOS, assets_available, left_padded, random_prompts

from mortal.workers.prefix import ENV, MIN_SHARED_PREFIX
from mortal.workers.rollout.engines.base import cut_at_eos
from mortal.workers.rollout.engines.prefix_cache import PrefixChain, PromptPrefix, common_length, message_ends
from mortal.workers.rollout.engines.static_decode import Sampling, StaticDecoder, processed_logprobs
from mortal.workers.rollout.engines.turn_decode import TurnDecoder

pytestmark = pytest.mark.skipif(not assets_available(), reason="SmolLM2 tokenizer/config assets not found")
GREEDY = Sampling(temperature=1.0, top_k=1, top_p=1.0)
PLAIN = Sampling(temperature=1.0, top_k=0, top_p=1.0)
SHARED = random_prompts([40], seed=5)[0]  # a system prompt and tool schemas, as far as the model can tell


def _tool_prompts(own_lengths: list[int]) -> list[list[int]]:
    """The shared start, then each prompt's own tokens (ids the start never has at that place)."""
    return [SHARED + own for own in random_prompts(own_lengths, seed=6)]


@pytest.mark.parametrize(
    ("prompts", "expected"),
    [
        pytest.param([SHARED + [7, 8], SHARED + [9]], 40, id="shared start, own endings"),
        pytest.param([SHARED, SHARED + [9, 9]], 39, id="a whole prompt shared: its last token computed"),
        pytest.param([SHARED[:20] + [1], SHARED[:20] + [2]], 0, id="fewer than MIN_SHARED_PREFIX"),
        pytest.param([SHARED + [1]], 0, id="one prompt"),
        pytest.param([[5] + SHARED, SHARED + [5]], 0, id="the same tokens at other places"),
    ],
)
def test_the_shared_prefix_is_the_real_tokens_every_prompt_begins_with(prompts, expected) -> None:
    assert MIN_SHARED_PREFIX <= 39
    ids, mask = left_padded(prompts)
    assert common_length(ids, mask.sum(-1).tolist()) == expected


def _generate(model, prompts, sampling, seed=1, n=2, max_rows=3):
    decoder = StaticDecoder(model, compile=False, max_rows=max_rows, sync_every=3)
    ids, mask = left_padded([p for p in prompts for _ in range(n)])
    torch.manual_seed(seed)
    tokens, logprobs = decoder.generate(ids, mask, 16, sampling, FREQUENT_EOS)
    return [cut_at_eos(t, lp, FREQUENT_EOS) for t, lp in zip(tokens.tolist(), logprobs.tolist(), strict=True)]


@pytest.mark.parametrize("sampling", [GREEDY, PLAIN], ids=["greedy", "sampled"])
def test_single_turn_tokens_and_logprobs_equal_every_row_prefilling_its_whole_prompt(
    model, monkeypatch, sampling
) -> None:
    """10 sequences of five prompt lengths in 3 rows: rows are refilled with prompts of other lengths."""
    prompts = _tool_prompts([1, 6, 3, 9, 2])
    shared = _generate(model, prompts, sampling)
    monkeypatch.setenv(ENV, "0")
    whole = _generate(model, prompts, sampling)
    assert [c.ids for c in shared] == [c.ids for c in whole]
    for a, b in zip(shared, whole, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5)


def test_sampled_tokens_have_the_logprobs_of_one_forward_pass_over_prompt_and_completion(model) -> None:
    prompts = _tool_prompts([4, 1, 7])
    outs = _generate(model, prompts, PLAIN, n=3)
    for i, out in enumerate(outs):
        prompt = prompts[i // 3]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.ids])).logits[0, len(prompt) - 1 : -1]
        expected = processed_logprobs(logits, PLAIN).gather(1, torch.tensor(out.ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_each_rows_prefill_computes_only_the_columns_after_the_prefix(model, monkeypatch) -> None:
    """The prefix runs once (one row of 40 tokens); each fill of rows computes from the first column after
    the prefix in its longest prompt on, not the whole width."""
    widths: list[tuple[int, int]] = []
    forward = model.forward

    def recorded(*args, **kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 1:
            widths.append(tuple(ids.shape))
        return forward(*args, **kwargs)

    made = []
    of = PromptPrefix.of.__func__

    def counted(cls, *args, **kwargs):
        made.append(of(cls, *args, **kwargs))
        return made[-1]

    monkeypatch.setattr(model, "forward", recorded)
    monkeypatch.setattr(PromptPrefix, "of", classmethod(counted))
    _generate(model, _tool_prompts([1, 6, 3, 9, 2]), GREEDY, max_rows=4)
    assert len(made) == 1 and made[0] is not None and made[0].length == 40
    assert widths, "rows were prefilled"
    assert all(width <= 9 for _, width in widths), widths  # the longest own part: 9 tokens of 49


def _conversations(model, prompts, sampling, turns=3, max_tokens=20):
    """Conversations through the turn decoder, a fixed tool answer after each turn."""
    decoder = StaticDecoder(model, compile=False, max_rows=3)
    said: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    count = [0] * len(prompts)

    def on_turn_end(c, ids, lps):
        said[c] += ids
        logprobs[c] += lps
        count[c] += 1
        future: concurrent.futures.Future = concurrent.futures.Future()
        fed = [1000 + 9 * count[c] + 1, 2000 + 9 * c + 1]
        if count[c] >= turns or len(said[c]) + len(fed) >= max_tokens:
            future.set_result(None)
        else:
            said[c] += fed
            logprobs[c] += [0.0] * len(fed)
            future.set_result(fed)
        return future

    ids, mask = left_padded(prompts)
    keys = list(range(len(prompts)))
    TurnDecoder(decoder).converse(ids, mask, keys, max_tokens, sampling, FREQUENT_EOS, on_turn_end)
    return said, logprobs, count


@pytest.mark.parametrize("sampling", [GREEDY, PLAIN], ids=["greedy", "sampled"])
def test_conversations_across_turns_equal_every_row_prefilling_its_whole_prompt(
    model, monkeypatch, sampling
) -> None:
    prompts = _tool_prompts([1, 6, 3, 9, 2])
    shared, shared_logprobs, turns = _conversations(model, prompts, sampling)
    assert max(turns) > 1, "some conversation took more than one turn"
    monkeypatch.setenv(ENV, "0")
    whole, whole_logprobs, _ = _conversations(model, prompts, sampling)
    assert shared == whole
    for a, b in zip(shared_logprobs, whole_logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)


# -- the pieces kept for the next call -----------------------------------------------------------------------

BOUNDARY = FREQUENT_EOS[0]
_plain = [t for t in random_prompts([120], seed=7)[0] if t not in set(FREQUENT_EOS)]
SYSTEM = _plain[:35] + [BOUNDARY]  # one message: 36 tokens ending at an end-of-message token
USER = _plain[35:45]  # the start of the next message, shared too; no message end in it


@pytest.mark.parametrize(
    ("tokens", "ends"),
    [
        pytest.param([5, 6, BOUNDARY, 7, BOUNDARY, 8, 9], [3, 5, 7], id="after each message end, the rest"),
        pytest.param([5, 6, BOUNDARY], [3], id="ending at a message end"),
        pytest.param([5, 6, 7], [3], id="no message end: one piece"),
    ],
)
def test_a_prefix_is_cut_after_each_end_of_message_token(tokens, ends) -> None:
    assert message_ends(tokens, frozenset(FREQUENT_EOS)) == ends


def _one_call(decoder, prompts, sampling=PLAIN, seed=1, n=2):
    ids, mask = left_padded([p for p in prompts for _ in range(n)])
    torch.manual_seed(seed)
    tokens, logprobs = decoder.generate(ids, mask, 12, sampling, FREQUENT_EOS)
    return tokens.tolist(), logprobs.tolist()


def _tasks(seed: int) -> list[list[int]]:
    """A task's prompts: the shared system message and the start of the user's, then their own tokens."""
    return [SYSTEM + USER + own for own in random_prompts([3, 5], seed=seed)]


def test_the_next_call_computes_only_what_follows_the_kept_message_pieces(model) -> None:
    decoder = StaticDecoder(model, compile=False, max_rows=4)
    _one_call(decoder, _tasks(seed=8))
    first = decoder.prefixes.computed_tokens
    assert first == len(SYSTEM + USER)  # the whole shared prefix, in two pieces
    assert [len(piece.tokens) for piece in decoder.prefixes.pieces] == [len(SYSTEM)]
    _one_call(decoder, _tasks(seed=9))
    assert decoder.prefixes.computed_tokens - first == len(USER)  # the system message was kept


def test_a_call_samples_the_same_whatever_the_calls_before_it_kept(model) -> None:
    """Bit for bit: kept pieces hold what computing them again gives (a resumed run samples the same)."""
    warm = StaticDecoder(model, compile=False, max_rows=4)
    _one_call(warm, _tasks(seed=8))
    after_another_call = _one_call(warm, _tasks(seed=9))
    alone = _one_call(StaticDecoder(model, compile=False, max_rows=4), _tasks(seed=9))
    assert after_another_call == alone


def test_nothing_is_reused_after_the_weights_change(model) -> None:
    decoder = StaticDecoder(model, compile=False, max_rows=4)
    _one_call(decoder, _tasks(seed=8))
    decoder.forget_weights()
    before = decoder.prefixes.computed_tokens
    _one_call(decoder, _tasks(seed=9))
    assert decoder.prefixes.computed_tokens - before == len(SYSTEM + USER)


def test_a_changed_piece_and_every_piece_after_it_are_computed_again(model) -> None:
    decoder = StaticDecoder(model, compile=False, max_rows=4)
    two_messages = SYSTEM + SYSTEM[::-1][1:] + [BOUNDARY]
    _one_call(decoder, [two_messages + own for own in random_prompts([3, 5], seed=8)])
    assert len(decoder.prefixes.pieces) == 2
    other_first = [SYSTEM[1]] + SYSTEM[1:]
    before = decoder.prefixes.computed_tokens
    _one_call(decoder, [other_first + two_messages[36:] + own for own in random_prompts([3, 5], seed=9)])
    assert decoder.prefixes.computed_tokens - before == len(two_messages)


def test_pieces_hold_the_keys_and_values_of_one_forward_over_the_whole_prefix(model) -> None:
    """Pieces of one token too (two message ends in a row, one token after the last)."""
    tokens = SYSTEM + [BOUNDARY] + USER + [BOUNDARY, 5]
    ends = message_ends(tokens, frozenset(FREQUENT_EOS))
    assert [b - a for a, b in zip([0, *ends], ends, strict=False)] == [len(SYSTEM), 1, len(USER) + 1, 1]
    keys, values = PrefixChain().compute(model, tokens, frozenset(FREQUENT_EOS), torch.device("cpu"))
    with torch.no_grad():
        whole = model.get_decoder()(input_ids=torch.tensor([tokens]), use_cache=True).past_key_values.layers
    for got_keys, got_values, layer in zip(keys, values, whole, strict=True):
        torch.testing.assert_close(got_keys, layer.keys[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_values, layer.values[0], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_compiled_cuda_path_a_task_after_another_samples_what_it_does_alone(model) -> None:
    """The decode step captured as a graph: the kept system message serves the second task, whose tokens
    and logprobs equal it run on a fresh decoder, bit for bit, and its logprobs a plain forward's."""
    cuda_model = model.to("cuda")
    try:

        def call(decoder, prompts):
            ids, mask = left_padded([p for p in prompts for _ in range(2)])
            torch.manual_seed(1)
            tokens, logprobs = decoder.generate(ids.cuda(), mask.cuda(), 12, PLAIN, FREQUENT_EOS)
            return tokens.tolist(), logprobs.tolist()

        warm = StaticDecoder(cuda_model, compile=True, max_rows=4)
        call(warm, _tasks(seed=8))
        before = warm.prefixes.computed_tokens
        after_another = call(warm, _tasks(seed=9))
        assert warm.prefixes.computed_tokens - before == len(USER)
        alone = call(StaticDecoder(cuda_model, compile=True, max_rows=4), _tasks(seed=9))
        assert after_another == alone
        prompts = [p for p in _tasks(seed=9) for _ in range(2)]
        for prompt, ids, logprobs in zip(prompts, *after_another, strict=True):
            out = cut_at_eos(ids, logprobs, FREQUENT_EOS)
            with torch.no_grad():
                logits = cuda_model(torch.tensor([prompt + out.ids], device="cuda")).logits[
                    0, len(prompt) - 1 : -1
                ]
            expected = processed_logprobs(logits, PLAIN).gather(
                1, torch.tensor(out.ids, device="cuda")[:, None]
            )
            torch.testing.assert_close(
                torch.tensor(out.logprobs), expected.squeeze(1).cpu(), atol=2e-3, rtol=2e-3
            )
    finally:
        model.to("cpu")
