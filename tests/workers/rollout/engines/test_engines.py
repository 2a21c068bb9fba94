"""Generation engines: determinism per seed, sampling logprobs, EOS cut, chat template, weight loading.

`Engine.generate(prompts, n, seeds, params)` answers a whole rollout task: one group of n completions
per prompt, in order. The transformers engine's batched path (StaticDecoder, the default on CUDA) runs
eagerly on the CPU with `compiled=True`, so its padding, masking, sampling and row refills are tested
here (test_static_decode.py tests the decoder itself); vLLM is tested against a fake `vllm` module
(the real one only on a GPU)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from rollout_helpers import assets_available, make_tiny_model

from mortal.specs.training import ModelSpec
from mortal.workers.errors import FatalWorkerError
from mortal.workers.models import encode_prompt, load_model, load_tokenizer
from mortal.workers.rollout.engines import GenerationParams, resolve_engine_name, select_engine
from mortal.workers.rollout.engines.base import cut_at_eos, eos_token_ids
from mortal.workers.rollout.engines.static_decode import Sampling, StaticDecoder, processed_logprobs
from mortal.workers.rollout.engines.transformers_engine import PROMPT_BUCKET, TransformersEngine
from mortal.workers.sync.volume import write_weights

pytestmark = pytest.mark.skipif(not assets_available(), reason="SmolLM2 tokenizer/config assets not found")
CHAT = [{"role": "user", "content": "What is 2 + 3? Reply with only the number."}]
LONG = [{"role": "user", "content": "Add these up: " + " + ".join(str(i) for i in range(40))}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def spec(tiny_dir: Path) -> ModelSpec:
    return ModelSpec(name=str(tiny_dir), dtype="float32")


@pytest.fixture(scope="module")
def tokenizer(spec: ModelSpec):
    return load_tokenizer(spec)


@pytest.fixture
def engine(spec: ModelSpec, tokenizer) -> TransformersEngine:
    return TransformersEngine.create(spec, tokenizer, device="cpu")


def _recomputed_logprobs(model, prompt_ids: list[int], ids: list[int], temperature: float) -> torch.Tensor:
    """Logprobs of `ids` after `prompt_ids` from one plain forward pass, logits / temperature."""
    full = torch.tensor([prompt_ids + ids])
    with torch.no_grad():
        logits = model(full).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)


def test_same_seed_same_tokens_and_global_rng_untouched(engine, tokenizer) -> None:
    prompt = encode_prompt(tokenizer, CHAT)
    params = GenerationParams(max_tokens=12)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    [first] = engine.generate([prompt], 4, seeds=[7], params=params)
    assert torch.rand(1) == before  # the worker's global RNG is not consumed by generation
    [again] = engine.generate([prompt], 4, seeds=[7], params=params)
    [other] = engine.generate([prompt], 4, seeds=[8], params=params)
    assert [c.ids for c in first] == [c.ids for c in again]
    assert [c.logprobs for c in first] == [c.logprobs for c in again]
    assert [c.ids for c in first] != [c.ids for c in other]
    assert len({tuple(c.ids) for c in first}) > 1  # the n completions differ from each other


def test_a_fresh_worker_samples_the_same_tokens(engine, spec, tokenizer) -> None:
    prompt = encode_prompt(tokenizer, CHAT)
    params = GenerationParams(max_tokens=10, temperature=0.8)
    other = TransformersEngine.create(spec, tokenizer, device="cpu")
    [mine], [theirs] = engine.generate([prompt], 3, [11], params), other.generate([prompt], 3, [11], params)
    assert [c.ids for c in mine] == [c.ids for c in theirs]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_the_sampling_distribution(engine, tokenizer, temperature: float) -> None:
    prompt = encode_prompt(tokenizer, CHAT)
    params = GenerationParams(max_tokens=10, temperature=temperature)
    [outs] = engine.generate([prompt], 3, seeds=[3], params=params)
    for c in outs:
        assert len(c.logprobs) == len(c.ids) == 10
        expected = _recomputed_logprobs(engine.model, prompt, c.ids, temperature)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_the_gpu_paths_padded_prompt_and_static_cache_sample_the_same_distribution(engine, tokenizer) -> None:
    """What the compiled CUDA path changes (left padding to PROMPT_BUCKET, a static KV cache), run on the
    CPU where StaticDecoder runs eagerly: the logprobs still match a forward pass of the unpadded text."""
    padded = TransformersEngine(engine.model, tokenizer, compiled=True)
    prompt = encode_prompt(tokenizer, CHAT)
    assert len(prompt) % PROMPT_BUCKET, "the prompt must need padding for this test to mean anything"
    [outs] = padded.generate([prompt], 3, seeds=[3], params=GenerationParams(max_tokens=10, temperature=0.8))
    for c in outs:
        expected = _recomputed_logprobs(engine.model, prompt, c.ids, 0.8)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=1e-4)


def _prompts(tokenizer) -> list[list[int]]:
    """Three prompts of different lengths: 8 tokens, one bucket, and more than two buckets (more padding)."""
    prompts = [
        encode_prompt(tokenizer, "What is 2 + 3?"),
        encode_prompt(tokenizer, CHAT),
        encode_prompt(tokenizer, LONG),
    ]
    lengths = [len(p) for p in prompts]
    assert len(set(lengths)) == 3 and max(lengths) > PROMPT_BUCKET and all(n % PROMPT_BUCKET for n in lengths)
    return prompts


@pytest.fixture
def batched(engine, tokenizer) -> TransformersEngine:
    """The CUDA path's engine on the CPU: every prompt x n of a task in one StaticDecoder batch (eager)."""
    return TransformersEngine(engine.model, tokenizer, compiled=True)


def test_the_decoder_compiles_what_the_spec_asks_and_the_spec_takes_only_the_decoders_scopes(
    engine, tokenizer
) -> None:
    """generation.compileScope reaches the batched path's decoder (absent: "auto", which is "layer" for a
    model with a list of decoder layers, as this one); the spec's choices are the decoder's own
    (static_decode.COMPILE_SCOPES), so a spec that loads is one it runs."""
    from typing import get_args

    from mortal.specs.training import GenerationSpec
    from mortal.workers.rollout.engines.static_decode import COMPILE_SCOPES

    assert GenerationSpec().compile_scope == "auto"
    assert TransformersEngine(engine.model, tokenizer, compiled=True).decoder.compile_scope == "layer"
    assert (
        TransformersEngine(
            engine.model, tokenizer, compiled=True, compile_scope="model"
        ).decoder.compile_scope
        == "model"
    )
    assert get_args(GenerationSpec.model_fields["compile_scope"].annotation) == COMPILE_SCOPES


def test_the_batched_path_returns_one_group_of_n_per_prompt_in_order(batched, tokenizer) -> None:
    prompts = _prompts(tokenizer)
    groups = batched.generate(prompts, 3, [5, 6, 7], GenerationParams(max_tokens=10, temperature=0.8))
    assert [len(group) for group in groups] == [3, 3, 3]
    for group in groups:
        assert all(len(c.ids) == len(c.logprobs) == 10 for c in group)
        assert len({tuple(c.ids) for c in group}) > 1  # the n completions of a prompt differ
    assert groups[0] != groups[1] != groups[2]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_batched_logprobs_are_a_plain_forward_pass_whatever_the_padding(
    batched, tokenizer, temperature
) -> None:
    """Prompts of different lengths share one left-padded batch: a completion's logprobs equal those of
    the unpadded prompt + completion in a forward pass of its own, so the padding leaks into nothing."""
    prompts = _prompts(tokenizer)
    groups = batched.generate(prompts, 2, [1, 2, 3], GenerationParams(max_tokens=10, temperature=temperature))
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            expected = _recomputed_logprobs(batched.model, prompt, c.ids, temperature)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_the_batched_path_gives_the_same_tokens_for_the_same_seeds(batched, engine, tokenizer) -> None:
    prompts = _prompts(tokenizer)
    params = GenerationParams(max_tokens=10, temperature=0.9)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    first = batched.generate(prompts, 2, [4, 5, 6], params)
    assert torch.rand(1) == before  # the worker's global RNG is not consumed by generation
    again = batched.generate(prompts, 2, [4, 5, 6], params)
    fresh = TransformersEngine(engine.model, tokenizer, compiled=True).generate(prompts, 2, [4, 5, 6], params)
    ids = [[c.ids for c in group] for group in first]
    assert [[c.ids for c in group] for group in again] == ids
    assert [[c.logprobs for c in group] for group in again] == [
        [c.logprobs for c in group] for group in first
    ]
    assert [[c.ids for c in group] for group in fresh] == ids
    assert [[c.ids for c in group] for group in batched.generate(prompts, 2, [9, 5, 6], params)] != ids


def test_with_fewer_rows_than_completions_each_prompt_still_gets_its_n_completions_in_order(
    engine, spec, tokenizer
) -> None:
    """max_rows=4 for 3 prompts x 3: rows are refilled as completions end (every odd id is an EOS here), and
    each group is still its own prompt's n completions: each one's logprobs are those of that prompt."""
    prompts = _prompts(tokenizer)
    model = load_model(spec, "cpu")
    model.generation_config.eos_token_id = list(range(1, 49152, 2))
    refilling = TransformersEngine(model, tokenizer, compiled=True, max_rows=4)
    groups = refilling.generate(prompts, 3, [5, 6, 7], GenerationParams(max_tokens=10, temperature=0.8))
    assert [len(group) for group in groups] == [3, 3, 3]
    stats = refilling.generation_stats()
    assert stats["rows"] == 4 and stats["refills"] == 9 - 4 and 0 < stats["useful_fraction"] <= 1
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            assert len(c.ids) == len(c.logprobs) <= 10
            expected = _recomputed_logprobs(refilling.model, prompt, c.ids, 0.8)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=1e-4)
    assert engine.generation_stats() == {}  # the per-prompt path measures nothing


def test_the_batched_path_cuts_each_completion_at_its_first_eos(spec, tokenizer) -> None:
    """Rows run on past their EOS in the fixed-shape batch; what comes back ends at the first EOS, and
    the loop stops early once every row has ended."""
    model = load_model(spec, "cpu")
    model.generation_config.eos_token_id = list(
        range(1, 49152, 2)
    )  # every odd id: rows end within a few tokens
    engine = TransformersEngine(model, tokenizer, compiled=True)
    groups = engine.generate(_prompts(tokenizer), 4, [1, 2, 3], GenerationParams(max_tokens=200))
    stop_set = set(engine.eos_ids)
    for group in groups:
        for c in group:
            assert len(c.logprobs) == len(c.ids) < 200
            assert c.ids[-1] in stop_set and not stop_set & set(c.ids[:-1])


def test_on_cpu_a_prompts_completions_do_not_depend_on_the_other_prompts_of_its_task(
    engine, tokenizer
) -> None:
    """The CPU default generates each prompt alone (no padding): a task of several prompts gives each
    exactly what that prompt alone with its seed gives, whichever prompts share the task."""
    assert not engine.compiled and engine.decoder is None
    prompts = _prompts(tokenizer)
    seeds = [11, 12, 13]
    params = GenerationParams(max_tokens=10, temperature=0.8)
    together = engine.generate(prompts, 3, seeds, params)
    alone = [
        engine.generate([prompt], 3, [seed], params)[0] for prompt, seed in zip(prompts, seeds, strict=True)
    ]
    assert together == alone  # ids and logprobs, bit for bit
    assert engine.generate(prompts[1:], 3, seeds[1:], params) == together[1:]
    assert engine.generate(prompts[::-1], 3, seeds[::-1], params) == together[::-1]


def test_processed_logprobs_apply_temperature_then_top_k_then_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    full = processed_logprobs(logits, Sampling(temperature=1.0, top_k=0, top_p=1.0))
    torch.testing.assert_close(full.exp(), torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top2 = processed_logprobs(logits, Sampling(temperature=1.0, top_k=2, top_p=1.0)).exp()
    torch.testing.assert_close(top2, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # top-p keeps the smallest prefix whose mass reaches p: 0.5 + 0.3 >= 0.7; 0.5 alone reaches 0.5
    torch.testing.assert_close(
        processed_logprobs(logits, Sampling(1.0, 0, 0.7)).exp(), torch.tensor([[0.625, 0.375, 0.0, 0.0]])
    )
    torch.testing.assert_close(
        processed_logprobs(logits, Sampling(1.0, 0, 0.5)).exp(), torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    )
    hot = processed_logprobs(logits, Sampling(temperature=2.0, top_k=0, top_p=1.0)).exp()
    torch.testing.assert_close(hot, torch.softmax(logits / 2.0, -1))


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(temperature=1.0, top_k=3, top_p=1.0),
        Sampling(temperature=0.8, top_k=0, top_p=0.6),
        Sampling(temperature=1.0, top_k=5, top_p=0.5),
    ],
    ids=["top_k=3", "top_p=0.6", "top_k=5,top_p=0.5"],
)
def test_static_decoder_samples_inside_the_top_k_and_nucleus_sets(
    engine, tokenizer, sampling: Sampling
) -> None:
    """StaticDecoder(compile=False) on left-padded rows: every sampled token is in the processed
    distribution's support (top-k / nucleus of a plain forward pass), its logprob that distribution's."""
    prompts = [encode_prompt(tokenizer, "What is 2 + 3?"), encode_prompt(tokenizer, CHAT)]
    width = max(len(p) for p in prompts) + 3
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts for _ in range(2)])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts for _ in range(2)])
    decoder = StaticDecoder(engine.model, compile=False)
    torch.manual_seed(0)
    tokens, logprobs = decoder.generate(input_ids, mask, 8, sampling, eos_ids=[-1])
    assert tokens.shape == logprobs.shape == (4, 8)
    for row in range(4):
        prompt, ids = prompts[row // 2], tokens[row].tolist()
        with torch.no_grad():
            logits = engine.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
        allowed = processed_logprobs(logits, sampling)
        for t, token in enumerate(ids):
            support = torch.isfinite(allowed[t])
            if sampling.top_k:
                assert int(support.sum()) <= sampling.top_k
                assert token in logits[t].topk(sampling.top_k).indices.tolist()
            if sampling.top_p < 1.0:  # the nucleus of what top-k (if any) left: less than p above the token
                top_k_only = processed_logprobs(
                    logits[t], Sampling(sampling.temperature, sampling.top_k, 1.0)
                )
                probs = top_k_only.exp()
                assert probs[probs > probs[token]].sum() < sampling.top_p, "sampled outside the nucleus"
            assert bool(support[token])
            assert logprobs[row, t].item() == pytest.approx(allowed[t, token].item(), abs=1e-4)


def test_top_k_samples_within_the_k_best_and_renormalizes(engine, tokenizer) -> None:
    prompt = encode_prompt(tokenizer, CHAT)
    [[c]] = engine.generate([prompt], 1, seeds=[5], params=GenerationParams(max_tokens=6, top_k=3))
    full = torch.tensor([prompt + c.ids])
    with torch.no_grad():
        logits = engine.model(full).logits[0, len(prompt) - 1 : -1]
    top3 = logits.topk(3, dim=-1)
    for t, token in enumerate(c.ids):
        assert token in top3.indices[t].tolist()
        renormalized = torch.log_softmax(top3.values[t], -1)[top3.indices[t].tolist().index(token)]
        assert c.logprobs[t] == pytest.approx(renormalized.item(), abs=1e-4)


def test_completions_end_at_the_first_eos_included(spec, tokenizer) -> None:
    model = load_model(spec, "cpu")
    stops = list(range(1, 49152, 2))  # a model whose EOS set is every odd id: most completions stop early
    model.generation_config.eos_token_id = stops
    engine = TransformersEngine(model, tokenizer)
    params = GenerationParams(max_tokens=12)
    [outs] = engine.generate([encode_prompt(tokenizer, CHAT)], 8, seeds=[1], params=params)
    stopped = [c for c in outs if len(c.ids) < 12]
    assert stopped, "expected some completions to stop before max_tokens"
    stop_set = set(engine.eos_ids)
    assert tokenizer.eos_token_id == engine.eos_ids[0]  # TRL's order: the tokenizer's EOS first
    for c in outs:
        assert len(c.logprobs) == len(c.ids)
        assert not stop_set & set(c.ids[:-1])  # nothing after an EOS (padding is cut)
        assert c.ids[-1] in stop_set or len(c.ids) == 12


def test_cut_at_eos_and_eos_ids() -> None:
    c = cut_at_eos([5, 6, 2, 2, 2], [-1.0, -2.0, -3.0, -4.0, -5.0], [2])
    assert (c.ids, c.logprobs) == ([5, 6, 2], [-1.0, -2.0, -3.0])
    assert cut_at_eos([5, 6], [-1.0, -2.0], [2]).ids == [5, 6]

    class Tok:
        eos_token_id = 2

    assert eos_token_ids(Tok(), None) == [2]
    assert eos_token_ids(Tok(), [7, 2]) == [7, 2]
    assert eos_token_ids(Tok(), 7) == [2, 7]


def test_chat_prompts_get_the_chat_template_text_prompts_do_not(tokenizer) -> None:
    chat = tokenizer.decode(encode_prompt(tokenizer, CHAT))
    assert chat.startswith("<|im_start|>system") and "<|im_start|>user\nWhat is 2 + 3?" in chat
    assert chat.endswith("<|im_start|>assistant\n")  # the generation prompt
    text = tokenizer.decode(encode_prompt(tokenizer, "What is 2 + 3?"))
    assert text == "What is 2 + 3?"


def test_load_weights_switches_to_a_published_version(engine, tokenizer, tmp_path: Path) -> None:
    prompt = encode_prompt(tokenizer, CHAT)
    params = GenerationParams(max_tokens=8)
    before = [c.ids for c in engine.generate([prompt], 2, [4], params)[0]]
    other_dir = make_tiny_model(tmp_path / "other", seed=1)
    other_spec = ModelSpec(name=str(other_dir), dtype="float32")
    published = write_weights(load_model(other_spec, "cpu"), tmp_path / "weights" / "v1", version=1, step=1)
    engine.load_weights(str(published))
    reference = TransformersEngine.create(other_spec, tokenizer, device="cpu")
    after = [c.ids for c in engine.generate([prompt], 2, [4], params)[0]]
    assert after == [c.ids for c in reference.generate([prompt], 2, [4], params)[0]]
    assert after != before


def test_a_task_after_a_weight_load_samples_what_a_fresh_engine_of_those_weights_does(
    engine, tokenizer, tmp_path: Path
) -> None:
    """The batched path keeps the shared system message's K/V for the next task (prefix_cache); a weight
    load must drop it, or the next task would attend to the old weights' keys."""
    system = {"role": "system", "content": "You are a careful calculator. " * 12}

    def task(a: int) -> list[list[int]]:
        questions = [{"role": "user", "content": f"What is {a} + {b}?"} for b in (1, 2)]
        return [encode_prompt(tokenizer, [system, question]) for question in questions]

    tasks = [task(3), task(4)]
    params = GenerationParams(max_tokens=8, temperature=0.9)
    batched = TransformersEngine(engine.model, tokenizer, compiled=True)
    batched.generate(tasks[0], 2, [4, 5], params)
    assert batched.decoder.prefixes.pieces, "the system message was kept"
    other_spec = ModelSpec(name=str(make_tiny_model(tmp_path / "other", seed=1)), dtype="float32")
    published = write_weights(load_model(other_spec, "cpu"), tmp_path / "weights" / "v1", version=1, step=1)
    batched.load_weights(str(published))
    after = batched.generate(tasks[1], 2, [6, 7], params)
    fresh = TransformersEngine(load_model(other_spec, "cpu"), tokenizer, compiled=True)
    expected = fresh.generate(tasks[1], 2, [6, 7], params)
    assert [[c.logprobs for c in g] for g in after] == [[c.logprobs for c in g] for g in expected]


def test_load_weights_of_another_architecture_is_fatal(engine, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    (tmp_path / "v9").mkdir()
    save_file({"not.a.weight": torch.zeros(2)}, str(tmp_path / "v9" / "model.safetensors"))
    with pytest.raises(FatalWorkerError, match="WeightsMismatch"):
        engine.load_weights(str(tmp_path / "v9"))


class FakeSamplingParams:
    """vLLM's SamplingParams: keeps what it was given."""

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


class FakeLLM:
    """vLLM's offline LLM as VllmEngine uses it: `generate(prompts, [SamplingParams per prompt])` returns one
    RequestOutput per prompt, in order, with `n` children each. A child's tokens are a function of its
    prompt and seed + child index (as vLLM seeds children); child 1 stops at EOS 2, and vLLM keeps the stop
    token, so the engine must cut there."""

    def __init__(self, with_logprobs: bool = True) -> None:
        self.calls: list[tuple[list[Any], list[Any]]] = []
        self.with_logprobs = with_logprobs

    @staticmethod
    def tokens(prompt: list[int], seed: int, child: int, max_tokens: int) -> list[int]:
        ids = [100 + (prompt[-1] * 31 + (seed + child) * 7 + k) % 50 for k in range(max_tokens)]
        return ids[:2] + [2] if child == 1 else ids

    def generate(self, prompts: list[Any], sampling_params: Any, use_tqdm: bool = True) -> list[Any]:
        assert isinstance(sampling_params, list), "one SamplingParams per prompt"
        self.calls.append((prompts, sampling_params))
        outputs = []
        for prompt, sp in zip(prompts, sampling_params, strict=True):
            children = []
            for child in range(sp.n):
                ids = self.tokens(prompt["prompt_token_ids"], sp.seed, child, sp.max_tokens)
                logprobs = [{token: types.SimpleNamespace(logprob=-0.5 - k)} for k, token in enumerate(ids)]
                children.append(
                    types.SimpleNamespace(token_ids=ids, logprobs=logprobs if self.with_logprobs else None)
                )
            outputs.append(
                types.SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"], outputs=children)
            )
        return outputs


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A `vllm` module with the two names the engine imports (SamplingParams, inputs.TokensPrompt)."""
    vllm = types.ModuleType("vllm")
    inputs = types.ModuleType("vllm.inputs")
    vllm.SamplingParams = FakeSamplingParams
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    vllm.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    return vllm


def _vllm_engine(llm: FakeLLM) -> Any:
    from mortal.workers.rollout.engines.vllm_engine import VllmEngine

    return VllmEngine(llm, types.SimpleNamespace(eos_token_id=2), generation_eos=[2, 9])


def test_vllm_engine_generates_a_whole_task_in_one_call_with_a_seed_per_prompt(fake_vllm) -> None:
    llm = FakeLLM()
    engine = _vllm_engine(llm)
    prompts = [[1, 5, 7], [1, 8], [1, 5, 7, 4]]
    params = GenerationParams(max_tokens=6, temperature=0.7, top_p=0.9)
    groups = engine.generate(prompts, 3, [40, 41, 42], params)
    [(sent, sampling)] = llm.calls  # one LLM.generate for the task: vLLM batches the prompts itself
    assert sent == [{"prompt_token_ids": p} for p in prompts]
    assert [sp.seed for sp in sampling] == [40, 41, 42]
    for sp in sampling:
        assert (sp.n, sp.max_tokens, sp.temperature, sp.top_p, sp.top_k) == (
            3,
            6,
            0.7,
            0.9,
            -1,
        )  # -1: top-k off
        assert (sp.logprobs, sp.stop_token_ids, sp.detokenize) == (0, [2, 9], False)
    assert [len(group) for group in groups] == [3, 3, 3]
    for prompt, seed, group in zip(prompts, [40, 41, 42], groups, strict=True):
        for child, c in enumerate(group):
            full = FakeLLM.tokens(prompt, seed, child, 6)
            assert c.ids == full
            assert c.logprobs == [-0.5 - k for k in range(len(full))]
        assert group[1].ids[-1] == 2 and len(group[1].ids) == 3  # ends at its EOS, included


class FakeVllmWorker:
    """What a function sent with `collective_rpc` sees in a vLLM worker: `model_runner.model`, whose
    `load_weights(weights=...)` takes (HF name, tensor) pairs; this one loads them into a transformers
    model of the same architecture, as vLLM's would into its own."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model_runner = types.SimpleNamespace(
            model=types.SimpleNamespace(parameters=model.parameters, load_weights=self.load_weights)
        )
        self.model, self.loaded = model, []

    def load_weights(self, weights: Any) -> None:
        params = dict(self.model.named_parameters())
        for name, tensor in weights:
            self.loaded.append(name)
            params[name].data.copy_(tensor)


class RpcLLM(FakeLLM):
    def __init__(self, worker: FakeVllmWorker) -> None:
        super().__init__()
        self.worker, self.resets = worker, 0

    def collective_rpc(self, method: Any, args: tuple = ()) -> list[Any]:
        return [method(self.worker, *args)]

    def reset_prefix_cache(self) -> None:
        self.resets += 1


def test_vllm_engine_applies_a_lora_version_onto_base_weights_read_from_the_model_files(
    tiny_dir, tmp_path
) -> None:
    """A LoRA version holds only A and B: each vLLM worker reads the adapted modules' base weights
    from the model's own files once, then loads base + B @ A * scale for those modules only."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from mortal.workers.rollout.engines import vllm_engine
    from mortal.workers.sync.volume import load_published

    module = "model.layers.0.self_attn.q_proj"
    base = AutoModelForCausalLM.from_pretrained(tiny_dir).state_dict()[f"{module}.weight"]
    torch.manual_seed(0)
    lora_a, lora_b = torch.randn(2, base.shape[1]), torch.randn(base.shape[0], 2)
    for version in ("v1", "v2"):
        (tmp_path / version).mkdir()
        save_file(
            {f"{module}.lora_A": lora_a, f"{module}.lora_B": lora_b * (2 if version == "v2" else 1)},
            str(tmp_path / version / "adapter.safetensors"),
            metadata={"scales": json.dumps({module: 0.5})},
        )
    worker = FakeVllmWorker(AutoModelForCausalLM.from_pretrained(tiny_dir))
    llm = RpcLLM(worker)
    engine = vllm_engine.VllmEngine(llm, types.SimpleNamespace(eos_token_id=2), location=str(tiny_dir))
    vllm_engine._LORA_BASE.clear()
    engine.load_weights(str(tmp_path / "v1"))
    engine.load_weights(str(tmp_path / "v2"))  # applied onto the base, not onto v1
    assert worker.loaded == [f"{module}.weight"] * 2 and llm.resets == 2
    reference = AutoModelForCausalLM.from_pretrained(tiny_dir)
    load_published(reference, tmp_path / "v2")  # the transformers engine's way: the same weights
    assert torch.equal(
        worker.model.state_dict()[f"{module}.weight"], reference.state_dict()[f"{module}.weight"]
    )
    assert torch.equal(reference.state_dict()[f"{module}.weight"], base + (lora_b * 2 @ lora_a) * 0.5)


def test_vllm_engine_passes_top_k_and_refuses_missing_logprobs(fake_vllm) -> None:
    llm = FakeLLM()
    _vllm_engine(llm).generate([[1, 2, 3]], 2, [5], GenerationParams(max_tokens=4, top_k=7))
    assert llm.calls[0][1][0].top_k == 7
    with pytest.raises(RuntimeError, match="no logprobs"):
        _vllm_engine(FakeLLM(with_logprobs=False)).generate(
            [[1, 2, 3]], 2, [5], GenerationParams(max_tokens=4)
        )


def test_engine_selection() -> None:
    assert select_engine("transformers") is TransformersEngine
    assert resolve_engine_name("auto", device="cpu") == "transformers", "a CPU rollout never picks vLLM"
    with pytest.raises(FatalWorkerError, match="needs a CUDA GPU|not installed"):
        resolve_engine_name("vllm", device="cpu")
    if not torch.cuda.is_available():
        assert resolve_engine_name("auto") == "transformers"
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(FatalWorkerError, match="vLLM is not installed"):
            select_engine("vllm")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_transformers_engine_on_gpu_is_deterministic_per_seed(spec, tokenizer) -> None:
    gpu_spec = ModelSpec(name=spec.name, dtype="bfloat16")
    engine = TransformersEngine.create(gpu_spec, tokenizer, device="cuda")
    prompt = encode_prompt(tokenizer, CHAT)
    params = GenerationParams(max_tokens=16)
    [first] = engine.generate([prompt], 4, [7], params)
    assert [c.ids for c in first] == [c.ids for c in engine.generate([prompt], 4, [7], params)[0]]
    assert all(len(c.ids) == len(c.logprobs) for c in first)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_vllm_engine_generates_and_reloads(spec, tokenizer, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from mortal.workers.rollout.engines.vllm_engine import VllmEngine

    engine = VllmEngine.create(
        ModelSpec(name=spec.name, dtype="bfloat16"), tokenizer, gpu_memory_utilization=0.3
    )
    prompt = encode_prompt(tokenizer, CHAT)
    params = GenerationParams(max_tokens=8)
    [first] = engine.generate([prompt], 4, [7], params)
    assert [c.ids for c in first] == [c.ids for c in engine.generate([prompt], 4, [7], params)[0]]
    assert all(len(c.ids) == len(c.logprobs) and all(lp <= 0 for lp in c.logprobs) for c in first)
    other = make_tiny_model(tmp_path / "other", seed=1)
    engine.load_weights(
        str(write_weights(load_model(ModelSpec(name=str(other)), "cpu"), tmp_path / "v1", 1, 1))
    )
    assert [c.ids for c in engine.generate([prompt], 4, [7], params)[0]] != [c.ids for c in first]
    engine.close()


def test_the_batched_path_logs_each_shapes_first_preparation_once(engine, tokenizer, caplog) -> None:
    """What `mortalctl logs` shows of the decode step's compile: one line per new shape, with its seconds
    and the compile cache's verdict (on the CPU the decoder runs eagerly: nothing is compiled)."""
    batched = TransformersEngine(engine.model, tokenizer, compiled=True)
    prompts = _prompts(tokenizer)
    with caplog.at_level("INFO", logger="mortal.worker"):
        batched.generate(prompts, 2, [1, 2, 3], GenerationParams(max_tokens=4))
        batched.generate(prompts, 2, [4, 5, 6], GenerationParams(max_tokens=4))  # same shape: no new line
        batched.generate(prompts, 2, [4, 5, 6], GenerationParams(max_tokens=5))
    lines = [r.getMessage() for r in caplog.records if "prepared in" in r.getMessage()]
    assert len(lines) == 2, lines
    width = -(-max(len(p) for p in prompts) // PROMPT_BUCKET) * PROMPT_BUCKET
    assert lines[0].startswith(f"decode shape 6 rows x {width}+4 tokens prepared in ")
    assert lines[0].endswith("s (no compile)") and f"x {width}+5 tokens" in lines[1]


def test_a_shape_the_decoder_evicted_and_prepares_again_is_logged_again(engine, tokenizer, caplog) -> None:
    """The log follows the decoder's real preparations: a shape pushed out of its kept shapes pays again."""
    batched = TransformersEngine(engine.model, tokenizer, compiled=True)
    prompts = _prompts(tokenizer)
    with caplog.at_level("INFO", logger="mortal.worker"):
        for max_tokens in (4, 5, 6, 4):  # two shapes are kept: the third evicts the first
            batched.generate(prompts, 2, [1, 2, 3], GenerationParams(max_tokens=max_tokens))
    lines = [r.getMessage() for r in caplog.records if "prepared in" in r.getMessage()]
    assert [line.split(" tokens")[0].rsplit("+", 1)[1] for line in lines] == ["4", "5", "6", "4"]


def test_only_an_engine_that_will_compile_starts_the_compile_workers(
    spec: ModelSpec, tokenizer, monkeypatch
) -> None:
    """On CUDA the decoder compiles, so inductor's workers start as the engine is created (before its model
    loads); on the CPU nothing compiles and none start."""
    from mortal.workers.rollout.engines import transformers_engine

    started: list[int] = []
    monkeypatch.setattr(transformers_engine, "start_compile_workers", lambda: started.append(1))
    monkeypatch.setattr(
        transformers_engine, "load_model", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("stop"))
    )
    with pytest.raises(RuntimeError, match="stop"):
        TransformersEngine.create(spec, tokenizer, device="cpu")
    assert started == []
    with pytest.raises(RuntimeError, match="stop"):
        TransformersEngine.create(spec, tokenizer, device="cuda:0")
    assert started == [1]
