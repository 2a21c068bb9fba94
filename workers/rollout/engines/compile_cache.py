"""What torch.compile cost a worker and whether the run's compile cache served it: one line in its log.

Who calls it: mortal.workers.rollout.engines.transformers_engine, around the first preparation of each
decode shape (compile, then CUDA graph capture), so that `mortalctl logs RUN --role rollout` shows what a
relaunch paid. The caches themselves are set up by the backend before torch is imported
(TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR under $MORTAL_HOME/compile-cache/:
mortal.controller.backends.base.compile_cache_environ says why); hit or miss is read from torch's counters
(names as in torch 2.13). After a miss, `persist` commits the Modal volume (a no-op elsewhere), so what was
compiled is kept even by a container preempted before Modal's background commit. `start_compile_workers`
starts inductor's compile processes as a GPU engine is created, not at the first compile.
What it must not do: change how anything compiles, or fail the worker (the report is only a log line).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from mortal.workers.atomic import volume_sync

log = logging.getLogger("mortal.worker")

_COUNTERS = {  # our name -> (torch counter group, counter)
    "fx_hit": ("inductor", "fxgraph_cache_hit"),
    "fx_miss": ("inductor", "fxgraph_cache_miss"),
    "fx_bypass": ("inductor", "fxgraph_cache_bypass"),
    "aot_hit": ("aot_autograd", "autograd_cache_hit"),
    "aot_miss": ("aot_autograd", "autograd_cache_miss"),
    "aot_bypass": ("aot_autograd", "autograd_cache_bypass"),
}


def _snapshot() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {name: int(counters[group][key]) for name, (group, key) in _COUNTERS.items()}


@dataclass(frozen=True)
class CompileReport:
    """What one watched block compiled: seconds, and the cache lookups torch counted meanwhile."""

    seconds: float
    fx_hit: int = 0
    fx_miss: int = 0
    fx_bypass: int = 0
    aot_hit: int = 0
    aot_miss: int = 0
    aot_bypass: int = 0

    @property
    def verdict(self) -> str:
        """'cache hit' (every compiled graph came from the cache), 'cache miss' (none did), 'partial
        cache hit', or 'no compile' (nothing was looked up: eager, or graphs compiled earlier in-process)."""
        if self.fx_hit + self.fx_miss + self.fx_bypass == 0:
            return "no compile"
        if self.fx_miss + self.fx_bypass == 0:
            return "cache hit"
        return "cache miss" if self.fx_hit == 0 else "partial cache hit"

    @property
    def wrote(self) -> bool:
        """Something was compiled afresh (and so written to the cache)."""
        return self.fx_miss + self.aot_miss > 0

    def describe(self) -> str:
        if self.verdict == "no compile":
            return f"{self.seconds:.1f} s (no compile)"
        return (
            f"{self.seconds:.1f} s (compile {self.verdict}: fx graph {self.fx_hit} hit {self.fx_miss} miss"
            f"{f' {self.fx_bypass} bypass' if self.fx_bypass else ''}, aot autograd {self.aot_hit} hit "
            f"{self.aot_miss} miss{f' {self.aot_bypass} bypass' if self.aot_bypass else ''}; "
            f"cache {os.environ.get('TORCHINDUCTOR_CACHE_DIR') or 'torch default'})"
        )


class CompileWatch:
    """`with CompileWatch() as watch: ...` then `watch.report`: the block's seconds and cache lookups.

    Counters are per process: watch one compiling block at a time (the engine compiles on one thread)."""

    def __init__(self) -> None:
        self.report: CompileReport | None = None
        self._before: dict[str, int] = {}
        self._started = 0.0

    def __enter__(self) -> CompileWatch:
        self._before = _snapshot()
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        seconds = time.perf_counter() - self._started
        after = _snapshot()
        self.report = CompileReport(seconds, **{k: after[k] - self._before[k] for k in _COUNTERS})


def persist(report: CompileReport) -> None:
    """Commit what a miss compiled to the shared volume (Modal; a no-op elsewhere); never raises."""
    if not report.wrote:
        return
    try:
        volume_sync()
    except Exception as exc:  # noqa: BLE001 - a later commit (Modal's own, or the next one) still carries it
        log.warning("could not commit the compile cache to the volume: %s", exc)


def start_compile_workers() -> None:
    """Start inductor's compile subprocesses now. torch starts them when its backend first gets a graph, and
    until they answer it compiles the graph's Triton kernels one after another in this process; a rollout
    otherwise gets there only after loading its model and receiving its first task, so the pool would still be
    warming while the decode step compiles. torch's own warm-up, so TORCH_WARM_POOL=0 and a machine without
    Triton or with one compile thread still turn it off; a failure only leaves torch to start it later."""
    try:
        from torch._inductor.async_compile import maybe_warm_pool

        maybe_warm_pool()
    except Exception as exc:  # noqa: BLE001 - private torch API: an upgrade that moves it costs a log line
        log.info(
            "inductor's compile workers not started early (%s): torch starts them at the first compile", exc
        )
