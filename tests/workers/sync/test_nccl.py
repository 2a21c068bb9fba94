"""Weight sync `nccl`: the actor serves each version from its snapshot ring, and a rollout asks for it
and receives it bit for bit; rollouts join and leave without disturbing one another; a version that
left the ring, or an actor that is gone, reads as a missing version (FileNotFoundError), never as a
hang; and a spec says when nccl is possible.

Between CPU tensors the same protocol runs over gloo, so all of this runs without a GPU; the NCCL
path itself runs on two GPUs, through the controller: here a rollout killed mid-run, and in
test_ipc the loss curve against volume."""

from __future__ import annotations

import multiprocessing
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from rollout_helpers import assets_available
from run_helpers import needs_two_gpus, train_through_controller

from mortal.specs import TrainingRun
from mortal.specs.dump import dump_yaml
from mortal.specs.errors import SpecError
from mortal.specs.loader import load_text
from mortal.workers.sync import nccl as nccl_weights
from mortal.workers.sync.nccl import NcclTransport
from mortal.workers.sync.publisher import WeightPublisher
from mortal.workers.sync.ring import adapter_scales, slot_version

needs_assets = pytest.mark.skipif(not assets_available(), reason="SmolLM2 assets missing")


def _state(value: float) -> dict[str, torch.Tensor]:
    return {
        "embed": torch.full((4, 3), value),
        "head": torch.arange(5, dtype=torch.bfloat16) + value,
        "norm": torch.full((3,), -value),
    }


@pytest.fixture
def server():
    server = nccl_weights.NcclWeightServer(ring=2)
    yield server
    server.close()
    nccl_weights._Peer.drop()


def _assert_same(received: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    assert received.keys() == state.keys()
    for name, tensor in state.items():
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name


def test_a_rollout_receives_each_version_bit_for_bit_and_training_after_sharing_does_not_change_it(
    server, tmp_path: Path
) -> None:
    live = _state(1.0)
    path = server.share(live, tmp_path / "v0", version=0, step=0)
    expected = {k: v.clone() for k, v in live.items()}
    for tensor in live.values():  # the actor trains on after sharing
        tensor.add_(10)
    _assert_same(nccl_weights.receive(path, torch.device("cpu")), expected)
    path = server.share(_state(2.0), tmp_path / "v1", version=1, step=1)
    _assert_same(nccl_weights.receive(path, torch.device("cpu")), _state(2.0))
    assert slot_version(NcclTransport().manifest(path)) == (1, 2)


def test_a_version_that_left_the_ring_reads_as_missing(server, tmp_path: Path) -> None:
    oldest = server.share(_state(0.0), tmp_path / "v0", version=0, step=0)
    for version in (1, 2):  # a ring of 2: version 2 takes version 0's slot
        server.share(_state(float(version)), tmp_path / f"v{version}", version=version, step=version)
    with pytest.raises(FileNotFoundError, match="left the actor's ring"):
        nccl_weights.receive(oldest, torch.device("cpu"))
    _assert_same(
        nccl_weights.receive(tmp_path / "v2", torch.device("cpu")), _state(2.0)
    )  # the pair still works


def _share_and_exit(folder: str, ready) -> None:
    server = nccl_weights.NcclWeightServer(ring=2)
    server.share(_state(3.0), Path(folder) / "v0", version=0, step=0)
    ready.put("shared")


def test_the_version_of_an_actor_that_exited_reads_as_missing_at_once(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    ready = context.Queue()
    actor = context.Process(target=_share_and_exit, args=(str(tmp_path), ready))
    actor.start()
    assert ready.get(timeout=120) == "shared"
    actor.join(60)
    started = time.monotonic()
    with pytest.raises(nccl_weights.SyncPeerGone, match="rendezvous"):
        nccl_weights.receive(tmp_path / "v0", torch.device("cpu"))
    assert time.monotonic() - started < 5


def _rollout(path: str, asks, answers) -> None:
    """A rollout process: receive the version named on `asks` (by path), answer its tensors; exit on None."""
    while (version_dir := asks.get(timeout=120)) is not None:
        try:
            answers.put(
                {k: v.clone() for k, v in nccl_weights.receive(version_dir, torch.device("cpu")).items()}
            )
        except FileNotFoundError as exc:
            answers.put(repr(exc))


def test_closing_wakes_the_accept_and_sender_threads_where_they_wait_idle(tmp_path: Path) -> None:
    """They wait in the store for minutes at a time (so torch logs no timeout every fraction of a
    second): close must not wait that out."""
    server = nccl_weights.NcclWeightServer(ring=2)
    path = server.share(_state(0.0), tmp_path / "v0", version=0, step=0)
    nccl_weights.receive(
        path, torch.device("cpu")
    )  # a rollout joined: a sender thread waits for its next ask
    threads = list(server._threads)
    assert len(threads) == 2
    started = time.monotonic()
    server.close()
    assert time.monotonic() - started < 3 and not any(thread.is_alive() for thread in threads)
    nccl_weights._Peer.drop()


def test_rollouts_join_and_leave_while_the_actor_serves_the_others(server, tmp_path: Path) -> None:
    """Pairs, not one group: a rollout that exits or one that joins late changes nothing for the rest."""
    context = multiprocessing.get_context("spawn")
    rollouts = {name: (context.Queue(), context.Queue()) for name in ("first", "second", "late")}
    processes = {
        name: context.Process(target=_rollout, args=(str(tmp_path), *queues), daemon=True)
        for name, queues in rollouts.items()
    }
    try:
        for name in ("first", "second"):
            processes[name].start()
        v0 = server.share(_state(0.0), tmp_path / "v0", version=0, step=0)
        for name in ("first", "second"):
            rollouts[name][0].put(str(v0))
            _assert_same(rollouts[name][1].get(timeout=120), _state(0.0))
        rollouts["first"][0].put(None)  # leaves (says bye as it exits)
        processes["first"].join(60)
        v1 = server.share(_state(1.0), tmp_path / "v1", version=1, step=1)
        processes["late"].start()
        for name in ("second", "late"):
            rollouts[name][0].put(str(v1))
            _assert_same(rollouts[name][1].get(timeout=120), _state(1.0))
        senders = [t for t in server._threads if t.name.startswith("nccl-send")]
        deadline = time.monotonic() + 10
        while senders[0].is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not senders[0].is_alive() and all(t.is_alive() for t in senders[1:])
    finally:
        for name, process in processes.items():
            if process.is_alive():
                rollouts[name][0].put(None)
                process.join(30)


def test_the_publisher_serves_a_models_weights_that_load_published_copies_in_place(
    tmp_path: Path, monkeypatch
) -> None:
    from unittest import mock

    from mortal.state import paths

    monkeypatch.setattr(paths, "weights_dir", lambda run: tmp_path / run)
    store = mock.Mock()
    store.latest_weights.return_value = None
    actor_model, rollout_model = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    publisher = WeightPublisher(store, mock.Mock(run="r"), keep=2, method="nccl")
    try:
        version = publisher.publish(actor_model, step=0, prune=False)
        path = store.publish_weights.call_args.args[3]
        weight = rollout_model.weight
        NcclTransport().load(rollout_model, path)
    finally:
        publisher.close()
        nccl_weights._Peer.drop()
    assert version == 0 and store.publish_weights.call_args.kwargs == {"method": "nccl", "provenance": None}
    assert rollout_model.weight is weight  # in place: captured graphs keep pointing at it
    _assert_same(rollout_model.state_dict(), {k: v.detach() for k, v in actor_model.state_dict().items()})
    assert NcclTransport().loaded_whole(path, newest_recorded=lambda: 0)
    assert not NcclTransport().loaded_whole(
        path, newest_recorded=lambda: 1
    )  # a ring of 2: version 2 may be in its slot now


def test_a_lora_actors_ring_holds_its_factors_alone_and_a_rollout_merges_each_version_onto_its_base(
    tmp_path: Path, monkeypatch
) -> None:
    """LoRA through the ring (ipc's ring too; nccl's protocol runs here over gloo): each version is the
    adapters' A and B (no merged model: 3 of those took 45 GB at 7B), and a rollout that loads version after
    version holds base + B @ A * scale of the newest, as peft's merge computes it, never one merged twice."""
    from unittest import mock

    from peft import LoraConfig, get_peft_model
    from rollout_helpers import make_tiny_model
    from transformers import AutoModelForCausalLM

    from mortal.state import paths
    from mortal.workers.sync.weights import plain_state_dict

    monkeypatch.setattr(paths, "weights_dir", lambda run: tmp_path / run)
    folder = make_tiny_model(tmp_path / "model")
    actor = get_peft_model(
        AutoModelForCausalLM.from_pretrained(folder),
        LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    rollout_model = AutoModelForCausalLM.from_pretrained(folder)
    store = mock.Mock()
    store.latest_weights.return_value = None
    publisher = WeightPublisher(store, mock.Mock(run="r"), keep=2, method="nccl")
    try:
        for version in range(2):
            with torch.no_grad():  # a step of training: B moves away from its zeros
                for name, param in actor.named_parameters():
                    if "lora_B" in name:
                        param.add_(0.01 * (version + 1))
            assert publisher.publish(actor, step=version, prune=False) == version
            path = store.publish_weights.call_args.args[3]
            scales = adapter_scales(NcclTransport().manifest(path))
            assert scales and set(scales.values()) == {2.0}
            assert {slot.name.rsplit(".", 1)[1] for slot in NcclTransport().manifest(path)["slots"]} == {
                "lora_A",
                "lora_B",
            }
            NcclTransport().load(rollout_model, path)
            merged = plain_state_dict(actor)
            _assert_same({k: v for k, v in rollout_model.state_dict().items() if k in merged}, merged)
    finally:
        publisher.close()
        nccl_weights._Peer.drop()


def _spec(**overrides) -> dict:
    spec = {
        "model": {"name": "m"},
        "dataset": {"name": "builtin:arithmetic"},
        "rewards": [{"function": "mortal.workers.rewards.builtin:short_answer"}],
        "actor": {"gpu": "H100"},
        "rollout": {"gpu": "H100"},
        "generation": {"engine": "transformers"},
        "sync": {"method": "nccl"},
    }
    for key, value in overrides.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return {"apiVersion": "mortal/v1", "kind": "TrainingRun", "metadata": {"name": "r"}, "spec": spec}


def test_nccl_is_accepted_for_rollouts_on_gpus_of_their_own_on_this_host() -> None:
    assert TrainingRun.model_validate(_spec()).spec.sync_method() == "nccl"


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"rollout": {"colocate": True}}, "GPU of its own"),
        ({"backend": "modal"}, "same host"),
        ({"rollout": {"gpu": "none"}}, "same host"),
        ({"generation": {"engine": "vllm"}}, "same host"),
    ],
)
def test_nccl_where_it_cannot_work_is_refused_naming_the_file_and_field(overrides: dict, says: str) -> None:
    text = dump_yaml([_spec(**overrides)])
    with pytest.raises(SpecError, match=rf"run\.yaml.*sync\.method.*{says}"):
        load_text(text, "run.yaml")


@pytest.mark.gpu
@needs_two_gpus
@needs_assets
def test_a_rollout_killed_mid_run_is_relaunched_joins_the_actor_again_and_the_run_finishes(
    tmp_path: Path,
) -> None:
    """Preemption of a rollout under nccl: its pair dies with it; the relaunched rollout joins a new
    pair and loads the newest version; the actor's other work goes on."""
    import os
    import signal

    from actor_helpers import actor_spec
    from rollout_helpers import make_tiny_model

    from mortal.controller.backends.local import parse_handle

    spec = actor_spec(
        str(make_tiny_model(tmp_path / "model", seed=0)),
        model={"dtype": "float32"},
        actor={"gpu": "H100"},
        rollout={"gpu": "H100", "replicas": 1},
        generation={"engine": "transformers"},
        algorithm={"maxSteps": 6},
        sync={"method": "nccl"},
        checkpoint={"every": 10, "keep": 1},
    )
    killed: list[int] = []

    def kill_the_rollout_after_step_2(store) -> None:
        if killed or not any(m.name == "loss" and m.step >= 2 for m in store.list_metrics("nccl-kill")):
            return
        [rollout] = [w for w in store.list_workers("nccl-kill", live_only=True) if w.role == "rollout"]
        pid, _ = parse_handle(rollout.handle)
        os.kill(pid, signal.SIGKILL)
        killed.append(rollout.incarnation)

    (tmp_path / "home").mkdir()
    losses = train_through_controller(
        tmp_path / "home", "nccl-kill", spec, gpus="0,1", while_running=kill_the_rollout_after_step_2
    )
    assert killed and sorted(losses) == [1, 2, 3, 4, 5, 6]
    from mortal.state import open_store

    store = open_store(f"sqlite:///{tmp_path / 'home' / 'state.db'}")
    later = [w for w in store.list_workers("nccl-kill") if w.role == "rollout" and w.incarnation > killed[0]]
    assert later and max(w.weight_version or 0 for w in later) >= 3, later


def test_a_collective_whose_peer_never_answers_fails_within_spec_deadlines_collective_seconds() -> None:
    """The pair's group is made with the collective deadline (here 1 s): a receive whose sender is stuck fails
    the rollout (it is relaunched) instead of waiting forever; the actor writes the deadline into each
    manifest, so both sides use the one the spec set."""
    import torch.distributed as dist

    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    groups: dict[int, object] = {}

    def make(rank: int) -> None:
        store = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10))
        groups[rank] = nccl_weights._group(
            dist.PrefixStore("pair/0/", store), rank, torch.device("cpu"), timedelta(seconds=1)
        )

    makers = [threading.Thread(target=make, args=(rank,)) for rank in (0, 1)]
    for t in makers:
        t.start()
    for t in makers:
        t.join(30)
    started = time.monotonic()
    with pytest.raises(RuntimeError):  # rank 0 (the actor's sender) never sends
        groups[1].recv([torch.empty(3)], 0, 0).wait()
    assert time.monotonic() - started < 10


def test_the_manifest_carries_the_collective_deadline(tmp_path: Path) -> None:
    server = nccl_weights.NcclWeightServer(ring=2, transfer_timeout=timedelta(seconds=7))
    try:
        path = server.share(_state(1.0), tmp_path / "v0", version=0, step=0)
        assert NcclTransport().manifest(path)["transfer_seconds"] == 7.0
    finally:
        server.close()
        nccl_weights._Peer.drop()
