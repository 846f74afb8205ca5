"""A node as one worker (``AsyncPSStrategy(island=...)``, plug_asgd/placement/island.py): the refusals before anything
starts, the plan's arithmetic, and real launches in which islands of 2 processes train, each island's ranks holding
the same bits at every batch (gathered from every rank, not assumed), the PS seeing one worker per island, an island
alone training DDP's bits, and an island whose leader is killed ending while the other island finishes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl

from plug_asgd import AsyncPSStrategy
from plug_asgd.placement.island import IslandPlan, check_island, island_size
from plug_asgd.placement.island_collectives import decode_part, encode_part
from tests.conftest import (
    PYTHON,
    ProcessGroups,
    free_port_block,
    full_tier_param,
    params_to_run,
    require_emulated_hosts,
    run_on_emulated_hosts,
)
from tests.scripts.island_fit import folder

SCRIPT = "tests/scripts/island_fit.py"
# every mode that takes islands (hogwild refuses them), one fit each in one launch of 2 islands of 2 processes
MODES = ["asgd", "adacomp", "agn", "downpour", "dynsgd", "eamsgd", "easgd", "localsgd", "losp", "osp", "sagn", "ssp",
         "sync", "diloco:inner_steps=5", "async_diloco:inner_steps=5", "diloco:inner_steps=6,fragments=2"]
# the suite's: one for each way an island's leader exchanges (a push each step, rounds, local steps between rounds,
# rounds overlapped, elastic, inner steps with an outer step, inner steps applied as they arrive); the full tier
# fits the others (diloco's fragments among them: the leader's exchange is the fragments', its island gets its weights
# after every step as with any exchange)
SUITE_MODES = ("asgd", "sync", "localsgd", "osp", "easgd", "diloco:inner_steps=5", "async_diloco:inner_steps=5")


# -- refusals and arithmetic (quick) ---------------------------------------------------------------------


@pytest.mark.parametrize(("island", "devices", "nodes", "expected"), [
    (1, 4, 1, 1), (2, 4, 1, 2), ("node", 4, 2, 4), ("auto", 4, 1, 1), ("auto", 4, 2, 4), ("auto", 1, 3, 1)])
def test_island_size_is_what_the_setting_and_the_nodes_give(island, devices, nodes, expected):
    assert island_size(island, devices, nodes, "asgd") == expected


def test_auto_keeps_hogwild_per_device_and_an_explicit_island_refuses_it():
    assert island_size("auto", 4, 2, "hogwild") == 1
    with pytest.raises(ValueError, match="hogwild.*cannot train with island='node'.*Use island=1"):
        check_island("node", "hogwild")
    with pytest.raises(ValueError, match="cannot train with island=2"):
        AsyncPSStrategy(mode="hogwild", island=2)


@pytest.mark.parametrize("bad", [0, -1, "nodes", 1.5, True, None])
def test_an_island_that_is_no_size_is_refused_with_the_choices(bad):
    with pytest.raises(ValueError, match="give a number of consecutive local ranks"):
        AsyncPSStrategy(island=bad)


def test_an_island_that_would_span_two_nodes_or_not_divide_a_node_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="would span two nodes"):
        pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=AsyncPSStrategy(island=4), logger=False)
    with pytest.raises(ValueError, match="does not divide the 4 devices of a node"):
        pl.Trainer(accelerator="cpu", devices=4, strategy=AsyncPSStrategy(island=3), logger=False)
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=AsyncPSStrategy(island=2), logger=False)
    assert trainer.strategy.island_ranks == 2


def test_the_plan_numbers_islands_as_the_ps_sees_them():
    plans = [IslandPlan(2, r, 8) for r in range(8)]
    assert [p.island for p in plans] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [p.leader for p in plans] == [True, False] * 4
    assert {p.count for p in plans} == {4} and plans[5].island_of(6) == 3


def test_a_collective_part_crosses_the_island_as_msgpack_with_its_arrays_bit_for_bit():
    arrays = {"x": np.arange(6, dtype=np.float32).reshape(2, 3) / 7, "n": np.array([3], dtype=np.int64)}
    rank, obj, back = decode_part(encode_part(5, {"value": [1, "a"]}, arrays))
    assert rank == 5 and obj == {"value": [1, "a"]}
    for k, v in arrays.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and back[k].tobytes() == v.tobytes()


# -- real launches -----------------------------------------------------------------------------------------


def _launch(out: Path, *args: str, timeout: float) -> tuple[int, str]:
    groups = ProcessGroups()
    try:
        code, log = groups.run([PYTHON, SCRIPT, "--out", str(out), *args], timeout=timeout,
                               env={"OMP_NUM_THREADS": "1"})
    finally:
        left = groups.leftovers()
        for p in groups.procs:
            groups.kill(p)
    assert not left, f"processes left running: {left}"
    return code, log


def _ranks(out: Path, log: str, ranks: int = 4) -> list[dict]:
    missing = [r for r in range(ranks) if not (out / f"rank{r}.json").exists()]
    assert not missing, f"rank(s) {missing} wrote no result:\n{log[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


@pytest.fixture(scope="module")
def islands_run(request, tmp_path_factory):
    """Each mode this session's tests check, 2 islands of 2 processes on this machine, 20 steps each."""
    modes = params_to_run(request, "mode")
    out = tmp_path_factory.mktemp("islands")
    code, log = _launch(out, "--modes", ";".join(modes), "--steps", "20", "--ps-port",
                        str(free_port_block(10 * len(modes))), timeout=400)
    assert code == 0, log[-4000:]
    return out, log, len(modes)


@pytest.mark.integration
@pytest.mark.timeout(480)
@pytest.mark.parametrize("mode", [full_tier_param(m, SUITE_MODES) for m in MODES])
def test_every_mode_trains_islands_whose_ranks_hold_the_same_bits_and_the_ps_sees_one_worker_each(islands_run,
                                                                                                   mode):
    out, log, launched = islands_run
    ranks = _ranks(out / folder(mode) if launched > 1 else out, log)  # a launch of one mode writes into OUT
    for r in ranks:
        assert r["island"] == r["rank"] // 2 and r["leader"] == (r["rank"] % 2 == 0)
        assert r["steps"] == 20
        # the check ran at the start of every batch on every rank, each answering for its whole island
        assert len(r["agree"]) == 20 and all(r["agree"]), r["agree"]
        # 20 batches of 32 per rank, momentum SGD at lr 0.05: measured once per mode, islands of 2 reached 0.77
        # (sagn) to 0.90 (asgd, adacomp) and 4 per-device workers, which make twice the updates at half the batch,
        # 0.77 (sagn) to 0.97 (downpour); chance is 0.5
        assert r["test_acc"] >= 0.75, r
    assert len({r["digest"] for r in ranks}) == 1  # every rank ends on the final central model
    assert len({r["test_acc"] for r in ranks}) == 1  # reduced across islands through the PS: one value
    for leader in (ranks[0], ranks[2]):
        ps = leader["ps"]
        assert ps["world_size"] == 2 and set(ps["pushes_by_rank"]) <= {"0", "1"}, ps
        assert leader["comm"]["island_bytes_sent"] > 0
    # only the leaders pushed; both islands did
    assert set(ranks[0]["ps"]["pushes_by_rank"]) == {"0", "1"}
    for leader, follower in ((ranks[0], ranks[1]), (ranks[2], ranks[3])):
        assert "pushes" not in follower["comm"] and follower["comm"]["local_steps"] == 20
        assert follower["ps"] == leader["ps"]  # ps_stats() after the fit: the counters its leader saw as it left
        if "fragments=2" in mode:  # H = 6, F = 2: a fragment every 3 steps, fragment 1 first; the fit's end pushes
            # both (their steps since 15 and 18 not pushed): (the fit's step, the fragment)
            assert leader["comm"]["fragment_trace"] == [[3, 1], [6, 0], [9, 1], [12, 0], [15, 1], [18, 0], [20, 1],
                                                        [20, 0]], leader["comm"]


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_an_island_alone_trains_the_bits_of_ddp(tmp_path):
    """One island of 2 processes (the PS's lone worker: its pushes answered "own") against Lightning's DDP on 2
    processes: the same averaged gradient, the same momentum steps, the leader's BatchNorm buffers as DDP broadcasts
    rank 0's: the same bits after 12 steps."""
    runs = {}
    for name, args in (("island", ["--modes", "asgd", "--devices", "2", "--island", "node"]),
                       ("ddp", ["--modes", "ddp", "--devices", "2"])):
        code, log = _launch(tmp_path / name, *args, "--steps", "12", timeout=200)
        assert code == 0, log[-4000:]
        runs[name] = _ranks(tmp_path / name, log, ranks=2)
    assert runs["island"][0]["ps"]["world_size"] == 1
    # (DDP's rank 1 keeps the BatchNorm statistics of its own last batch: rank 0's are the ones it broadcasts)
    assert {r["digest"] for r in runs["island"]} == {runs["ddp"][0]["digest"]}, runs


@pytest.mark.integration
@pytest.mark.faults
@pytest.mark.timeout(300)
def test_a_killed_leader_ends_its_island_within_5_s_and_the_other_island_finishes(tmp_path):
    """Two nodes of 2 processes on this machine (each node's own launcher, as on two hosts), one island each. Rank 2
    (node 1's leader) SIGKILLs itself after its 5th step: rank 3 ends (its island lost a rank) within 5 s, the PS
    counts the lost island as a lost worker, and island 0 trains to its end and tests the central model.

    (On one node, Lightning's launcher ends every rank of the node when one of its processes dies, as it does for
    per-device workers: the islands that outlive one another are on different nodes.)"""
    out = tmp_path / "run"
    port = free_port_block(1)
    groups = ProcessGroups()
    try:
        nodes = [groups.start([PYTHON, SCRIPT, "--out", str(out), "--modes", "asgd", "--steps", "40", "--nodes", "2",
                               "--devices", "2", "--island", "node", "--kill-rank", "2", "--kill-at", "5",
                               "--worker-timeout", "4"],
                              env={"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "NODE_RANK": str(node)}) for node in (0, 1)]
        logs = []
        for proc in nodes:
            try:
                logs.append(proc.communicate(timeout=200)[0])
            except subprocess.TimeoutExpired:
                groups.kill(proc)
                logs.append(proc.communicate()[0])
    finally:
        left = groups.leftovers()
        for p in groups.procs:
            groups.kill(p)
    assert not left, f"processes left running: {left}"
    assert nodes[0].returncode == 0, logs[0][-4000:]
    assert nodes[1].returncode != 0, logs[1][-4000:]
    for r in (0, 1):
        rank = json.loads((out / f"rank{r}.json").read_text())
        assert rank["steps"] == 40 and all(rank["agree"]) and rank["test_acc"] >= 0.75, rank
    assert not (out / "rank2.json").exists() and not (out / "rank3.json").exists()
    assert "island 1 lost a rank" in logs[1], logs[1][-4000:]
    ps = json.loads((out / "rank0.json").read_text())["ps"]
    assert 4 <= ps["pushes_by_rank"]["1"] <= 5 and ps["pushes_by_rank"]["0"] == 40, ps
    ends = {e["rank"]: e for e in map(json.loads, (out / "ends.jsonl").read_text().splitlines())}
    assert ends[2]["how"] == "killed" and "IslandLost" in ends[3]["how"], ends
    assert ends[3]["at"] - ends[2]["at"] < 5.0, ends
    assert ends[0]["how"] == ends[1]["how"] == "done", ends


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_callbacks_validation_and_a_resumed_fit_work_with_islands(tmp_path):
    """Supervisor, PSCheckpoint and CommunicationMonitor on 2 islands of 2, validation twice in the fit, then a
    second fit resumed from Lightning's checkpoint on every rank alike: the islands' ranks agree at every batch of
    both fits and end on one model; each rank's monitor records its island and its traffic there."""
    out = tmp_path / "run"
    code, log = _launch(out, "--modes", "asgd", "--steps", "8", "--features", timeout=250)
    assert code == 0, log[-4000:]
    ranks = _ranks(out, log)
    for r in ranks:
        assert r["steps"] == 12 and len(r["agree"]) == 12 and all(r["agree"]), r  # 8 steps, then 4 more resumed
    assert len({r["digest"] for r in ranks}) == 1
    for r in range(4):
        records = [json.loads(line) for line in (out / "comm" / f"worker{r}.jsonl").read_text().splitlines()]
        last = records[-1]
        assert last["island"] == r // 2 and last["island_leader"] == (r % 2 == 0), last
        assert last["local_steps"] == 8 and last["island_bytes_received"] > 0, last
        # only a leader talks to the PS
        assert (last["pushes"] == 8 and last["bytes_up"] > 0) if r % 2 == 0 else (last["bytes_up"] == 0), last
    evaluations = (out / "supervisor" / "supervisor.jsonl").read_text().splitlines()
    assert evaluations and all(json.loads(e)["test_acc"] > 0 for e in evaluations)
    assert sorted(p.name.split("-")[1] for p in (out / "ps_ckpt").glob("ps-v*.ckpt"))[-1] == "v0000000016"


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_max_time_stops_each_islands_ranks_at_the_same_step_and_each_shard_folds_every_islands_pushes(tmp_path):
    """One launch for two things (it starts 4 processes): Lightning's Timer decides on rank 0 and the decision travels
    as a notice, so within an island every rank stops at the same batch (else its all-reduce would wait for a rank
    that left) and every rank ends on the final central model; and on 2 embedded shards each shard counts the 2
    islands as its workers and folds each island's every push, up to the step the Timer stopped it at."""
    out = tmp_path / "run"
    code, log = _launch(out, "--modes", "asgd,adacomp", "--steps", "2000", "--max-time", "00:00:00:05",
                        "--ps-shards", "2", "--ps-port", str(free_port_block(20)), timeout=250)
    assert code == 0, log[-4000:]
    for mode in ("asgd", "adacomp"):
        ranks = _ranks(out / mode, log)
        assert ranks[0]["steps"] == ranks[1]["steps"] and ranks[2]["steps"] == ranks[3]["steps"], (mode, ranks)
        assert all(0 < r["steps"] < 2000 and all(r["agree"]) for r in ranks), mode
        assert len({r["digest"] for r in ranks}) == 1, mode
        pushes = {"0": ranks[0]["steps"], "1": ranks[2]["steps"]}  # one push per island step, by the leader
        for shard in ranks[0]["ps"]["shards"]:
            assert shard["world_size"] == 2 and shard["pushes_by_rank"] == pushes, (mode, shard)


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_two_hosts_of_two_processes_send_one_workers_bytes_across_each_link(tmp_path):
    """2 emulated hosts (network namespaces) of 2 processes, ``island="auto"`` (the node, on 2 nodes): the PS sees 2
    workers, and what crosses node 1's link, read from its interface's counters, is its leader's traffic as the
    leader's client counted it on the wire (frames' headers and TCP's acknowledgements aside), not two workers'."""
    require_emulated_hosts(None, "i")
    out = tmp_path / "run"
    rc, output = run_on_emulated_hosts([PYTHON, "tests/scripts/per_node_launch.py", "--out", str(out), "--script",
                                        SCRIPT, "--timeout", "240", "--", "--devices", "2", "--island", "auto",
                                        "--steps", "10", "--width", "16384"], timeout=330)
    assert rc == 0, output[-6000:]
    ranks = _ranks(out, output)
    assert all(r["island"] == r["rank"] // 2 and len(r["agree"]) == 10 and all(r["agree"]) for r in ranks), ranks
    assert len({r["digest"] for r in ranks}) == 1
    ps = ranks[0]["ps"]
    assert ps["world_size"] == 2 and ps["pushes_by_rank"] == {"0": 10, "1": 10}, ps
    hosts = json.loads((out / "hosts.json").read_text())
    before, after = hosts["counters_before"]["n1"], hosts["counters_after"]["n1"]
    link = (after["tx"] - before["tx"]) + (after["rx"] - before["rx"])
    leader = ranks[2]["comm"]
    wire = leader["bytes_up"] + leader["bytes_down"]
    # a dense push of the 16,384-wide net carries 15 x 16,384 floats (its parameters and BatchNorm's statistics)
    assert leader["bytes_up"] > 10 * 15 * 16384 * 4
    assert wire <= link < 1.25 * wire, (link, wire)
