"""Pushes sent again to a PS that was SIGKILLed and resumed from its checkpoint.

A worker whose PS dies resends the request it was waiting on once the PS is back (docs/faults.md).
What the resumed PS must do with a push it sees again depends on the checkpoint alone: a push
folded in before the checkpoint is refused as a duplicate (the checkpoint holds each session's
last push number); a push folded in after it was lost with the PS, and is folded in again. The
central model after each is computed here by hand.
"""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from plug_asgd.protocol.checkpoint import list_checkpoints, read_checkpoint
from plug_asgd.worker.client import PSClient
from plug_asgd.worker.transport import PSError
from tests.conftest import PLUG_ASGD, free_port

pytestmark = [pytest.mark.integration, pytest.mark.faults]


def newest_version(folder) -> int:
    files = list_checkpoints(folder)
    return int(read_checkpoint(files[-1]).fields["version"]) if files else -1


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.timeout(90)
def test_a_push_replayed_after_a_resume_is_refused_if_checkpointed_and_folded_in_if_lost(procs, tmp_path,
                                                                                           fault_report):
    port, ck = free_port(), tmp_path / "ck"
    serve = [PLUG_ASGD, "serve-ps", "--port", str(port), "--mode", "asgd", "--quiet", "--checkpoint-dir", str(ck),
             "--checkpoint-every-updates", "2"]
    ps = procs.start(serve)
    client = PSClient(f"tcp://127.0.0.1:{port}", rank=0, world_size=1, mode="asgd", request_timeout=30,
                      lost_timeout=30, heartbeat_s=None)
    try:
        client.hello(stage=0, training=True, timeout=30)
        client.init({"w": np.zeros(3, np.float32)})

        def push(seq: int, base: int, delta: float):
            fields = {"rank": 0, "base_version": base, "seq": seq, "session": client.session, "model": False}
            return client.request("push", fields, {"w": np.full(3, delta, np.float32)})

        push(0, 0, 1.0)
        push(1, 1, 2.0)
        wait_for(lambda: newest_version(ck) == 2, 30, "the checkpoint of version 2")
        assert push(2, 2, 4.0).fields["version"] == 3  # after the checkpoint: lost with the PS
        ps.send_signal(signal.SIGKILL)
        ps.wait(10)
        resumed = procs.start([*serve, "--resume", str(ck)])
        with pytest.raises(PSError) as refused:  # folded in before the checkpoint: not again
            push(1, 1, 2.0)
        assert refused.value.code == "duplicate"
        assert client.pull().version == 2
        assert push(2, 2, 4.0).fields["version"] == 3  # lost with the PS: folded in again, once
        with pytest.raises(PSError) as again:
            push(2, 2, 4.0)
        assert again.value.code == "duplicate"
        reply = client.pull()
        assert reply.version == 3
        np.testing.assert_array_equal(reply.tensors["w"], np.full(3, 1.0 + 2.0 + 4.0, np.float32))
    finally:
        client.close()
    resumed.terminate()  # its clean stop
    out, _ = resumed.communicate(timeout=20)
    assert resumed.returncode == 0, out[-3000:]
    fault_report(fault="pushes replayed to a PS resumed from its checkpoint", injected=2, handled=2, pushes_lost=0,
                 detail="one folded in before the checkpoint: refused as a duplicate; one after: folded in once")
