"""Whether a process is alive: how a lock or a cache folder tells a live owner from a killed one."""

from __future__ import annotations

import os


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
