"""Process-tree memory: a child's allocation shows up in the tree's sum and in the sampled peak."""
import subprocess
import sys
import time

import psutil
import pytest

from search_r1.procmem import PeakTreeMemory, tree_memory

# The child holds 300 MB of touched pages, then waits to be killed.
CHILD = "import sys, time; b = bytearray(300 * 2**20); print('ready', flush=True); time.sleep(60)"


@pytest.mark.parametrize("metric", ["rss", "pss"])
def test_child_memory_counts_in_the_tree_and_its_peak(metric):
    shell = subprocess.Popen([sys.executable, "-c",
                              f"import subprocess, sys; subprocess.run([sys.executable, '-c', {CHILD!r}])"],
                             stdout=subprocess.PIPE, text=True)
    try:
        peak = PeakTreeMemory(shell.pid, metric, every=0.05)
        assert shell.stdout.readline().strip() == "ready"  # the grandchild holds its 300 MB now
        time.sleep(0.3)
        assert tree_memory(shell.pid, metric) > 300 * 2**20
        assert peak.stop() > 300 / 1024
    finally:
        for proc in [*psutil.Process(shell.pid).children(recursive=True), shell]:
            proc.kill()


def test_unknown_metric_is_refused():
    with pytest.raises(ValueError, match=r"metric must be one of \('rss', 'pss'\)"):
        tree_memory(1, "vms")
