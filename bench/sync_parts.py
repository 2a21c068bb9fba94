"""Where a weight sync's milliseconds go: each part of a ring publish and load, timed alone.

    python bench/sync_parts.py      # needs a CUDA GPU; the cross-GPU copy uses a second one if present

The bench's model (a random-init Qwen2.5-0.5B shape, bf16), each part's median of 5 after 2 warm-ups.
Not a claim by itself: it explains bench/gpu_step.py's publish and load figures. The parts are those
of mortal.workers.weights.WeightPublisher.publish (ipc) and load_published; the store's writes are
left out (bench/gpu_step.py's figures include them).
"""

from __future__ import annotations

import pickle
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.multiprocessing.reductions import reduce_tensor
from transformers import AutoModelForCausalLM, Qwen2Config

from mortal.workers import atomic, weight_ring, weights


def milliseconds(part: Callable[[], object], repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        part()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times[2:])


def main() -> None:
    config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=True)
    actor = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to("cuda:0")
    other = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    rollout = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(other)
    state = weights.plain_state_dict(actor)
    sizes, slots = weight_ring.layout(state)
    buffers = weight_ring.empty_buffers(sizes, "cuda:0")
    manifest = {"slots": slots, "handles": {d: reduce_tensor(b) for d, b in buffers.items()}}
    folder = Path(tempfile.mkdtemp())
    names = iter(range(1000))

    def write_manifest() -> None:
        with atomic.atomic_dir(folder / f"v{next(names)}", durable=False) as tmp:
            (tmp / "ipc.pkl").write_bytes(pickle.dumps(manifest))

    moved = weight_ring.views(buffers, slots, torch.device(other))
    current = rollout.state_dict()
    parts = {
        "publish: plain_state_dict": lambda: weights.plain_state_dict(actor),
        "publish: snapshot into the ring": lambda: weight_ring.fill(buffers, state, slots),
        "publish: manifest written": write_manifest,
        "load: manifest read": lambda: pickle.loads(pickle.dumps(manifest)),
        f"load: ring slot to {other}": lambda: weight_ring.views(buffers, slots, torch.device(other)),
        "load: rollout's state_dict": rollout.state_dict,
        "load: copy into the model": lambda: weight_ring.copy_into(rollout, moved, current),
    }
    print(f"{len(slots)} tensors, {sum(b.numel() * b.element_size() for b in buffers.values()) / 1e9:.2f} GB")
    for name, part in parts.items():
        print(f"{name}: {milliseconds(part):.2f} ms")


if __name__ == "__main__":
    main()
