"""Ranks of a sharded model started by a test (torch.multiprocessing's spawn imports this module by name):
what rank 0 and the others do when a sharded actor publishes into its ring of weight snapshots."""

from __future__ import annotations

import os
import time
from pathlib import Path

RECEIVED = "received"  # the file the test writes once it has the version, so rank 0 may stop serving it


def publish_into_ring(rank: int, model_dir: str, port: int, out: str) -> None:
    """Load the model sharded over 2 CPU ranks (gloo); rank 0 serves version 0 over sync nccl's protocol
    (gloo between CPU tensors) from its ring, gathering one weight at a time; rank 1 joins the gathers."""
    from mortal.specs.training import ModelSpec
    from mortal.workers import models, nccl_weights, sharded

    os.environ.update(sharded.rank_environment(rank, 2, port))
    ranks = sharded.Ranks(rank, 2, "cpu")
    ranks.join()
    model = models.load_model(ModelSpec.model_validate({"name": model_dir}), "cpu", for_training=True, fsdp_size=2)
    if rank == 0:
        server = nccl_weights.NcclWeightServer(ring=2)
        server.share(sharded.publish_state(model, ring=True), Path(out) / "v0", version=0, step=0,
                     gather=sharded.whole, device=sharded.rank_device("cpu", 0))
        deadline = time.monotonic() + 120
        while not (Path(out) / RECEIVED).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        server.close()
    else:
        sharded.join_publish(model, ring=True)
    ranks.close()
