"""Generation alone on one GPU: transformers' compiled `generate` against mortal's StaticDecoder.

    python bench/decode_speed.py [--batch 64] [--tokens 256] [--repeats 3] [--attention sdpa kernel]
                                 [--no-transformers] [--profile] [--json out.json]

Same model as bench/gpu_step.py (Qwen2.5-0.5B's shape, random init, bf16), `--batch` rows of a
~40-token prompt left-padded to 64, `--tokens` completion tokens each (a random-init model rarely
samples EOS, so every row runs to the end). Each engine is warmed up once (compilation), then timed
`--repeats` times; the median is printed. Also checks that the decoder's sampling logprobs agree
with one plain forward pass over the sampled sequences (the number TRL's importance correction and
the loss read), as the max absolute difference.
`--profile` then records one more decoder generate with torch's profiler and prints its GPU kernels by
total time (the kernels inside the replayed CUDA graphs included), with the count of kernels per
decode step: where a step's milliseconds go, which bench/gpu_step.py's `limits` only totals.
`--attention`: the decode step's attention, each in a fresh decoder: `kernel` (decode_attention_kernel's
split-column Triton kernel, the default on a GPU) and `sdpa` (the packed SDPA call before it,
MORTAL_DECODE_KERNEL=0). `--no-transformers` leaves transformers' generate out. `--profile` records the
first `--attention`'s decoder.
Needs a CUDA GPU and SmolLM2's tokenizer (MORTAL_TEST_ASSETS, as the tests).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from gpu_step import make_model


def timed(fn, repeats: int) -> tuple[list[float], object]:
    import torch

    fn()  # warm-up: compiles
    seconds, out = [], None
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return seconds, out


def left_padded_prompts(batch: int, real: int, padding: int):
    """(ids, attention mask) on CUDA: `batch` prompts of `real` random tokens after `padding` pad tokens
    (id 2)."""
    import torch

    prompt = torch.randint(100, 40000, (batch, real), device="cuda")
    ids = torch.cat([torch.full((batch, padding), 2, device="cuda"), prompt], 1)
    mask = torch.cat(
        [torch.zeros(batch, padding, dtype=torch.long, device="cuda"), torch.ones_like(prompt)], 1
    )
    return ids, mask


def forward_logprobs(model, ids, mask, tokens):
    """The logprobs of `tokens` after the left-padded prompts `ids`, from one plain forward pass: what the
    decoder's sampling logprobs are checked against."""
    import torch

    with torch.no_grad():
        full_mask = torch.cat([mask, torch.ones_like(tokens)], 1)
        positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
        logits = (
            model(input_ids=torch.cat([ids, tokens], 1), attention_mask=full_mask, position_ids=positions)
            .logits[:, ids.shape[1] - 1 : -1]
            .float()
        )
        return torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)


def profile_decoder(generate, decoder, top: int) -> dict:
    """One generate under torch's profiler: GPU time by kernel name, per decode step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate()
        torch.cuda.synchronize()
    steps = decoder.last_stats.decode_steps
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.device_time)
    rows = sorted(((name, sum(t), len(t)) for name, t in kernels.items()), key=lambda r: -r[1])
    total_us = sum(r[1] for r in rows)
    count = sum(r[2] for r in rows)
    print(
        f"profile: {steps} decode steps, GPU kernel time {total_us / 1e3:.1f} ms "
        f"({total_us / steps / 1e3:.3f} ms a step), {count / steps:.0f} kernels a step"
    )
    for name, us, n in rows[:top]:
        print(f"  {us / steps:8.1f} us/step  {n / steps:6.1f}/step  {us / n:7.2f} us each  {name[:110]}")
    return {
        "decode_steps": steps,
        "gpu_ms_per_step": total_us / steps / 1e3,
        "kernels_per_step": count / steps,
        "top": [
            {"name": name, "us_per_step": us / steps, "calls_per_step": n / steps}
            for name, us, n in rows[:top]
        ],
    }


def time_engine(out: dict, name: str, fn, args: argparse.Namespace):
    """Times `fn` (after one warm-up) into out[name]; returns its last result."""
    seconds, result = timed(fn, args.repeats)
    out[name] = {
        "seconds": seconds,
        "median": statistics.median(seconds),
        "tokens_per_second": args.batch * args.tokens / statistics.median(seconds),
    }
    print(
        f"{name}: {statistics.median(seconds):.3f} s "
        f"({out[name]['tokens_per_second']:.0f} tokens/s) {seconds}",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="profile one more decoder generate, by kernel")
    parser.add_argument("--top", type=int, default=30, help="kernels printed with --profile")
    parser.add_argument("--attention", nargs="+", choices=["kernel", "sdpa"], default=["kernel"])
    parser.add_argument("--no-transformers", action="store_true", help="time the decoder only")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from mortal.workers.rollout.engines.static_decode import Sampling, StaticDecoder

    out: dict = {
        "device": torch.cuda.get_device_name(0),
        "gpus": 1,
        **{k: v for k, v in vars(args).items() if k != "json"},
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = (
            AutoModelForCausalLM.from_pretrained(make_model(Path(tmp) / "m"), dtype=torch.bfloat16)
            .cuda()
            .eval()
        )
    ids, mask = left_padded_prompts(args.batch, real=40, padding=24)

    def hf_generate():
        with torch.no_grad():
            return model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=args.tokens,
                min_new_tokens=args.tokens,
                do_sample=True,
                top_k=0,
                pad_token_id=2,
                cache_implementation="static",
                return_dict_in_generate=True,
                output_scores=True,
            )

    sampling = Sampling(temperature=1.0, top_k=0, top_p=1.0)
    if not args.no_transformers:
        time_engine(out, "transformers_generate_static_compiled", hf_generate, args)
    decoders = {}
    for attention in args.attention:
        os.environ["MORTAL_DECODE_KERNEL"] = "1" if attention == "kernel" else "0"
        torch._dynamo.reset()
        decoder = decoders[attention] = StaticDecoder(model)
        name = "static_decoder" if attention == "kernel" else "static_decoder_sdpa"
        tokens, logprobs = time_engine(
            out,
            name,
            lambda decoder=decoder: decoder.generate(ids, mask, args.tokens, sampling, eos_ids=[2]),
            args,
        )
        out[name]["ms_per_decode_step"] = out[name]["median"] * 1e3 / decoder.last_stats.decode_steps
        ref = forward_logprobs(model, ids, mask, tokens)
        out[name]["logprob_max_abs_diff"] = float((ref - logprobs).abs().max())
        out[name]["logprob_mean_abs_diff"] = float((ref - logprobs).abs().mean())
        print(
            f"{name}: {out[name]['ms_per_decode_step']:.3f} ms a decode step (wall clock, prefill included); "
            f"logprobs vs one forward pass: max |diff| {out[name]['logprob_max_abs_diff']:.4f}, "
            f"mean {out[name]['logprob_mean_abs_diff']:.5f}",
            flush=True,
        )
        if not args.no_transformers:
            out[name]["speedup"] = (
                out["transformers_generate_static_compiled"]["median"] / out[name]["median"]
            )
            print(f"{name} / transformers generate: {out[name]['speedup']:.2f}x")
    if args.profile:  # the first --attention's decoder: its graphs are captured, replays need no compiling
        decoder = decoders[args.attention[0]]
        out["profile"] = {
            "attention": args.attention[0],
            **profile_decoder(
                lambda: decoder.generate(ids, mask, args.tokens, sampling, eos_ids=[2]), decoder, args.top
            ),
        }
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
