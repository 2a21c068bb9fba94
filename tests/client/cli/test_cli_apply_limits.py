"""`mortalctl apply` holds every input to the YAML reader's limits: a file, a folder, stdin, JSON.

A billion-laughs spec (nested aliases) or a JSON value nested past MAX_DEPTH fails at once with the
loader's error, naming the file, the line and the limit; nothing is applied.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys

from clihelpers import QUICKSTART
from hostile_yaml import FAST_SECONDS, SMALL_BYTES, billion_laughs, bounded, deep_json
from store_kinds import sqlite_only

from mortal.specs.parse_limits import MAX_DEPTH

ADDRESS_SPACE = 2 * 1024**3
pytestmark = sqlite_only  # the subject is how apply reads its input, not the store


def refused_fast(cli, *args: str, input: str | None = None):
    result, seconds, peak = bounded(lambda: cli("apply", *args, input=input))
    assert result.exit_code == 1, result.output
    assert seconds < FAST_SECONDS and peak < SMALL_BYTES, (seconds, peak)
    return result


def test_apply_a_billion_laughs_file_fails_fast_naming_file_line_and_limit(cli, tmp_path):
    path = tmp_path / "lol.yaml"
    path.write_text(billion_laughs())
    out = refused_fast(cli, "-f", str(path))
    assert out.stderr.startswith(f"error: {path}:") and "(MAX_ALIAS" in out.stderr
    assert cli("get", "runs").stdout.strip() in ("", "No resources found.")


def test_apply_a_folder_with_a_billion_laughs_file_applies_nothing(cli, tmp_path):
    (tmp_path / "lol.yaml").write_text(billion_laughs())
    (tmp_path / "quickstart.yaml").write_text(QUICKSTART.read_text())
    out = refused_fast(cli, "-f", str(tmp_path))
    assert "lol.yaml:" in out.stderr and "(MAX_ALIAS" in out.stderr
    assert "quickstart" not in cli("get", "runs").stdout


def test_apply_from_stdin_is_limited_too(cli):
    out = refused_fast(cli, "-f", "-", input=billion_laughs())
    assert out.stderr.startswith("error: <stdin>:") and "(MAX_ALIAS" in out.stderr


def test_json_on_stdin_nested_too_deep_is_refused(cli):
    out = refused_fast(cli, "-f", "-", input=deep_json(MAX_DEPTH * 1000))
    assert out.stderr == f"error: <stdin>:1: nested deeper than {MAX_DEPTH} levels (MAX_DEPTH)\n"


def test_get_json_still_applies_again(cli):
    assert cli("apply", "-f", str(QUICKSTART)).exit_code == 0
    dumped = cli("get", "runs", "-o", "json").stdout
    again = cli("apply", "-f", "-", input=dumped)
    assert (again.exit_code, again.stdout) == (0, "trainingrun/quickstart unchanged\n"), again.output


def test_a_real_mortalctl_process_refuses_it_within_a_small_address_space(mortal_home, store_url, tmp_path):
    path = tmp_path / "lol.yaml"
    path.write_text(billion_laughs())
    env = {
        **os.environ,
        "MORTAL_HOME": str(mortal_home),
        "MORTAL_STATE_URL": store_url,
        "MORTAL_NO_CONTROLLER": "1",
    }

    def limit() -> None:  # the interpreter and mortalctl's imports fit; expanding the aliases would not
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    out = subprocess.run(
        [sys.executable, "-m", "mortal.client.cli.main", "apply", "-f", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        preexec_fn=limit,
    )
    assert out.returncode == 1 and "(MAX_ALIAS" in out.stderr, out.stderr
