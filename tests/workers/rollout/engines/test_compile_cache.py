"""The run's compile cache on the CPU: torch, started with the environment a backend gives a worker, uses
the run's folder with both caches on (a few seconds: one torch import); and, end to end (marked slow,
about 15 s), a second process compiling what a first one compiled is served from that folder and the
report says so. torch.compile with inductor works on this CPU (gcc). The compiled function is a matmul,
which inductor hands to an extern kernel: no C++ to build.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mortal.controller.backends import WorkerLaunch
from mortal.state import paths
from mortal.workers.rollout.engines import compile_cache
from mortal.workers.rollout.engines.compile_cache import CompileReport

COMPILES = """
import json, torch
from mortal.workers.rollout.engines.compile_cache import CompileWatch
with torch.no_grad(), CompileWatch() as watch:
    torch.compile(lambda x: x @ x.t(), dynamic=False)(torch.ones(4, 8))
r = watch.report
print(json.dumps({"verdict": r.verdict, "fx_hit": r.fx_hit, "fx_miss": r.fx_miss, "aot_hit": r.aot_hit,
                  "aot_miss": r.aot_miss, "line": r.describe()}))
"""


RESOLVES = """
import json
from torch._functorch import config as functorch_config
from torch._inductor import config
from torch._inductor.runtime.cache_dir_utils import cache_dir, triton_cache_dir
print(json.dumps({"inductor": cache_dir(), "triton": triton_cache_dir(0),
                  "fx_graph_cache": config.fx_graph_cache,
                  "autograd_cache": functorch_config.enable_autograd_cache}))
"""


def _in_a_worker_process(home: Path, code: str) -> dict:
    launch = WorkerLaunch(
        run="cc",
        role="rollout",
        replica=0,
        incarnation=1,
        worker_id="cc/rollout-0#1",
        state_url="sqlite:///unused.db",
        mortal_home=str(home),
    )
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_"))}
    env = launch.environ(inherited, "")
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # no pool of compile workers to start
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_torch_in_a_worker_uses_the_runs_folder_with_both_caches_on(tmp_path: Path) -> None:
    folder = paths.compile_cache_dir(tmp_path)
    assert _in_a_worker_process(tmp_path, RESOLVES) == {
        "inductor": str(folder / "inductor"),
        "triton": str(folder / "triton"),
        "fx_graph_cache": True,
        "autograd_cache": True,
    }


@pytest.mark.slow
def test_a_relaunched_process_is_served_what_the_first_compiled(tmp_path: Path) -> None:
    first = _in_a_worker_process(tmp_path, COMPILES)
    assert (first["verdict"], first["fx_miss"], first["fx_hit"], first["aot_miss"]) == ("cache miss", 1, 0, 1)
    inductor = paths.compile_cache_dir(tmp_path) / "inductor"
    assert any((inductor / "fxgraph").iterdir()) and any((inductor / "aotautograd").iterdir())

    second = _in_a_worker_process(tmp_path, COMPILES)
    assert (second["verdict"], second["fx_hit"], second["fx_miss"], second["aot_hit"]) == (
        "cache hit",
        1,
        0,
        1,
    )
    assert f"cache {inductor}" in second["line"] and "compile cache hit" in second["line"]


@pytest.mark.parametrize(
    ("counts", "verdict"),
    [
        ({}, "no compile"),
        ({"fx_hit": 2}, "cache hit"),
        ({"fx_miss": 1}, "cache miss"),
        ({"fx_bypass": 1}, "cache miss"),
        ({"fx_hit": 1, "fx_miss": 1}, "partial cache hit"),
    ],
)
def test_verdict(counts: dict, verdict: str) -> None:
    assert CompileReport(1.0, **counts).verdict == verdict


def test_what_a_miss_compiled_is_committed_to_the_volume_and_a_failed_commit_is_only_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    commits = []
    monkeypatch.setattr(compile_cache, "volume_sync", lambda: commits.append(1))
    compile_cache.persist(CompileReport(1.0, fx_hit=3))
    assert commits == []  # nothing new was written
    compile_cache.persist(CompileReport(1.0, fx_miss=1, aot_miss=1))
    assert commits == [1]

    def broken() -> None:
        raise RuntimeError("volume busy")

    monkeypatch.setattr(compile_cache, "volume_sync", broken)
    compile_cache.persist(CompileReport(1.0, fx_miss=1))
    assert "could not commit the compile cache" in caplog.text


def test_start_compile_workers_is_torchs_own_pool_warm_up_and_never_fails_the_worker(
    monkeypatch, caplog
) -> None:
    import torch._inductor.async_compile as async_compile

    calls: list[int] = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: calls.append(1))
    compile_cache.start_compile_workers()
    assert calls == [1]

    def moved() -> None:
        raise AttributeError("maybe_warm_pool is gone")

    monkeypatch.setattr(async_compile, "maybe_warm_pool", moved)
    with caplog.at_level("INFO", logger="mortal.worker"):
        compile_cache.start_compile_workers()
    assert "not started early" in caplog.text
