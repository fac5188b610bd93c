"""Helper threads run torch on one thread, so the computing thread's OpenMP team keeps spinning.

The mechanism is checked in a fresh interpreter (OpenMP's state is the process's): the main thread runs
many small parallel ops and counts the voluntary context switches of the process's threads, before and
after a helper thread ran one large parallel op. Spinning workers switch a few times in 2,000 regions;
workers put to sleep between regions (libgomp does that once it manages more threads than there are
cores) switch about four times a region. The negative control runs the same op on a plain thread.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from cachefuse.fusion.background_saver import BackgroundSaver
from cachefuse.fusion.saving import HoleSave, HoleWriter
from cachefuse.loading.loader import PipelinedLoader
from cachefuse.metadata.base import VariantRecord
from cachefuse.metadata.sqlite import SqliteMetaStore
from cachefuse.store.base import ChunkKV, StoreIdentity
from cachefuse.store.memory import MemoryStore

REGIONS = 2000

_SCRIPT = textwrap.dedent("""
    import os, sys, threading, torch
    from cachefuse.torch_threads import start_helper_thread
    x = torch.randn(64, 4096)

    def voluntary_switches():
        total = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/status") as status:
                    total += next(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt"))
            except OSError:
                pass
        return total

    def regions():
        before = voluntary_switches()
        for _ in range(REGIONS):
            (x * 1.5).sum(dim=0)  # one small parallel region
        return voluntary_switches() - before

    regions()  # the main thread's team exists before anything is counted
    done = threading.Event()
    def helper():
        torch.randn(1 << 21).mul_(2)  # one large parallel op on the helper
        done.wait()
    if sys.argv[1] == "helper":
        start_helper_thread(helper, "test-helper")
    else:
        threading.Thread(target=helper, daemon=True).start()
    import time; time.sleep(0.2)
    print(regions())
    done.set()
""").replace("REGIONS", str(REGIONS))


def _switches_after(kind: str) -> int:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, kind], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "2"}, timeout=300)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2,
                    reason="needs Linux's per-thread counters and two cores (an OpenMP team of two)")
def test_a_helper_thread_leaves_the_computing_threads_team_spinning():
    assert _switches_after("helper") < REGIONS // 2
    # Negative control: the same op on a plain thread puts the main team's worker to sleep between regions
    assert _switches_after("plain") > 2 * REGIONS


def test_the_loader_and_the_hole_writer_run_torch_on_one_thread():
    seen: list[int] = []
    with PipelinedLoader(lambda layer: seen.append(torch.get_num_threads()), num_layers=3, depth=2) as loader:
        for layer in range(3):
            loader.layer(layer)
    assert seen == [1, 1, 1]

    class RecordingStore(MemoryStore):
        def put(self, key: str, entry: ChunkKV) -> bool:
            seen.append(torch.get_num_threads())
            return super().put(key, entry)

    store = RecordingStore(StoreIdentity("test", 1, torch.float32), capacity_bytes=1 << 20)
    saver = BackgroundSaver(HoleWriter(store, SqliteMetaStore(":memory:", max_variants=10), True, "memory"),
                            max_bytes=1 << 20)
    entry = ChunkKV([torch.ones(4, 1, 4)], [torch.ones(4, 1, 4)])
    saver.submit([HoleSave("a" * 16, VariantRecord.without_stats("a" * 16, (), 4), entry)])
    assert saver.close() == 0 and store.contains("a" * 16)
    assert seen[-1] == 1
