"""The run's compile cache, end to end on the CPU: a second process compiling what a first one compiled is
served from the cache the backend's environment points at, and the report says so.

torch.compile with inductor works on this CPU (gcc). The compiled function is a matmul, which inductor
hands to an extern kernel: no C++ to build, so both processes take a few seconds, mostly importing torch.
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
from mortal.workers import compile_cache
from mortal.workers.compile_cache import CompileReport

COMPILES = """
import json, torch
from mortal.workers.compile_cache import CompileWatch
with torch.no_grad(), CompileWatch() as watch:
    torch.compile(lambda x: x @ x.t(), dynamic=False)(torch.ones(4, 8))
r = watch.report
print(json.dumps({"verdict": r.verdict, "fx_hit": r.fx_hit, "fx_miss": r.fx_miss, "aot_hit": r.aot_hit,
                  "aot_miss": r.aot_miss, "line": r.describe()}))
"""


def _compile_in_a_worker_process(home: Path) -> dict:
    launch = WorkerLaunch(run="cc", role="rollout", replica=0, incarnation=1, worker_id="cc/rollout-0#1",
                          state_url="sqlite:///unused.db", mortal_home=str(home))
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_"))}
    env = launch.environ(inherited, "")
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # no pool of compile workers to start
    out = subprocess.run([sys.executable, "-c", COMPILES], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_relaunched_process_is_served_what_the_first_compiled(tmp_path: Path) -> None:
    first = _compile_in_a_worker_process(tmp_path)
    assert (first["verdict"], first["fx_miss"], first["fx_hit"], first["aot_miss"]) == ("cache miss", 1, 0, 1)
    inductor = paths.compile_cache_dir("cc", tmp_path) / "inductor"
    assert any((inductor / "fxgraph").iterdir()) and any((inductor / "aotautograd").iterdir())

    second = _compile_in_a_worker_process(tmp_path)
    assert (second["verdict"], second["fx_hit"], second["fx_miss"], second["aot_hit"]) == ("cache hit", 1, 0, 1)
    assert f"cache {inductor}" in second["line"] and "compile cache hit" in second["line"]


@pytest.mark.parametrize(("counts", "verdict"), [
    ({}, "no compile"),
    ({"fx_hit": 2}, "cache hit"),
    ({"fx_miss": 1}, "cache miss"),
    ({"fx_bypass": 1}, "cache miss"),
    ({"fx_hit": 1, "fx_miss": 1}, "partial cache hit"),
])
def test_verdict(counts: dict, verdict: str) -> None:
    assert CompileReport(1.0, **counts).verdict == verdict


def test_what_a_miss_compiled_is_committed_to_the_volume_and_a_failed_commit_is_only_logged(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
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
