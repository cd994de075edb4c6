"""Shared pytest set-up: the real-server helpers live in ``tests/servers.py``."""

from __future__ import annotations

import os

# Gloo and torch threads: keep worlds small and quiet on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
