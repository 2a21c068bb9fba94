"""Where a weight sync's milliseconds go: the real publish and load paths, and each part of them.

    python bench/sync_parts.py [--sync ipc|nccl] [--versions 8] [--json out.json]

The actor's side runs in this process on cuda:0: WeightPublisher.publish of the bench's model
(bench/gpu_step.py's random-init Qwen2.5-0.5B shape, bf16) into a SQLite store, as the actor worker
publishes after a step. The rollout's side runs in a child process, on cuda:1 when there are two GPUs
(rollouts on GPUs of their own) and on cuda:0 otherwise (colocated): RolloutWorker.refresh_weights,
as the rollout worker loads each new version. Between versions the actor changes every weight a
little, as an optimizer step would.

Each side times its whole (what bench/gpu_step.py reports as publish and load: `weights/publish_seconds`
and `weights/load_seconds`) and, by wrapping them with timers, the functions it goes through; a
part's time includes the parts it calls. Medians over the versions after two warm-ups. Not a claim
by itself: it explains bench/gpu_step.py's figures, where the whole runs through the controller.
Needs a CUDA GPU, and SmolLM2's tokenizer (MORTAL_TEST_ASSETS) for the run's spec.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from gpu_step import build_parser, make_model, mortal_spec, prompt_rows  # noqa: E402

WARM_UPS = 2


def actor_device() -> str:
    """cuda:0; the CPU only to try the script's plumbing (--sync nccl, over gloo) on a machine without one."""
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class PartTimers:
    """Wall time spent in wrapped functions, per version; nested parts are counted in their callers too."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.versions: list[dict[str, float]] = []

    def wrap(self, owner: Any, attribute: str, label: str) -> None:
        original = getattr(owner, attribute)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.current[label] += time.perf_counter() - started

        setattr(owner, attribute, timed)

    def next_version(self, whole_seconds: float) -> None:
        self.versions.append({"whole": whole_seconds, **self.current})
        self.current = defaultdict(float)

    def medians_ms(self) -> dict[str, float]:
        measured = self.versions[WARM_UPS:]
        labels = dict.fromkeys(label for version in measured for label in version)
        return {
            label: round(1000 * statistics.median(v.get(label, 0.0) for v in measured), 2) for label in labels
        }


def run_context(home: Path, role: str) -> Any:
    """A WorkerContext of a fresh incarnation of `role` in the bench's run (which `main` applied)."""
    from mortal.specs import TrainingRun
    from mortal.state import open_store
    from mortal.state.store import WorkerRef
    from mortal.workers.runtime import WorkerContext

    store = open_store(f"sqlite:///{home / 'state.db'}")
    row = store.get_run("sync")
    run = TrainingRun.from_record(row.name, row.spec, row.status, annotations=row.annotations, uid=row.uid)
    worker = store.create_worker("sync", role, 0, "local", lease_seconds=600)
    ref = WorkerRef(run="sync", role=role, replica=0, incarnation=worker.incarnation)
    context = WorkerContext(store, ref, run, heartbeat_seconds=600)
    context.check_fence()  # Pending -> Running, as the worker's start does
    return context


def rollout_side(home: str, device: str, model_dir: str, asks: Any, answers: Any) -> None:
    """The child: a rollout worker's weight loading, timed (see the module docstring)."""
    from transformers import AutoModelForCausalLM

    from mortal.workers.rollout.loop import RolloutWorker
    from mortal.workers.sync import ipc as ipc_weights
    from mortal.workers.sync import nccl as nccl_weights
    from mortal.workers.sync import volume, weights
    from mortal.workers.sync.base import WeightTransport

    class ModelOnly:
        """The part of the transformers engine a load goes through."""

        def __init__(self) -> None:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)

        def load_weights(self, path: str, transport: WeightTransport | None = None) -> None:
            (transport or volume.VolumeTransport()).load(self.model, path)

    timers = PartTimers()
    context = run_context(Path(home), "rollout")
    worker = RolloutWorker(context, ModelOnly(), tokenizer=None, rewards=None)
    timers.wrap(context.store, "latest_weights", "store: latest_weights (the one before the load is untimed)")
    timers.wrap(volume, "load_published", "load_published")
    timers.wrap(ipc_weights, "_manifest", "  manifest read")
    timers.wrap(nccl_weights, "_manifest", "  manifest read")
    timers.wrap(ipc_weights, "open_shared", "  ipc: open_shared (map, copy to this GPU, views)")
    timers.wrap(nccl_weights, "receive", "  nccl: receive (ask, NCCL recv, views)")
    timers.wrap(weights, "_destinations", "  the model's tensors to copy into")
    timers.wrap(weights, "copy_pairs", "  copy into the model")
    timers.wrap(RolloutWorker, "_intact", "ring check (_intact)")
    answers.put("ready")
    while (version := asks.get()) is not None:
        worker.refresh_weights()
        if worker.published_version != version:
            raise RuntimeError(f"rollout loaded {worker.published_version}, expected {version}")
        timers.next_version(worker.load_seconds)
        answers.put(version)
    answers.put(timers.medians_ms())


def actor_side(
    home: Path, method: str, model_dir: Path, versions: int, child: tuple[Any, Any]
) -> dict[str, float]:
    """This process: publish `versions` versions, each after the rollout loaded the one before."""
    from transformers import AutoModelForCausalLM

    from mortal.workers.sync import ipc as ipc_weights
    from mortal.workers.sync import ring as weight_ring
    from mortal.workers.sync.publisher import WeightPublisher

    asks, answers = child
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(actor_device())
    context = run_context(home, "actor")
    publisher = WeightPublisher(context.store, context.worker, method=method)
    timers = PartTimers()
    timers.wrap(context.store, "publish_weights", "store: publish_weights (the record)")
    timers.wrap(context.store, "latest_weights", "store: latest_weights")
    timers.wrap(publisher.transport, "_plain", "plain state dict")
    timers.wrap(weight_ring, "layout", "  layout")
    timers.wrap(weight_ring.SnapshotRing, "write", "snapshot into the ring (with its synchronize)")
    timers.wrap(weight_ring, "fill_views", "  the copy launched")
    timers.wrap(ipc_weights.IpcWeightSharer, "_handle", "ipc handles")
    for version in range(versions):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1e-3)
        synchronize()  # as the actor does: the step's queued work is training, not publishing
        started = time.perf_counter()
        published = publisher.publish(model, step=version, prune=False)
        timers.next_version(time.perf_counter() - started)
        asks.put(published)
        if answers.get(timeout=600) != published:
            raise RuntimeError(f"rollout did not load version {published}")
        publisher.prune()  # the actor prunes while it waits for rollouts: off the timed path
    asks.put(None)
    publisher.close()
    return timers.medians_ms()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sync", choices=["ipc", "nccl"], default="ipc")
    parser.add_argument("--versions", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from mortal.specs import TrainingRun
    from mortal.state import open_store

    work = Path(tempfile.mkdtemp(prefix="sync-parts-"))
    home = work / "mortal-home"
    os.environ["MORTAL_HOME"] = str(home)
    model_dir = make_model(work / "model")
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in prompt_rows()))
    spec_args = build_parser().parse_args([])  # gpu_step's defaults for every field its spec reads
    spec_args.__dict__.update(
        gens=8,
        prompts=8,
        steps=1,
        staleness=0,
        tokens=256,
        rollouts=1,
        gpus=torch.cuda.device_count(),
        sync=args.sync,
    )
    run = TrainingRun.model_validate(
        {"metadata": {"name": "sync"}, "spec": mortal_spec(model_dir, data, spec_args)}
    )
    open_store(f"sqlite:///{home / 'state.db'}").apply_run("sync", run.spec_dict())
    device = "cuda:1" if torch.cuda.device_count() > 1 else actor_device()
    spawn = mp.get_context("spawn")
    asks, answers = spawn.Queue(), spawn.Queue()
    child = spawn.Process(target=rollout_side, args=(str(home), device, str(model_dir), asks, answers))
    child.start()
    if answers.get(timeout=600) != "ready":
        raise RuntimeError("the rollout process did not start")
    publish = actor_side(home, args.sync, model_dir, args.versions, (asks, answers))
    load = answers.get(timeout=600)
    child.join(60)
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    report = {
        "sync": args.sync,
        "device": name,
        "gpus": torch.cuda.device_count(),
        "rollout_device": device,
        "versions": args.versions,
        "warm_ups": WARM_UPS,
        "publish_ms": publish,
        "load_ms": load,
        "together_ms": round(publish["whole"] + load["whole"], 2),
    }
    for side in ("publish_ms", "load_ms"):
        print(f"{side[:-3]}: {report[side]['whole']:.2f} ms")
        for label, ms in report[side].items():
            if label != "whole":
                print(f"    {label}: {ms:.2f}")
    print(f"together: {report['together_ms']:.2f} ms ({args.sync}, {report['device']} x{report['gpus']})")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
