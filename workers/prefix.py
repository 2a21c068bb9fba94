"""The prompt prefix every row of a batch shares (a tool-calling run's system prompt and tool schemas), and
the switch that turns its sharing off.

Who uses it: the actor's loss (mortal.workers.actor.shared_prefix) and the rollout's prefill
(mortal.workers.rollout.engines.prefix_cache) each compute that prefix once instead of once per row; one
environment variable turns both off, for a comparison or to rule the path out.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ENV = "MORTAL_SHARED_PREFIX"  # "0": neither the actor nor the rollout shares the prefix
# Fewer shared tokens than this gain less than the extra forward call and the copies of its K/V cost.
MIN_SHARED_PREFIX = 32


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the shared prefix is computed once: unless ENV is "0"."""
    return environ.get(ENV, "1").strip() != "0"
