"""A push sent by a thread of its own, while the training thread goes on: its reply is taken later."""

from __future__ import annotations

import threading
from collections.abc import Callable

from plug_asgd.worker.model_reply import ModelReply


class InFlight:
    """``work`` (a push, returning its reply) run by a daemon thread; :meth:`answered` waits for the reply and
    re-raises, in the training thread, whatever went wrong.

    Args:
        work: the request to run, which returns the PS's reply; it starts at once.
    """

    def __init__(self, work: Callable[[], ModelReply]) -> None:
        self.reply: ModelReply | None = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.reply = work()
            except BaseException as exc:  # re-raised in the training thread
                self.error = exc

        self.thread = threading.Thread(target=run, name="plug_asgd-push", daemon=True)
        self.thread.start()

    def answered(self) -> ModelReply:
        """The reply, once it came.

        Raises:
            BaseException: whatever ``work`` raised (kept as ``error``), re-raised in the caller's thread.
        """
        self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.reply is not None
        return self.reply
