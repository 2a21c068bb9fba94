"""Out-of-memory recognition and torch's message parsed into figures (mortal.workers.oom),
and main's exit code."""

from __future__ import annotations

import pytest
import torch

from mortal.workers.oom import (
    BudgetRefusal,
    OutOfMemory,
    out_of_memory,
    parse_torch_message,
    with_device_state,
)
from mortal.workers.simulated import TORCH_OOM_MESSAGE

GiB = 2**30
# torch 2.0's wording (no "of which ... is free" clause order change, "reserved in total")
TORCH_20 = (
    "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.79 GiB total capacity; 6.43 GiB already "
    "allocated; 3.44 MiB free; 6.59 GiB reserved in total by PyTorch)"
)
COLOCATED = (
    "CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
    "512.00 MiB is free. Process 1201 has 40.00 GiB memory in use. Process 1305 has 38.62 GiB memory in "
    "use. Of the allocated memory 36.00 GiB is allocated by PyTorch, and 1.25 GiB is reserved by PyTorch "
    "but unallocated."
)


def test_torch_message_gives_every_figure():
    oom = parse_torch_message(TORCH_OOM_MESSAGE)
    assert oom == OutOfMemory(
        source="torch",
        tried=2 * GiB,
        device=0,
        total=round(79.19 * GiB),
        free=round(1.23 * GiB),
        by_torch=round(70.10 * GiB),
        reserved_unallocated=round(6.50 * GiB),
        processes=(("process 48213", round(77.95 * GiB)),),
    )
    assert oom.describe() == (
        "tried to allocate 2.00 GiB on GPU 0 (total 79.19 GiB, 77.96 GiB in use, 1.23 GiB free, "
        "70.10 GiB allocated by PyTorch, 6.50 GiB reserved by PyTorch but unallocated)"
    )


def test_two_processes_on_one_gpu_are_named():
    oom = parse_torch_message(COLOCATED)
    assert oom.free == 512 * 2**20
    assert oom.processes == (("process 1201", 40 * GiB), ("process 1305", round(38.62 * GiB)))
    assert "in use by process 1201 40.00 GiB, process 1305 38.62 GiB" in oom.describe()


def test_an_older_message_keeps_what_it_can_read():
    oom = parse_torch_message(TORCH_20)
    assert oom.tried == 20 * 2**20
    assert (oom.device, oom.total, oom.free) == (None, None, None)
    assert oom.describe() == "tried to allocate 20.00 MiB"  # in MiB below a GiB, not "0.02 GiB"


@pytest.mark.parametrize(
    "exc, source",
    [
        (torch.cuda.OutOfMemoryError(TORCH_OOM_MESSAGE), "torch"),
        (
            RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
            "cuda",
        ),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), "cuda"),
        (
            RuntimeError(
                "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with NCCL_DEBUG=INFO "
                "for details), NCCL version 2.21.5\nncclUnhandledCudaError: Call to CUDA function "
                "failed.\nLast error:\nFailed to CUDA calloc 6291456 bytes"
            ),
            "nccl",
        ),
    ],
)
def test_out_of_memory_is_recognised_by_type_or_by_cuda_and_nccl_text(exc, source):
    found = out_of_memory(exc)
    assert found is not None and found.source == source


def test_an_out_of_memory_raised_from_inside_another_error_is_found():
    try:
        try:
            raise torch.cuda.OutOfMemoryError(TORCH_OOM_MESSAGE)
        except torch.cuda.OutOfMemoryError as inner:
            raise RuntimeError("generation failed") from inner
    except RuntimeError as outer:
        assert out_of_memory(outer).tried == 2 * GiB


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("CUDA error: device-side assert triggered"),
        ValueError("CUDA out of memory"),  # not an error torch or CUDA raise
        MemoryError(),  # host memory: a different problem
        KeyError("memory"),
    ],
)
def test_other_errors_are_not_out_of_memory(exc):
    assert out_of_memory(exc) is None


class FakeCuda:
    """torch.cuda's memory queries on a GPU that is 70 GiB full, 12 GiB of it this process's allocator's."""

    def __init__(self, initialized: bool = True) -> None:
        self.initialized = initialized

    def is_initialized(self) -> bool:
        return self.initialized

    def current_device(self) -> int:
        return 0

    def mem_get_info(self, device: int) -> tuple[int, int]:
        return 10 * GiB, 80 * GiB

    def memory_allocated(self, device: int) -> int:
        return 12 * GiB

    def memory_reserved(self, device: int) -> int:
        return 13 * GiB


def test_a_cuda_out_of_memory_without_figures_gets_the_devices_state_now(monkeypatch):
    monkeypatch.setattr(torch, "cuda", FakeCuda())
    oom = with_device_state(out_of_memory(RuntimeError("CUDA error: out of memory")))
    assert oom.describe() == (
        "CUDA out of memory on GPU 0 (total 80.00 GiB, 70.00 GiB in use, 10.00 GiB free, "
        "12.00 GiB allocated by PyTorch, 1.00 GiB reserved by PyTorch but unallocated)"
    )


def test_figures_torch_gave_are_kept_and_a_process_without_cuda_is_left_alone(monkeypatch):
    monkeypatch.setattr(torch, "cuda", FakeCuda())
    assert with_device_state(parse_torch_message(TORCH_OOM_MESSAGE)) == parse_torch_message(TORCH_OOM_MESSAGE)
    monkeypatch.setattr(torch, "cuda", FakeCuda(initialized=False))
    bare = out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert with_device_state(bare) == bare


class BudgetTooSmall(torch.OutOfMemoryError, BudgetRefusal):
    """What engines/static_decode.py raises when a rollout's share of the GPU holds no KV cache row."""


def test_a_refusal_by_budget_is_reported_in_its_own_words_with_the_devices_state(monkeypatch):
    """On a large GPU a tiny share can hold the weights and refuse only the cache: torch gave no figures,
    so the report says what did not fit (the refusal's words), then how full the GPU was."""
    words = "the rollout's memory budget (0.01 GiB) holds 0.01 GiB of weights and no room for 2 KV caches"
    monkeypatch.setattr(torch, "cuda", FakeCuda())
    oom = with_device_state(out_of_memory(BudgetTooSmall(words)))
    assert (oom.source, oom.refusal, oom.tried) == ("budget", words, None)
    assert oom.describe() == words + (
        "; GPU 0: total 80.00 GiB, 70.00 GiB in use, 10.00 GiB free, "
        "12.00 GiB allocated by PyTorch, 1.00 GiB reserved by PyTorch but unallocated"
    )
