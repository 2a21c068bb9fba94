"""One send of a bf16 tensor between two processes over a two-rank process group, 5 times.

    python bench/nccl_send.py nccl   # 0.8 GB, GPU 0 -> GPU 1
    python bench/nccl_send.py gloo   # 1,000 elements on the CPU: checks the wiring only

The group is built as mortal.workers.sync.nccl builds a pair (a TCPStore, a prefix, the backend's
ProcessGroup made directly); the first send includes NCCL's set-up.
"""

from __future__ import annotations

import datetime
import multiprocessing
import socket
import sys
import time

import torch
import torch.distributed as dist


def side(rank: int, port: int, backend: str) -> None:
    store = dist.PrefixStore(
        "pair/0/",
        dist.TCPStore(
            "127.0.0.1",
            port,
            is_master=rank == 0,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=30),
        ),
    )
    if backend == "nccl":
        torch.cuda.set_device(rank)
        group, device, numel = (
            dist.ProcessGroupNCCL(store, rank, 2, dist.ProcessGroupNCCL.Options()),
            f"cuda:{rank}",
            400_000_000,
        )
    else:
        group, device, numel = dist.ProcessGroupGloo(store, rank, 2), "cpu", 1000
    tensor = torch.full((numel,), float(rank), dtype=torch.bfloat16, device=device)
    for attempt in range(5):
        if backend == "nccl":
            torch.cuda.synchronize()
        started = time.perf_counter()
        (group.send([tensor], 1, 0) if rank == 0 else group.recv([tensor], 0, 0)).wait()
        if backend == "nccl":
            torch.cuda.synchronize()
        print(f"rank {rank} send {attempt}: {(time.perf_counter() - started) * 1000:.2f} ms", flush=True)
    assert tensor[0].item() == 0.0  # the receiver holds the sender's values


def main() -> None:
    backend = sys.argv[1] if len(sys.argv) > 1 else "nccl"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    sides = [context.Process(target=side, args=(rank, port, backend)) for rank in (0, 1)]
    for process in sides:
        process.start()
    for process in sides:
        process.join()
    if any(process.exitcode for process in sides):
        raise SystemExit(f"a side failed: exit codes {[p.exitcode for p in sides]}")


if __name__ == "__main__":
    main()
