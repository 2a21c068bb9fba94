"""Split-column attention for one query token per row (flash-decoding), as a Triton kernel on CUDA.

Who uses it: decode_attention.packed_decode_attention, for a decode step on a CUDA GPU with Triton
(`supports` says when). It is a torch custom op (`torch.ops.mortal.decode_attention`, torch.library's
triton_op), so the compiled decode step traces through it and the CUDA graph records its kernels.
Why a kernel of our own: SDPA has no decode kernel for this layout; the prefill kernel it runs tiles more
query positions than a step has and reads every column of the static cache, those no row has reached
included, the largest part of a decode step (bench/decode_attention.py). Here each program takes one
(row, key/value head) pair and a slice of the columns (enough programs to fill the GPU at any row count),
skips the blocks its row cannot see, reads K and V once for the G query heads that share them, and a
second kernel merges the slices' float32 partial results (log-sum-exp).
What it must not do: change results beyond floating-point summation order (float32 models multiply in
IEEE float32, not TF32), or run where `supports` says no.
"""

from __future__ import annotations

import functools
import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton: `supports` is then False everywhere
    triton = None

BLOCK_COLUMNS = 64  # columns a program reads at a time
MAX_GROUPS = 16  # query heads per key/value head one tile holds (tl.dot needs at least 16 rows)
LOG2E = 1.4426950408889634


def supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the kernel runs this call: CUDA tensors, Triton importable, a power-of-two head size
    of 16 to 256, at most MAX_GROUPS query heads per key/value head, a float dtype tl.dot takes,
    unit-stride heads, and MORTAL_DECODE_KERNEL not "0" (SDPA then, as before the kernel: a way out,
    and what benches compare)."""
    dim = query.shape[-1]
    return (
        os.environ.get("MORTAL_DECODE_KERNEL", "1") != "0"
        and triton is not None
        and query.is_cuda
        and key.is_cuda
        and value.is_cuda
        and dim & (dim - 1) == 0
        and 16 <= dim <= 256
        and key.shape[-1] == value.shape[-1] == dim
        and query.shape[-2] <= MAX_GROUPS
        and query.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and key.dtype == value.dtype == query.dtype
        and key.stride(-1) == 1
        and value.stride(-1) == 1
    )


def slices_for(pairs: int, columns: int, processors: int) -> int:
    """Column slices per (row, head) pair: enough programs for two per processor, and never a slice of
    less than one block of columns."""
    wanted = max(1, math.ceil(2 * processors / max(pairs, 1)))
    return max(1, min(wanted, math.ceil(columns / BLOCK_COLUMNS)))


@functools.cache
def _processors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


if triton is not None:

    @triton.jit
    def _slice_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        mask_ptr,
        acc_ptr,
        max_ptr,
        sum_ptr,
        stride_qb,
        stride_qh,
        stride_qg,
        stride_kb,
        stride_kh,
        stride_kl,
        stride_vb,
        stride_vh,
        stride_vl,
        stride_mb,
        stride_ml,
        heads,
        groups,
        columns,
        slice_columns,
        scale_log2,
        slices: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DIM: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        pair = tl.program_id(0)
        part = tl.program_id(1)
        row = pair // heads
        head = pair % heads
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, DIM)
        n = tl.arange(0, BLOCK_N)
        q = tl.load(
            q_ptr + row * stride_qb + head * stride_qh + g[:, None] * stride_qg + d[None, :],
            mask=g[:, None] < groups,
            other=0.0,
        )
        running_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, DIM], tl.float32)
        start = part * slice_columns
        end = tl.minimum(start + slice_columns, columns)
        k_base = k_ptr + row * stride_kb + head * stride_kh
        v_base = v_ptr + row * stride_vb + head * stride_vh
        for block in range(start, end, BLOCK_N):
            cols = block + n
            inside = cols < end
            hidden = tl.load(mask_ptr + row * stride_mb + cols * stride_ml, mask=inside, other=float("-inf"))
            hidden = hidden.to(tl.float32)
            if tl.max(hidden, axis=0) > -1.0e30:  # a block of columns this row cannot see is not read
                k = tl.load(k_base + cols[:, None] * stride_kl + d[None, :], mask=inside[:, None], other=0.0)
                v = tl.load(v_base + cols[:, None] * stride_vl + d[None, :], mask=inside[:, None], other=0.0)
                # (cast: compiled by inductor, scale_log2 may arrive as a float64 constant)
                scores = (tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2).to(tl.float32)
                scores = tl.where(
                    hidden[None, :] > -1.0e30, scores + hidden[None, :] * 1.4426950408889634, float("-inf")
                )
                new_max = tl.maximum(running_max, tl.max(scores, axis=1))
                weights = tl.exp2(scores - new_max[:, None])
                rescale = tl.exp2(running_max - new_max)
                running_sum = running_sum * rescale + tl.sum(weights, axis=1)
                acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
                running_max = new_max
        out = (pair * slices + part) * BLOCK_G + g
        tl.store(acc_ptr + out[:, None] * DIM + d[None, :], acc)
        tl.store(max_ptr + out, running_max)
        tl.store(sum_ptr + out, running_sum)

    @triton.jit
    def _combine_kernel(
        acc_ptr,
        max_ptr,
        sum_ptr,
        out_ptr,
        groups,
        slices: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_S: tl.constexpr,
        DIM: tl.constexpr,
    ):
        pair = tl.program_id(0)
        s = tl.arange(0, BLOCK_S)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, DIM)
        index = (pair * slices + s[:, None]) * BLOCK_G + g[None, :]  # [S, G]
        present = s[:, None] < slices
        maxes = tl.load(max_ptr + index, mask=present, other=float("-inf"))
        sums = tl.load(sum_ptr + index, mask=present, other=0.0)
        overall = tl.max(maxes, axis=0)  # [G]: every row sees at least one column, so finite
        weight = tl.where(maxes == float("-inf"), 0.0, tl.exp2(maxes - overall[None, :]))
        total = tl.sum(sums * weight, axis=0)
        acc = tl.load(
            acc_ptr + index[:, :, None] * DIM + d[None, None, :], mask=present[:, :, None], other=0.0
        )
        # a row that sees no column (an idle row of a captured graph) gets zeros, not 0 / 0
        out = tl.sum(acc * weight[:, :, None], axis=0) / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(
            out_ptr + (pair * groups + g[:, None]) * DIM + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g[:, None] < groups,
        )

    @torch.library.triton_op("mortal::decode_attention", mutates_args=())
    def decode_attention(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """query [B, H_kv, G, D] (the G query heads of each key/value head), key/value [B, H_kv, L, D],
        mask [B, L] additive (0 seen, -inf or the dtype's minimum hidden) -> [B, H_kv, G, D]."""
        from torch.library import wrap_triton

        rows, heads, groups, dim = query.shape
        columns = key.shape[-2]
        pairs = rows * heads
        slices = slices_for(pairs, columns, _processors(query.device.index or 0))
        slice_columns = math.ceil(math.ceil(columns / slices) / BLOCK_COLUMNS) * BLOCK_COLUMNS
        slices = math.ceil(columns / slice_columns)
        block_g = max(16, triton.next_power_of_2(groups))
        acc = torch.empty(pairs * slices * block_g, dim, device=query.device, dtype=torch.float32)
        maxes = torch.empty(pairs * slices * block_g, device=query.device, dtype=torch.float32)
        sums = torch.empty_like(maxes)
        query = query.contiguous() if query.stride(-1) != 1 else query
        precision = "ieee" if query.dtype == torch.float32 else "tf32"
        wrap_triton(_slice_kernel)[(pairs, slices)](
            query,
            key,
            value,
            mask,
            acc,
            maxes,
            sums,
            query.stride(0),
            query.stride(1),
            query.stride(2),
            key.stride(0),
            key.stride(1),
            key.stride(2),
            value.stride(0),
            value.stride(1),
            value.stride(2),
            mask.stride(0),
            mask.stride(1),
            heads,
            groups,
            columns,
            slice_columns,
            scale * LOG2E,
            slices=slices,
            BLOCK_G=block_g,
            BLOCK_N=BLOCK_COLUMNS,
            DIM=dim,
            PRECISION=precision,
            num_warps=4,
            num_stages=2,
        )
        out = torch.empty(rows, heads, groups, dim, device=query.device, dtype=query.dtype)
        wrap_triton(_combine_kernel)[(pairs,)](
            acc,
            maxes,
            sums,
            out,
            groups,
            slices=slices,
            BLOCK_G=block_g,
            BLOCK_S=max(2, triton.next_power_of_2(slices)),
            DIM=dim,
            num_warps=4,
        )
        return out
