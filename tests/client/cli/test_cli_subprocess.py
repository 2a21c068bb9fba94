"""mortalctl as a user runs it: a real process (`python -m mortal.client.cli.main`), real exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from clihelpers import QUICKSTART


@pytest.fixture
def mortalctl(mortal_home, store_url):
    env = {
        **os.environ,
        "MORTAL_HOME": str(mortal_home),
        "MORTAL_STATE_URL": store_url,
        "MORTAL_NO_CONTROLLER": "1",
        "COLUMNS": "250",
    }
    env.pop("MORTAL_DEBUG", None)

    def run(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "mortal.client.cli.main", *args],
            input=input,
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )

    return run


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)  # every store: test_cli_apply (CliRunner)
def test_apply_created_unchanged_configured(mortalctl, spec_file):
    first = mortalctl("apply", "-f", str(QUICKSTART))
    assert (first.returncode, first.stdout) == (0, "trainingrun/quickstart created\n"), first.stderr
    second = mortalctl("apply", "-f", str(QUICKSTART))
    assert (second.returncode, second.stdout) == (0, "trainingrun/quickstart unchanged\n"), second.stderr
    edited = mortalctl("apply", "-f", str(spec_file(**{"spec.generation.maxTokens": 32})))
    assert edited.stdout == "trainingrun/quickstart configured\n"
    doc = json.loads(mortalctl("get", "run", "quickstart", "-o", "json").stdout)
    assert doc["metadata"]["generation"] == 2


def test_get_json_pipes_into_apply(mortalctl, spec_file):
    mortalctl("apply", "-f", str(QUICKSTART), "-f", str(spec_file("other")))
    dumped = mortalctl("get", "runs", "-o", "json")
    assert dumped.returncode == 0
    again = mortalctl("apply", "-f", "-", input=dumped.stdout)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == ["trainingrun/other unchanged", "trainingrun/quickstart unchanged"]


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_scale_suspend_resume_delete(mortalctl):
    mortalctl("apply", "-f", str(QUICKSTART))
    assert mortalctl("scale", "rollout=3").stdout == "trainingrun/quickstart scaled (rollout: 2 -> 3)\n"
    bad = mortalctl("scale", "quickstart", "rollout=4", "--current-replicas=2")
    assert bad.returncode == 1 and "not --current-replicas=2" in bad.stderr
    assert mortalctl("suspend", "run", "quickstart").stdout == "trainingrun/quickstart suspended\n"
    assert mortalctl("resume", "run", "quickstart").stdout == "trainingrun/quickstart resumed\n"
    assert mortalctl("delete", "run", "quickstart").returncode == 0
    table = mortalctl("get", "runs").stdout.splitlines()
    assert table[1].split()[:2] == ["quickstart", "Terminating"]


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_bad_file_is_exit_1_with_file_line_and_no_traceback(mortalctl, spec_file):
    bad = spec_file(**{"spec.algorithm.batchSize": 6})
    out = mortalctl("apply", "-f", str(bad))
    assert out.returncode == 1
    assert out.stderr.startswith(f"error: {bad}:")
    assert "batchSize" in out.stderr and "Traceback" not in out.stderr and out.stdout == ""


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_usage_errors_exit_2(mortalctl):
    out = mortalctl("apply", "--frobnicate")
    assert out.returncode == 2 and "No such option" in out.stderr
    assert mortalctl("get", "nonsense").returncode == 2


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("verb", ["apply", "get", "scale"])  # every verb's help: test_cli_ops (CliRunner)
def test_help_of_verbs(mortalctl, verb):
    out = mortalctl(verb, "--help")
    assert out.returncode == 0 and out.stdout.startswith(f"Usage: mortalctl {verb}")
    assert "Examples:" in out.stdout


def test_help_and_schema_import_no_ml_library(mortal_home):
    code = (
        "import sys\nfrom mortal.client.cli.main import app\nfrom typer.testing import CliRunner\n"
        "for args in (['--help'], ['schema'], ['apply', '--help']):\n"
        "    assert CliRunner().invoke(app, args).exit_code == 0\n"
        "import mortal\nmortal.MortalTrainer, mortal.RewardEnvironment\n"
        "print(sorted(m for m in ('torch', 'trl', 'transformers', 'datasets', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_installed_console_script(mortal_home):
    exe = os.path.join(os.path.dirname(sys.executable), "mortalctl")
    if not os.path.exists(exe):
        pytest.skip("mortalctl console script not installed (pip install -e .)")
    env = {**os.environ, "MORTAL_HOME": str(mortal_home), "MORTAL_NO_CONTROLLER": "1"}
    env.pop("MORTAL_STATE_URL", None)
    out = subprocess.run(
        [exe, "apply", "-f", str(QUICKSTART)], capture_output=True, text=True, env=env, timeout=120
    )
    assert (out.returncode, out.stdout) == (0, "trainingrun/quickstart created\n"), out.stderr
    assert (mortal_home / "state.db").exists()


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_controller_runs_in_the_foreground_until_idle(mortalctl):
    out = mortalctl("controller", "--idle-exit", "1")
    assert out.returncode == 0, out.stderr
    assert "started" in out.stderr and "idle" in out.stderr


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)  # every store: test_cli_fork (CliRunner)
def test_fork_and_rollback_exit_codes_and_no_ml_library(mortalctl, mortal_home):
    mortalctl("apply", "-f", str(QUICKSTART))
    missing = mortalctl("fork", "nope:step-3", "new")
    assert missing.returncode == 1 and missing.stderr == "error: trainingrun 'nope' not found\n"
    none = mortalctl("fork", "quickstart", "new")
    assert none.returncode == 1 and "trainingrun 'quickstart' has no complete checkpoint yet" in none.stderr
    back = mortalctl("rollback", "quickstart", "--to", "step-3")
    assert back.returncode == 1 and "has no complete checkpoint of step 3" in back.stderr
    assert mortalctl("rollback", "quickstart", "--to", "three").returncode == 2
    code = (
        "import sys\nfrom mortal.client.cli.main import app\nfrom typer.testing import CliRunner\n"
        "assert CliRunner().invoke(app, ['fork', 'quickstart', 'new']).exit_code == 1\n"
        "print(sorted(m for m in ('torch', 'trl', 'transformers', 'datasets', 'vllm') if m in sys.modules))"
    )
    env = {
        **os.environ,
        "MORTAL_HOME": str(mortal_home),
        "MORTAL_NO_CONTROLLER": "1",
        "MORTAL_STATE_URL": f"sqlite:///{mortal_home / 'state.db'}",
    }
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_a_reader_that_stops_early_is_no_error(mortal_home, store_url):
    """`mortalctl ... | head`: the pipe closes before the output is written; the command ends as `cat`
    would (exit 141, SIGPIPE's) with nothing on stderr, not "unexpected BrokenPipeError"."""
    env = {**os.environ, "MORTAL_HOME": str(mortal_home), "MORTAL_STATE_URL": store_url}
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    try:
        done = subprocess.run(
            [sys.executable, "-m", "mortal.client.cli.main", "controller", "status"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=120,
        )
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, "")


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_test_reward_keeps_what_a_reward_s_child_process_prints_inside_its_report(
    mortalctl, spec_file, tmp_path
):
    """A reward that runs a program (or C code writing to the file descriptor) prints where Python's own
    redirection does not reach: it is captured as the reward's output, and `-o json` stays one document."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "chatty_rewards.py").write_text(
        "import os, subprocess, sys\n\n"
        "def chatty(completions, **kw):\n"
        "    subprocess.run([sys.executable, '-c', 'print(\"from a child\")'], check=True)\n"
        "    os.write(2, b'straight to fd 2\\n')\n"
        "    print('from python')\n"
        "    return [1.0]\n"
    )
    rewards = [{"function": "chatty_rewards:chatty"}]
    path = spec_file("chatty", **{"spec.rewards": rewards, "spec.model": {"name": "example-org/absent"}})
    done = mortalctl_in(project, "test", "reward", "-f", str(path), "--completion", "27", "-o", "json")
    assert done.returncode == 0, done.stderr
    [report] = json.loads(done.stdout)["rewards"]
    assert sorted(report["stdout"].splitlines()) == ["from a child", "from python"]
    assert report["stderr"] == "straight to fd 2\n"
    assert "straight to fd 2" not in done.stderr


def test_test_rollout_sends_what_a_tool_prints_to_stderr_so_json_stays_one_document(tmp_path):
    """The run's tools print (and run programs that print) while it generates: stdout is kept for the
    document, and their output goes to stderr, where the user still sees it."""
    from rollout_helpers import assets_available, make_tiny_model

    if not assets_available():
        pytest.skip("needs the test assets (SmolLM2's tokenizer and config)")
    project = tmp_path / "project"
    project.mkdir()
    model = make_tiny_model(tmp_path / "tiny", seed=0)
    (project / "loud_tools.py").write_text(
        "import subprocess, sys\n\n"
        "class Loud:\n"
        "    def reset(self, **row):\n"
        "        print('reset from python')\n"
        "        subprocess.run([sys.executable, '-c', 'print(\"reset from a child\")'], check=True)\n\n"
        "    def shout(self, word: str) -> str:\n"
        '        """Shout.\n\n        Args:\n            word: what to shout\n        """\n'
        "        return word.upper()\n"
    )
    spec = project / "loud.yaml"
    spec.write_text(
        "apiVersion: mortal/v1\nkind: TrainingRun\nmetadata: {name: loud}\nspec:\n"
        f"  model: {{name: {model}}}\n  dataset: {{name: 'builtin:arith'}}\n"
        "  rewards: [{function: 'mortal.workers.rewards.builtin:correct_answer'}]\n"
        "  rollout: {environment: 'loud_tools:Loud', chatTemplate: qwen2_5}\n"
        "  generation: {maxTokens: 8}\n"
    )
    done = mortalctl_in(
        project, "test", "rollout", "-f", str(spec), "--row", "0", "-n", "1", "--device", "cpu", "-o", "json"
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["completions"]
    assert "reset from python" in done.stderr and "reset from a child" in done.stderr


def mortalctl_in(folder, *args: str) -> subprocess.CompletedProcess:
    """mortalctl run from `folder` (the run's modules import from there), no store involved."""
    return subprocess.run(
        [sys.executable, "-m", "mortal.client.cli.main", *args],
        capture_output=True,
        text=True,
        cwd=folder,
        env={**os.environ, "MORTAL_NO_CONTROLLER": "1"},
        timeout=300,
    )
