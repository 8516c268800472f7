"""The records a server's python-model instances share: what each publishes, who reads it, how it crosses.

Every instance of a python model is a stub process of its own (and so is each instance of ``admission``), so a
fact one of them knows and another needs crosses between processes. Each such fact is published by one writer
into shared memory in a per-server folder (:func:`server_folder`, ``/dev/shm/s3flow-<record>-<server pid>``), one
file per record opened and mapped once per process, then written and read as memory: the load reports on a board
of lanes, one per instance (``s3flow.serving.report_board``), the per-sequence marks in a table of lanes, one per
writer process (``s3flow.serving.mark_table``); the drain, in the file the launcher names, is watched by the
kernel (``s3flow.serving.draining``). A chunk costs the records no system call but a look at the drain file at a
START (results/syscalls.md; they were 14 files opened, renamed and locked a chunk). ``RECORDS`` is the schema:

=========  =====================================  =======================================  =====================
record     writer (one per lane)                  readers                                  a lane holds
=========  =====================================  =======================================  =====================
load       each solver and vocoder instance, its  admission (capacity, the live cap), the  ``LoadReport`` JSON
           own lane, on a change of its streams   vocoder (a stream the solver holds or
           and at most every 1 s else             ended moments ago is not idle), the
                                                  vocoder's capacity gauge
starts     admission: each START it admits        the vocoder (first audio; takes it)      arrival time
seen       admission: every request it lets       the solver (``OnTheWay``: a chunk on its  time and count
           through, counted                       way keeps its sequence from going idle)
gone       the solver: each sequence it dropped   admission (answers its late chunks;      time and why
           before its END, with why               takes it at a new START)
vocoded    the vocoder: every answer, counted     the solver (``Delivery``: a token2wav    time and count
                                                  stream is idle from its vocoder answer)
voices     the voice_encoder                      the solver and admission (a START's      the prompt (npz
                                                  ``voice_id``)                            file, not a lane)
drain      the drain supervisor                   the solver, the vocoder, admission       ``draining`` or
           (``s3flow.server.drain``)                                                       ``closing`` (a file)
=========  =====================================  =======================================  =====================

Why shared memory (docs/reliability.md): the readers need the last word of another process, at any moment and
without a round trip through it (admission answers a burst of STARTs while the solver is busy solving; a BLS call
into the solver would queue behind its batch). A process that dies leaves its files, which the next start sweeps
(``s3flow.server.leftovers``). A record names its writer's PID, and a report whose writer has died is passed
over by its readers (:func:`writer_watched`: the kernel tells a reader when a writer exits): a dead instance never
refuses traffic on its behalf. Files that are still replaced whole (a voice, the drain, a saved price) go through
:func:`write_atomic`.

Example::

    folder = server_folder("load")                 # this server's (the models' parent PID)
    write_atomic(folder / "cfm_solver_0", text)    # a reader never sees half of it
"""
from __future__ import annotations

import mmap
import os
import select
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class Record:
    """One kind of record (the module's table): its name, its one writer, its readers, what a file holds."""
    name: str
    writer: str
    readers: tuple[str, ...]
    holds: str
    per_server: bool = True     # in a per-server folder (the drain file is the launcher's to name)


RECORDS = (
    Record("load", "each solver and vocoder instance (its own lane)", ("admission", "vocoder"), "LoadReport JSON"),
    Record("starts", "admission", ("vocoder",), "a START's arrival time"),
    Record("seen", "admission", ("cfm_solver",), "time and count of a sequence's requests"),
    Record("gone", "cfm_solver", ("admission",), "time and why a sequence was dropped"),
    Record("vocoded", "vocoder", ("cfm_solver",), "time and count of a sequence's vocoder answers"),
    Record("voices", "voice_encoder", ("cfm_solver", "admission"), "a voice's prompt tensors (npz)"),
    Record("drain", "drain supervisor", ("cfm_solver", "vocoder", "admission"), "draining or closing, since when",
           per_server=False),
)
#: the per-server folders (``s3flow.server.leftovers`` removes them)
SERVER_FOLDERS = tuple(r.name for r in RECORDS if r.per_server)
#: what a file being written is called until it is complete (readers pass over it)
TEMPORARY = ".tmp"


def server_folder(name: str, server_pid: Optional[int] = None) -> Path:
    """``/dev/shm/s3flow-<name>-<server pid>``: the folder of record ``name`` of one server (its python models are
    its children: the default PID is our parent's)."""
    if name not in SERVER_FOLDERS:
        raise ValueError(f"record must be one of {SERVER_FOLDERS}, got {name!r}")
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return Path(root) / f"s3flow-{name}-{server_pid if server_pid is not None else os.getppid()}"


def writer_alive(pid: int) -> bool:
    """Whether the process ``pid`` (a record's writer) still runs: a record whose writer died (a stub killed under
    the server) must not speak for it (issue 53: admission refused traffic on a dead solver's last load report).
    0: no writer named (counts as alive)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's process: alive
        return True
    return True


def map_region(path: Path, size: int, header: tuple[int, ...], what: str) -> tuple[mmap.mmap, memoryview]:
    """``path`` mapped shared (made ``size`` bytes of zeros if new: every opener may, it only ever grows to
    ``size``), and a view of it. Its first fields are ``header`` (u64 each, the first the layout's magic), written by
    the first to map it; ValueError naming ``what`` it holds when another layout's magic is there."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
        region = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    view = memoryview(region)
    fields = struct.Struct(f"<{len(header)}Q")
    magic = fields.unpack_from(view, 0)[0]
    if magic == 0:
        fields.pack_into(view, 0, *header)
    elif magic != header[0]:
        view.release()
        region.close()
        raise ValueError(f"{path} holds {what} of another layout (magic {magic:#x})")
    return region, view


class WriterWatch:
    """Whether records' writers live, kept by the kernel: a reader opens a pidfd per writer once (Linux 5.3+), and one
    daemon thread sleeps in ``epoll`` until one of them exits; asking is then memory only (a ``kill(pid, 0)`` per
    writer per look was 12 system calls a chunk once the records themselves cost none, issue 49). Where pidfds are
    not there, :func:`writer_alive` each time."""

    def __init__(self):
        self.pid = os.getpid()
        self._fds: dict[int, int] = {}       # writer pid -> its pidfd
        self._dead: set[int] = set()
        self._lock = threading.Lock()
        try:
            self._epoll = select.epoll()
        except (AttributeError, OSError):
            self._epoll = None
            return
        threading.Thread(target=self._run, name="writer-watch", daemon=True).start()

    def alive(self, pid: int) -> bool:
        if pid <= 0:
            return True
        with self._lock:
            if pid in self._dead:
                return False
            if pid in self._fds:
                return True
            if self._epoll is None:
                return writer_alive(pid)
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._dead.add(pid)
                return False
            except (AttributeError, OSError):   # no pidfd here (or not ours to watch)
                return writer_alive(pid)
            self._fds[pid] = fd
            self._epoll.register(fd, select.EPOLLIN)   # (seen by the waiting thread at once)
            return True

    def wrote(self, pid: int) -> None:
        """``pid`` has just published something new: if it was taken for dead, its number now names a new process
        (PIDs are reused), looked at afresh at the next :meth:`alive`."""
        with self._lock:
            self._dead.discard(pid)

    def _run(self) -> None:
        while True:
            for fd, _ in self._epoll.poll():   # a watched writer exited
                with self._lock:
                    pid = next((p for p, f in self._fds.items() if f == fd), None)
                    if pid is not None:
                        self._dead.add(pid)
                        del self._fds[pid]
                    self._epoll.unregister(fd)
                    os.close(fd)


_watch: Optional[WriterWatch] = None


def writer_watch() -> WriterWatch:
    """This process's :class:`WriterWatch` (one per process; a forked child makes its own)."""
    global _watch
    if _watch is None or _watch.pid != os.getpid():
        _watch = WriterWatch()
    return _watch


def writer_watched(pid: int) -> bool:
    """Whether ``pid`` (a record's writer) still runs, by this process's :class:`WriterWatch`."""
    return writer_watch().alive(pid)


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace ``path`` with ``data`` whole: written beside it under a name no other process or thread uses, then
    renamed over it."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}{TEMPORARY}{os.getpid()}-{threading.get_ident()}")
    if isinstance(data, bytes):
        tmp.write_bytes(data)
    else:
        tmp.write_text(data)
    os.replace(tmp, path)


def is_temporary(path: Path) -> bool:
    """A file :func:`write_atomic` has not finished (readers pass over it)."""
    return TEMPORARY in Path(path).name
