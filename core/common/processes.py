"""Whether a process is alive: how a lock or a cache folder tells a live owner from a killed one.

A PID alone says little on a shared file system: another machine, another container (PID namespace)
or an earlier boot may have written it, and the same number may now belong to an unrelated process.
:func:`process_identity` records where a PID is meaningful and when its process started, so that
:func:`owner_state` can tell a live owner, a dead one, and one it cannot see from here.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Literal

#: what :func:`owner_state` can say about a recorded owner
OwnerState = Literal["alive", "dead", "elsewhere"]


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID exists (signal 0 checks without sending anything)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    except OSError:
        return False
    return True


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22); "" off Linux."""
    stat = _read(f"/proc/{pid}/stat")
    fields = stat.rpartition(")")[2].split()  # the command name may hold spaces and parentheses
    return fields[19] if len(fields) > 19 else ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def process_identity(pid: int | None = None) -> dict[str, str]:
    """Where ``pid`` (default: this process) means a process, and when that process started.

    ``host`` (the machine's name), ``boot`` (Linux's boot id), ``pidns`` (the PID namespace) and
    ``start``; the last three are "" where the system does not tell.
    """
    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "boot": _read("/proc/sys/kernel/random/boot_id"),
            "pidns": _pid_namespace(), "start": _start_time(pid)}


def owner_state(pid: int, recorded: Mapping[str, str]) -> OwnerState:
    """Whether the owner ``pid`` with ``recorded`` identity (:func:`process_identity`'s keys; empty for
    an old record holding the PID alone) is alive, dead, or on another machine or PID namespace.

    The same host on another boot is dead; another host or namespace cannot be checked from here
    ("elsewhere": treat it as alive); a live PID that started at another time is a new process
    that reused the number, so the owner is dead.
    """
    if pid <= 0:
        return "dead"
    here = process_identity()
    host, boot = recorded.get("host"), recorded.get("boot")
    if host is not None and host != here["host"]:
        return "elsewhere"
    if boot and here["boot"] and boot != here["boot"]:
        return "dead"  # written before this machine last started
    pidns = recorded.get("pidns")
    if pidns and here["pidns"] and pidns != here["pidns"]:
        return "elsewhere"
    if not pid_alive(pid):
        return "dead"
    start = recorded.get("start")
    if start and (now := _start_time(pid)) and now != start:
        return "dead"  # the number now belongs to another process
    return "alive"


def owner_record() -> str:
    """This process as an owner file holds it: the PID on the first line, then :func:`process_identity`'s
    ``key=value`` lines."""
    return "".join([f"{os.getpid()}\n", *(f"{key}={value}\n" for key, value in process_identity().items())])


def read_owner_record(text: str) -> tuple[int | None, dict[str, str]]:
    """The PID and identity of an owner file's ``text`` (no identity in a file holding the PID alone);
    ``(None, {})`` when it names no PID."""
    try:
        first, *rest = text.splitlines()
        pid = int(first.split()[0])
    except (ValueError, IndexError):
        return None, {}
    return pid, dict(line.split("=", 1) for line in rest if "=" in line)
