"""Out of GPU memory: recognise it in a worker's exception, and read torch's figures out of its message.

Who calls it: mortal.workers.main, when a workload raised; tests call the pure functions directly.
An out-of-memory is not a transient crash: the same spec on the same GPU allocates the same tensors,
so the worker reports it as such (exit EXIT_OUT_OF_MEMORY, message "OutOfMemory: <figures>") and the
controller diagnoses it (condition MemoryFits, at most one relaunch) instead of relaunching in a loop.

What counts (the exception or anything in its __cause__/__context__ chain):
  - torch.cuda.OutOfMemoryError (and torch.OutOfMemoryError), recognised by type when torch is loaded;
  - a RuntimeError/AcceleratorError of CUDA's own "CUDA error: out of memory" (a kernel launch or a
    cuBLAS/cuDNN workspace that could not allocate: CUBLAS_STATUS_ALLOC_FAILED);
  - NCCL's "Failed to CUDA calloc" / "out of memory" inside an NCCL error (its buffers on the GPU);
  - mortal's own refusal before allocating (`BudgetRefusal`: a rollout's share of the GPU that cannot hold
    one row's KV cache beside its weights), whose words are kept: they say what did not fit, which torch's
    figures cannot (on a large GPU a tiny share may hold the weights and refuse only the cache).
torch gives no structured figures, only text: the parse happens here, once, at the boundary, into
`OutOfMemory`; nothing downstream matches strings. What it must not do: import torch.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, replace

REASON = "OutOfMemory"
_SIZE = r"([\d.]+)\s*(B|KiB|MiB|GiB|TiB|bytes)"
_UNITS = {"B": 1, "bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
# torch >= 2.1 (c10/cuda/CUDACachingAllocator.cpp): "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has
# a total capacity of 79.19 GiB of which 1.23 GiB is free. Process 1234 has 77.9 GiB memory in use. Of the
# allocated memory 70.10 GiB is allocated by PyTorch, and 6.50 GiB is reserved by PyTorch but unallocated.
# ..."
_TRIED = re.compile(r"Tried to allocate " + _SIZE)
_GPU = re.compile(r"GPU (\d+) has a total capacity of " + _SIZE + r" of which " + _SIZE + r" is free")
_BY_TORCH = re.compile(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch")
_RESERVED = re.compile(_SIZE + r" is reserved by PyTorch but unallocated")
_PROCESS = re.compile(r"Process (\d+) has " + _SIZE + r" memory in use")
_THIS_PROCESS = re.compile(r"this process has " + _SIZE + r" memory in use")
_CUDA_TEXT = re.compile(
    r"CUDA (error: )?out of memory|CUBLAS_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation", re.IGNORECASE
)
_NCCL_TEXT = re.compile(
    r"NCCL.*(Failed to CUDA calloc|out of memory)|(Failed to CUDA calloc|out of memory).*NCCL",
    re.IGNORECASE | re.DOTALL,
)


class BudgetRefusal(Exception):
    """A mixin for an out-of-memory mortal raises itself, before allocating: its message says what did not fit
    in which budget. Here, without torch, so that this module can recognise it without importing torch; the
    raising class also derives from torch.OutOfMemoryError (mortal.workers.rollout.engines.static_decode's
    MemoryBudgetTooSmall)."""


@dataclass(frozen=True)
class OutOfMemory:
    """What ran out: the figures torch printed (None where its message did not say), in bytes."""

    # "torch" (the caching allocator), "cuda" (a CUDA/cuBLAS call), "nccl" or "budget" (BudgetRefusal)
    source: str
    tried: int | None = None  # the allocation that failed
    device: int | None = None  # the GPU index as the worker saw it (after CUDA_VISIBLE_DEVICES)
    total: int | None = None  # the GPU's capacity
    free: int | None = None
    by_torch: int | None = None  # allocated by PyTorch in this process
    reserved_unallocated: int | None = None  # cached by PyTorch's allocator but not in use (fragmentation)
    processes: tuple[tuple[str, int], ...] = ()  # (pid or "this process", bytes in use) as torch listed them
    refusal: str | None = None  # a BudgetRefusal's own words (source "budget")

    def describe(self) -> str:
        """One line for the worker's report: what it tried, on which GPU, how full the GPU was."""
        what = {
            "torch": "out of GPU memory",
            "cuda": "CUDA out of memory",
            "nccl": "NCCL could not allocate GPU memory",
            "budget": self.refusal,
        }[self.source]
        parts = [f"tried to allocate {readable_size(self.tried)}" if self.tried is not None else what]
        gpu = "the GPU" if self.device is None else f"GPU {self.device}"
        figures = []
        if self.total is not None:
            figures.append(f"total {readable_size(self.total)}")
        if self.total is not None and self.free is not None:
            figures.append(f"{readable_size(self.total - self.free)} in use")
        if self.free is not None:
            figures.append(f"{readable_size(self.free)} free")
        if self.by_torch is not None:
            figures.append(f"{readable_size(self.by_torch)} allocated by PyTorch")
        if self.reserved_unallocated is not None:
            figures.append(f"{readable_size(self.reserved_unallocated)} reserved by PyTorch but unallocated")
        # one process is this one; more say who shares the GPU (colocated workers)
        if len(self.processes) > 1:
            figures.append("in use by " + ", ".join(f"{who} {readable_size(n)}" for who, n in self.processes))
        if self.source == "budget":  # the refusal is a sentence of its own; the GPU's state follows it
            return "; ".join(parts + ([f"{gpu}: {', '.join(figures)}"] if figures else []))
        if figures or self.device is not None:
            parts.append(f"on {gpu}" + (f" ({', '.join(figures)})" if figures else ""))
        return " ".join(parts)


def readable_size(n: int) -> str:
    """In torch's own units: GiB from 1 GiB up, MiB below (a capped rollout fails on megabytes)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def with_device_state(oom: OutOfMemory) -> OutOfMemory:
    """`oom`, its missing GPU figures read from the device now, in this process. CUDA's and cuBLAS's own
    out-of-memory errors ("CUDA error: out of memory") carry no figures, and the actor's step ran out so
    at 3B: the report said only "CUDA out of memory". Read as the worker reports, while the exception (and
    its frames' tensors) is still held, so close to what the device held when it failed. Left as it is where
    torch is not loaded, CUDA never started in this process, or the query itself fails."""
    torch = sys.modules.get("torch")
    if oom.total is not None or torch is None or not torch.cuda.is_initialized():
        return oom
    try:
        device = torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(device)
        allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    except RuntimeError:  # a CUDA context the error broke
        return oom
    return replace(
        oom,
        device=device,
        total=total,
        free=free,
        by_torch=allocated,
        reserved_unallocated=reserved - allocated,
    )


def _bytes(number: str, unit: str) -> int:
    return round(float(number) * _UNITS[unit])


def parse_torch_message(text: str, source: str = "torch") -> OutOfMemory:
    """The figures in torch's out-of-memory message; fields it lacks stay None (older torch, other text)."""
    tried, gpu, by_torch, reserved = (
        _TRIED.search(text),
        _GPU.search(text),
        _BY_TORCH.search(text),
        _RESERVED.search(text),
    )
    return OutOfMemory(
        source=source,
        tried=_bytes(*tried.groups()) if tried else None,
        device=int(gpu.group(1)) if gpu else None,
        total=_bytes(gpu.group(2), gpu.group(3)) if gpu else None,
        free=_bytes(gpu.group(4), gpu.group(5)) if gpu else None,
        by_torch=_bytes(*by_torch.groups()) if by_torch else None,
        reserved_unallocated=_bytes(*reserved.groups()) if reserved else None,
        processes=tuple(
            [(f"process {pid}", _bytes(n, u)) for pid, n, u in _PROCESS.findall(text)]
            + [("this process", _bytes(n, u)) for n, u in _THIS_PROCESS.findall(text)]
        ),
    )


def out_of_memory(exc: BaseException) -> OutOfMemory | None:
    """The out-of-memory this exception (or one it was raised from) reports; None if it is another error."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        found = _classify(current)
        if found is not None:
            return found
        current = current.__cause__ or current.__context__
    return None


def _classify(exc: BaseException) -> OutOfMemory | None:
    text = str(exc)
    if isinstance(exc, BudgetRefusal):
        return OutOfMemory(source="budget", refusal=text)
    if _is_torch_oom(exc):
        return parse_torch_message(text)
    # torch.AcceleratorError and NCCL's DistBackendError are RuntimeErrors
    if not isinstance(exc, RuntimeError):
        return None
    if "NCCL" in text and _NCCL_TEXT.search(text):
        return parse_torch_message(text, source="nccl")
    if _CUDA_TEXT.search(text):
        return parse_torch_message(text, source="cuda")
    return None


def _is_torch_oom(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")  # a worker that never loaded torch cannot have hit its allocator
    if torch is None:
        return False
    kinds = tuple(
        k
        for k in (
            getattr(torch, "OutOfMemoryError", None),
            getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None),
        )
        if isinstance(k, type)
    )
    return bool(kinds) and isinstance(exc, kinds)
