"""mortal.workers.actor.sharded's own rules, without starting ranks (test_actor_sharded.py trains them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mortal.workers.actor import sharded


def test_a_transformers_that_would_wrap_a_sharded_model_in_ddp_is_refused_naming_both_versions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert sharded.unsupported() is None  # the version the tests install
    # by name: the module sharded imports now (a test run earlier in this process may have
    # replaced it in sys.modules)
    monkeypatch.setattr("transformers.__version__", "5.17.0")  # the GPU machines' image
    why = sharded.unsupported()
    assert why is not None and ">= 5.19.0" in why and "has 5.17.0" in why and "actor.count 1" in why


def test_each_rank_trains_on_its_own_device() -> None:
    assert sharded.rank_device("cpu", 1) == torch.device("cpu")
    if torch.cuda.device_count() < 2:
        with pytest.raises(sharded.ShardedError, match="actor rank 1 has no GPU"):
            sharded.rank_device("cuda", 1)


def test_a_generation_batch_is_split_in_rank_order_and_must_divide() -> None:
    output = {"completion_ids": [[1], [2], [3], [4]], "prompt_ids": [[0]] * 4}
    assert sharded.output_slice(output, 1, 2)["completion_ids"] == [[3], [4]]
    with pytest.raises(sharded.ShardedError, match="does not split over 3 ranks"):
        sharded.output_slice(output, 0, 3)


def test_a_replicated_rank_0_publishes_alone_and_fsdp2_ranks_publish_together() -> None:
    """ddp: rank 0 holds the whole model and publishes it as one rank does; FSDP2: every rank gathers."""
    from mortal.specs import TrainingSpec

    def spec(**actor):
        return TrainingSpec.model_validate(
            {
                "model": {"name": "m"},
                "dataset": {"name": "d"},
                "rewards": [{"function": "builtin:length"}],
                "actor": actor,
            }
        )

    assert sharded.publishes_alone(spec(count=2, strategy="ddp"))
    assert not sharded.publishes_alone(spec(count=2))  # strategy fsdp, the default


TORCH_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 79.19 GiB of which "
    "1.23 GiB is free. Of the allocated memory 70.10 GiB is allocated by PyTorch, and 6.50 GiB is "
    "reserved by PyTorch but unallocated."
)


def test_a_rank_that_ran_out_of_gpu_memory_leaves_its_figures_and_rank_0_reports_the_actors_out_of_memory(
    tmp_path,
) -> None:
    """Rank 1 has no store: it exits EXIT_OUT_OF_MEMORY with torch's figures in its note, and rank 0 reports
    them as the worker's own out-of-memory (what the controller diagnoses), not as a lost rank to relaunch."""
    from mortal.workers.runtime import EXIT_OUT_OF_MEMORY, EXIT_RETRYABLE

    notes = tmp_path / "ranks"
    try:
        raise RuntimeError("the step failed") from torch.OutOfMemoryError(TORCH_OOM)
    except RuntimeError as exc:
        assert sharded.exit_code_of(exc, notes, rank=1) == EXIT_OUT_OF_MEMORY
    ranks = sharded.Ranks(0, 2, "cpu", notes)
    lost = ranks.ended(1, EXIT_OUT_OF_MEMORY)
    assert isinstance(lost, sharded.RankOutOfMemory) and lost.exit_code == EXIT_OUT_OF_MEMORY
    assert lost.report().startswith("OutOfMemory: actor rank 1 of 2: tried to allocate 2.00 GiB on GPU 1")

    killed = sharded.Ranks(0, 2, "cpu", tmp_path / "none").ended(1, -9)
    assert type(killed) is sharded.RankLost and killed.exit_code == EXIT_RETRYABLE
    assert killed.report() == "RankLost: actor rank 1 of 2 ended with exit code -9"


def test_a_rank_that_crashed_leaves_its_error_and_rank_0_reports_it(tmp_path) -> None:
    """Any other error of rank 1 is a lost rank to relaunch (exit 75), reported by rank 0 with the rank's own
    error: the same error on every launch is then the same message (the controller's CrashLoop)."""
    from mortal.workers.runtime import EXIT_RETRYABLE

    notes = tmp_path / "ranks"
    assert (
        sharded.exit_code_of(AssertionError("FSDP parameters should be materialized on CPU"), notes, rank=1)
        == EXIT_RETRYABLE
    )
    crashed = sharded.Ranks(0, 2, "cpu", notes).ended(1, EXIT_RETRYABLE)
    assert type(crashed) is sharded.RankLost and crashed.exit_code == EXIT_RETRYABLE
    assert crashed.report() == (
        "RankLost: actor rank 1 of 2 failed: AssertionError: FSDP parameters should be materialized on CPU"
    )


@pytest.fixture(scope="module")
def gathered(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What sharded_helpers.gather_in_buckets' two ranks made whole (spawned once for the tests below)."""
    import torch.multiprocessing as mp
    from sharded_helpers import gather_in_buckets

    out = tmp_path_factory.mktemp("wholes")
    mp.start_processes(
        gather_in_buckets, args=(sharded.free_port(), str(out)), nprocs=2, join=True, start_method="spawn"
    )
    return torch.load(out / "wholes.pt")


def test_shards_are_made_whole_a_bucket_at_a_time_with_one_all_gather_a_bucket(gathered: dict) -> None:
    """What a sharded actor's ring holds after a publish: every weight whole and bit for bit the unsharded
    one, uneven rows, an empty shard and dtypes mixed; consecutive row shards of one dtype share one
    all-gather up to the bucket's bytes, the rest pass alone."""
    from sharded_helpers import expected_weights

    result = gathered
    expected = expected_weights()
    assert list(result["whole"]) == list(expected)
    for name, tensor in expected.items():
        assert result["whole"][name].dtype == tensor.dtype and torch.equal(result["whole"][name], tensor), (
            name
        )
    # a rank's padded share, in elements (16 float32 or 32 bfloat16 fill a bucket): [a 9 + b 4] [c 4] (a dtype
    # change) [d 4 + e 4] (another) [big 80, alone] [f 2] (ended by the replicated weight) [g 3]
    assert result["whole gathers"] == 6


def test_a_mixed_precision_actor_gathers_its_float32_shards_cast_to_bfloat16_in_fuller_buckets(
    gathered: dict,
) -> None:
    """publish_dtype: each weight whole in bfloat16 equals the float32 whole cast, and half the bytes a rank
    sends fill a bucket half as fast (one dtype now, so no bucket ends at a dtype change)."""
    from sharded_helpers import expected_weights

    result = gathered
    for name, tensor in expected_weights().items():
        assert result["bfloat16"][name].dtype == torch.bfloat16, name
        assert torch.equal(result["bfloat16"][name], tensor.to(torch.bfloat16)), name
    # [a 9 + b 4 + c 4 + d 4 + e 4] [big 80, alone] [f 2] (ended by the replicated weight) [g 3]
    assert result["bfloat16 gathers"] == 4


@pytest.mark.parametrize("cuda_in_use", [False, True])
def test_a_ranks_rng_states_round_trip_through_its_checkpoint_the_gpus_once_cuda_is_in_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cuda_in_use: bool
) -> None:
    """Its GPU's generator is kept only once CUDA is in use (dropout, sampling), and put back where there is a
    GPU. Here torch.cuda's state calls are stood in for, with a state no real generator would hold."""
    import random

    gpu = {"state": torch.arange(16, dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_in_use)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: cuda_in_use)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: gpu["state"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state: gpu.update(state=state))
    random.seed(1)
    torch.manual_seed(1)
    sharded.save_rng(tmp_path, rank=1)
    expected = (random.random(), torch.rand(3))
    random.seed(2)
    torch.manual_seed(2)
    gpu["state"] = torch.zeros(16, dtype=torch.uint8)
    sharded.restore_rng(tmp_path, rank=1)
    assert (random.random(), *torch.rand(3).tolist()) == (expected[0], *expected[1].tolist())
    restored = torch.arange(16, dtype=torch.uint8) if cuda_in_use else torch.zeros(16, dtype=torch.uint8)
    assert torch.equal(gpu["state"], restored)
    assert ("cuda" in torch.load(tmp_path / "rng_state_1.pth", weights_only=False)) is cuda_in_use
