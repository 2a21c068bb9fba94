"""What the decoder tests share: a tiny random-init model (float32, eval mode), built once per module."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(tmp_path_factory.mktemp("decode") / "model", seed=0)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
