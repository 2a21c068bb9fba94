"""StaticDecoder: continuous batching over a fixed number of rows, refilled as sequences end.

A task's sequences (each prompt x n, left-padded to one width) are decoded R rows at a time; a row
whose sequence has sampled an EOS or reached max_tokens takes the next waiting sequence. These tests
run the eager step (`compile=False`) on the CPU with a tiny random-init model: a refilled row's
tokens have the model's own logprobs, the refill schedule is deterministic per seed, R = all
sequences is the single batch of before, and alternating prompt widths reuse the kept shapes. The
compiled CUDA-graph path is checked by the GPU test at the end (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import (
    FREQUENT_EOS,
    assets_available,
    budget_for_rows,
    left_padded,
    make_tiny_model,
    random_prompts,
)

from mortal.workers.oom import out_of_memory
from mortal.workers.rollout.engines import static_decode
from mortal.workers.rollout.engines.base import cut_at_eos
from mortal.workers.rollout.engines.static_decode import (
    COMPILE_SCOPES,
    DEFAULT_KEPT_SHAPES,
    SAMPLING_COPIES,
    SYNC_EVERY,
    MemoryBudgetTooSmall,
    RowSchedule,
    Sampling,
    StaticDecoder,
    compiled_model,
    graph_rows,
    kv_bytes_per_token,
    processed_logprobs,
    rows_within_budget,
    sample,
)

pytestmark = pytest.mark.skipif(not assets_available(), reason="SmolLM2 tokenizer/config assets not found")
PLAIN = Sampling(temperature=1.0, top_k=0, top_p=1.0)


def _completions(tokens: torch.Tensor, logprobs: torch.Tensor, eos_ids: list[int]) -> list:
    return [
        cut_at_eos(ids, lps, eos_ids) for ids, lps in zip(tokens.tolist(), logprobs.tolist(), strict=True)
    ]


def _teacher_forced(model, prompt: list[int], ids: list[int], sampling: Sampling) -> torch.Tensor:
    """The processed logprobs of `ids` after the unpadded `prompt`, from one plain forward pass on the
    model's device; returned on the CPU."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids], device=device)).logits[0, len(prompt) - 1 : -1]
    return (
        processed_logprobs(logits, sampling)
        .gather(1, torch.tensor(ids, device=device)[:, None])
        .squeeze(1)
        .cpu()
    )


def _decode(
    decoder: StaticDecoder,
    prompts,
    n: int,
    max_tokens: int,
    eos_ids: list[int],
    seed: int = 0,
    sampling: Sampling = PLAIN,
    width: int | None = None,
) -> list:
    ids, mask = left_padded(prompts, n, width)
    torch.manual_seed(seed)
    return _completions(*decoder.generate(ids, mask, max_tokens, sampling, eos_ids), eos_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_every_sequence_of_a_refilled_row_has_the_logprobs_of_a_plain_forward_pass(
    model, temperature
) -> None:
    """4 rows, 15 sequences of three prompt lengths: rows are refilled many times (a new prompt's K/V
    over the columns a longer or shorter one had written), and each sequence's logprobs are still
    those of its own unpadded prompt + completion in one teacher-forced forward."""
    prompts, n, max_tokens = random_prompts([5, 11, 3, 8, 13]), 3, 24
    sampling = Sampling(temperature=temperature, top_k=0, top_p=1.0)
    decoder = StaticDecoder(model, compile=False, max_rows=4, sync_every=4)
    outs = _decode(decoder, prompts, n, max_tokens, FREQUENT_EOS, seed=1, sampling=sampling)
    stats = decoder.last_stats
    assert (stats.rows, stats.sequences) == (4, 15)
    assert stats.refills == 15 - 4, "every sequence after the first four went into a row that held another"
    lengths = [len(c.ids) for c in outs]
    assert min(lengths) < max_tokens and len(set(lengths)) > 3, "completions end at EOS at different lengths"
    for i, c in enumerate(outs):
        expected = _teacher_forced(model, prompts[i // n], c.ids, sampling)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_a_sequence_ends_at_its_first_eos_or_at_max_tokens_and_the_stats_count_what_was_kept(model) -> None:
    prompts, max_tokens = random_prompts([6, 9, 4]), 12
    decoder = StaticDecoder(model, compile=False, max_rows=2, sync_every=3)
    ids, mask = left_padded(prompts, 4)
    torch.manual_seed(3)
    tokens, logprobs = decoder.generate(ids, mask, max_tokens, PLAIN, FREQUENT_EOS)
    outs = _completions(tokens, logprobs, FREQUENT_EOS)
    stop = set(FREQUENT_EOS)
    assert len(outs) == 12 and tokens.shape[1] == max(len(c.ids) for c in outs) <= max_tokens
    for c in outs:
        assert len(c.ids) == len(c.logprobs) and not stop & set(c.ids[:-1])
        assert c.ids[-1] in stop or len(c.ids) == max_tokens
    stats = decoder.last_stats
    assert stats.useful_tokens == sum(len(c.ids) for c in outs)
    assert stats.sampled_tokens == 2 * stats.decode_steps + 12
    assert 0 < stats.useful_fraction <= 1


def test_the_same_seed_gives_the_same_tokens_and_refill_schedule(model) -> None:
    prompts = random_prompts([5, 11, 3])
    first_decoder = StaticDecoder(model, compile=False, max_rows=4, sync_every=4)
    first = _decode(first_decoder, prompts, 4, 20, FREQUENT_EOS, seed=7)
    again = _decode(first_decoder, prompts, 4, 20, FREQUENT_EOS, seed=7)
    fresh_decoder = StaticDecoder(model, compile=False, max_rows=4, sync_every=4)
    fresh = _decode(fresh_decoder, prompts, 4, 20, FREQUENT_EOS, seed=7)
    assert again == first and fresh == first  # ids and logprobs, bit for bit
    assert fresh_decoder.last_stats == first_decoder.last_stats
    assert _decode(first_decoder, prompts, 4, 20, FREQUENT_EOS, seed=8) != first


def _single_batch_reference(model, input_ids, mask, max_tokens: int, sampling: Sampling):
    """The decoder before rows were refilled, eagerly: one StaticCache batch, every row writing the same
    slot at every step, all T tokens (what follows an EOS included)."""
    from transformers import StaticCache

    batch, width = input_ids.shape
    length = width + max_tokens
    cache = StaticCache(config=model.config, max_cache_len=length)
    real = mask.bool()
    visible = torch.zeros(batch, length, dtype=torch.bool)
    visible[:, :width] = real
    causal = torch.ones(width, length, dtype=torch.bool).tril()
    allowed = (visible[:, None, None] & causal) | torch.eye(width, length, dtype=torch.bool)

    def additive(keep: torch.Tensor) -> torch.Tensor:
        return torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)

    positions = (real.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=additive(allowed),
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1]
        token, logprob = sample(logits, sampling)
        tokens, logprobs = [token], [logprob]
        step_mask, position = additive(visible[:, None, None]), positions[:, -1:] + 1
        for t in range(1, max_tokens):
            step_mask[..., width + t - 1] = 0.0
            logits = model(
                input_ids=token[:, None],
                position_ids=position,
                attention_mask=step_mask,
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
            token, logprob = sample(logits, sampling)
            tokens.append(token), logprobs.append(logprob)
            position = position + 1
    return torch.stack(tokens, 1), torch.stack(logprobs, 1)


@pytest.mark.parametrize("eos_ids", [[-1], FREQUENT_EOS], ids=["no-eos", "frequent-eos"])
def test_rows_for_all_sequences_decode_the_single_batch_of_before(model, eos_ids) -> None:
    """When every sequence has a row nothing is refilled: the same tokens and logprobs as the single
    batch decoded to its longest row (the same random draws, in the same order)."""
    prompts, max_tokens = random_prompts([5, 11, 3]), 16
    ids, mask = left_padded(prompts, 3)
    torch.manual_seed(4)
    expected = _completions(*_single_batch_reference(model, ids, mask, max_tokens, PLAIN), eos_ids)
    decoder = StaticDecoder(model, compile=False)  # max_rows 256 >= 9 sequences
    got = _decode(decoder, prompts, 3, max_tokens, eos_ids, seed=4)
    assert [c.ids for c in got] == [c.ids for c in expected]
    torch.testing.assert_close([c.logprobs for c in got], [c.logprobs for c in expected], atol=1e-6, rtol=0)
    assert decoder.last_stats.refills == 0 and decoder.last_stats.rows == 9


def test_alternating_prompt_widths_reuse_the_kept_shapes(model) -> None:
    """Tasks alternate between two prompt widths: each shape is prepared (captured, on CUDA) once and
    kept; a third shape evicts the least recently used; kept_shapes=1 prepares at every switch."""
    prompts = random_prompts([5, 9])
    decoder = StaticDecoder(model, compile=False, max_rows=4)
    first = [_decode(decoder, prompts, 2, 6, [-1], seed=1, width=width) for width in (16, 32, 16, 32)]
    assert decoder.preparations == 2
    assert first[2] == first[0] and first[3] == first[1], "a kept shape decodes as a fresh one"
    _decode(decoder, prompts, 2, 6, [-1], width=48)  # evicts width 16
    _decode(decoder, prompts, 2, 6, [-1], width=32)
    assert decoder.preparations == 3
    _decode(decoder, prompts, 2, 6, [-1], width=16)
    assert decoder.preparations == 4
    single = StaticDecoder(model, compile=False, max_rows=4, kept_shapes=1)
    for width in (16, 32, 16, 32):
        _decode(single, prompts, 2, 6, [-1], width=width)
    assert single.preparations == 4


def test_one_token_completions_refill_every_row_at_once(model) -> None:
    """max_tokens=1: every sequence is done at its prefill; rows are refilled without a decode step."""
    decoder = StaticDecoder(model, compile=False, max_rows=2)
    outs = _decode(decoder, random_prompts([4, 7, 5]), 2, 1, [-1])
    assert [len(c.ids) for c in outs] == [1] * 6
    assert (decoder.last_stats.decode_steps, decoder.last_stats.refills) == (0, 4)


def test_row_schedule_hands_out_sequences_in_order_and_checks_when_a_row_reaches_max_tokens() -> None:
    schedule = RowSchedule(rows=3, sequences=5, max_tokens=10, sync_every=4)
    assert schedule.assign([0, 1, 2]) == [(0, 0, None), (1, 1, None), (2, 2, None)]
    assert schedule.steps_to_check(0) == 4
    schedule.advance(4)
    assert schedule.finish([False, True, False]) == [1]  # row 1 sampled an EOS
    assert schedule.assign([1]) == [(1, 3, 1)] and schedule.refills == 1
    assert schedule.steps_to_check(4) == 4
    schedule.advance(4)  # rows 0 and 2 at t=9, row 1 at t=5
    assert schedule.steps_to_check(8) == 1, "row 0 and 2 reach max_tokens before the next sync"
    schedule.advance(1)
    assert schedule.finish([False, False, False]) == [0, 2]
    assert schedule.assign([0, 2]) == [(0, 4, 0)], "one sequence left: row 2 idles"
    assert schedule.held == [4, 3, 2] and schedule.live == [True, True, False]
    assert schedule.steps_to_check(9) == 3  # the next multiple of sync_every
    assert RowSchedule(rows=1, sequences=1, max_tokens=100).steps_to_check(0) == SYNC_EVERY


@pytest.mark.slow
def test_the_torch_compiled_step_traces_the_row_cache_on_the_cpu(model, monkeypatch) -> None:
    """What the GPU path adds before its graph capture: the step's forward through torch.compile (inductor
    on the CPU here), the row cache's per-row writes traced by dynamo. The same tokens as the eager step,
    refills included. (About half a minute of compilation, hence `slow`.)"""
    monkeypatch.setattr(StaticDecoder, "_capture", lambda self, cache, step: step)  # no CUDA graph on a CPU
    prompts = random_prompts([5, 11, 3, 8])
    compiled = _decode(
        StaticDecoder(model, compile=True, max_rows=3, sync_every=4),
        prompts,
        2,
        12,
        FREQUENT_EOS,
        seed=1,
        width=16,
    )
    eager = _decode(
        StaticDecoder(model, compile=False, max_rows=3, sync_every=4),
        prompts,
        2,
        12,
        FREQUENT_EOS,
        seed=1,
        width=16,
    )
    assert [c.ids for c in compiled] == [c.ids for c in eager]
    torch.testing.assert_close([c.logprobs for c in compiled], [c.logprobs for c in eager], atol=1e-4, rtol=0)


@pytest.mark.parametrize("row_cache", ["stacked", "one object per layer"])
def test_a_layer_scope_compiles_one_graph_for_every_layer_and_decodes_as_the_eager_step(
    tmp_path, monkeypatch, row_cache
) -> None:
    """compile_scope "layer": each decoder layer compiled, one graph with the layer index as its input serving
    layers 1..N-1 (layer 0's is the first, fixed), through the stacked cache; tokens and logprobs those of the
    eager step, refills included, and the model's own layers back in place after the call. Through a cache
    with one object per layer (transformers' own layout) dynamo compiles every layer anew: why the stack."""
    from transformers import AutoModelForCausalLM

    four_layers = AutoModelForCausalLM.from_pretrained(
        make_tiny_model(tmp_path / "model", num_hidden_layers=4), dtype=torch.float32
    ).eval()
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module

    layer_compiled = static_decode.layer_compiled_model
    monkeypatch.setattr(
        static_decode, "layer_compiled_model", lambda m: layer_compiled(m, backend=counting_backend)
    )
    monkeypatch.setattr(StaticDecoder, "_capture", lambda self, cache, step: step)  # no CUDA graph on a CPU
    if row_cache != "stacked":
        monkeypatch.setattr(static_decode, "StackedRowCache", static_decode.RowCache)
    names = [name for name, _ in four_layers.named_parameters()]
    prompts = random_prompts([5, 11, 3, 8])
    torch._dynamo.reset()
    layered = _decode(
        StaticDecoder(four_layers, max_rows=3, sync_every=4, compile_scope="layer"),
        prompts,
        2,
        12,
        FREQUENT_EOS,
        seed=1,
        width=16,
    )
    eager = _decode(
        StaticDecoder(four_layers, compile=False, max_rows=3, sync_every=4),
        prompts,
        2,
        12,
        FREQUENT_EOS,
        seed=1,
        width=16,
    )
    assert len(graphs) == (2 if row_cache == "stacked" else 4)
    assert [c.ids for c in layered] == [c.ids for c in eager]
    torch.testing.assert_close([c.logprobs for c in layered], [c.logprobs for c in eager], atol=1e-5, rtol=0)
    assert [name for name, _ in four_layers.named_parameters()] == names


def test_a_layer_scope_step_writes_the_stacked_cache_in_place(tmp_path, monkeypatch) -> None:
    """Each compiled layer writes its new K/V into the stacked cache in place: its final post-grad graph (what
    inductor makes kernels of) holds no copy. Written into a view of the stack (all_keys[layer]), inductor
    copied the layer's whole K/V out and back every step: 0.4-0.5 ms of an H200's 1.9 ms decode step at 64
    rows, 24 layers (docs/benchmarks.md). The graphs are read after inductor's reinplacing pass, its last
    word on what is in place (a private function: renamed in a later torch, this test says so at once)."""
    from torch._inductor.fx_passes import post_grad
    from transformers import AutoModelForCausalLM

    graphs: list[list[str]] = []
    reinplace = post_grad.reinplace_inplaceable_ops

    def reinplace_and_record(updater, graph: torch.fx.Graph) -> None:
        reinplace(updater, graph)
        graphs.append([str(node.target) for node in graph.nodes if node.op == "call_function"])

    monkeypatch.setattr(post_grad, "reinplace_inplaceable_ops", reinplace_and_record)
    monkeypatch.setattr(StaticDecoder, "_capture", lambda self, cache, step: step)  # no CUDA graph on a CPU
    two_layers = AutoModelForCausalLM.from_pretrained(
        make_tiny_model(tmp_path / "model", num_hidden_layers=2), dtype=torch.float32
    ).eval()
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        _decode(
            StaticDecoder(two_layers, max_rows=2, compile_scope="layer"),
            random_prompts([5, 7]),
            1,
            3,
            [],
            width=8,
        )
    assert len(graphs) == 2  # layer 0's graph and the one serving the others
    for targets in graphs:
        assert targets.count("aten.index_put_.default") == 2, targets  # keys and values, in place
        assert not [t for t in targets if t.startswith(("aten.copy", "aten.index_put.default"))], targets


def test_a_shape_is_prepared_without_autograd_whoever_calls_it(model, monkeypatch) -> None:
    """prepare compiles and captures with grad off even when its caller has it on (a bench, a test): traced
    with grad on, the compiled step took a backward through the decode-attention op, which has none, and
    failed on the GPU (2026-11-28). What the capture sees is recorded in place of a CUDA graph."""
    grad_at_capture = []

    def capture(self, cache, step):
        grad_at_capture.append(torch.is_grad_enabled())
        return step

    monkeypatch.setattr(StaticDecoder, "_capture", capture)
    decoder = StaticDecoder(model, compile=True, max_rows=2)
    with torch.enable_grad():
        decoder.prepare(2, 8, 4, PLAIN)
    assert grad_at_capture == [False]


def test_an_unknown_compile_scope_is_refused_naming_the_known_ones(model) -> None:
    with pytest.raises(ValueError, match="'block': one of auto, model, layer"):
        StaticDecoder(model, compile_scope="block")


def test_the_auto_scope_compiles_a_layer_where_the_model_lists_its_layers_and_the_whole_model_elsewhere(
    model,
) -> None:
    """ "auto" (the spec's default) is "layer" for a transformers decoder with get_decoder().layers, "model"
    for a causal LM without such a list, which the layer scope cannot serve; asked for by name, "layer" is
    refused there, naming the way out."""

    class NoLayerList(torch.nn.Module):
        def get_decoder(self) -> torch.nn.Module:
            return torch.nn.Sequential(torch.nn.Linear(2, 2))

    assert static_decode.resolve_compile_scope(model, "auto") == "layer"
    assert static_decode.resolve_compile_scope(NoLayerList(), "auto") == "model"
    assert static_decode.resolve_compile_scope(NoLayerList(), "model") == "model"
    assert StaticDecoder(model, compile=False).compile_scope == "layer"
    with pytest.raises(ValueError, match="compile it whole"):
        StaticDecoder(NoLayerList(), compile_scope="layer")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile_scope", COMPILE_SCOPES)
def test_the_compiled_graph_refills_rows_with_the_logprobs_of_a_plain_forward_pass(
    model, compile_scope
) -> None:
    """The CUDA path: the step captured as a graph (per-row scatter into the cache, per-row masks and
    positions), rows refilled between replays; logprobs match a teacher-forced forward (float32), the
    same seed gives the same tokens, and alternating widths replay the kept graphs. With the whole
    model compiled, and with one graph for every decoder layer."""
    cuda_model = model.to("cuda")
    try:
        prompts, n, max_tokens = random_prompts([5, 11, 3, 8, 13]), 3, 24
        decoder = StaticDecoder(
            cuda_model, compile=True, max_rows=4, sync_every=4, compile_scope=compile_scope
        )
        ids, mask = left_padded(prompts, n, width=16)
        torch.manual_seed(1)
        tokens, logprobs = decoder.generate(ids.cuda(), mask.cuda(), max_tokens, PLAIN, FREQUENT_EOS)
        outs = _completions(tokens.cpu(), logprobs.cpu(), FREQUENT_EOS)
        assert decoder.last_stats.refills == 15 - 4
        assert min(len(c.ids) for c in outs) < max_tokens
        for i, c in enumerate(outs):
            torch.testing.assert_close(
                torch.tensor(c.logprobs),
                _teacher_forced(cuda_model, prompts[i // n], c.ids, PLAIN),
                atol=2e-3,
                rtol=2e-3,
            )
        torch.manual_seed(1)
        again = _completions(
            *(x.cpu() for x in decoder.generate(ids.cuda(), mask.cuda(), max_tokens, PLAIN, FREQUENT_EOS)),
            FREQUENT_EOS,
        )
        assert [c.ids for c in again] == [c.ids for c in outs]
        wide_ids, wide_mask = left_padded(prompts, n, width=32)
        for width_ids, width_mask in ((wide_ids, wide_mask), (ids, mask), (wide_ids, wide_mask)):
            decoder.generate(width_ids.cuda(), width_mask.cuda(), max_tokens, PLAIN, FREQUENT_EOS)
        assert decoder.preparations == 2
    finally:
        model.to("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fewer_sequences_replay_the_one_compiled_shape_with_idle_rows(model) -> None:
    """A tool loop's later turns have fewer live rollouts each time: 7, 6 and 5 sequences all replay one
    captured 8-row shape (graph_rows), the rows past them idle, and each completion keeps the logprobs of
    a plain forward pass."""
    cuda_model = model.to("cuda")
    try:
        decoder = StaticDecoder(cuda_model, compile=True, sync_every=4)
        for sequences in (7, 6, 5):
            prompts = random_prompts([5, 11, 3, 8, 13, 6, 9][:sequences], seed=sequences)
            ids, mask = left_padded(prompts, 1, width=16)
            torch.manual_seed(sequences)
            tokens, logprobs = decoder.generate(ids.cuda(), mask.cuda(), 24, PLAIN, FREQUENT_EOS)
            outs = _completions(tokens.cpu(), logprobs.cpu(), FREQUENT_EOS)
            assert len(outs) == sequences and decoder.last_stats.rows == 8
            for prompt, c in zip(prompts, outs, strict=True):
                torch.testing.assert_close(
                    torch.tensor(c.logprobs),
                    _teacher_forced(cuda_model, prompt, c.ids, PLAIN),
                    atol=2e-3,
                    rtol=2e-3,
                )
        assert decoder.preparations == 1
    finally:
        model.to("cpu")


def test_min_rows_decodes_fewer_sequences_in_a_larger_shape_with_idle_rows(model) -> None:
    """A later turn of a tool loop asks for its first turn's rows: the rows past its sequences idle, and
    each completion keeps the logprobs of a plain forward pass."""
    decoder = StaticDecoder(model, compile=False, sync_every=4)
    prompts = random_prompts([5, 11, 3])
    ids, mask = left_padded(prompts, 1, width=16)
    torch.manual_seed(2)
    outs = _completions(*decoder.generate(ids, mask, 12, PLAIN, FREQUENT_EOS, min_rows=6), FREQUENT_EOS)
    assert len(outs) == 3 and decoder.last_stats.rows == 6 and decoder.last_stats.refills == 0
    for prompt, c in zip(prompts, outs, strict=True):
        torch.testing.assert_close(
            torch.tensor(c.logprobs), _teacher_forced(model, prompt, c.ids, PLAIN), atol=1e-4, rtol=1e-4
        )


@pytest.mark.parametrize(
    ("sequences", "max_rows", "rows"),
    [
        (64, 256, 64),  # a task of 8 prompts x 8: its own count, as before
        (61, 256, 64),  # a later turn with 61 rollouts left: the same shape
        (33, 256, 64),
        (32, 256, 32),
        (1, 256, 1),
        (65, 256, 128),
        (300, 256, 256),  # more sequences than rows: max_rows, refilled
        (3, 2, 2),
    ],
)
def test_graph_rows_round_the_sequences_up_to_a_power_of_two_within_max_rows(
    sequences, max_rows, rows
) -> None:
    assert graph_rows(sequences, max_rows) == rows


# A memory budget (rollout.gpuMemoryUtilization x the GPU): the rows come from the spec's and the model's
# sizes alone, so that a relaunched worker decodes with the same rows and samples the same tokens.


@pytest.mark.parametrize(
    ("budget", "weights", "row_bytes", "kept", "wanted", "floor", "rows"),
    [
        (1000, 0, 10, 1, 500, 0, 85),  # 15% of the budget is workspace: 850 bytes of rows
        (1000, 0, 10, 1, 64, 0, 64),  # room for more than wanted: wanted
        (1000, 450, 10, 1, 64, 0, 40),  # the weights come first
        (1000, 450, 10, 2, 64, 0, 20),  # room for two kept shapes' caches at once
        (1000, 850, 10, 1, 64, 0, 0),  # nothing left for a row
        (1000, 900, 10, 1, 64, 0, 0),  # weights past the budget: still 0, never negative
        (1000, 0, 10, 1, 500, 400, 60),  # a small budget keeps the workspace floor, more than its 15%
        (10000, 0, 10, 1, 5000, 400, 850),  # a large one keeps 15%, more than the floor
    ],
)
def test_rows_within_budget_leaves_workspace_weights_and_every_kept_cache_room(
    budget, weights, row_bytes, kept, wanted, floor, rows
) -> None:
    assert rows_within_budget(budget, weights, row_bytes, kept, wanted, workspace_floor=floor) == rows


def test_a_budget_for_two_rows_decodes_as_two_rows_do(model) -> None:
    """The planned rows are the rows: the same tokens as max_rows=2, every sequence still
    decoded (refills)."""
    prompts, n, max_tokens = random_prompts([5, 9]), 3, 10
    width = 9
    unbudgeted = StaticDecoder(model, compile=False, sync_every=4)
    length_bytes = (width + max_tokens) * kv_bytes_per_token(model) + SAMPLING_COPIES * 4 * unbudgeted.vocab
    budget = budget_for_rows(unbudgeted.weight_bytes, length_bytes, DEFAULT_KEPT_SHAPES, 2)
    budgeted = StaticDecoder(model, compile=False, sync_every=4, memory_budget=budget)
    two_rows = StaticDecoder(model, compile=False, sync_every=4, max_rows=2)
    outs = _decode(budgeted, prompts, n, max_tokens, FREQUENT_EOS, seed=2)
    assert budgeted.last_stats.rows == 2 and len(outs) == 6
    assert outs == _decode(two_rows, prompts, n, max_tokens, FREQUENT_EOS, seed=2)


def test_a_budget_without_room_for_one_row_is_an_out_of_memory_naming_the_field(model) -> None:
    decoder = StaticDecoder(model, compile=False, memory_budget=decoder_weights(model))
    ids, mask = left_padded(random_prompts([4]), 2)
    with pytest.raises(MemoryBudgetTooSmall, match="raise rollout.gpuMemoryUtilization") as raised:
        decoder.generate(ids, mask, 8, PLAIN, FREQUENT_EOS)
    assert isinstance(
        raised.value, torch.OutOfMemoryError
    )  # so the worker reports it as one (workers/oom.py)
    reported = out_of_memory(raised.value)
    assert reported.source == "budget"  # in its own words: what did not fit, not figures torch never gave
    assert reported.describe().startswith("the rollout's memory budget (")


def decoder_weights(model) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


@pytest.mark.parametrize("dynamic,graphs", [(False, 10), (None, 2)])
def test_a_model_compiles_past_dynamos_default_limit_of_eight_shapes(tmp_path, dynamic, graphs) -> None:
    """With fixed shapes each width is a compilation of its own (past dynamo's default of 8 a width would
    run eagerly); automatic dynamic compiles a second width with symbolic sizes that serves the rest."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        make_tiny_model(tmp_path / "model"), dtype=torch.float32
    ).eval()
    compiled_graphs = []

    def counting_backend(graph_module, example_inputs):
        compiled_graphs.append(graph_module)
        return graph_module

    torch._dynamo.reset()
    forward = compiled_model(model, backend=counting_backend, dynamic=dynamic)
    with torch.no_grad():
        for width in range(1, 11):
            forward(input_ids=torch.ones(1, width, dtype=torch.long))
    assert len(compiled_graphs) == graphs
