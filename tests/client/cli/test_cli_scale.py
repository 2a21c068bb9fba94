"""`mortalctl scale`: with and without a name, preconditions, validation, conflicts."""

from __future__ import annotations

import pytest
from clihelpers import DROP, QUICKSTART, set_status

from mortal.client.cli.context import modify_spec
from mortal.client.cli.scale import scaled_spec
from mortal.state import Conflict, open_store


@pytest.fixture
def store(store_url):
    opened = open_store(store_url)
    yield opened
    opened.close()


def test_scale_named_run(cli, store):
    cli("apply", "-f", str(QUICKSTART))
    out = cli("scale", "quickstart", "rollout=4")
    assert out.exit_code == 0, out.output
    assert out.stdout == "trainingrun/quickstart scaled (rollout: 2 -> 4)\n"
    row = store.get_run("quickstart")
    assert (row.spec["rollout"]["replicas"], row.generation) == (4, 2)
    again = cli("scale", "trainingrun/quickstart", "rollout=4")
    assert again.stdout == "trainingrun/quickstart unchanged (rollout: 4 -> 4)\n"
    assert store.get_run("quickstart").resource_version == row.resource_version


def test_scale_to_zero_and_replicas_shorthand(cli, store):
    cli("apply", "-f", str(QUICKSTART))
    assert cli("scale", "quickstart", "rollout=0").exit_code == 0
    assert store.get_run("quickstart").spec["rollout"]["replicas"] == 0
    assert cli("scale", "quickstart", "--replicas", "3").exit_code == 0
    assert store.get_run("quickstart").spec["rollout"]["replicas"] == 3


def test_re_applying_a_file_keeps_the_scale_of_a_field_it_leaves_out(cli, spec_file, store):
    """kubectl apply's three-way merge: a scale of a field the file does not set survives re-applying the
    file; a file that sets the field decides (leave replicas out of a file whose run you scale by hand);
    a field dropped from the file since its last apply goes back to its default."""
    without = spec_file("quickstart", **{"spec.rollout.replicas": DROP})
    assert cli("apply", "-f", str(without)).stdout == "trainingrun/quickstart created\n"
    assert cli("scale", "quickstart", "rollout=3").exit_code == 0
    assert cli("apply", "-f", str(without)).stdout == "trainingrun/quickstart unchanged\n"
    assert store.get_run("quickstart").spec["rollout"]["replicas"] == 3
    assert cli("apply", "-f", str(QUICKSTART)).stdout == "trainingrun/quickstart configured\n"
    assert store.get_run("quickstart").spec["rollout"]["replicas"] == 2, "the file sets 2"
    assert cli("apply", "-f", str(without)).stdout == "trainingrun/quickstart configured\n"
    assert store.get_run("quickstart").spec["rollout"]["replicas"] == 1, "dropped from the file: the default"


def test_scale_without_name_picks_the_one_active_run(cli, spec_file, store):
    cli("apply", "-f", str(QUICKSTART))
    cli("apply", "-f", str(spec_file("done")))
    set_status(store, "done", phase="Succeeded")
    out = cli("scale", "rollout=3")
    assert out.exit_code == 0, out.output
    assert out.stdout.startswith("trainingrun/quickstart scaled")


def test_scale_without_name_and_several_active_runs_lists_them(cli, spec_file):
    cli("apply", "-f", str(QUICKSTART))
    cli("apply", "-f", str(spec_file("second")))
    out = cli("scale", "rollout=3")
    assert out.exit_code == 1
    assert "2 runs are active (quickstart, second)" in out.stderr
    assert "mortalctl scale NAME rollout=N" in out.stderr


def test_scale_without_name_and_no_run(cli):
    out = cli("scale", "rollout=3")
    assert out.exit_code == 1 and "no active run" in out.stderr


def test_current_replicas_precondition(cli, store):
    cli("apply", "-f", str(QUICKSTART))
    wrong = cli("scale", "quickstart", "rollout=5", "--current-replicas", "3")
    assert wrong.exit_code == 1
    assert "has rollout=2, not --current-replicas=3" in wrong.stderr
    assert store.get_run("quickstart").spec["rollout"]["replicas"] == 2
    right = cli("scale", "quickstart", "rollout=5", "--current-replicas=2")
    assert right.exit_code == 0, right.output
    assert store.get_run("quickstart").spec["rollout"]["replicas"] == 5


def test_actor_count_is_validated_by_the_spec(cli, store):
    cli("apply", "-f", str(QUICKSTART))
    out = cli("scale", "quickstart", "actor=3")  # 16 completions a step do not split over 3 ranks
    assert out.exit_code == 1
    assert "actor.count" in out.stderr and "must divide over the actor's 3 ranks" in out.stderr
    assert cli("scale", "quickstart", "actor=1").stdout.startswith("trainingrun/quickstart unchanged")


def test_scaling_the_actor_says_its_ranks_change_at_its_next_start(cli, store):
    cli("apply", "-f", str(QUICKSTART))
    out = cli("scale", "quickstart", "actor=2")
    assert out.exit_code == 0 and out.stdout == "trainingrun/quickstart scaled (actor: 1 -> 2)\n"
    assert "trains with 2 ranks from its next start (mortalctl suspend quickstart, then resume" in out.stderr
    assert store.get_run("quickstart").spec["actor"]["count"] == 2
    assert "note:" not in cli("scale", "quickstart", "rollout=3").stderr  # rollouts are scaled live


@pytest.mark.parametrize(
    "args",
    [
        ["quickstart", "gpu=2"],
        ["quickstart", "rollout=-1"],
        ["quickstart", "rollout=x"],
        ["quickstart"],
        ["a", "b", "rollout=1"],
    ],
)
def test_usage_errors_exit_2(cli, args):
    cli("apply", "-f", str(QUICKSTART))
    assert cli("scale", *args).exit_code == 2


def test_scale_missing_run_is_exit_1(cli):
    out = cli("scale", "nope", "rollout=2")
    assert out.exit_code == 1 and "not found" in out.stderr


def test_modify_spec_rereads_and_retries_on_conflict(cli, store):
    """A writer that lands between our read and our write costs one retry, not an error or a lost update."""
    cli("apply", "-f", str(QUICKSTART))
    calls = []

    def change(row):
        calls.append(row.resource_version)
        if len(calls) == 1:  # someone else scales in between
            store.update_spec("quickstart", {**row.spec, "suspend": True}, row.resource_version)
        return scaled_spec(row, {"rollout": 7})

    _, after = modify_spec(store, "quickstart", change)
    assert len(calls) == 2 and calls[1] > calls[0]
    assert after.spec["rollout"]["replicas"] == 7 and after.spec["suspend"] is True


def test_modify_spec_gives_up_after_repeated_conflicts(cli, store):
    cli("apply", "-f", str(QUICKSTART))

    def change(row):
        store.update_spec(
            "quickstart", {**row.spec, "suspend": not row.spec["suspend"]}, row.resource_version
        )
        return scaled_spec(row, {"rollout": 7})

    with pytest.raises(Conflict):
        modify_spec(store, "quickstart", change, retries=3)
