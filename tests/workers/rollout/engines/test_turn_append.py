"""TurnAppender: tokens appended to rows mid-conversation in fixed buckets of rows and width.

Padding repeats a resumed row, and a row's padding slots repeat its last token at its own column: what an
append writes must be exactly the resumed rows' last-token and fed columns, whatever the bucket. The
conversations' own results (greedy equality with re-prefilling, logprobs of one forward pass) are
test_turn_decode's; these tests pin the layout on the CPU's eager run of the same code."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import assets_available

from mortal.workers.rollout.engines.static_decode import Sampling, StaticDecoder
from mortal.workers.rollout.engines.turn_append import MIN_WIDTH, Bucket, TurnAppender
from mortal.workers.rollout.engines.turn_decode import TURNS

pytestmark = pytest.mark.skipif(not assets_available(), reason="SmolLM2 tokenizer/config assets not found")
GREEDY = Sampling(temperature=1.0, top_k=1, top_p=1.0)
PROMPT, BUDGET = 6, 20


@pytest.mark.parametrize(
    ("fed_lengths", "bucket"),
    [
        ([1], Bucket(1, MIN_WIDTH)),
        ([2, 5, 1], Bucket(4, MIN_WIDTH)),
        ([MIN_WIDTH], Bucket(1, 2 * MIN_WIDTH)),  # the last token and the fed ones: MIN_WIDTH + 1 inputs
        ([1] * 5, Bucket(8, MIN_WIDTH)),
    ],
)
def test_an_append_is_padded_to_powers_of_two_of_rows_and_width(fed_lengths, bucket) -> None:
    resumed = [(row, 3, [7] * n) for row, n in enumerate(fed_lengths)]
    assert Bucket.of(resumed) == bucket


def _shape(model, rows: int = 4):
    """A prepared turn shape whose cache and state hold random values, as if mid-conversation."""
    decoder = StaticDecoder(model, compile=False, max_rows=rows)
    shape = decoder.prepare(rows, PROMPT, BUDGET, GREEDY, stepper=TURNS)
    generator = torch.Generator().manual_seed(0)
    for layer in shape.cache.layers:
        layer.keys.copy_(torch.randn(layer.keys.shape, generator=generator))
        layer.values.copy_(torch.randn(layer.values.shape, generator=generator))
    state = shape.state
    state.tokens.copy_(torch.randint(100, 4000, state.tokens.shape, generator=generator))
    state.last_token.copy_(torch.randint(100, 4000, state.last_token.shape, generator=generator))
    state.positions.fill_(PROMPT + 3)
    return decoder, shape


def _snapshot(shape):
    state = shape.state
    cache = [(layer.keys.clone(), layer.values.clone()) for layer in shape.cache.layers]
    return cache, state.tokens.clone(), state.mask.clone(), state.t.clone(), state.positions.clone()


def test_an_append_writes_only_the_resumed_rows_last_token_and_fed_columns(model) -> None:
    """Rows 0 and 2 resumed (a bucket of 2 rows by MIN_WIDTH), fed 3 and 1 tokens after token index t=4 and
    t=2: rows 1 and 3 keep every value; rows 0 and 2 change only columns P+t-1 .. P+t-1+fed of their cache
    and mask, and their token record from t on (the fed tokens, then the sampled one) and the spare column."""
    decoder, shape = _shape(model)
    before = _snapshot(shape)
    resumed = [(0, 4, [11, 12, 13]), (2, 2, [21])]
    appender = TurnAppender(decoder.model, shape.cache, shape.state, GREEDY, record=False)
    appender.append(resumed)
    after = _snapshot(shape)
    state = shape.state
    for row in (1, 3):
        for (k0, v0), (k1, v1) in zip(before[0], after[0], strict=True):
            assert torch.equal(k0[row], k1[row]) and torch.equal(v0[row], v1[row])
        for old, new in zip(before[1:], after[1:], strict=True):
            assert torch.equal(old[row], new[row])
    for row, t, fed in resumed:
        written = range(PROMPT + t - 1, PROMPT + t + len(fed))
        kept = [c for c in range(PROMPT + BUDGET) if c not in written]
        for (k0, _), (k1, _) in zip(before[0], after[0], strict=True):
            assert torch.equal(k0[row][:, kept], k1[row][:, kept])
            assert not torch.equal(k0[row][:, list(written)], k1[row][:, list(written)])
        assert (state.mask[row, 0, 0, list(written)] == 0).all()
        assert torch.equal(before[2][row, 0, 0, kept], state.mask[row, 0, 0, kept])
        assert state.tokens[row, t : t + len(fed)].tolist() == fed
        assert torch.equal(before[1][row, :t], state.tokens[row, :t])
        assert state.t[row] == t + len(fed) + 1
        assert state.positions[row, 0] == PROMPT + 3 + len(fed) + 1
        assert state.last_token[row, 0] == state.tokens[row, t + len(fed)]


def test_padding_does_not_change_what_a_row_samples_or_writes(model) -> None:
    """Row 2 appended alone (a bucket of 1 row) and beside three others (4 rows, a wider bucket): the same
    K/V at its columns and the same greedy token."""
    alone_decoder, alone = _shape(model)
    TurnAppender(alone_decoder.model, alone.cache, alone.state, GREEDY, record=False).append([(2, 4, [5, 6])])
    crowd_decoder, crowd = _shape(model)
    resumed = [(0, 3, [9] * 12), (2, 4, [5, 6]), (3, 1, [8])]
    TurnAppender(crowd_decoder.model, crowd.cache, crowd.state, GREEDY, record=False).append(resumed)
    for a, b in zip(alone.cache.layers, crowd.cache.layers, strict=True):
        torch.testing.assert_close(a.keys[2], b.keys[2], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values[2], b.values[2], atol=1e-5, rtol=1e-5)
    assert torch.equal(alone.state.tokens[2, :8], crowd.state.tokens[2, :8])
