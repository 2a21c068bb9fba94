"""What compiling one decoder layer instead of the whole model would save the rollout's start: a probe.

    python bench/regional_compile.py [--shape 0.5b] [--layers N] [--rows 64] [--prompt 64] [--tokens 256]
                                     [--steps 32] [--cpu] [--json out.json]

Why: a rollout's first decode shape pays torch.compile of the whole model's decode step (34 s for
SmolLM2-135M on an H100, 11 s from a warm cache; docs/benchmarks.md, "Learning on a GPU beside TRL"),
and a relaunched worker pays it again. Compiling the repeated decoder layer once and reusing it for every
layer ("regional compilation") compiles one layer's graph instead of N. It does not work as the decoder
stands: transformers' StaticCache.update indexes its per-layer list with the attention module's
`layer_idx`, so dynamo guards on that int and compiles every layer anew (TORCH_LOGS=recompiles:
`self._modules['self_attn'].layer_idx == 0`). Here the cache keeps all layers' K/V in one tensor indexed
by that int, and the int is left unspecialised (torch._dynamo.config.allow_unspec_int_on_nn_module,
dynamic=None), so layer 0 compiles once with it fixed and one more graph serves every other layer.

Each variant runs in its own process with an empty inductor cache: `full` (torch.compile of the model,
dynamic=False, as StaticDecoder does) and `regional`. Printed for each: the first forward's seconds (the
compile), graphs compiled, milliseconds per decode forward after it (no CUDA graph: the regional variant's
eager embedding, norm and head count against it here, though a captured step would replay them as
kernels), and the largest difference of its logits from the eager model's on the same step.
Model: bench/gpu_step.py's SHAPES, random init (bf16 on a GPU, float32 with --cpu), with the decoder's
packed attention and fused projections installed. This measures the idea; StaticDecoder does not use it.
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

VARIANTS = ("full", "regional")


def stacked_cache_class():
    """A RowCache whose layers' K/V are views of one [layers, rows, heads, columns, dim] tensor each, written
    and read through the layer index as a tensor index (no per-layer Python object for dynamo to guard on)."""
    import torch

    from mortal.workers.engines.static_decode import RowCache

    class StackedRowCache(RowCache):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.all_keys = torch.stack([layer.keys for layer in self.layers])
            self.all_values = torch.stack([layer.values for layer in self.layers])
            for index, layer in enumerate(self.layers):
                layer.keys, layer.values = self.all_keys[index], self.all_values[index]

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            keys, values = self.all_keys[layer_idx], self.all_values[layer_idx]
            keys[self.writes.every_row, :, self.writes.columns] = key_states[:, :, 0]
            values[self.writes.every_row, :, self.writes.columns] = value_states[:, :, 0]
            return keys, values

    return StackedRowCache


def child(args: argparse.Namespace) -> dict:
    import torch
    from gpu_step import SHAPES
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM, Qwen2Config

    from mortal.workers.engines import decode_attention, fused_projections
    from mortal.workers.engines.static_decode import RowCache, RowWrites

    device = "cpu" if args.cpu else "cuda"
    dtype = torch.float32 if args.cpu else torch.bfloat16
    shape = {**SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {})}
    config = Qwen2Config(**{"tie_word_embeddings": True, **shape}, vocab_size=49152, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    decode_attention.install(model)
    fused_projections.fuse(model)
    length = args.prompt + args.tokens
    columns = torch.full((args.rows,), args.prompt, dtype=torch.long, device=device)
    cache_class = stacked_cache_class() if args.child == "regional" else RowCache
    cache = cache_class(model, args.rows, length, RowWrites(columns))
    for layer in cache.layers:  # a filled prompt: attention reads something
        layer.keys.normal_()
        layer.values.normal_()
    inputs = dict(input_ids=torch.randint(0, 49152, (args.rows, 1), device=device),
                  position_ids=torch.full((args.rows, 1), args.prompt, device=device),
                  attention_mask=torch.zeros(args.rows, 1, 1, length, dtype=dtype, device=device),
                  past_key_values=cache, use_cache=True)
    inputs["attention_mask"][..., args.prompt + 1:] = float("-inf")

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    with torch.no_grad():
        eager = model(**inputs).logits.float()
        if args.child == "full":
            forward = torch.compile(model, dynamic=False)
        else:
            torch._dynamo.config.allow_unspec_int_on_nn_module = True
            for layer in model.model.layers:
                layer.compile(dynamic=None)
            forward = model
        counters.clear()
        started = time.perf_counter()
        logits = forward(**inputs).logits.float()
        sync()
        compile_seconds = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(args.steps):
            forward(**inputs)
        sync()
        per_forward = (time.perf_counter() - started) / args.steps
    return {"variant": args.child, "layers": config.num_hidden_layers, "compile_seconds": compile_seconds,
            "graphs": int(counters["stats"]["unique_graphs"]), "ms_per_forward": per_forward * 1e3,
            "max_logit_diff_vs_eager": float((logits - eager).abs().max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="0.5b")
    parser.add_argument("--layers", type=int, default=0, help="override the shape's layer count")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    results = []
    for variant in VARIANTS:
        with tempfile.TemporaryDirectory() as cache_dir:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "TRITON_CACHE_DIR": f"{cache_dir}/triton"}
            out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", variant], env=env,
                                 capture_output=True, text=True, check=False)
        if out.returncode != 0:
            sys.exit(f"{variant} failed:\n{out.stderr[-3000:]}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = results[-1]
        print(f"{variant:9s} {r['layers']} layers: compile {r['compile_seconds']:.1f} s, {r['graphs']} graph(s), "
              f"{r['ms_per_forward']:.2f} ms a forward, logits within {r['max_logit_diff_vs_eager']:.2e} of eager")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("json", "child")},
                                         "results": results}, indent=2))


if __name__ == "__main__":
    main()
