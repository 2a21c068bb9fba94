"""`mortalctl describe run` shows spec.limits, the active time counted against maxDuration and the GPU-hours
counted against maxGPUHours, and each worker's GPUs; `mortalctl schema` documents the limits."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from clihelpers import QUICKSTART, set_status

from mortal.state import WorkerRef, open_store


@pytest.fixture
def store(store_url):
    opened = open_store(store_url)
    yield opened
    opened.close()


def test_describe_shows_limits_active_time_and_gpu_hours(cli, store):
    assert cli("apply", "-f", str(QUICKSTART)).exit_code == 0
    row = store.get_run("quickstart")
    store.update_spec(
        "quickstart", {**row.spec, "limits": {"maxDuration": "2h", "maxGPUHours": 40}}, row.resource_version
    )
    worker = store.create_worker("quickstart", "actor", 0, "local", lease_seconds=30, gpus=2)
    store.heartbeat(WorkerRef("quickstart", "actor", 0, worker.incarnation))
    since = (datetime.now(UTC) - timedelta(minutes=5)).isoformat()
    set_status(store, "quickstart", phase="Running", activeSeconds=3600.0, activeSince=since, gpuHours=12.345)
    out = cli("describe", "run", "quickstart")
    assert out.exit_code == 0, out.output
    lines = {
        line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip()
        for line in out.stdout.splitlines()
        if ":" in line
    }
    assert lines["Limits"] == "maxDuration 2h, maxGPUHours 40"
    assert lines["Active time"].startswith("1h05m0") and lines["Active time"].endswith("of maxDuration 2h")
    assert lines["GPU-hours"] == "12.35 of maxGPUHours 40"
    header = next(line for line in out.stdout.splitlines() if "INCARNATION" in line)
    gpus_at = header.split().index("GPUS")
    actor_line = next(line for line in out.stdout.splitlines() if line.split()[:1] == ["actor"])
    assert actor_line.split()[gpus_at] == "2"


def test_describe_without_limits_says_none_and_zero_gpu_hours(cli, store):
    assert cli("apply", "-f", str(QUICKSTART)).exit_code == 0
    out = cli("describe", "run", "quickstart")
    assert out.exit_code == 0, out.output
    assert "Limits:" in out.stdout and "<none>" in out.stdout.split("Limits:")[1].splitlines()[0]
    assert "GPU-hours:" in out.stdout and out.stdout.split("GPU-hours:")[1].splitlines()[0].strip() == "0.00"


def test_schema_documents_the_limits(cli):
    out = cli("schema")
    assert out.exit_code == 0, out.output
    limits = json.loads(out.stdout)["$defs"]["LimitsSpec"]["properties"]
    assert set(limits) == {"maxDuration", "maxGPUHours"}
    assert (
        "Suspended" in limits["maxDuration"]["description"] and "90s" in limits["maxDuration"]["description"]
    )
    assert "GPUs it holds" in limits["maxGPUHours"]["description"]
