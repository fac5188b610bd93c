"""Helper threads that run torch on one thread: `start_helper_thread`.

Imports threading and torch only. A thread of ours that runs any multi-threaded torch CPU op (a large copy,
a norm over a chunk's keys) gets its own OpenMP team. From then on the process manages more OpenMP
threads than it has cores, and libgomp stops spin-waiting between parallel regions: every region of the
thread that runs the model (vLLM's, bound to the cores) then ends with its workers asleep on a futex and
starts with waking them (four context switches a region, measured). That made every plain decode step
after the first saved hole ~1.7x slower on the 2-core bench machine, for as long as the writer lived.
Our helper threads only copy, serialise and wait on I/O: one thread each costs them little, and keeps the
model's team spinning. vLLM makes the same call for its engine loop (`torch.set_num_threads(1)` "for
serving").
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


def start_helper_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """Starts a daemon thread running `target` with torch's intra-op parallelism off on it.

    torch's thread count is read first on the calling thread: torch sizes a thread's OpenMP team from a
    process-wide value when the thread first needs it, and the helper sets that value to 1 (vLLM's CPU
    worker already has). Reading it here fixes the caller's team before the helper can change it.
    """
    torch.get_num_threads()
    thread = threading.Thread(target=_serially, args=(target,), name=name, daemon=True)
    thread.start()
    return thread


def _serially(target: Callable[[], None]) -> None:
    # torch._C's: vLLM's CPU worker replaces torch.set_num_threads with a no-op after binding its threads
    torch._C.set_num_threads(1)
    target()
