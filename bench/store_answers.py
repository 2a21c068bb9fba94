"""A step's rollout answer through the store: how long a rollout takes to hand it in, the actor to read it.

    python bench/store_answers.py [--store sqlite --store postgres] [--prompts 8 --gens 8 --tokens 256]

Both are on every step's critical path (the rollout writes its answer, the actor's collect reads every
task of the step), so their cost is latency a GPU step pays. Each case runs with the store's JSON codec
(pydantic-core, mortal.state.engine.JSON_CODEC) and again with the json module SQLAlchemy uses by
default, in this one invocation. The answer is the forced-256 bench's: 8 prompts x 8 completions x 256
tokens, random token ids and log-probabilities (0.5 MB of JSON). Reported: the median of --rounds of
complete_task (the rollout's write) and of step_results + RolloutAnswer.model_validate (the actor's
read), in ms. A fresh SQLite file or PostgreSQL run each case; nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from typing import Any

PG_URL = "postgresql://postgres@127.0.0.1:5432/test"


def answer(prompts: int, gens: int, tokens: int) -> dict[str, Any]:
    from mortal.workers.messages import RolloutAnswer, RolloutResult

    rng = random.Random(0)
    results = [
        RolloutResult(
            prompt_ids=list(range(40)),
            completion_ids=[[rng.randrange(49152) for _ in range(tokens)] for _ in range(gens)],
            logprobs=[[rng.random() * -5 for _ in range(tokens)] for _ in range(gens)],
            completions=["x" * (3 * tokens)] * gens,
            rewards={"short_answer": [0.0] * gens},
            weight_version=3,
        )
        for _ in range(prompts)
    ]
    return RolloutAnswer(results=results).model_dump()


def measure(url: str, result: dict[str, Any], rounds: int) -> tuple[float, float]:
    from mortal.state import NewTask, WorkerRef, open_store
    from mortal.workers.messages import RolloutAnswer

    store = open_store(url)
    run = f"answers-{random.randrange(10**9)}"
    store.apply_run(run, {"model": {"name": "tiny"}, "rollout": {"replicas": 1}})

    def worker(role: str) -> WorkerRef:
        return WorkerRef(
            run, role, 0, store.create_worker(run, role, 0, backend="local", lease_seconds=60).incarnation
        )

    actor, rollout = worker("actor"), worker("rollout")
    writes, reads = [], []
    for step in range(1, rounds + 1):
        store.enqueue_tasks(actor, [NewTask(step=step, slot=0, min_weight_version=0)])
        task = store.lease_task(rollout, 60)
        started = time.perf_counter()
        store.complete_task(rollout, task.id, task.lease_token, result)
        writes.append(time.perf_counter() - started)
        started = time.perf_counter()
        RolloutAnswer.model_validate(store.step_results(run, step)[0].result)
        reads.append(time.perf_counter() - started)
    store.close()
    return statistics.median(writes) * 1e3, statistics.median(reads) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--store", action="append", choices=["sqlite", "postgres"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--gens", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()

    from mortal.state import engine

    result = answer(args.prompts, args.gens, args.tokens)
    print(
        f"answer: {args.prompts} prompts x {args.gens} x {args.tokens} tokens, "
        f"{len(json.dumps(result)) / 1e6:.2f} MB of JSON; medians of {args.rounds}"
    )
    codecs = {
        "pydantic-core": dict(engine.JSON_CODEC),
        "json module": {"json_serializer": json.dumps, "json_deserializer": json.loads},
    }
    for store in args.store or ["sqlite"]:
        for name, codec in codecs.items():
            engine.JSON_CODEC.clear()
            engine.JSON_CODEC.update(codec)
            url = PG_URL if store == "postgres" else f"sqlite:///{tempfile.mkdtemp()}/state.db"
            write_ms, read_ms = measure(url, result, args.rounds)
            print(
                f"{store:8s} {name:13s}: rollout's write {write_ms:6.1f} ms, actor's read {read_ms:6.1f} ms"
            )


if __name__ == "__main__":
    main()
