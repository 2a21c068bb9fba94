"""The actor's ranks: one actor worker trains over `spec.actor.count` processes of one host (FSDP2 or DDP).

Who calls it: mortal.workers.actor.loop (rank 0, the worker process a backend launched) and
mortal.workers.actor.follower (ranks 1..N-1). `start` spawns ranks 1..N-1 as rank 0's children, each
running the follower's entry that rank 0 hands it; every rank builds the same GRPOTrainer on the same model,
sharded by transformers at load (docs/fsdp.md says why that route), trains on its slice of each batch and
joins rank 0's collectives when rank 0 says so over the `Channel` (batch, checkpoint, go or stop). Rank 0
publishes: for a ring (ipc, nccl) the shards are made whole a bucket at a time (`wholes`, every rank
joining each all-gather); for files (volume, ray) torch gathers one tensor at a time to rank 0's CPU.
If a rank dies, rank 0's watcher reports it and the worker exits retryably, so the controller relaunches
the whole actor; a rank whose rank 0 is gone exits at once.
What it must not do: let a rank other than 0 talk to the store, or decide when to publish or checkpoint
(rank 0's loop decides and tells the others).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mortal.workers import models
from mortal.workers.actor.checkpoint import DCP_DIR, is_sharded, read_marker
from mortal.workers.oom import REASON as OUT_OF_MEMORY
from mortal.workers.oom import out_of_memory, with_device_state
from mortal.workers.runtime import EXIT_OUT_OF_MEMORY, EXIT_RETRYABLE
from mortal.workers.sync.ring import kept_dtype
from mortal.workers.sync.weights import tied_once

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.multiprocessing import ProcessContext
    from transformers import PretrainedConfig, TrainingArguments
    from trl import GRPOTrainer

    from mortal.specs.run import TrainingRun
    from mortal.specs.training import TrainingSpec

log = logging.getLogger("mortal.sharded")
# what ranks 1..N-1 run once they joined (the follower's loop)
Follow = Callable[["TrainingRun", "Ranks"], None]
WATCH_SECONDS = 0.2
# Trainer leaves a model that transformers sharded at load to itself (is_distributed_loading_by_transformers)
# since 5.19; before, accelerate wraps it in DistributedDataParallel on GPUs, which fails on DTensor
# parameters ("mixed torch.Tensor and DTensor", docs/fsdp.md's pre-sharded mode). Checked against 5.17/5.18's
# trainer.py.
MIN_TRANSFORMERS = "5.19.0"


class RankLost(RuntimeError):
    """A rank of the actor ended while the others trained (a collective would wait for it forever): the
    worker exits with `exit_code` and `report` as its message (mortal.workers.actor.loop)."""

    exit_code = EXIT_RETRYABLE  # the controller relaunches the actor, which resumes

    def report(self) -> str:
        return f"{type(self).__name__}: {self}"


class RankOutOfMemory(RankLost):
    """A rank of the actor ran out of GPU memory: the worker reports it as its own out-of-memory, so the
    controller diagnoses it (MemoryFits, one relaunch) rather than relaunching a crash ten times."""

    exit_code = EXIT_OUT_OF_MEMORY

    def __init__(self, rank: int, world: int, details: str) -> None:
        super().__init__(f"actor rank {rank} of {world}: {details}")

    def report(self) -> str:
        return f"{OUT_OF_MEMORY}: {self}"  # as mortal.workers.main reports a worker's own


class ShardedError(RuntimeError):
    """The ranks disagree about what comes next (a message of the wrong kind): a bug, never retried
    silently."""


def unsupported() -> str | None:
    """Why this process cannot run a sharded actor (None when it can): a transformers too old to leave a model
    sharded at load to itself."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        return (
            f"an actor of several ranks needs transformers >= {MIN_TRANSFORMERS} (its Trainer then trains a "
            "model sharded at load as it is; older ones wrap it in DistributedDataParallel, which fails on "
            f"its sharded parameters); this worker has {transformers.__version__}: upgrade it, or use "
            "actor.count 1"
        )
    return None


def backend_for(device: str) -> str:
    return "gloo" if device == "cpu" else "cuda:nccl,cpu:gloo"


def rank_device(device: str, rank: int) -> torch.device:
    """The device rank `rank` trains on: the CPU, or the rank-th GPU of those the worker sees."""
    if device == "cpu":
        return torch.device("cpu")
    if rank >= torch.cuda.device_count():
        raise ShardedError(
            f"actor rank {rank} has no GPU: this worker sees {torch.cuda.device_count()} "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}), one a rank is needed"
        )
    return torch.device("cuda", rank)


def free_port() -> int:
    """A TCP port free on loopback now, for a rendezvous of processes of this host (the ranks', TRL's in the
    bench)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_environment(rank: int, world: int, port: int) -> dict[str, str]:
    """What torch.distributed, accelerate and transformers read to find their rank and the rendezvous."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
    }


def threads_per_rank(world: int) -> int:
    """A CPU actor's cores split between its ranks (MORTAL_THREADS is the whole actor's,
    runtime.cpu_threads)."""
    total = int(os.environ.get("MORTAL_THREADS") or os.cpu_count() or 1)
    return max(1, total // world)


@dataclass
class Ranks:
    """This process's place among the actor's ranks, and (on rank 0) the children it started."""

    rank: int
    world: int
    device: str
    # where a rank leaves what ended it (rank_notes): read by rank 0, written by the others
    notes: Path | None = None
    collective_seconds: float | None = None  # spec.deadlines.collectiveSeconds when set; else torch's default
    channel: Channel = field(init=False)
    _children: ProcessContext | None = None
    _closed: threading.Event = field(default_factory=threading.Event)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def join(self) -> None:
        """Join the process group (every rank, in the same order) and make the message channel. On GPUs rank
        r binds the r-th GPU the worker sees (the backend gave the actor one per rank, CUDA_VISIBLE_DEVICES),
        before the group exists, so NCCL's communicator is made for that device and no other."""
        import torch.distributed as dist

        torch.set_num_threads(threads_per_rank(self.world))
        device_id = rank_device(self.device, self.rank)
        if device_id.type == "cuda":
            torch.cuda.set_device(device_id)
        # A collective past its timeout raises in the rank, which fails the actor: it is relaunched from its
        # checkpoint. Unset, torch's default: a rank waits in the channel while rank 0 waits for rollouts.
        timeout = (
            {} if self.collective_seconds is None else {"timeout": timedelta(seconds=self.collective_seconds)}
        )
        dist.init_process_group(
            backend_for(self.device),
            rank=self.rank,
            world_size=self.world,
            device_id=device_id if device_id.type == "cuda" else None,
            **timeout,
        )
        self.channel = Channel(dist.new_group(backend="gloo", **timeout), self.rank, self.world)

    def watch(self, on_lost: Callable[[RankLost], None]) -> None:
        """Rank 0: call `on_lost` (from a daemon thread) as soon as a child rank has failed or been killed."""

        def loop() -> None:
            while not self._closed.wait(WATCH_SECONDS):
                for index, proc in enumerate(self._children.processes):
                    # 0 is a rank that finished training as rank 0 said: only rank 0's own end follows it
                    if proc.exitcode not in (None, 0) and not self._closed.is_set():
                        on_lost(self.ended(index + 1, proc.exitcode))
                        return

        threading.Thread(target=loop, name="mortal-rank-watch", daemon=True).start()

    def lost(self, wait: float = 2.0) -> RankLost | None:
        """Rank 0, after a collective failed: the child rank that ended under it, if one did (waiting up
        to `wait` s for a dying one's exit to be seen); None when they all still run."""
        deadline = time.monotonic() + wait
        for index, proc in enumerate(self._children.processes):
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode not in (None, 0):
                return self.ended(index + 1, proc.exitcode)
        return None

    def ended(self, rank: int, code: int) -> RankLost:
        """What ended child rank `rank` with exit `code`: its out-of-memory with the figures it left, else a
        loss that names the rank's error when it left one (a killed rank leaves none)."""
        if self.notes is not None:
            memory, error = rank_note(self.notes, rank), rank_error_note(self.notes, rank)
            if code == EXIT_OUT_OF_MEMORY and memory.exists():
                return RankOutOfMemory(rank, self.world, memory.read_text())
            if error.exists():
                return RankLost(f"actor rank {rank} of {self.world} failed: {error.read_text()}")
        return RankLost(f"actor rank {rank} of {self.world} ended with exit code {code}")

    def close(self, timeout: float = 60.0) -> None:
        """Leave the group; rank 0 waits for its children to end (they end after the last collective)."""
        import torch.distributed as dist

        self._closed.set()
        if self._children is not None:
            deadline = time.monotonic() + timeout
            for proc in self._children.processes:
                proc.join(max(0.0, deadline - time.monotonic()))
                if proc.exitcode is None:
                    log.warning(
                        "actor rank (pid %d) still running after %.0f s: killing it", proc.pid, timeout
                    )
                    proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_notes(run_name: str) -> Path:
    """The folder where the actor's ranks leave what ended them, for rank 0 to report (a rank has no
    store)."""
    from mortal.state import paths

    return paths.run_dir(run_name) / "actor" / "ranks"


def rank_note(notes: Path, rank: int) -> Path:
    return notes / f"rank-{rank}.out-of-memory"


def rank_error_note(notes: Path, rank: int) -> Path:
    return notes / f"rank-{rank}.error"


def start(run: TrainingRun, world: int, device: str, follow: Follow) -> Ranks:
    """Rank 0: spawn ranks 1..world-1 (each runs `follower_main`, which hands its Ranks to `follow`: a
    module-level function, as spawn pickles it by name), then join the group with them.

    The rendezvous variables are set in this process's environment too: accelerate and transformers
    read RANK / WORLD_SIZE / LOCAL_RANK from it."""
    import shutil

    import torch.multiprocessing as mp

    notes = rank_notes(run.name)
    shutil.rmtree(notes, ignore_errors=True)  # an earlier incarnation's ranks' notes
    port = free_port()
    os.environ.update(rank_environment(0, world, port))
    children = mp.start_processes(
        follower_main,
        args=(world, port, run, device, os.getpid(), follow),
        nprocs=world - 1,
        join=False,
        start_method="spawn",
    )
    ranks = Ranks(0, world, device, notes, run.spec.deadlines.collective_seconds, _children=children)
    ranks.join()
    return ranks


class Channel:
    """Rank 0 tells the others what comes next: (kind, payload) messages over a gloo group (CPU objects).

    Every message is a scatter, so a rank receives only what is its own: the same payload for every rank
    (`send`), or one each (`send_each`: a step's batch, of which a rank trains only its slice). Broadcasting
    the whole batch made every rank unpickle all of it (every step's token ids and log-probabilities)."""

    def __init__(self, group: ProcessGroup, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world

    def send(self, kind: str, payload: Any = None) -> None:
        self.send_each(kind, [payload] * self.world)

    def send_each(self, kind: str, payloads: list[Any]) -> None:
        """Rank r gets payloads[r] (rank 0's own is payloads[0], dropped here: rank 0 holds it already)."""
        import torch.distributed as dist

        if len(payloads) != self.world:
            raise ShardedError(f"{len(payloads)} payloads for {self.world} ranks")
        mine: list[Any] = [None]
        dist.scatter_object_list(mine, [(kind, p) for p in payloads], src=0, group=self.group)

    def recv(self) -> tuple[str, Any]:
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.scatter_object_list(box, None, src=0, group=self.group)
        return box[0]


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight as a full CPU tensor on rank 0 ({} elsewhere); a collective, so every rank calls it.

    torch's get_model_state_dict gathers one parameter at a time (full_tensor) and, with cpu_offload,
    moves it to rank 0's CPU before the next: an accelerator never holds more than one gathered tensor
    beside its shards, never a second full copy of the model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def shard_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights as FSDP2 holds them (DTensor shards; buffers whole), under the names a rollout
    loads them by, a tied weight once (under its first name, as the volume's files hold it). Every rank
    builds the same dict in the same order: the ring gathers its tensors in that order (`wholes`)."""
    return {name: tensor.detach() for name, tensor in tied_once(model).items()}


# The most bytes of shards one all-gather of `wholes` takes from each rank: a rank holds world x this of
# gathered weights at a time, far below a second copy of the model, and a small model takes a handful of
# collectives where one a weight would take hundreds.
GATHER_BUCKET_BYTES = 64 * 2**20


def replicate_arguments(args: TrainingArguments, config: PretrainedConfig) -> None:
    """actor.strategy ddp: what the Trainer's DistributedDataParallel is told, on its TrainingArguments.
    - find_unused_parameters only for a mixture of experts (models.routes_experts says why).
    - No broadcast of the model's buffers from rank 0 before each forward (DDP's default: one collective a
      micro-batch, on a step bound by the host). A causal LM's buffers are computed from its config when it
      loads (rotary inv_freq, its attention scaling), the same on every rank; a dynamic RoPE recomputes them
      from each rank's own sequence lengths, which rank 0's copy would overwrite with the wrong ones."""
    args.ddp_find_unused_parameters = models.routes_experts(config)
    args.ddp_broadcast_buffers = False


def bucket_view_gradients(trainer: GRPOTrainer) -> None:
    """actor.strategy ddp, before the Trainer wraps its model (at train): each gradient a view into the
    all-reduce bucket DistributedDataParallel sends (its gradient_as_bucket_view), set on the accelerator's
    DDP arguments. Why: otherwise DDP copies every gradient into its bucket and the reduced bucket back, two
    copies a weight a step on a step bound by the host's launches, and holds the gradients twice.
    TrainingArguments has no field for it (it passes bucket size, buffer broadcast and static
    graph only), so the accelerator's handler, which the Trainer built from those, is given it here."""
    from accelerate.utils import DistributedDataParallelKwargs

    if trainer.accelerator.ddp_handler is None:
        trainer.accelerator.ddp_handler = DistributedDataParallelKwargs()
    trainer.accelerator.ddp_handler.gradient_as_bucket_view = True


def replication(model: torch.nn.Module) -> str | None:
    """How the Trainer's wrapped model replicates (for the actor's log), None when it is no
    DistributedDataParallel."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return None
    return (
        "DistributedDataParallel: gradients "
        + ("as views of" if model.gradient_as_bucket_view else "copied into")
        + " its all-reduce buckets, "
        + ("searching for unused parameters" if model.find_unused_parameters else "every parameter used")
        + (", buffers broadcast from rank 0" if model.broadcast_buffers else ", buffers the rank's own")
    )


def publishes_alone(spec: TrainingSpec) -> bool:
    """Whether rank 0 publishes as an actor of one rank does, the other ranks taking no part: with strategy
    ddp it holds the whole model, so the ring's fused copy of its own parameters (the dict of them kept
    between publishes) replaces the gather path's per-tensor copies, the state dict built anew and the other
    ranks' walk through it. FSDP2's shards need every rank's gathers."""
    return spec.actor.strategy == "ddp"


def publish_dtype(spec: TrainingSpec) -> torch.dtype | None:
    """The dtype a sharded actor publishes its floating weights in when it is not theirs: bfloat16 under
    actor.mixedPrecision, the rollouts' (TrainingSpec.rollout_model), so float32 master weights travel at half
    their bytes; None: as the actor keeps them. Every rank asks it: the gathers' buffers must match."""
    return torch.bfloat16 if spec.actor.mixed_precision else None


def cast_floating(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`tensor` in `dtype` if it is a floating tensor and one is given; integer buffers keep theirs."""
    return tensor.to(kept_dtype(tensor, dtype))


def wholes(
    tensors: list[torch.Tensor], dtype: torch.dtype | None = None, bucket_bytes: int = GATHER_BUCKET_BYTES
) -> Iterator[torch.Tensor]:
    """Each tensor made whole, in order (collectives: every rank iterates the same list to the end, rank 0
    keeping what it yields), floating ones in `dtype` when given (publish_dtype: cast before the gather, so
    the collective moves the smaller bytes); anything not a DTensor is yielded as it is, cast alike.

    FSDP2 shards a weight by rows (Shard(0), torch.chunk's split: ceil(rows / world) a rank, the last ranks
    fewer or none). Consecutive such shards of one dtype are packed, each padded to that chunk, into one
    buffer and all-gathered at once; rank r's rows then sit at r x chunk in the result, so each weight is a
    reshape of its columns of the gathered buffer. Why not FSDP2's own unshard: it gathers in its mixed
    precision's dtype and only for its forward, and the ring must hold the weights in the dtype rollouts
    load."""
    bucket: list[torch.Tensor] = []
    held = 0  # bytes of a rank's padded shares in the bucket, in the dtype they are gathered in
    for tensor in tensors:
        size = _chunk_numel(tensor) * kept_dtype(tensor, dtype).itemsize if _row_sharded(tensor) else None
        if bucket and (
            size is None or held + size > bucket_bytes or not _same_group(bucket[0], tensor, dtype)
        ):
            yield from _gather_bucket(bucket, dtype)
            bucket, held = [], 0
        if size is None:
            yield _whole(tensor, dtype)
        else:
            bucket.append(tensor)
            held += size
    yield from _gather_bucket(bucket, dtype)


def _whole(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A tensor `wholes` cannot pack: a DTensor sharded otherwise than by rows, gathered on its own."""
    from torch.distributed.tensor import DTensor

    return cast_floating(tensor.full_tensor() if isinstance(tensor, DTensor) else tensor, dtype)


def _row_sharded(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor, Shard

    return (
        isinstance(tensor, DTensor)
        and tensor.device_mesh.ndim == 1
        and tensor.ndim > 0
        and tuple(tensor.placements) == (Shard(0),)
    )


def _chunk_numel(tensor: torch.Tensor) -> int:
    """Elements of one rank's padded share of a row-sharded tensor (from its global shape: alike on every
    rank)."""
    world = tensor.device_mesh.size()
    return -(-tensor.shape[0] // world) * (tensor.numel() // max(tensor.shape[0], 1))


def _same_group(first: torch.Tensor, tensor: torch.Tensor, dtype: torch.dtype | None) -> bool:
    """Whether two row shards can share one all-gather: one buffer's dtype (once cast), one group of ranks."""
    return (kept_dtype(tensor, dtype), tensor.device_mesh) == (kept_dtype(first, dtype), first.device_mesh)


def _gather_bucket(bucket: list[torch.Tensor], dtype: torch.dtype | None) -> Iterator[torch.Tensor]:
    """One all-gather for the bucket's row shards, then each tensor whole (a copy out of the gathered buffer).
    The shards are cast to `dtype` as they are packed (publish_dtype)."""
    if not bucket:
        return
    import torch.distributed as dist

    first = bucket[0]
    world, local = first.device_mesh.size(), first.to_local()
    chunks = [_chunk_numel(t) for t in bucket]
    # padding: never read
    packed = torch.empty(sum(chunks), dtype=kept_dtype(first, dtype), device=local.device)
    offset = 0
    for tensor, chunk in zip(bucket, chunks, strict=True):
        shard = tensor.to_local().reshape(-1)
        packed[offset : offset + shard.numel()].copy_(shard)
        offset += chunk
    # gloo: flat only
    gathered = torch.empty(world * packed.numel(), dtype=packed.dtype, device=packed.device)
    # renamed in torch 2.13
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(gathered, packed, group=first.device_mesh.get_group())
    gathered = gathered.view(world, packed.numel())
    offset = 0
    for tensor, chunk in zip(bucket, chunks, strict=True):
        rows = -(-tensor.shape[0] // world)
        yield gathered[:, offset : offset + chunk].reshape(world * rows, *tensor.shape[1:])[: tensor.shape[0]]
        offset += chunk


def publish_state(
    model: torch.nn.Module, ring: bool, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Every rank, when rank 0 publishes: for a ring (sync ipc, nccl), the shards (rank 0 hands them to the
    ring with `wholes` in `dtype`, and the other ranks join its gathers through `join_publish`); for the files
    of volume and ray, every weight whole on rank 0's CPU in `dtype` (full_state_dict; {} on the others)."""
    if ring:
        return shard_state(model)
    return {name: cast_floating(tensor, dtype) for name, tensor in full_state_dict(model).items()}


def join_publish(model: torch.nn.Module, ring: bool, dtype: torch.dtype | None = None) -> None:
    """Ranks 1..N-1: the collectives of rank 0's publish, in its order and its `dtype` (nothing is kept)."""
    if not ring:
        full_state_dict(model)
        return
    for _ in wholes(list(shard_state(model).values()), dtype):
        pass


def local_share(model: torch.nn.Module) -> tuple[int, int]:
    """(elements this rank holds, elements of the whole model): about 1 / world of it when sharded."""
    from torch.distributed.tensor import DTensor

    held = total = 0
    for param in model.parameters():
        total += param.numel()
        held += param.to_local().numel() if isinstance(param, DTensor) else param.numel()
    return held, total


def output_slice(output: dict[str, list[Any]], rank: int, world: int) -> dict[str, list[Any]]:
    """This rank's share of a generation batch, in rank order: TRL gathers the ranks' rewards in that
    order for the group advantages and slices them back by process_index x len(prompts)."""
    n = len(output["completion_ids"])
    if n % world:
        raise ShardedError(f"a generation batch of {n} completions does not split over {world} ranks")
    part = slice(rank * (n // world), (rank + 1) * (n // world))
    return {key: values[part] for key, values in output.items()}


def save_sharded(trainer: GRPOTrainer, dest: Path, rank: int) -> None:
    """Every rank: model and optimizer through torch.distributed.checkpoint (each rank writes its shards
    into dest/dcp), each rank's RNG states; rank 0 also the scheduler and trainer_state.json."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(dest / DCP_DIR))
    save_rng(dest, rank)
    if rank == 0:
        torch.save(trainer.lr_scheduler.state_dict(), dest / "scheduler.pt")
        trainer.state.save_to_json(str(dest / "trainer_state.json"))
    dist.barrier()


def restore_checkpoint(trainer: GRPOTrainer, path: Path) -> int:
    """Once the Trainer made its optimizer and scheduler (on_train_begin), on every rank of a sharded actor
    and in an unsharded actor resuming from a sharded checkpoint: model, optimizer and scheduler from a
    checkpoint written by an actor of any count; returns its step (the caller sets it as the Trainer's).
    A sharded checkpoint is read through torch.distributed.checkpoint, which reshards it to this actor's
    ranks (or to a whole model); an unsharded one (the Trainer's files) is read whole and each rank keeps
    its shards. The RNG comes later, and only on the count that wrote it (restore_rng)."""
    import json

    if is_sharded(path):
        _load_dcp(trainer, path)
    else:
        _load_trainer_files(trainer, path)
    trainer.lr_scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    return int(json.loads((path / "trainer_state.json").read_text())["global_step"])


def written_by(path: Path) -> int:
    """How many actor ranks wrote the checkpoint at `path` (mortal.json's "ranks"; an unsharded actor: 1)."""
    return int(read_marker(path).get("ranks", 1))


def rng_source(checkpoint: Path, world: int) -> Path | None:
    """The checkpoint whose per-rank RNG files a resume on `world` ranks restores: only one written by as
    many ranks. On another count rank r's file is some other slice's stream, so every rank keeps its seeded
    RNG: the run goes on equivalently, not bit for bit (resume_check warns the user)."""
    return checkpoint if written_by(checkpoint) == world else None


def _load_dcp(trainer: GRPOTrainer, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(path / DCP_DIR))
    set_state_dict(
        trainer.model, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )


def _load_trainer_files(trainer: GRPOTrainer, path: Path) -> None:
    """An unsharded actor's checkpoint (model.safetensors, optimizer.pt) into this sharded model. The
    optimizer file keys its state by each parameter's index in the optimizer's groups; the Trainer builds
    its groups in the same order for the same model, sharded or not, so index i is the i-th parameter of
    this optimizer's groups, which torch's loader wants by name. Every rank reads the files whole."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model, optimizer = trainer.model, trainer.optimizer
    weights = load_file(str(path / "model.safetensors"))
    names = {id(param): name for name, param in model.named_parameters()}  # a tied weight once, by its owner
    missing = sorted(set(names.values()) - weights.keys())
    if missing:
        raise ShardedError(
            f"{path}/model.safetensors lacks {len(missing)} of the model's weights, e.g. {missing[:3]}"
        )
    # not strict: the file holds a tied weight once (the LM head is the embedding), the model's state dict
    # twice
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
    saved = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)
    ours = [param for group in optimizer.param_groups for param in group["params"]]
    indices = [index for group in saved["param_groups"] for index in group["params"]]
    if len(indices) != len(ours):
        raise ShardedError(
            f"{path}/optimizer.pt holds {len(indices)} parameters in its groups, the trainer's "
            f"optimizer {len(ours)}: not this model's optimizer"
        )
    by_index = dict(zip(indices, ours, strict=True))
    for index, moments in saved["state"].items():
        shape = tuple(by_index[index].shape)  # a sharded parameter's shape is the whole tensor's
        if "exp_avg" in moments and tuple(moments["exp_avg"].shape) != shape:
            raise ShardedError(
                f"{path}/optimizer.pt: the state of parameter {index} ({names[id(by_index[index])]}) "
                f"has shape {tuple(moments['exp_avg'].shape)}, the parameter {shape}"
            )
    named = {
        "state": {names[id(by_index[index])]: moments for index, moments in saved["state"].items()},
        "param_groups": [
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [names[id(by_index[index])] for index in group["params"]],
            }
            for group in saved["param_groups"]
        ],
    }
    set_optimizer_state_dict(model, optimizer, named, options=StateDictOptions(full_state_dict=True))


def save_rng(dest: Path, rank: int) -> None:
    """This rank's RNG states into the checkpoint: Python's, torch's CPU generator and, once CUDA is in use,
    its GPU's (dropout and sampling on it draw from that one)."""
    import random

    rng = {"python": random.getstate(), "cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, dest / f"rng_state_{rank}.pth")


def restore_rng(path: Path, rank: int) -> None:
    """Every rank, at the first step's start after restore_checkpoint (on_step_begin), not at on_train_begin:
    the Trainer makes its data iterator in between, which draws from torch's RNG (the Trainer's own
    resume restores its RNG after that too). TRL shuffles each batch with that RNG, and the order
    decides float sums: restored earlier, a resumed run ends ~1e-7 away from an uninterrupted one."""
    import random

    rng = torch.load(path / f"rng_state_{rank}.pth", weights_only=False)
    random.setstate(rng["python"])
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


def _exit_with_parent(parent: int) -> None:
    """A rank whose rank 0 is gone can never finish a collective: leave at once."""
    while True:
        time.sleep(WATCH_SECONDS)
        if os.getppid() != parent:
            os._exit(75)


def follower_main(
    index: int, world: int, port: int, run: TrainingRun, device: str, parent: int, follow: Follow
) -> None:
    """Ranks 1..N-1: the trainer rank 0 has, fed and steered by rank 0 (`follow`:
    mortal.workers.actor.follower's)."""
    rank = index + 1
    os.environ.update(rank_environment(rank, world, port))
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 decides when to stop, at a step boundary
    threading.Thread(
        target=_exit_with_parent, args=(parent,), name="mortal-parent-watch", daemon=True
    ).start()
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        force=True,
        format=f"%(asctime)s %(levelname)s actor-rank{rank} %(name)s: %(message)s",
    )
    notes = rank_notes(run.name)
    try:
        ranks = Ranks(rank, world, device, notes, run.spec.deadlines.collective_seconds)
        ranks.join()
        follow(run, ranks)
        ranks.close()
    except BaseException as exc:
        log.error("rank %d crashed:\n%s", rank, traceback.format_exc())
        sys.stderr.flush()
        os._exit(exit_code_of(exc, notes, rank))
    sys.stderr.flush()
    os._exit(0)


def exit_code_of(exc: BaseException, notes: Path, rank: int) -> int:
    """A crashed rank's exit code: EXIT_OUT_OF_MEMORY, with torch's figures left in its note for rank 0 (which
    reports the actor's out-of-memory as the worker's own), or EXIT_RETRYABLE for anything else, with the
    error left in a note too: rank 0 reports it, so the run's status names the rank's error, not only its exit
    code (and the controller can tell the same error on every launch from a rank lost at random:
    CrashLoop)."""
    notes.mkdir(parents=True, exist_ok=True)
    found = out_of_memory(exc)
    if found is None:
        # one line
        rank_error_note(notes, rank).write_text(" ".join(f"{type(exc).__name__}: {exc}".split())[:500])
        return EXIT_RETRYABLE
    rank_note(notes, rank).write_text(with_device_state(found).describe())
    return EXIT_OUT_OF_MEMORY
