"""The rollout decoder's start with the whole model compiled against one graph for every decoder layer.

    python bench/regional_compile.py [--shape 0.5b] [--layers N] [--rows 64] [--prompt 64] [--tokens 256]
                                     [--repeats 2] [--cpu] [--profile] [--json out.json]

Why: a rollout's first decode shape pays torch.compile of the whole model's decode step (34 s for
SmolLM2-135M on an H100, 11 s from a warm cache; docs/benchmarks.md, "Learning on a GPU beside TRL"),
and a relaunched worker pays it again. StaticDecoder's compile_scope "layer" compiles the repeated decoder
layer once for all of them (workers/rollout/engines/static_decode.py, layer_compiled_model and
StackedRowCache say how). Whether it should be the default is a trade: seconds of compilation saved at
the start against any
milliseconds lost per decode step (the embedding, norm and head run unfused; a second shape compiles the
layer with symbolic sizes).

Each scope runs in its own process with an empty inductor cache, through StaticDecoder as the engine uses it:
  1. `prepare` the first shape (rows x (prompt + tokens)): the compile and the CUDA graph capture, timed;
  2. decode it with no end of sequence (every row runs all its tokens) `repeats` times: ms per decode step
     (a generate's seconds over its decode steps, its one prefill included; the slowest repeat after the
     first);
  3. the same for a second shape, the prompt twice as wide (what a worker pays when its prompts' width
     changes).
Printed and recorded for each: seconds to prepare each shape, graphs compiled, ms per decode step of each.
`--profile` (GPU): one more generate of the first shape under torch's profiler, its GPU kernels by name
(bench/decode_speed.py's profile_decoder), to see where one scope's decode step spends what the other's does
not. Model: bench/gpu_step.py's SHAPES (--layers overrides the count), random init, bf16 on a GPU, float32
with --cpu (no CUDA graph there: the step runs as compiled, so the CPU's milliseconds say nothing of a GPU's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCOPES = ("model", "layer")


def compile_without_graph(decoder, cache, step):
    """The CPU's stand-in for StaticDecoder._capture: its warm-up step (which compiles), and no CUDA graph."""
    import torch

    with torch.random.fork_rng():
        cache.reset()
        step()
    return step


def child(args: argparse.Namespace) -> dict:
    import torch
    from gpu_step import SHAPES
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM, Qwen2Config

    from mortal.workers.rollout.engines.static_decode import Sampling, StaticDecoder

    device = "cpu" if args.cpu else "cuda"
    dtype = torch.float32 if args.cpu else torch.bfloat16
    shape = {**SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {})}
    config = Qwen2Config(
        **{"tie_word_embeddings": True, **shape}, vocab_size=49152, max_position_embeddings=4096
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    if args.cpu:
        StaticDecoder._capture = compile_without_graph
    decoder = StaticDecoder(model, compile=True, max_rows=args.rows, compile_scope=args.child)
    sampling = Sampling(temperature=1.0, top_k=0, top_p=1.0)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    measured = []
    for width in (args.prompt, 2 * args.prompt):
        ids = torch.randint(100, 40000, (args.rows, width), device=device)
        mask = torch.ones_like(ids)
        counters.clear()
        started = time.perf_counter()
        decoder.prepare(args.rows, width, args.tokens, sampling)
        sync()
        prepare_seconds = time.perf_counter() - started
        graphs = int(counters["stats"]["unique_graphs"])
        step_ms = []
        for _ in range(args.repeats + 1):
            started = time.perf_counter()
            decoder.generate(ids, mask, args.tokens, sampling, eos_ids=[])
            sync()
            step_ms.append((time.perf_counter() - started) / decoder.last_stats.decode_steps * 1e3)
        measured.append(
            {
                "prompt": width,
                "prepare_seconds": prepare_seconds,
                "graphs": graphs,
                "ms_per_decode_step": max(step_ms[1:]),
                "ms_per_decode_step_each": step_ms,
            }
        )
        if args.profile and device == "cuda" and width == args.prompt:
            from decode_speed import profile_decoder

            measured[-1]["profile"] = profile_decoder(
                lambda ids=ids, mask=mask: decoder.generate(ids, mask, args.tokens, sampling, eos_ids=[]),
                decoder,
                args.top,
            )
    return {
        "scope": args.child,
        "layers": config.num_hidden_layers,
        "shapes": measured,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="0.5b")
    parser.add_argument("--layers", type=int, default=0, help="override the shape's layer count")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--profile", action="store_true", help="GPU: the first shape's kernels, by name")
    parser.add_argument("--top", type=int, default=24, help="kernels printed with --profile")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", choices=SCOPES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    results = []
    for scope in SCOPES:
        with tempfile.TemporaryDirectory() as cache_dir:
            env = {
                **os.environ,
                "TORCHINDUCTOR_CACHE_DIR": cache_dir,
                "TRITON_CACHE_DIR": f"{cache_dir}/triton",
            }
            out = subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], "--child", scope],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
        if out.returncode != 0:
            sys.exit(f"scope {scope} failed:\n{out.stderr[-3000:]}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = results[-1]
        for s in r["shapes"]:
            print(
                f"{scope:6s} {r['layers']} layers, prompt {s['prompt']}: "
                f"prepared in {s['prepare_seconds']:.1f} s "
                f"({s['graphs']} graph(s)), {s['ms_per_decode_step']:.2f} ms a decode step"
            )
            if "profile" in s:
                p = s["profile"]
                print(
                    f"  profile: {p['gpu_ms_per_step']:.3f} ms of GPU kernels a step, "
                    f"{p['kernels_per_step']:.0f} kernels"
                )
                for k in p["top"]:
                    print(
                        f"    {k['us_per_step']:8.1f} us/step {k['calls_per_step']:6.1f}/step  "
                        f"{k['name'][:100]}"
                    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: v for k, v in vars(args).items() if k not in ("json", "child")},
                    "device": results[0]["device"],
                    "gpus": 0 if args.cpu else 1,
                    "results": results,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
