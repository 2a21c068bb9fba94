"""The tensors a conversation's decode step and its appends read and write in place, one entry per row.

Who uses it: turn_decode's stepper (new_state) and turn_append; both are recorded as CUDA graphs over these
very tensors, so Python changes a row only by writing into them.
"""

from __future__ import annotations

import torch

from mortal.workers.rollout.engines.hashed_noise import mix32
from mortal.workers.rollout.engines.static_decode import DecodeState


class TurnState(DecodeState):
    """The single-turn state plus each row's noise key (and the token ids' hashes the noise mixes in)."""

    def __init__(
        self,
        rows: int,
        prompt_len: int,
        max_tokens: int,
        vocab: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(rows, prompt_len, max_tokens, vocab, dtype, device)
        self.keys = torch.zeros(rows, dtype=torch.long, device=device)
        self.vocab_hash = mix32(torch.arange(vocab, dtype=torch.long, device=device))
