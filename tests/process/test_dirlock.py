"""The checkpoint dir's lock: a live holder on this host is bad input; a holder that cannot be seen
alive (another host: maybe a dead node whose NFS lease has not ended) is retriable; the lock is the
process's own, so children forked after it do not keep it."""

import subprocess
import sys
import time

import pytest

from ddpjob.checkpoint import dirlock
from ddpjob.errors import Retriable, UsageError

pytestmark = pytest.mark.serial  # timing-sensitive: beside the parallel tier held back (make process)

HOLD = """
import os, sys, time
from pathlib import Path
from ddpjob.checkpoint import dirlock
fd = dirlock.acquire(Path(sys.argv[1]), wait=0)
if sys.argv[2] != "-":
    os.pwrite(fd, sys.argv[2].encode().ljust(100), 0)
if os.fork() == 0:
    time.sleep(30)
    os._exit(0)
print("locked", flush=True)
time.sleep(30)
"""


def hold(directory, holder: str = "-") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory), holder], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_live_job_on_this_host_is_bad_input_naming_it(tmp_path):
    holder = hold(tmp_path)
    try:
        with pytest.raises(UsageError, match=rf"in use by another live job \(host \S+ pid {holder.pid}"):
            dirlock.acquire(tmp_path, wait=0.5)
    finally:
        holder.kill()


def test_a_holder_on_another_host_is_retriable(tmp_path):
    holder = hold(tmp_path, "host node-that-died pid 4242 SLURM_JOB_ID=7")
    try:
        with pytest.raises(Retriable, match=r"locked by host node-that-died pid 4242 SLURM_JOB_ID=7.*NFS lease"):
            dirlock.acquire(tmp_path, wait=0.5)
    finally:
        holder.kill()


def test_the_lock_goes_with_its_process_even_when_a_forked_child_lives_on(tmp_path):
    holder = hold(tmp_path)
    holder.kill()
    holder.wait()
    started = time.monotonic()
    dirlock.release(dirlock.acquire(tmp_path, wait=5))  # the child forked after locking is still alive
    assert time.monotonic() - started < 1
