"""Generation engines: determinism per seed, sampling logprobs, EOS cut, chat template, weight loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rollout_helpers import assets_available, make_tiny_model

from mortal.specs.training import ModelSpec
from mortal.workers.engines import GenerationParams, resolve_engine_name, select_engine
from mortal.workers.engines.base import cut_at_eos, eos_token_ids
from mortal.workers.engines.transformers_engine import PROMPT_BUCKET, TransformersEngine
from mortal.workers.errors import FatalWorkerError
from mortal.workers.models import encode_prompt, load_model, load_tokenizer
from mortal.workers.weights import write_weights

pytestmark = pytest.mark.skipif(not assets_available(), reason="SmolLM2 tokenizer/config assets not found")
CHAT = [{"role": "user", "content": "What is 2 + 3? Reply with only the number."}]


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
    first = engine.generate(prompt, 4, seed=7, params=params)
    assert torch.rand(1) == before  # the worker's global RNG is not consumed by generation
    again = engine.generate(prompt, 4, seed=7, params=params)
    other = engine.generate(prompt, 4, seed=8, params=params)
    assert [c.ids for c in first] == [c.ids for c in again]
    assert [c.logprobs for c in first] == [c.logprobs for c in again]
    assert [c.ids for c in first] != [c.ids for c in other]
    assert len({tuple(c.ids) for c in first}) > 1  # the n completions differ from each other


def test_a_fresh_worker_samples_the_same_tokens(engine, spec, tokenizer) -> None:
    prompt = encode_prompt(tokenizer, CHAT)
    params = GenerationParams(max_tokens=10, temperature=0.8)
    other = TransformersEngine.create(spec, tokenizer, device="cpu")
    assert [c.ids for c in engine.generate(prompt, 3, 11, params)] == [c.ids for c in other.generate(prompt, 3, 11, params)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_the_sampling_distribution(engine, tokenizer, temperature: float) -> None:
    prompt = encode_prompt(tokenizer, CHAT)
    outs = engine.generate(prompt, 3, seed=3, params=GenerationParams(max_tokens=10, temperature=temperature))
    for c in outs:
        assert len(c.logprobs) == len(c.ids) == 10
        expected = _recomputed_logprobs(engine.model, prompt, c.ids, temperature)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_the_gpu_paths_padded_prompt_and_static_cache_sample_the_same_distribution(engine, tokenizer) -> None:
    """What the compiled CUDA path changes (left padding to PROMPT_BUCKET, a static KV cache), run on the
    CPU where transformers does not compile: the logprobs still match a forward pass of the unpadded text."""
    padded = TransformersEngine(engine.model, tokenizer, compiled=True)
    prompt = encode_prompt(tokenizer, CHAT)
    assert len(prompt) % PROMPT_BUCKET, "the prompt must need padding for this test to mean anything"
    outs = padded.generate(prompt, 3, seed=3, params=GenerationParams(max_tokens=10, temperature=0.8))
    for c in outs:
        expected = _recomputed_logprobs(engine.model, prompt, c.ids, 0.8)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_top_k_samples_within_the_k_best_and_renormalizes(engine, tokenizer) -> None:
    prompt = encode_prompt(tokenizer, CHAT)
    [c] = engine.generate(prompt, 1, seed=5, params=GenerationParams(max_tokens=6, top_k=3))
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
    outs = engine.generate(encode_prompt(tokenizer, CHAT), 8, seed=1, params=GenerationParams(max_tokens=12))
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
    before = [c.ids for c in engine.generate(prompt, 2, 4, params)]
    other_dir = make_tiny_model(tmp_path / "other", seed=1)
    other_spec = ModelSpec(name=str(other_dir), dtype="float32")
    published = write_weights(load_model(other_spec, "cpu"), tmp_path / "weights" / "v1", version=1, step=1)
    engine.load_weights(str(published))
    reference = TransformersEngine.create(other_spec, tokenizer, device="cpu")
    after = [c.ids for c in engine.generate(prompt, 2, 4, params)]
    assert after == [c.ids for c in reference.generate(prompt, 2, 4, params)]
    assert after != before


def test_load_weights_of_another_architecture_is_fatal(engine, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    (tmp_path / "v9").mkdir()
    save_file({"not.a.weight": torch.zeros(2)}, str(tmp_path / "v9" / "model.safetensors"))
    with pytest.raises(FatalWorkerError, match="WeightsMismatch"):
        engine.load_weights(str(tmp_path / "v9"))


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
    first = engine.generate(prompt, 4, 7, params)
    assert [c.ids for c in first] == [c.ids for c in engine.generate(prompt, 4, 7, params)]
    assert all(len(c.ids) == len(c.logprobs) for c in first)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_vllm_engine_generates_and_reloads(spec, tokenizer, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from mortal.workers.engines.vllm_engine import VllmEngine

    engine = VllmEngine.create(ModelSpec(name=spec.name, dtype="bfloat16"), tokenizer, gpu_memory_utilization=0.3)
    prompt = encode_prompt(tokenizer, CHAT)
    params = GenerationParams(max_tokens=8)
    first = engine.generate(prompt, 4, 7, params)
    assert [c.ids for c in first] == [c.ids for c in engine.generate(prompt, 4, 7, params)]
    assert all(len(c.ids) == len(c.logprobs) and all(lp <= 0 for lp in c.logprobs) for c in first)
    other = make_tiny_model(tmp_path / "other", seed=1)
    engine.load_weights(str(write_weights(load_model(ModelSpec(name=str(other)), "cpu"), tmp_path / "v1", 1, 1)))
    assert [c.ids for c in engine.generate(prompt, 4, 7, params)] != [c.ids for c in first]
    engine.close()
