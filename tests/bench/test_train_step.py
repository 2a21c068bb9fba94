"""bench/train_step.py: TRL's training step alone, the fused LM head against whole-vocabulary logits. What its
figures rest on: both losses train the same step, micro-batches split the same batch, and a variant that runs
out of GPU memory is recorded as a finding instead of ending the bench."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import train_step  # noqa: E402


def _run(monkeypatch, tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["train_step.py", "--cpu", *flags, "--json", str(out)])
    train_step.main()
    return json.loads(out.read_text())


def test_the_fused_head_and_full_logits_train_the_same_step_in_micro_batches(monkeypatch, tmp_path) -> None:
    # Qwen's vocabulary, wider than the tokenizer's: the drawn ids stay decodable, the logits are 151,936 wide
    result = _run(monkeypatch, tmp_path, "--shape", "tiny", "--vocab", "151936", "--micro-batch", "2")
    fused, full = result["variants"]
    assert (fused["loss"], full["loss"]) == ("fused", "full")
    assert fused["micro_batch"] == full["micro_batch"] == 2
    assert len(fused["grad_norms"]) == len(full["grad_norms"]) == 4
    assert fused["grad_norms"] == pytest.approx(full["grad_norms"], rel=1e-5)
    assert fused["losses"] == pytest.approx(full["losses"], rel=1e-5, abs=1e-7)


def test_a_micro_batch_that_does_not_divide_the_batch_is_refused_by_flag(
    monkeypatch, tmp_path, capsys
) -> None:
    monkeypatch.setattr(sys, "argv", ["train_step.py", "--shape", "tiny", "--micro-batch", "5"])
    with pytest.raises(SystemExit):
        train_step.main()
    assert "--micro-batch 5 must divide the batch" in capsys.readouterr().err


def test_a_variant_out_of_gpu_memory_is_recorded_with_torchs_words(monkeypatch) -> None:
    import torch

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 37.10 GiB\nmore detail")

    monkeypatch.setattr(train_step, "train_variant", out_of_memory)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 64 * 2**30)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    result = train_step.run_variant("bf16", "full", "eager", None, "cuda", Path("."))
    assert result["out_of_memory"] == "CUDA out of memory. Tried to allocate 37.10 GiB"
    assert result["median_step_seconds"] is None and result["peak_memory_gib"] == 64
