"""Ranks of a sharded model started by a test (torch.multiprocessing's spawn imports this module by name):
what rank 0 and the others do when a sharded actor publishes into its ring of weight snapshots."""

from __future__ import annotations

import os
import time
from pathlib import Path

RECEIVED = "received"  # the file the test writes once it has the version, so rank 0 may stop serving it


def publish_into_ring(rank: int, model_dir: str, port: int, out: str) -> None:
    """Load the model sharded over 2 CPU ranks (gloo); rank 0 serves version 0 over sync nccl's protocol (gloo
    between CPU tensors) from its ring, gathering a bucket of weights at a time; rank 1 joins the gathers."""
    from mortal.specs.training import ModelSpec
    from mortal.workers import models
    from mortal.workers.actor import sharded
    from mortal.workers.sync import nccl as nccl_weights

    os.environ.update(sharded.rank_environment(rank, 2, port))
    ranks = sharded.Ranks(rank, 2, "cpu")
    ranks.join()
    model = models.load_model(
        ModelSpec.model_validate({"name": model_dir}), "cpu", for_training=True, fsdp_size=2
    )
    if rank == 0:
        server = nccl_weights.NcclWeightServer(ring=2)
        server.share(
            sharded.publish_state(model, ring=True),
            Path(out) / "v0",
            version=0,
            step=0,
            gather=sharded.wholes,
            device=sharded.rank_device("cpu", 0),
        )
        deadline = time.monotonic() + 120
        while not (Path(out) / RECEIVED).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        server.close()
    else:
        sharded.join_publish(model, ring=True)
    ranks.close()


# The weights `gather_in_buckets` shards: rows that do not split evenly over 2 ranks (rank 1 gets fewer, or
# none), a dtype change that ends a bucket, one tensor larger than a bucket, a DTensor replicated rather than
# sharded and a plain tensor (each passed on as it is, between buckets).
GATHERED_SHAPES = [
    ("a", (5, 3), "float32"),
    ("b", (7,), "float32"),
    ("c", (1, 4), "float32"),
    ("d", (3, 2), "bfloat16"),
    ("e", (4, 2), "bfloat16"),
    ("big", (40, 4), "float32"),
    ("f", (2, 2), "float32"),
    ("replicated", (3, 3), "float32"),
    ("plain", (2,), "float32"),
    ("g", (6, 1), "float32"),
]
GATHER_BUCKET_BYTES = 64  # 16 float32 or 32 bfloat16 elements of a rank's shards


def expected_weights() -> dict:
    import torch

    generator = torch.Generator().manual_seed(0)
    return {
        name: torch.randn(shape, generator=generator).to(getattr(torch, dtype))
        for name, shape, dtype in GATHERED_SHAPES
    }


def gather_in_buckets(rank: int, port: int, out: str) -> None:
    """Shard expected_weights() over 2 CPU ranks (gloo) as FSDP2 does (by rows), make them whole with
    sharded.wholes, as they are and cast to bfloat16 (a mixedPrecision actor's publish), and write, from
    rank 0, the whole tensors and how many all-gathers each took."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from mortal.workers.actor import sharded

    os.environ.update(sharded.rank_environment(rank, 2, port))
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    weights = expected_weights()
    shards = [
        weights["plain"]
        if name == "plain"
        else distribute_tensor(weights[name], mesh, [Replicate() if name == "replicated" else Shard(0)])
        for name, _, _ in GATHERED_SHAPES
    ]
    gathers = 0
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    real = getattr(dist, name)

    def counted(*args, **kwargs):
        nonlocal gathers
        gathers += 1
        return real(*args, **kwargs)

    setattr(dist, name, counted)
    names = [name for name, _, _ in GATHERED_SHAPES]
    result = {}
    for key, dtype in (("whole", None), ("bfloat16", torch.bfloat16)):
        gathers = 0
        whole = [t.clone() for t in sharded.wholes(shards, dtype, bucket_bytes=GATHER_BUCKET_BYTES)]
        result[key], result[f"{key} gathers"] = dict(zip(names, whole, strict=True)), gathers
    if rank == 0:
        torch.save(result, Path(out) / "wholes.pt")
    dist.destroy_process_group()


def tied_weight_step(rank: int, model_dir: str, port: int, out: str) -> None:
    """Load the model sharded over 2 CPU ranks (gloo) as the actor does, and write from rank 0 what FSDP2
    manages (how many parameters, in how many groups), how many all-gathers one forward and backward make,
    the loss and the embedding's whole gradient of that step on a fixed batch, and then what place_shards
    made of the parameters (their specs, devices, the tie)."""
    import torch

    from mortal.specs.training import ModelSpec
    from mortal.workers import models
    from mortal.workers.actor import sharded

    os.environ.update(sharded.rank_environment(rank, 2, port))
    ranks = sharded.Ranks(rank, 2, "cpu")
    ranks.join()
    model = models.load_model(
        ModelSpec.model_validate({"name": model_dir}), "cpu", for_training=True, fsdp_size=2
    )
    groups = [group for state in models.fsdp_states(model) for group in models._param_groups(state)]
    batch = torch.tensor(TIED_BATCH)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
    gathers = sum(1 for event in profile.events() if event.name == "fsdp::all_gather_copy_in")
    gradient = model.get_input_embeddings().weight.grad.full_tensor()
    before = {
        name: (param.placements, param.shape, param.requires_grad) for name, param in model.named_parameters()
    }
    models.place_shards(model, "meta")  # as cpuOffload places them on "cpu" (no CPU run has them elsewhere)
    placed = {
        name: (param.placements, param.shape, param.requires_grad) for name, param in model.named_parameters()
    }
    if rank == 0:
        torch.save(
            {
                "fsdp_params": sum(len(group.fsdp_params) for group in groups),
                "groups": len(groups),
                "parameters": len(list(model.parameters())),
                "gathers": gathers,
                "loss": loss.detach(),
                "embedding_grad": gradient,
                "placed_same_spec": placed == before,
                "placed_devices": sorted(
                    {param.to_local().device.type for param in model.parameters()}
                    | {param.device.type for param in model.parameters()}
                ),
                "placed_still_tied": model.get_output_embeddings().weight
                is model.get_input_embeddings().weight,
            },
            Path(out) / "tied.pt",
        )
    ranks.close()


TIED_BATCH = [[1, 5, 9, 13, 17, 21, 25, 29], [2, 4, 8, 16, 32, 64, 128, 256]]  # token ids of one step
