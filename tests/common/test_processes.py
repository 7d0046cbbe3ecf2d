"""A recorded owner is alive, dead, or out of sight: what a lock on a shared file system must tell apart."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from layerwise.common.processes import owner_state, pid_alive, process_identity

linux_only = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_this_process_is_alive_and_a_finished_one_dead():
    assert pid_alive(os.getpid()) and owner_state(os.getpid(), process_identity()) == "alive"
    assert owner_state(_dead_pid(), {}) == "dead"
    assert owner_state(0, {}) == "dead"  # a lock released by a failed run names no process


def test_an_old_lock_with_the_pid_alone_is_read_as_before():
    assert owner_state(os.getpid(), {}) == "alive"


def test_an_owner_on_another_host_cannot_be_checked_and_counts_as_alive():
    elsewhere = {**process_identity(), "host": "another-machine"}
    assert owner_state(_dead_pid(), elsewhere) == "elsewhere"  # its PID means nothing here


@linux_only
def test_an_owner_in_another_pid_namespace_counts_as_alive():
    assert process_identity()["pidns"], "Linux names the PID namespace"
    other = {**process_identity(), "pidns": "pid:[1]"}
    assert owner_state(_dead_pid(), other) == "elsewhere"


@linux_only
def test_an_owner_from_an_earlier_boot_of_this_host_is_dead():
    assert process_identity()["boot"], "Linux gives a boot id"
    earlier = {**process_identity(), "boot": "00000000-0000-0000-0000-000000000000"}
    assert owner_state(os.getpid(), earlier) == "dead"  # the same number, a new process


@linux_only
def test_a_reused_pid_is_not_its_old_owner():
    me = process_identity()
    assert me["start"].isdigit()
    assert owner_state(os.getpid(), {**me, "start": str(int(me["start"]) + 1)}) == "dead"
