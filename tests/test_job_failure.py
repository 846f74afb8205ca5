"""A rank's failure told to the job's other ranks through the PS (plug_asgd/ps/failure.py, issue 47).

The Lightning side (a real 2-rank job whose rank 0 or rank 1 raises, ending the others within 5 s) is in
tests/test_worker_failures.py; here the PS's side: what it refuses, what it still answers, and to whom.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import zmq

from plug_asgd.protocol.wire import Message, WireError, decode, encode
from plug_asgd.ps import failure
from plug_asgd.ps.failure import JobFailure
from plug_asgd.worker.client import PSClient, PSError
from tests.conftest import PYTHON
from tests.test_faults import WORKER, finish, ps_client, pushes, read_log, wait_for

W0 = {"w": np.zeros(4, np.float32)}


def test_a_failed_jobs_sessions_are_refused_but_for_bye_stats_and_heartbeats():
    jobs = JobFailure()
    assert jobs.record("rank 0 failed", ["a", "b"]) == {"a", "b"}
    assert jobs.record("rank 1 failed", ["b", "c"]) == {"c"}  # b keeps its job's first failure
    for session, text in (("a", "rank 0 failed"), ("b", "rank 0 failed"), ("c", "rank 1 failed")):
        for msg_type in ("push", "pull", "gather", "notice", "hello", "init", "attach"):
            with pytest.raises(WireError) as err:
                jobs.check(session, msg_type)
            assert (err.value.code, str(err.value)) == ("job_failed", text)
        for msg_type in ("bye", "stats", "heartbeat"):
            jobs.check(session, msg_type)
    jobs.check("d", "push")  # a worker started afterwards
    jobs.check(None, "pull")  # a bystander
    assert jobs.text == "rank 1 failed"


def test_a_byes_failed_text_is_bounded():
    assert failure.reason(Message("bye", {"failed": "x" * failure.MAX_FAILURE_CHARS})) is not None
    assert failure.reason(Message("bye", {})) is None
    for bad in ("x" * (failure.MAX_FAILURE_CHARS + 1), 7, ["x"]):
        with pytest.raises(WireError) as err:
            failure.reason(Message("bye", {"failed": bad}))
        assert err.value.code == "limit"


class Raw:
    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, msg_type: str, fields: dict, tensors: dict | None = None) -> None:
        self.sock.send_multipart(encode(msg_type, {"rid": 1, **fields}, tensors))

    def reply(self) -> tuple[str, dict]:
        assert self.sock.poll(20_000), "the PS did not answer"
        msg = decode(self.sock.recv_multipart())
        return msg.type, msg.fields

    def ask(self, msg_type: str, fields: dict, tensors: dict | None = None) -> tuple[str, dict]:
        self.send(msg_type, fields, tensors)
        return self.reply()


def hello(rank: int, session: str) -> dict:
    return {"rank": rank, "world_size": 3, "stage": 1, "session": session, "mode": "asgd", "training": True}


@pytest.mark.faults
def test_a_rank_that_fails_is_told_to_the_others_and_a_later_job_is_served(start_ps, fault_report):
    address = start_ps("asgd", worker_timeout=60)
    worker = PSClient(address, rank=0, world_size=3, mode="asgd", request_timeout=20, heartbeat_s=None)
    failing, waiting, later = Raw(address), Raw(address), Raw(address)
    try:
        worker.hello(stage=1, training=True, timeout=30)
        assert worker.init(W0)
        assert failing.ask("hello", hello(1, "failing"))[0] == "welcome"
        assert waiting.ask("hello", hello(2, "waiting"))[0] == "welcome"
        waiting.send("gather", {"rank": 2, "stage": 1, "seq": 0, "kind": "barrier:"})  # waits for the others
        kind, fields = failing.ask("bye", {"rank": 1, "stage": 1, "failed": "RuntimeError: out of memory",
                                           "session": "failing"})
        assert kind == "ok"
        text = "the job failed: rank 1 stopped on RuntimeError: out of memory"
        assert waiting.reply() == ("error", {"rid": 1, "code": "job_failed", "message": text, "epoch": 1})  # its gather
        with pytest.raises(PSError) as err:
            worker.push(0, {"w": np.ones(4, np.float32)})
        assert err.value.code == "job_failed" and text in str(err.value)
        assert waiting.ask("push", {"rank": 2, "base_version": 0, "seq": 1, "session": "waiting"},
                           {"w": np.ones(4, np.float32)})[1]["code"] == "job_failed"
        stats = worker.stats()  # still answered, as the bye that follows
        assert stats["job_failed"] == text and stats["version"] == 0 and stats["workers"] == [0, 2]
        assert Counter(stats["refused"]) == Counter(job_failed=3)
        worker.bye(1)
        assert waiting.ask("bye", {"rank": 2, "stage": 1})[0] == "ok"
        # a later job's worker (a new session) is served; the failed job's sessions stay refused
        assert later.ask("hello", {**hello(0, "later"), "world_size": 3})[0] == "welcome"
        kind, fields = later.ask("pull", {"rank": 0})
        assert kind == "model" and fields["version"] == 0
        assert waiting.ask("hello", hello(2, "waiting"))[1]["code"] == "job_failed"
    finally:
        worker.close()
        for raw in (failing, waiting, later):
            raw.sock.close(0)
    fault_report(fault="a rank's bye saying it failed, the job's other ranks pushing and waiting in a gather",
                 injected=1, handled=1, pushes_lost=0, recovery_s=None,
                 detail="the gather waiting and each later push, pull or hello of the job's other workers refused "
                        "(job_failed, quoting rank 1's error); their stats and byes answered; a later job's worker "
                        "served")


def test_a_gather_waiting_of_another_job_is_not_answered_by_a_failure(start_ps):
    address = start_ps("asgd", worker_timeout=60)
    first, second = Raw(address), Raw(address)
    try:
        assert first.ask("hello", hello(1, "first"))[0] == "welcome"
        assert first.ask("bye", {"rank": 1, "stage": 1, "failed": "KeyboardInterrupt: ", "session": "first"})[0] == "ok"
        assert second.ask("hello", hello(1, "second"))[0] == "welcome"  # a new process for the rank
        second.send("gather", {"rank": 1, "stage": 1, "seq": 0, "kind": "barrier:"})
        assert not second.sock.poll(500)  # it waits for ranks 0 and 2, as ever
        assert second.ask("stats", {})[1]["stats"]["refused"] == {}
    finally:
        for raw in (first, second):
            raw.sock.close(0)


@pytest.mark.faults
def test_only_a_ranks_own_connection_under_its_session_says_its_rank_failed(procs, start_ps, tmp_path, fault_report):
    """Forged failed byes, from a raw peer holding the free rank 2 and from one holding none, for the honest ranks
    (and for rank 2 under another session): each refused and counted; the honest workers train to the end."""
    address = start_ps("asgd", worker_timeout=60, world_size=3)
    logs = [tmp_path / f"w{r}.log" for r in (0, 1)]
    workers = [procs.start([PYTHON, WORKER, "--address", address, "--rank", str(r), "--world", "3", "--pushes", "40",
                            "--delta", str(r + 1.0), "--interval", "0.05", "--log", str(logs[r])]) for r in (0, 1)]
    squatter, stranger = Raw(address), Raw(address)
    try:
        wait_for(lambda: all(len(pushes(log)) >= 5 for log in logs), 60, "5 pushes of each worker")
        assert squatter.ask("hello", {**hello(2, "squat"), "stage": 0})[0] == "welcome"
        before = _state(address)
        forged = [(squatter, {"rank": 0, "session": "squat"}), (squatter, {"rank": 1}),
                  (squatter, {"rank": 2, "session": "another"}), (stranger, {"rank": 0}),
                  (stranger, {"rank": 1, "session": "squat"})]
        codes = [raw.ask("bye", {**fields, "stage": 0, "failed": "RuntimeError: forged"})[1]["code"]
                 for raw, fields in forged]
        assert codes == ["not_owner", "not_owner", "not_owner", "not_member", "not_member"]
        after = _state(address)
        assert after["job_failed"] is None and after["workers"] == [0, 1, 2] == before["workers"]
        for w in workers:
            finish(w)
        done = [r for log in logs for r in read_log(log) if r["event"] == "done"]
        assert len(done) == 2 and all(r["event"] != "error" for log in logs for r in read_log(log))
        assert all(p["status"] == "applied" for log in logs for p in pushes(log))
        final = _state(address)
        assert final["version"] == 80 and final["pushes_by_rank"] == {"0": 40, "1": 40}
        assert Counter(final["refused"]) == Counter(not_owner=3, not_member=2)
        assert final["job_failed"] is None
        client = ps_client(address, "asgd")
        try:
            assert client.pull().tensors["w"].tolist() == [40 * 1.0 + 40 * 2.0] * 4
        finally:
            client.close()
    finally:
        for raw in (squatter, stranger):
            raw.sock.close(0)
    fault_report(fault="failed byes forged for the honest ranks (and for its own rank under another session) by a "
                       "peer holding a free rank, and by one holding none", injected=5, handled=5, pushes_lost=0,
                 recovery_s=None, detail="each refused (not_owner 3, not_member 2), no job_failed; both honest "
                                         "workers pushed to the end: 80 of 80 pushes applied, w = 120")


def _state(address: str) -> dict:
    client = ps_client(address, "asgd")
    try:
        return client.stats()
    finally:
        client.close()
