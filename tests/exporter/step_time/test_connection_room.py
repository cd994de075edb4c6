"""The root's room for rankwatch connections under this process's real open-file limit."""

from __future__ import annotations

import os
import resource

from rankwatch.exporter.step_time.transport import connection_room


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_room_is_the_limit_less_open_files_and_those_kept_for_training() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        # A low limit: 64 files kept for training.
        resource.setrlimit(resource.RLIMIT_NOFILE, (_open_files() + 100, hard))
        room = connection_room()
        assert room is not None and 100 - 64 - 2 <= room <= 100 - 64, room
        # A larger one: a quarter of it kept.
        limit = _open_files() + 1000
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
        room = connection_room()
        assert room is not None and 1000 - limit // 4 - 2 <= room <= 1000 - limit // 4, room
        # No room left is no room, never a negative count.
        resource.setrlimit(resource.RLIMIT_NOFILE, (_open_files() + 10, hard))
        assert connection_room() == 0
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
