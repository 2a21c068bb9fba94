"""One decode step's attention alone, on one GPU: the ways the decoder could compute it, each compiled and
replayed as a CUDA graph, in microseconds a call.

    python bench/decode_attention.py [--rows 64 256] [--columns 320] [--json out.json]

Why: after the fused projections, attention is the largest part of a decode step at the 0.5B shape
(bench/decode_speed.py --profile: 11.4 us a layer, cuDNN's flash kernel, whose 64 x 128 tile holds
7 query rows). Qwen2.5-0.5B's heads (14 query, 2 key/value, dim 64), bf16, a [rows, 1, 1, columns]
additive mask hiding a random half of each row's columns, as the decoder's static cache has. Each
variant's output is compared with the packed SDPA's (the decoder's today), as the max absolute
difference. Variants:
  sdpa_packed       the decoder's: G query heads as G query positions of their key/value head, SDPA's
                    own choice of kernel (cuDNN on an H100)
  sdpa_packed_efficient / sdpa_packed_flash...: the same, one SDPA backend forced
  flex_gqa          torch's flex_attention (its decoding kernel for short queries), the mask read in score_mod
  math              matmul, masked softmax, matmul, left to inductor
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--columns", type=int, default=320)
    parser.add_argument("--replays", type=int, default=500)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    heads, kv_heads, dim = 14, 2, 64
    groups = heads // kv_heads
    out: dict = {"device": torch.cuda.get_device_name(0), "gpus": 1, "columns": args.columns, "results": {}}

    def packed(q, k, v, mask):
        b = q.shape[0]
        o = F.scaled_dot_product_attention(q.reshape(b, kv_heads, groups, dim), k, v, attn_mask=mask)
        return o.reshape(b, heads, 1, dim)

    def forced(backend):
        def run(q, k, v, mask):
            with sdpa_kernel([backend]):
                return packed(q, k, v, mask)

        return run

    def flex(q, k, v, mask):
        additive = mask[:, 0, 0, :]

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + additive[b, kv_idx]

        return flex_attention(q, k, v, score_mod=score_mod, enable_gqa=True)

    def math(q, k, v, mask):
        b = q.shape[0]
        scores = q.reshape(b, kv_heads, groups, dim) @ k.transpose(-1, -2) * dim**-0.5 + mask
        o = scores.float().softmax(-1).to(q.dtype) @ v
        return o.reshape(b, heads, 1, dim)

    variants = {
        "sdpa_packed": packed,
        "sdpa_packed_efficient": forced(SDPBackend.EFFICIENT_ATTENTION),
        "sdpa_packed_cudnn": forced(SDPBackend.CUDNN_ATTENTION),
        "flex_gqa": flex,
        "math": math,
    }
    for rows in args.rows:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(rows, heads, 1, dim, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (
            torch.randn(rows, kv_heads, args.columns, dim, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2)
        )
        hidden = torch.rand(rows, 1, 1, args.columns, device="cuda", generator=g) < 0.5
        hidden[..., -1] = False
        mask = torch.zeros(rows, 1, 1, args.columns, device="cuda", dtype=torch.bfloat16).masked_fill(
            hidden, torch.finfo(torch.bfloat16).min
        )
        reference = None
        for name, fn in variants.items():
            try:
                micros, result = _time(torch, torch.compile(fn, dynamic=False), (q, k, v, mask), args.replays)
            except Exception as exc:  # a backend that does not take these inputs: say so, go on
                print(f"rows {rows} {name}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                out["results"][f"{rows}/{name}"] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                continue
            reference = result if reference is None else reference
            diff = float((result.float() - reference.float()).abs().max())
            print(
                f"rows {rows} {name}: {micros:.2f} us a call, max |diff| vs sdpa_packed {diff:.4f}",
                flush=True,
            )
            out["results"][f"{rows}/{name}"] = {"us": micros, "max_abs_diff": diff}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


def _time(torch, fn, inputs, replays: int) -> tuple[float, object]:
    """Microseconds a call of `fn`, replayed as a CUDA graph of 20 calls (so launch costs are left out,
    as in the decoder's graph)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            result = fn(*inputs)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays // 20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays // 20 * 20), result


if __name__ == "__main__":
    main()
