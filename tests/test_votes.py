"""A leader chosen by a majority (issue 59): a standby leads only with the votes of a majority of the run's live
workers, never below a version a voter saw, and a primary believes ``fenced`` only with a majority's ballots under
the link's seal (plug_asgd/ps/election.py). Real PS processes on loopback, frozen (SIGSTOP); the workers are
PSClients of this process (no heartbeats), their votes sent from raw sockets as a worker sends them, and a standby
that lies played by this process with the primary's standby secret (it holds the link's credential).
"""

from __future__ import annotations

import contextlib
import secrets
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from plug_asgd.protocol.wire import DEFAULT_LIMITS, decode, encode
from plug_asgd.ps.election import Tally, Vote, ballot, check_proof, electorate, needed, seal
from plug_asgd.ps.standby_join import proven
from plug_asgd.ps.standby_link import StandbyLink
from plug_asgd.worker.client import PSClient
from tests.test_faults import wait_for
from tests.test_standby import FAILOVER, _answers, ask, signal_ps, start_pair, stats

pytestmark = pytest.mark.faults


@pytest.fixture
def start_ps(start_ps):
    start_ps.env["PLUG_ASGD_LOG"] = "INFO"
    return start_ps


@contextlib.contextmanager
def workers(primary: str, world: int) -> Iterator[list[PSClient]]:
    """Ranks 0 .. world - 1, said hello (training) in stage 1, rank 0's model (four zeros) sent; closed after."""
    clients = [PSClient(primary, rank=r, world_size=world, mode="asgd", request_timeout=30, heartbeat_s=None)
               for r in range(world)]
    try:
        for c in clients:
            c.hello(1, True)
        clients[0].init({"w": np.zeros(4, np.float32)})
        yield clients
    finally:
        for c in clients:
            c.close()


def vote(standby: str, worker: PSClient, version: int | None = None) -> tuple[str, dict]:
    """``worker``'s vote for ``standby``, as its client sends it (``version``: the one it claims to have seen)."""
    return ask(standby, "lead", {"epoch": 1, "session": worker.session, "token": worker.token, "rank": worker.rank,
                                 "version": worker.seen_version if version is None else version})


def freeze(start_ps, primary: str, standby: str, voter: PSClient) -> tuple[str, dict]:
    """SIGSTOP the primary; ``voter``'s vote once the standby has heard nothing from it for the failover timeout."""
    signal_ps(start_ps, primary, signal.SIGSTOP)
    deadline = time.monotonic() + 3 * FAILOVER
    while time.monotonic() < deadline:
        answer = vote(standby, voter)
        if answer[0] != "primary_alive":
            return answer
        time.sleep(0.1)
    raise AssertionError("the standby still hears the frozen primary")


def push(worker: PSClient) -> int:
    """One push of ones (on base 0: asgd folds any base in), applied; the version it made."""
    reply = worker.push(0, {"w": np.ones(4, np.float32)})
    assert reply.status == "applied", reply.status
    return reply.version


def test_one_worker_of_three_does_not_make_the_standby_lead_two_do_and_the_old_primary_believes_them(start_ps):
    primary, standby = start_pair(start_ps)
    with workers(primary, 3) as ranks:
        for _ in range(3):
            for w in ranks:
                push(w)
        code, fields = freeze(start_ps, primary, standby, ranks[0])
        assert (code, fields["votes"], fields["needed"]) == ("pending", 1, 2)
        time.sleep(FAILOVER)  # one vote, cast again: still one rank's, and no lead
        code, fields = vote(standby, ranks[0])
        assert (code, fields["votes"]) == ("pending", 1)
        assert stats(standby)["role"] == "standby"
        code, fields = vote(standby, ranks[1])
        assert code == "leading" and fields["epoch"] == 2 and fields["version"] == 9
        assert vote(standby, ranks[0])[0] == "leading"  # the first voter, asking again, moves too
        signal_ps(start_ps, primary, signal.SIGCONT)
        # its next beat is answered `fenced` with the two ballots under the link's seal: it believes it
        wait_for(lambda: stats(primary)["role"] == "replaced", 2 * FAILOVER, "the old primary to find itself replaced")
        old = stats(primary)
        assert old["leader"] == standby and old["refused"].get("bad_fenced", 0) == 0
        assert push(ranks[2]) == 10  # the worker that never voted is sent on by the old primary
        assert ranks[2].address == standby
    led = stats(standby)
    assert led["role"] == "primary" and led["epoch"] == 2 and led["version"] == 10


def test_a_vote_naming_a_version_above_the_standbys_is_refused_and_the_standby_does_not_lead(start_ps):
    primary, standby = start_pair(start_ps)
    with workers(primary, 3) as ranks:
        for w in ranks:
            push(w)
        held = stats(standby)["version"]
        assert held == 3
        code, fields = freeze(start_ps, primary, standby, ranks[0])
        assert code == "pending"
        code, fields = vote(standby, ranks[1], version=held + 5)  # a voter that saw a push the standby lacks
        assert code == "standby_behind" and "would lose" in fields["message"], fields
        code, fields = vote(standby, ranks[2])  # a majority now, but below what a voter saw: no lead
        assert code == "standby_behind", fields
        assert stats(standby)["role"] == "standby" and stats(standby)["epoch"] == 1
        signal_ps(start_ps, primary, signal.SIGCONT)
        wait_for(lambda: _answers(primary), 10, "the primary to answer again")
        assert stats(primary)["role"] == "primary" and stats(primary)["epoch"] == 1
        assert push(ranks[0]) == 4


def test_with_two_workers_one_vote_alone_never_makes_the_standby_lead(start_ps):
    # a worker cut from the primary while the other still reaches it: a majority of 2 is 2, so its vote alone
    # (cast again and again, past the vote's lifetime) makes no second leader; here the primary is frozen, the
    # standby hears nothing from it either, and still does not lead on one vote
    primary, standby = start_pair(start_ps)
    with workers(primary, 2) as ranks:
        push(ranks[0])
        assert freeze(start_ps, primary, standby, ranks[0])[0] == "pending"
        deadline = time.monotonic() + 2.5 * FAILOVER
        while time.monotonic() < deadline:
            code, fields = vote(standby, ranks[0])
            assert (code, fields["votes"], fields["needed"]) == ("pending", 1, 2)
            time.sleep(0.2)
        assert stats(standby)["role"] == "standby"
        signal_ps(start_ps, primary, signal.SIGCONT)


class LyingStandby:
    """A standby played by this process: it proves the primary's secret (the link's credential: this process runs
    as the PS's user), joins, takes the state, then answers the primary's next record ``fenced`` with ``proof``."""

    def __init__(self, primary: str) -> None:
        self.token = secrets.token_hex(16)
        self.link = StandbyLink(zmq.Context.instance(), "tcp://127.0.0.1:0", None, self.token, DEFAULT_LIMITS)
        self.asker = zmq.Context.instance().socket(zmq.DEALER)
        self.asker.setsockopt(zmq.LINGER, 0)
        self.asker.connect(primary)
        join = {"address": "tcp://127.0.0.1:9", "link_address": self.link.address, "link": self.token}
        self.asker.send_multipart(encode("standby", {**proven(primary, "join", join, None), "rid": 3}))
        snapshot = self._record()
        self.run_id = snapshot[1].fields["run_id"]
        self._answer(snapshot, "ack", {"version": snapshot[1].fields.get("version", 0), "status": "ok"})
        assert self.asker.poll(10_000), "no answer to the join"
        assert decode(self.asker.recv_multipart()).type == "standby_joined"

    def _record(self) -> tuple[bytes, object]:
        assert self.link.socket.poll(10_000), "no record from the primary"
        frames = self.link.socket.recv_multipart()
        return frames[0], decode(frames[1:], DEFAULT_LIMITS)

    def _answer(self, record: tuple[bytes, object], msg_type: str, fields: dict) -> None:
        identity, msg = record
        self.link.socket.send_multipart([identity, *encode(msg_type, {**fields, "rid": msg.fields["rid"]})])

    def fence(self, proof: dict) -> None:
        """Answer the next record (a beat, within a quarter of the failover timeout) ``fenced``."""
        self._answer(self._record(), "fenced", proof)

    def close(self) -> None:
        self.asker.close(0)
        self.link.close()


def test_a_fenced_without_a_majoritys_ballots_does_not_depose_the_primary(start_ps):
    primary = start_ps("asgd")
    wait_for(lambda: _answers(primary), 30, "the primary to answer")
    with workers(primary, 3) as ranks:
        version = push(ranks[0])

        def sealed(liar: LyingStandby, votes: list) -> dict:
            return {"epoch": 2, "voters": [0, 1, 2], "votes": votes, "seal": seal(liar.token, 2, [0, 1, 2], votes)}

        def real(liar: LyingStandby, w: PSClient) -> list:  # a ballot the worker's token makes (a vote it cast)
            return [w.session, 0, ballot(w.token, liar.run_id, 2, w.session, 0)]

        forgeries = [
            lambda liar: {"epoch": 2},  # the word alone
            lambda liar: {**sealed(liar, [real(liar, w) for w in ranks]), "seal": "0" * 64},  # a stranger's seal
            lambda liar: sealed(liar, [[w.session, 0, secrets.token_hex(32)] for w in ranks]),  # made-up ballots
            lambda liar: sealed(liar, [real(liar, ranks[0]), real(liar, ranks[0])]),  # one vote, twice: a minority
        ]
        for n, forge in enumerate(forgeries, 1):
            liar = LyingStandby(primary)
            try:
                wait_for(lambda liar=liar: stats(primary)["standby"] == "tcp://127.0.0.1:9", 10, "the liar to join")
                liar.fence(forge(liar))
                wait_for(lambda n=n: stats(primary)["refused"].get("bad_fenced", 0) == n, 10, "the fenced refused")
            finally:
                liar.close()
            now = stats(primary)
            assert now["role"] == "primary" and now["epoch"] == 1 and now["leader"] is None
            assert now["standby"] is None and now["standbys_detached"] == n  # the liar is dropped
            version = push(ranks[n % 3])
        # a stranger's `fenced` on the workers' socket is no message the primary takes
        code, _ = ask(primary, "fenced", {"epoch": 2})
        assert code != "fenced" and stats(primary)["role"] == "primary"
        assert version == 5 and push(ranks[1]) == 6


# -- the rule's arithmetic, without processes --------------------------------------------------------------------------


def test_the_electorate_its_majority_and_which_votes_count() -> None:
    assert electorate([2, 0], [0, 1, 2, 3]) == {0, 2} and electorate([], [1, 1, 3]) == {1, 3}
    assert [needed(frozenset(range(n))) for n in range(1, 6)] == [1, 2, 2, 3, 3]
    tally = Tally(ttl=6.0)
    for rank, at in ((0, 10.0), (1, 4.0), (2, 12.0), (7, 12.0)):
        tally.cast(rank, Vote(f"s{rank}", rank, "b", at))
    tally.cast(0, Vote("s0", 5, "b", 13.0))  # a rank's latest vote replaces its earlier one
    # rank 1 voted before the primary's last word (5.0); rank 7 is not of the electorate; at 17.5 every vote is fresh
    assert sorted(tally.live(frozenset({0, 1, 2}), since=5.0, now=17.5)) == [0, 2]
    assert sorted(tally.live(frozenset({0, 1, 2}), since=5.0, now=18.5)) == [0]  # rank 2's is 6.5 s old
    assert tally.highest(since=5.0) == 7 and tally.highest(since=12.5) == 5


def test_a_fenced_proof_holds_with_a_majoritys_ballots_and_no_changed_field() -> None:
    tokens = {f"s{r}": (r, secrets.token_hex(16)) for r in range(3)}
    voters = frozenset(tokens[s][0] for s in tokens)

    def proof(sessions: list[str], link: str = "L" * 32, epoch: int = 2) -> dict:
        votes = [[s, 4, ballot(tokens[s][1], "run", epoch, s, 4)] for s in sessions]
        ranks = sorted(voters)
        return {"epoch": epoch, "voters": ranks, "votes": votes, "seal": seal(link, epoch, ranks, votes)}

    assert check_proof(proof(["s0", "s2"]), "L" * 32, "run", voters, tokens) is None
    assert "majority" in check_proof(proof(["s0"]), "L" * 32, "run", voters, tokens)
    assert "seal" in check_proof(proof(["s0", "s2"], link="M" * 32), "L" * 32, "run", voters, tokens)
    assert "majority" in check_proof(proof(["s0", "s2"]), "L" * 32, "another run", voters, tokens)
    changed = proof(["s0", "s2"])
    changed["votes"][1][1] = 5  # a ballot's version changed (and sealed again): its HMAC no longer holds
    changed["seal"] = seal("L" * 32, 2, changed["voters"], changed["votes"])
    assert "1 valid" in check_proof(changed, "L" * 32, "run", voters, tokens)
    assert "no proof" in check_proof({"epoch": 2}, "L" * 32, "run", voters, tokens)
