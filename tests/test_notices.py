"""Broadcasts inside the training loop: the PS's board and the worker's notices, without waiting.

The worker's side runs here against a fake socket that hands each request to a real
:class:`~plug_asgd.ps.board.Board` and queues its reply, as the PS would, so what each rank sees after
each batch is known exactly; ``test_max_time_stops_every_worker_without_lockstep`` runs it for real.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path

import pytest
import zmq

from plug_asgd.protocol.schema import NOTICE_BYTES, NOTICE_KEYS
from plug_asgd.protocol.wire import DEFAULT_LIMITS, WireError, decode, encode
from plug_asgd.ps.board import NOTICE_ENTRIES, Board
from plug_asgd.worker.notices import Notices
from tests.conftest import PYTHON, free_port, run_to_end

MAX_TIME = 4  # seconds: Trainer(max_time=...) of tests/scripts/timed_fit.py


def message(**fields):
    return decode(encode("notice", {"session": "s", **fields}), DEFAULT_LIMITS)


def test_the_board_keeps_the_latest_value_of_each_call_and_refuses_what_is_out_of_bounds():
    board = Board()
    read = message(rank=1, stage=1, src=0, key=0)
    assert board.notice(1, 2, read) == {"stage": 1, "src": 0, "key": 0, "found": False, "value": None}
    board.notice(0, 2, message(rank=0, stage=1, src=0, key=0, value=False))
    board.notice(0, 2, message(rank=0, stage=1, src=0, key=0, value=True))
    assert board.notice(1, 2, read)["value"] is True
    assert board.notice(1, 2, message(rank=1, stage=1, src=0, key=1))["found"] is False  # another call
    with pytest.raises(WireError, match="cannot post the notice of rank 0"):
        board.notice(1, 2, message(rank=1, stage=1, src=0, key=0, value=True))
    with pytest.raises(WireError, match="out of bounds"):
        board.notice(0, 2, message(rank=0, stage=1, src=0, key=NOTICE_KEYS))
    with pytest.raises(WireError, match="out of bounds"):
        board.notice(0, 2, message(rank=0, stage=1, src=2, key=0))
    with pytest.raises(WireError) as big:
        board.notice(0, 2, message(rank=0, stage=1, src=0, key=0, value="x" * NOTICE_BYTES))
    assert big.value.code == "too_large"
    board.forget_stage(1)
    assert board.notice(1, 2, read)["found"] is False
    for stage in range(NOTICE_ENTRIES + 10):
        board.notice(0, 2, message(rank=0, stage=stage, src=0, key=0, value=stage))
    assert len(board.posted) == NOTICE_ENTRIES and (0, 0, 0) not in board.posted  # the oldest went first


class BoardSocket:
    """A worker's side socket whose PS is ``board``; replies wait until ``deliver()``, as on a wire."""

    def __init__(self, board: Board, rank: int) -> None:
        self.board, self.rank = board, rank
        self.in_flight: list[list[bytes]] = []
        self.arrived: deque[list[bytes]] = deque()
        self.full = False

    def send_multipart(self, frames, flags=0):
        if self.full:
            raise zmq.Again()
        msg = decode(frames, DEFAULT_LIMITS)
        self.in_flight.append(encode("noticed", self.board.notice(self.rank, 2, msg)))

    def deliver(self) -> None:
        self.arrived.extend(self.in_flight)
        self.in_flight = []

    def poll(self, timeout=0):
        return bool(self.arrived)

    def recv_multipart(self, copy=True):
        return self.arrived.popleft()

    def close(self, linger=0):
        pass


def test_each_rank_gets_the_sources_value_a_batch_later_and_its_own_until_then():
    board = Board()
    sockets = {r: BoardSocket(board, r) for r in (0, 1)}
    notices = {r: Notices(sockets[r], r, "s", None, DEFAULT_LIMITS) for r in (0, 1)}
    seen = []
    for batch in range(4):
        stop = batch >= 1  # rank 0 decides to stop after its batch 1; rank 1's own clock says no
        got = {r: notices[r].broadcast(stop if r == 0 else False, 0, 1, batch) for r in (0, 1)}
        seen.append((got[0], got[1]))
        for s in sockets.values():
            s.deliver()
    # rank 1's read of batch b was answered with what rank 0 had posted before it; it is used at batch b + 1
    assert seen == [(False, False), (True, False), (True, True), (True, True)]
    assert notices[1].sent == 4 and notices[1].received == 3


def test_calls_within_a_batch_are_told_apart_and_the_limits_are_said():
    board = Board()
    sock = BoardSocket(board, 0)
    notices = Notices(sock, 0, "s", None, DEFAULT_LIMITS)
    assert notices.broadcast("a", 0, 1, batch=7) == "a" and notices.broadcast("b", 0, 1, batch=7) == "b"
    assert {w: v for w, v in board.posted.items()} == {(1, 0, 0): "a", (1, 0, 1): "b"}
    notices.broadcast("c", 0, 1, batch=8)  # a new batch: its first call is key 0 again
    assert board.posted[(1, 0, 0)] == "c"
    with pytest.raises(TypeError, match="msgpack data only"):
        notices.broadcast(object(), 0, 1, batch=9)
    with pytest.raises(ValueError, match=f"at most {NOTICE_BYTES} bytes"):
        notices.broadcast("x" * NOTICE_BYTES, 0, 1, batch=10)
    for _ in range(NOTICE_KEYS):
        notices.broadcast(1, 0, 1, batch=11)
    with pytest.raises(RuntimeError, match=f"more than {NOTICE_KEYS} broadcasts"):
        notices.broadcast(1, 0, 1, batch=11)
    sock.full = True  # the PS is away: the notice is dropped, nothing waits
    assert notices.broadcast(2, 0, 1, batch=12) == 2 and notices.dropped == 1


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_max_time_stops_every_worker_without_lockstep(tmp_path):
    """Lightning's Timer broadcasts rank 0's decision after every batch: the slowed rank must not hold rank 0."""
    run_to_end([PYTHON, str(Path(__file__).parent / "scripts" / "timed_fit.py"), str(tmp_path), str(free_port()),
                str(MAX_TIME)], timeout=100)
    steps = {str(r): json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    # rank 1 sleeps 0.2 s a batch, rank 0 0.01 s: in lockstep both would make the same number of steps; apart,
    # rank 0 makes up to 20 times as many (measured on 2 loaded cores: 104 and 31 with 0.1 s)
    assert steps["0"]["steps"] >= 2 * steps["1"]["steps"] > 0, steps
    # and both stopped by the Timer: rank 0 at max_time, rank 1 within a few of its batches after
    assert all(MAX_TIME <= s["train_s"] <= MAX_TIME + 5 for s in steps.values()), steps
