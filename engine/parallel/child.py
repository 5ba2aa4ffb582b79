"""What every process Tandem starts under another does first: it never outlives its parent."""

from __future__ import annotations

import os
import signal
import threading
import time

PARENT_POLL_S = 0.5


def exit_with_parent() -> None:
    """Exit at once if the parent dies, whatever this process is doing (a SIGKILLed parent
    cannot tell it, and a process in a device collective or a busy loop would outlive it), and
    ignore SIGINT and SIGTERM: the parent ends this process (a Ctrl-C or SIGTERM sent to the
    whole process group must not take it away from under a parent that is draining)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
