"""What a new prompt width costs the decoder on one GPU: fixed shapes (the decoder's default) against
torch.compile's automatic dynamic shapes.

    python bench/decode_shapes.py [--widths 64 128 192 256] [--batch 64] [--tokens 256] [--modes fixed auto]
                                  [--json out.json]

Why: every decode shape (rows, prompt width P + max tokens T) is compiled on its own with fixed shapes,
30 s each for SmolLM2 on an H100; a tool loop whose prompts cross a 64-token bucket stalls that long
mid-run (docs/benchmarks.md, the multi-turn bench's step 14). With dynamic=None torch compiles a second
width with symbolic sizes that serves every later one (on the CPU: 2 graphs for 4 widths, against 4;
tests/workers/rollout/engines/test_static_decode.py).
Open questions this answers on a GPU: does the CUDA graph capture
of a dynamic-shape step work, what does each new width cost to prepare, and how fast is a decode step
with symbolic sizes compared with fixed ones.

For each mode (fixed, auto), in a fresh dynamo cache and a fresh StaticDecoder over the same model
(Qwen2.5-0.5B's shape as bench/gpu_step.py makes it, bf16, random init): for each width in turn, the
seconds to prepare the shape (compile and capture), then one generate of --batch rows x --tokens
tokens to warm up and two timed ones (the faster is kept), as ms per decode step; and, at the last width,
the largest difference between the decoder's logprobs and one plain forward over the sampled tokens.
Needs a CUDA GPU and SmolLM2's tokenizer (MORTAL_TEST_ASSETS, as the tests).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from decode_speed import forward_logprobs, left_padded_prompts
from gpu_step import make_model

MODES = {"fixed": False, "auto": None}  # --modes: StaticDecoder's `dynamic` (torch.compile's) for each


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128, 192, 256])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=list(MODES),
        help="fixed: dynamic=False (the decoder's default); auto: dynamic=None",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from mortal.workers.rollout.engines.static_decode import Sampling, StaticDecoder

    out: dict = {
        "device": torch.cuda.get_device_name(0),
        "gpus": 1,
        **{k: v for k, v in vars(args).items() if k != "json"},
        "modes": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = (
            AutoModelForCausalLM.from_pretrained(make_model(Path(tmp) / "m"), dtype=torch.bfloat16)
            .cuda()
            .eval()
        )
    sampling = Sampling(temperature=1.0, top_k=0, top_p=1.0)
    for mode in args.modes:
        torch._dynamo.reset()
        decoder = StaticDecoder(model, dynamic=MODES[mode], kept_shapes=len(args.widths))
        rows = []
        for width in args.widths:
            ids, mask = left_padded_prompts(args.batch, real=width - 8, padding=8)
            torch.cuda.synchronize()
            started = time.perf_counter()
            decoder.prepare(args.batch, width, args.tokens, sampling)
            torch.cuda.synchronize()
            prepared = time.perf_counter() - started
            seconds = []
            # one generate first: a new shape's first call pays one-time work (its prefill's first kernels,
            # lazy allocations) that inflated the first run of this bench (5.8 ms a step at width 64, against
            # 1.46 from decode_speed.py's warmed-up median)
            decoder.generate(ids, mask, args.tokens, sampling, eos_ids=[2])
            for _ in range(2):
                started = time.perf_counter()
                tokens, logprobs = decoder.generate(ids, mask, args.tokens, sampling, eos_ids=[2])
                torch.cuda.synchronize()
                seconds.append(time.perf_counter() - started)
            ms = min(seconds) * 1e3 / decoder.last_stats.decode_steps
            rows.append({"width": width, "prepare_seconds": prepared, "ms_per_decode_step": ms})
            print(
                f"{mode}: width {width}: prepared in {prepared:.1f} s, {ms:.3f} ms a decode step", flush=True
            )
        diff = float((forward_logprobs(model, ids, mask, tokens) - logprobs).abs().max())
        print(
            f"{mode}: decoder logprobs vs one forward pass at width {args.widths[-1]}: max |diff| {diff:.4f}",
            flush=True,
        )
        out["modes"][mode] = {"widths": rows, "logprob_max_abs_diff": diff}
        if args.json:  # after each mode: a call that runs out of time keeps the modes it finished
            args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
