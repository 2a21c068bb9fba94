"""mortal.workers.sharded's own rules, without starting ranks (tests/workers/test_actor_sharded.py trains them)."""

from __future__ import annotations

import pytest
import torch
import transformers

from mortal.workers import sharded


def test_a_transformers_that_would_wrap_a_sharded_model_in_ddp_is_refused_naming_both_versions(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert sharded.unsupported() is None  # the version the tests install
    monkeypatch.setattr(transformers, "__version__", "5.17.0")  # the GPU machines' image
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
