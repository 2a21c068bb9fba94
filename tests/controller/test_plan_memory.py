"""Table tests of the planner's out-of-memory decisions: one relaunch, then Failed; MemoryFits and its one
event."""

from __future__ import annotations

import pytest
from planhelpers import CFG, kinds, proc, row, run_plan, running, status

from mortal.controller.actions import EndWorker, Launch
from mortal.controller.conditions import MemoryKnobs, memory_advice
from mortal.controller.outcome import RequeueAfter
from mortal.specs import RunStatus

OOM = 4
ROLLOUT_OOM = (
    "OutOfMemory: tried to allocate 2.00 GiB on GPU 0 (total 79.19 GiB, 1.23 GiB free, "
    "70.10 GiB allocated by PyTorch)"
)


def cond(p, type_):
    return next(c for c in p.status["conditions"] if c["type"] == type_)


def launches(p):
    return [(a.role, a.replica, a.restart) for a in p.actions if isinstance(a, Launch)]


def memory_events(p):
    return [(e.type, e.reason) for e in p.events if "MemoryFits" in e.message]


def test_first_out_of_memory_is_relaunched_once_after_backoff_with_one_warning():
    rows, procs = running(rollouts=1)
    rows[1] = row("rollout", 0, 2, "Failed", code=OOM, message=ROLLOUT_OOM, ended=30)
    p = run_plan(
        rows,
        procs[:1],
        prev=status("Running", conditions=[{"type": "MemoryFits", "status": "True"}]),
        colocate=True,
    )
    assert launches(p) == [("rollout", 0, True)]
    assert p.status["phase"] == "Recovering"
    c = cond(p, "MemoryFits")
    assert (c["status"], c["reason"]) == ("False", "OutOfMemory")
    assert c["message"].startswith(
        "rollout-0 #2 ran out of GPU memory: tried to allocate 2.00 GiB on GPU 0 "
        "(total 79.19 GiB, 1.23 GiB free, 70.10 GiB allocated by PyTorch)"
    )
    assert "a second out-of-memory fails the run" in c["message"]
    assert "generation.maxNumSeqs" in c["message"] and "rollout.colocate: false" in c["message"]
    assert "gradientCheckpointing" not in c["message"]  # an actor's remedy, not a rollout's
    assert memory_events(p) == [("Warning", "OutOfMemory")]
    RunStatus.model_validate(p.status)


def test_the_relaunch_waits_for_the_backoff_like_any_failure():
    rows, procs = running(rollouts=1)
    rows[1] = row("rollout", 0, 2, "Failed", code=OOM, message=ROLLOUT_OOM, ended=1)
    p = run_plan(rows, procs[:1], prev=status("Running"), backoff_seconds=5.0)
    assert launches(p) == []
    assert isinstance(p.outcome, RequeueAfter)
    assert p.status["message"].startswith(
        "restarting rollout-0 in 4s (failed: OutOfMemory: tried to allocate"
    )


def test_while_the_relaunch_runs_memory_fits_stays_false_and_no_second_event():
    rows = [
        row("actor", 0, 1, step=5),
        row("rollout", 0, 2, "Failed", code=OOM, message=ROLLOUT_OOM, ended=30),
        row("rollout", 0, 3),
    ]
    first = run_plan(rows, [proc(rows[0]), proc(rows[2])], prev=status("Recovering"))
    assert cond(first, "MemoryFits")["status"] == "False"
    again = run_plan(rows, [proc(rows[0]), proc(rows[2])], prev=first.status)
    assert memory_events(again) == []
    assert again.status["phase"] == "Running"
    assert kinds(again) == []


def test_second_out_of_memory_of_a_slot_fails_the_run_instead_of_relaunching():
    rows = [
        row("actor", 0, 1, step=5),
        row("rollout", 0, 2, "Failed", code=OOM, message=ROLLOUT_OOM, ended=60),
        row("rollout", 0, 3, "Failed", code=OOM, message=ROLLOUT_OOM, ended=1),
    ]
    first_oom = run_plan(rows[:2], [proc(rows[0])], prev=status("Running"))
    p = run_plan(rows, [proc(rows[0])], prev=first_oom.status)
    assert launches(p) == []
    assert p.status["phase"] == "Failed"
    failed = cond(p, "Failed")
    assert failed["reason"] == "OutOfMemory"
    assert failed["message"].startswith("rollout-0 #3 ran out of GPU memory: tried to allocate 2.00 GiB")
    assert "2 times with this spec, so it will not fit as it is" in failed["message"]
    assert cond(p, "MemoryFits")["status"] == "False"
    assert memory_events(p) == []  # the condition flipped once, on the first out-of-memory
    assert [(e.type, e.reason) for e in p.events] == [("Warning", "Failed")]
    assert p.status["restarts"] == 1
    assert [a.worker_id for a in p.actions if isinstance(a, EndWorker)] == [] and kinds(p) == [
        "Stop"
    ]  # the actor


def test_an_out_of_memory_with_no_restart_left_fails_with_its_own_reason():
    rows, procs = running(rollouts=1)
    rows[0] = row(
        "actor", 0, 1, "Failed", code=OOM, message="OutOfMemory: tried to allocate 512.00 MiB", ended=30
    )
    p = run_plan(rows, procs[1:], prev=status("Running"), max_restarts=0)
    assert p.status["phase"] == "Failed"
    assert cond(p, "Failed")["reason"] == "OutOfMemory"
    message = cond(p, "Failed")["message"]
    assert "actor-0 #1 ran out of GPU memory: tried to allocate 512.00 MiB" in message
    assert "lower algorithm.batchSize" in message and "model.gradientCheckpointing: true" in message
    assert "model.lora" in message


@pytest.mark.parametrize(("micro", "advised"), [(16, "lower algorithm.microBatchSize (now 16)"), (1, None)])
def test_the_actors_advice_starts_with_smaller_micro_batches_until_there_are_none(micro, advised):
    rows, procs = running(rollouts=1)
    rows[0] = row(
        "actor", 0, 1, "Failed", code=OOM, message="OutOfMemory: tried to allocate 2.00 GiB", ended=30
    )
    message = cond(
        run_plan(rows, procs[1:], prev=status("Running"), max_restarts=0, micro_batch_size=micro), "Failed"
    )["message"]
    if advised:
        assert message.index(advised) < message.index("lower algorithm.batchSize")
    else:
        assert "microBatchSize" not in message


def test_a_process_that_exited_4_without_its_report_is_lost_not_out_of_memory():
    """Only the worker's own report says out of memory: exit 4 from the run's code (os._exit(4) on a thread a
    reward started, on a CPU run) once read as one, with a GPU's advice."""
    rows, procs = running(rollouts=1)
    procs[0] = proc(rows[0], alive=False, code=OOM)
    p = run_plan(rows, procs, prev=status("Running"))
    end = next(a for a in p.actions if isinstance(a, EndWorker))
    assert (end.state, end.exit_code) == ("Lost", OOM)
    assert "without the report the worker writes with it" in end.message
    assert cond(p, "MemoryFits")["status"] == "True"


def test_an_actor_already_on_lora_with_checkpointing_is_not_told_to_use_them():
    rows, procs = running(rollouts=1)
    rows[0] = row(
        "actor", 0, 1, "Failed", code=OOM, message="OutOfMemory: tried to allocate 1.00 GiB", ended=30
    )
    p = run_plan(rows, procs[1:], prev=status("Running"), lora=True, gradient_checkpointing=True)
    message = cond(p, "MemoryFits")["message"]
    assert "gradientCheckpointing" not in message and "model.lora" not in message
    assert "lower algorithm.batchSize" in message and "actor.gpu" in message


def test_other_failures_leave_memory_fits_true_and_relaunch_as_before():
    rows, procs = running(rollouts=1)
    rows[1] = row("rollout", 0, 2, "Failed", code=75, message="RuntimeError: boom", ended=30)
    p = run_plan(rows, procs[:1], prev=status("Running"))
    assert cond(p, "MemoryFits")["status"] == "True"
    assert launches(p) == [("rollout", 0, True)]
    assert CFG.backoff_reset_seconds > 0


def test_memory_fits_turns_true_once_the_slot_ends_another_way():
    rows = [
        row("actor", 0, 1, step=5),
        row("rollout", 0, 2, "Failed", code=OOM, message=ROLLOUT_OOM, ended=300),
        row("rollout", 0, 3, "Stopped", ended=10),
        row("rollout", 0, 4),
    ]
    p = run_plan(
        rows,
        [proc(rows[0]), proc(rows[3])],
        prev=status("Running", conditions=[{"type": "MemoryFits", "status": "False"}]),
    )
    assert cond(p, "MemoryFits")["status"] == "True"
    assert memory_events(p) == [("Normal", "NoOutOfMemory")]


@pytest.mark.parametrize(
    ("role", "share", "advised"),
    [
        (
            "rollout",
            None,
            "set rollout.gpuMemoryUtilization (e.g. 0.3): the rollout then decodes only the rows",
        ),
        ("rollout", 0.2, "raise rollout.gpuMemoryUtilization (now 0.2)"),
        (
            "actor",
            None,
            "set rollout.gpuMemoryUtilization (e.g. 0.3): the colocated rollouts' share of this GPU",
        ),
        ("actor", 0.4, "lower rollout.gpuMemoryUtilization (now 0.4): the colocated rollouts' share"),
    ],
)
def test_colocated_advice_names_the_rollouts_share_of_the_gpu(role, share, advised):
    assert advised in memory_advice(role, MemoryKnobs(colocate=True, rollout_share=share))
    assert "gpuMemoryUtilization" not in memory_advice(role, MemoryKnobs(colocate=False))


def test_a_sharded_actor_is_told_to_shard_wider_or_offload_and_an_unsharded_one_that_it_may_shard():
    sharded = memory_advice("actor", MemoryKnobs(actor_ranks=2))
    assert (
        "actor.count, now 2" in sharded
        and "actor.cpuOffload: true" in sharded
        and "model.lora" not in sharded
    )
    assert "actor.count" not in memory_advice("actor", MemoryKnobs(actor_ranks=2, cpu_offload=True))
    assert "actor.count: 2" in memory_advice("actor", MemoryKnobs())


def test_a_replicated_actor_is_told_to_shard():
    advice = memory_advice("actor", MemoryKnobs(actor_ranks=2, replicated=True))
    assert "actor.strategy: fsdp" in advice and "actor.count, now 2" not in advice


def test_a_sharded_actor_keeping_its_gathered_weights_is_told_first_to_let_them_go():
    advice = memory_advice("actor", MemoryKnobs(actor_ranks=2, reshard_after_forward=False))
    assert advice.startswith("set actor.reshardAfterForward: true")
    assert "reshardAfterForward" not in memory_advice("actor", MemoryKnobs(actor_ranks=2))
