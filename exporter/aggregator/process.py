"""The root's handle on its group's aggregator: start it, relay what it sends, restart it.

:class:`Aggregator` starts ``python -m rankwatch.exporter.aggregator`` (a group of one runs the
same service on a thread: nothing grows there), hands it the setup, and keeps one relay thread
that reads what the aggregator sends: each window's report, already bounded to
``root_rank_budget`` ranks, goes to the root's publishers (``/metrics``, OTLP, incidents, the
run's summary, ``on_incident``) exactly as a report of the in-process root used to, at a cost
that does not grow with the group. The intake's address goes into the c10d store, where every
rank's shipper finds it.

Faults. An aggregator that exits (killed, crashed) or stops beating on the progress board for
``aggregator_stall_seconds`` (stopped, stuck) is said in one line, killed if need be, and
started again after a back-off (1 s doubling to 60 s); the ranks reconnect to the new one and
ship what they kept (the timer's ring), so the gap shows as windows that did not come. Training
never waits for any of it: the relay is a thread of its own, and a hang report the aggregator
cannot number is published here instead.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from rankwatch.diagnosis.hang import HangReport
from rankwatch.diagnosis.report import RankInfo, WindowReport
from rankwatch.diagnosis.step_time.mesh import MeshLayout
from rankwatch.exporter.aggregator.board import ProgressBoard
from rankwatch.exporter.aggregator.service import ServiceSetup, run_service
from rankwatch.exporter.child_frames import FrameReader, frame
from rankwatch.exporter.child_pipe import Backoff, ChildPipe
from rankwatch.exporter.config import RankwatchConfig
from rankwatch.exporter.layout import GroupLayout
from rankwatch.exporter.publish.protocol import Publisher, publish_to_all
from rankwatch.exporter.storage import child_storage_errors

__all__ = ["ADDRESS_KEY", "Aggregator", "advertised_host"]

log = logging.getLogger("rankwatch.aggregator")

ADDRESS_KEY = "aggregator"  # the store key (under the group's prefix) of the intake's address
_MODULE = "rankwatch.exporter.aggregator"
# The relay looks at the aggregator's beat at least this often (and four times per stall
# budget): each look wakes a thread of the root's process.
_RELAY_POLL_SECONDS = 5.0


def _underlying_host(store: Any) -> str | None:
    """The host of the TCP store ``store`` talks to (through prefixes), None if it is not one."""
    for _ in range(8):
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
        if store is None:
            return None
    return None


def advertised_host(config: RankwatchConfig, store: Any) -> str:
    """The address the ranks reach the intake at, which it also listens on: the setting,
    else the address this host reaches the job's c10d store from (every rank reaches that
    store, so it routes), else loopback for a job on one host."""
    if config.aggregator_host:
        return config.aggregator_host
    host = _underlying_host(store) if store is not None else None
    if host is None:
        return "127.0.0.1"
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
        target = infos[0][4][0]
        if ipaddress.ip_address(target).is_loopback:
            return "127.0.0.1"
        family = infos[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))  # no packet is sent: the kernel picks the route
            return str(probe.getsockname()[0])
    except (OSError, ValueError, IndexError):
        return "127.0.0.1"


class Aggregator:
    """The aggregator of one group, seen from its root's process (see the module docstring).

    ``store``: the group's c10d store prefix (None for a group of one). ``publishers``: the
    root's publishers. Starts at once; :meth:`stop` ends it after the summary window.
    """

    def __init__(
        self,
        layout: GroupLayout,
        config: RankwatchConfig,
        publishers: Sequence[Publisher],
        *,
        store: Any = None,
    ) -> None:
        self.layout = layout
        self.ranks = layout.ranks
        self.config = config
        self.publishers = tuple(publishers)
        self.store = store
        self.token = secrets.token_hex(16)
        self.host = advertised_host(config, store)
        self.process_mode = len(layout.ranks) > 1
        self.board = ProgressBoard.create(layout.ranks)
        self.latest_report: WindowReport | None = None
        self.reports_published = 0
        self.restarts = 0
        self.not_written: list[str] = []
        self._address: tuple[str, int] | None = None
        self._mesh: MeshLayout | None = None
        self._next_index = 0
        self._lock = threading.Lock()  # publishing order: the relay and direct hang reports
        self._stopping = False
        self._stopped = False
        self._done = threading.Event()
        self._pipe: ChildPipe | None = None
        self._thread: threading.Thread | None = None  # the service, in thread mode
        self._started_at = 0.0
        self._backoff = Backoff()
        self._start()
        self._relay = threading.Thread(
            target=self._relay_loop, name="rankwatch-aggregator", daemon=True
        )
        self._relay.start()

    # ---- what the root's process asks -------------------------------------------------------

    def address(self) -> tuple[str, int, str] | None:
        """``(host, port, token)`` of the intake, once it listens."""
        address = self._address
        return None if address is None else (*address, self.token)

    @property
    def pid(self) -> int | None:
        pipe = self._pipe
        return None if pipe is None else pipe.pid

    @property
    def mesh(self) -> MeshLayout | None:
        """The job's device mesh, as last set."""
        return self._mesh

    def set_mesh(self, mesh: MeshLayout | None) -> None:
        """The job's device mesh (the diagnosis compares ranks within its groups)."""
        self._mesh = mesh
        self._send(("mesh", mesh))

    def rebaseline(self, reason: str) -> None:
        """Start the group's pace baseline again (see ``RankWatch.rebaseline``)."""
        if not self._send(("rebaseline", reason)):
            log.warning("rankwatch: the aggregator is not there: baseline not reset (%s)", reason)

    def publish_hang(self, hang: HangReport) -> None:
        """The hang loop's verdict (or its end), numbered among the windows by the aggregator;
        published here at once when the aggregator is not there to do it."""
        if self._send(("hang", hang)):
            return
        with self._lock:
            ranks = sorted(
                {self.layout.root, *(() if hang.verdict is None else hang.verdict.ranks)}
            )
            report = WindowReport(
                group=self.config.group_name,
                window_index=self._next_index,
                created_at_s=time.time(),
                ranks=tuple(RankInfo(r) for r in ranks),
                run=self.config.run_id,
                hang=hang,
                group_size=len(self.ranks),
            )
            self._next_index += 1
            self._deliver(report)

    def progress_age(self, rank: int) -> float | None:
        """Seconds since ``rank``'s shipped steps last advanced, as the aggregator saw."""
        return self.board.progress_age(rank, time.monotonic())

    def broken(self) -> set[int]:
        """Ranks whose connection to the aggregator closed (or found no room)."""
        return self.board.hung_up()

    def stop(self, timeout_seconds: float) -> bool:
        """Let the aggregator wait for the final shipments (at most half the budget, and never
        longer than the gather timeout), publish the summary window, and end; True if it ended
        within ``timeout_seconds`` (else it is killed)."""
        if self._stopped:
            return True
        self._stopped = True
        deadline = time.monotonic() + timeout_seconds
        self._stopping = True
        final_wait = min(self.config.gather_timeout_seconds, timeout_seconds / 2)
        ended = self._send(("stop", final_wait)) and self._done.wait(max(0.0, timeout_seconds))
        if not ended:
            log.warning(
                "rankwatch: the group's aggregator did not end within %.1f s; stopped it",
                timeout_seconds,
            )
        self._kill()
        self._relay.join(max(0.05, deadline - time.monotonic()))
        if self._thread is not None:
            self._thread.join(max(0.05, deadline - time.monotonic()))
        if not self._relay.is_alive():
            self.board.close()
        return ended

    # ---- the aggregator's life -------------------------------------------------------------

    def _setup(self) -> ServiceSetup:
        level = logging.getLogger("rankwatch").getEffectiveLevel()
        return ServiceSetup(
            config=self.config,
            ranks=self.ranks,
            token=self.token,
            host=self.host,
            board_fd=self.board.fd,
            first_window_index=self._next_index,
            mesh=self._mesh,
            process=self.process_mode,
            log_level=level,
        )

    def _start(self) -> None:
        self._address = None
        self._started_at = time.monotonic()
        self.board.reset()
        setup = self._setup()
        if self.process_mode:
            self._pipe = ChildPipe.spawn(_MODULE, pass_fds=(self.board.fd,))
            self._write(frame(setup))
        else:
            in_r, in_w = os.pipe()
            out_r, out_w = os.pipe()
            self._pipe = ChildPipe.over_fds(in_w, out_r)

            def serve() -> None:
                try:
                    run_service(setup, in_r, out_w)
                except Exception:
                    log.exception("rankwatch: the group's aggregator failed")
                finally:
                    os.close(out_w)
                    os.close(in_r)

            self._thread = threading.Thread(
                target=serve, name="rankwatch-aggregator-service", daemon=True
            )
            self._thread.start()

    def _write(self, data: bytes) -> bool:
        pipe = self._pipe
        return pipe is not None and pipe.write(data)

    def _send(self, message: tuple[Any, ...]) -> bool:
        if self._address is None and message[0] != "stop":
            # Not listening yet (or being restarted): a mesh waits in the setup; a hang report
            # is published here.
            return message[0] == "mesh"
        return self._write(frame(message))

    def _kill(self) -> None:
        if self._pipe is not None:
            self._pipe.kill()  # thread mode: closing the control end ends the service's loop

    # ---- the relay thread ------------------------------------------------------------------

    def _relay_loop(self) -> None:
        reader = FrameReader()
        while True:
            assert self._pipe is not None
            fd = self._pipe.from_child
            assert fd is not None
            try:
                poll = min(_RELAY_POLL_SECONDS, self.config.aggregator_stall_seconds / 4)
                ready, _, _ = select.select([fd], [], [], poll)
                chunk = os.read(fd, 1 << 20) if ready else None
            except OSError:
                chunk = b""
            if chunk is None:
                self._watch()
                continue
            if chunk:
                reader.feed(chunk)
                for message in reader.frames():
                    self._handle(message)
                continue
            # The aggregator ended.
            self._reap()
            if self._stopping or not self._restart():
                self._done.set()
                return
            reader = FrameReader()

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "report":
            _, report, counts = message
            if self.process_mode:
                child_storage_errors("aggregator", counts)
            with self._lock:
                self._next_index = report.window_index + 1
                self._deliver(report)
        elif kind == "listening":
            self._address = (message[1], message[2])
            self._advertise()
            if self._mesh is not None:
                self._send(("mesh", self._mesh))
            if self.restarts:
                log.warning(
                    "rankwatch: the group's aggregator is back (pid %s); windows resume from "
                    "window %d",
                    self.pid,
                    self._next_index,
                )
        elif kind == "log":
            _, level, name, text = message
            logging.getLogger(name).log(level, "%s", text)
        elif kind == "done":
            _, faults, counts = message
            self.not_written = list(faults)
            if self.process_mode:
                child_storage_errors("aggregator", counts)
            self._done.set()

    def _deliver(self, report: WindowReport) -> None:
        self.latest_report = report
        self.reports_published += 1
        publish_to_all(self.publishers, report, log)

    def _advertise(self) -> None:
        if self.store is None or self._address is None:
            return
        host, port = self._address
        try:
            self.store.set(ADDRESS_KEY, f"{host}:{port}:{self.token}")
        except Exception as exc:  # the store is gone: the ranks cannot find us
            log.warning("rankwatch: cannot publish the aggregator's address: %s", exc)

    def _watch(self) -> None:
        """Between reads: an aggregator that stopped beating is stuck; kill it (the read then
        sees it end, and it is started again)."""
        if self._stopping or not self.process_mode or self._address is None:
            return
        beat = self.board.last_beat()
        now = time.monotonic()
        since = now - (beat if beat is not None else self._started_at)
        if since > self.config.aggregator_stall_seconds:
            log.warning(
                "rankwatch: the group's aggregator (pid %s) has not moved for %.0f s; killing it",
                self.pid,
                since,
            )
            self._kill()

    def _reap(self) -> None:
        self._address = None
        if self._pipe is not None:
            self._pipe.reap()

    def _restart(self) -> bool:
        """Start a new aggregator after the back-off; False when stopping meanwhile, or when it
        cannot start."""
        pipe = self._pipe
        log.warning(
            "rankwatch: the group's aggregator (pid %s) ended (status %s); no windows until it "
            "is back: starting it again in %.0f s",
            None if pipe is None else pipe.pid,
            None if pipe is None else pipe.returncode,
            self._backoff.upcoming(self._started_at),
        )
        if not self._backoff.wait(self._started_at, lambda: self._stopping):
            return False
        self.restarts += 1
        try:
            self._start()
        except OSError as exc:
            log.warning("rankwatch: cannot start the group's aggregator again: %s", exc)
            return False
        return True
