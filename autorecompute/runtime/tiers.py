"""Where offloaded activations go: the host (CUDA: pinned memory, side stream) and the disk (any device).

A tier copies a flat device tensor out (:meth:`store`) and back into a device buffer (:meth:`load`)
without blocking the compute stream (CUDA); both return a :class:`Transfer` to wait on. A CPU tensor's copy
is done on the calling thread before they return (the cores are the compute's). Errors (a full disk) are
raised as :class:`~autorecompute.errors.OffloadError` naming the tensor — by :meth:`Transfer.wait` for a
background copy, at once for the calling thread's: a step never continues with lost data.
"""
from __future__ import annotations

import contextlib
import errno
import os
import tempfile
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from autorecompute.budget import format_bytes
from autorecompute.errors import OffloadError
from autorecompute.problem import GRADIENT


class Transfer:
    """A copy in flight; :meth:`wait` blocks until it is done (and raises what it raised).

    ``then`` runs once, on the waiting thread, after the background part: the host-to-device step of a
    disk read, so it is queued on the caller's current stream like any other op.
    """

    def __init__(self, future: Future | None = None, event=None, what: str = "", then=None, device=None):
        self.future, self.event, self.what, self.then, self.device = future, event, what, then, device

    def wait(self) -> None:
        if self.future is not None:
            error = self.future.exception()
            if error is not None:
                raise error
        if self.then is not None:
            then, self.then = self.then, None
            then()
        if self.event is not None:
            # the compute stream waits for the copy, the host does not
            torch.cuda.current_stream(self.device).wait_event(self.event)


def check_writable(directory: str) -> str:
    """Creates ``directory`` if needed and checks a file can be written there, before any training step."""
    path = os.path.abspath(os.path.expanduser(directory))
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".autorecompute-check-"):
            pass
    except OSError as error:
        raise OffloadError(f"offload_dir={directory!r} cannot be written ({error.strerror or error}). "
                           f"Fix: pass offload_dir= a writable directory with room for the offloaded "
                           f"activations (see plan.bytes_by_action()), or leave it None for the system "
                           f"temporary directory.") from error
    return path


class DiskTier:
    """One anonymous file in ``directory`` (the system temporary directory by default), written and read at
    offsets; get the process's tier for a directory with :func:`disk_tier` (every plan and compiled module
    offloading there shares it).

    The file has no name (``tempfile.TemporaryFile``; on Windows a name removed when it closes): nothing to
    clean up after a crash, and nothing a temporary-directory cleaner can remove under a step. Each stored
    tensor takes an extent of the file, reused by later tensors of its size; once no extent is in use (a
    step's backward is over) the next step lays its tensors out from offset 0 again, so the file is as large
    as the most the process has held offloaded at once, and its pages are written over rather than allocated
    again. The space stays taken until the last module using the tier is gone.

    CPU tensors are written and read on the calling thread: the cores that would run a background copy are the
    ones computing, and handing a copy to a thread and waiting for it costs several times what writing a small
    tensor at an offset takes (creating a file per tensor, more still). Tensors of other devices, copied to the
    host first, are written and read by one background thread while the device keeps computing. A forked child
    opens a file of its own (a copy of what was stored at the fork): the two processes would otherwise lay their
    tensors out over each other in one file.
    """

    def __init__(self, directory: str | None = None):
        self.directory = check_writable(directory) if directory else tempfile.gettempdir()
        self._resources = [self._open(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="autorecompute-disk")]
        self._free: dict[int, list[int]] = {}      # extent size -> free offsets
        self._extents: dict[int, int] = {}         # offset -> size of the extents in use
        self._end = 0                              # where the next new extent starts
        self._released: deque = deque()            # extents released, not yet back on the free lists
        self._owner: int | None = None             # the thread doing the bookkeeping
        self._lock = threading.Lock()              # the bookkeeping
        self._io = threading.Lock()                # the file's position: a seek and its write or read
        self._finalizer = weakref.finalize(self, _close, self._resources)
        _OPEN.add(self)

    def _open(self):
        try:
            return tempfile.TemporaryFile(buffering=0, prefix="autorecompute-offload-", dir=self.directory)
        except OSError as error:
            raise OffloadError(f"cannot open the offload file in {self.directory!r} ({error.strerror or error}). "
                               "Fix: pass offload_dir= a writable directory, or plan without offload "
                               "(actions=('recompute',)).") from error

    def close(self) -> None:
        self._finalizer()

    @property
    def in_use(self) -> int:
        """How many stored tensors hold an extent of the file (0 between steps)."""
        with self._books():
            return len(self._extents)

    @property
    def file_bytes(self) -> int:
        """The size of the file: the most this tier has held at once since its last fresh layout began."""
        return os.fstat(self._resources[0].fileno()).st_size

    @contextlib.contextmanager
    def _books(self) -> Iterator[None]:
        """The bookkeeping, under its lock; extents released meanwhile (below) go back to the free lists."""
        with self._lock:
            self._owner = threading.get_ident()
            try:
                self._settle()
                yield
                self._settle()
            finally:
                self._owner = None

    def _settle(self) -> None:
        while self._released:
            offset, nbytes = self._released.popleft()
            if self._extents.pop(offset, None) != nbytes:
                raise RuntimeError(f"autorecompute: offload extent {offset}+{nbytes} released twice or never "
                                   "stored (a bug: please report it)")
            self._free.setdefault(nbytes, []).append(offset)
        if not self._extents:        # nothing stored: the next step starts the layout again at offset 0
            self._free.clear()
            self._end = 0

    def _allocate(self, nbytes: int) -> int:
        with self._books():
            free = self._free.get(nbytes)
            if free:
                offset = free.pop()
            else:
                offset, self._end = self._end, self._end + nbytes
            self._extents[offset] = nbytes
            return offset

    def release(self, stored: object) -> None:
        """Frees the extent ``stored``. The caller has waited for the write that filled it (a read still queued
        from it is harmless: one thread runs the background jobs in order and nobody reads what it fills). A
        release from a finalizer that garbage collection runs inside the bookkeeping is queued, not waited for
        (it would wait for its own thread), and done by that bookkeeping."""
        self._released.append(stored)
        if self._owner != threading.get_ident():
            with self._books():
                pass

    def store(self, flat: torch.Tensor, name: str) -> tuple[object, Transfer]:
        """Starts writing ``flat`` (a contiguous 1-D tensor) to a free extent; returns (extent, transfer)."""
        on_host = flat.device.type == "cpu"
        data = flat.detach() if on_host else flat.detach().cpu()
        nbytes = data.numel() * data.element_size()
        extent = (self._allocate(nbytes), nbytes)
        # the thread takes the tensor out of the box, so no reference outlives the write: the device
        # memory is free by the time the waiting thread wakes up (measured peaks must not depend on timing)
        box = [data]
        del data

        def write() -> None:
            try:
                with self._io:
                    _write_at(self._resources[0], memoryview(box.pop().view(torch.uint8).numpy()), extent[0])
            except OSError as error:
                raise OffloadError(
                    f"offloading {_what(name)} {name!r} ({format_bytes(nbytes)}) to a file in {self.directory} "
                    f"failed: {error.strerror or error}. The step is stopped so no data is lost. Fix: free "
                    f"space there, pass offload_dir= another disk, or allow fewer offloads "
                    f"(actions=('recompute',)).") from error

        try:
            return extent, self._run(write, on_host, name)
        except BaseException:
            self.release(extent)      # failed here: no caller holds the extent to release it
            raise

    def load(self, stored: object, out: torch.Tensor, name: str) -> Transfer:
        """Starts reading the extent ``stored`` into ``out`` (allocated by the caller on the device). For a
        device other than the CPU the thread fills a host buffer and the waiting thread copies it over."""
        offset, nbytes = stored
        on_host = out.device.type == "cpu"
        target = out if on_host else torch.empty(out.shape, dtype=out.dtype,
                                                 pin_memory=out.device.type == "cuda")
        box = [target]     # as in store: no reference to the buffer outlives the read in the thread
        expected = target.numel() * target.element_size()

        def read() -> None:
            try:
                with self._io:
                    done = _read_at(self._resources[0], memoryview(box.pop().view(torch.uint8).numpy()), offset)
            except OSError as error:
                raise OffloadError(
                    f"reading offloaded {_what(name)} {name!r} back from the file in {self.directory} failed: "
                    f"{error.strerror or error}. The backward cannot go on without it. Fix: plan without "
                    "offload (actions=('recompute',)) or pass offload_dir= a sound disk.") from error
            if done != expected or expected != nbytes:
                raise OffloadError(f"reading offloaded {_what(name)} {name!r} back: got {done} bytes of {expected} "
                                   f"(stored {nbytes}; a bug: please report it)")
        then = None if on_host else (lambda: out.copy_(target, non_blocking=out.device.type == "cuda"))
        if on_host:
            del target
        return self._run(read, on_host, name, then)

    def _run(self, job, here: bool, name: str, then=None) -> Transfer:
        """``job`` now on this thread (``here``; its error raised at once) or on the background thread."""
        if here:
            job()
            return Transfer(what=name, then=then)
        return Transfer(self._resources[1].submit(job), what=name, then=then)

    def _reopen_in_child(self) -> None:
        """After a fork, in the child: a file, locks and thread of its own, holding what was stored."""
        shared = self._resources[0]
        self._lock, self._io, self._owner = threading.Lock(), threading.Lock(), None
        own = self._open()
        done = 0
        while done < self._end:       # pread: the parent's file position, which the two share, stays
            chunk = os.pread(shared.fileno(), min(1 << 24, self._end - done), done)
            if not chunk:
                break
            _write_at(own, memoryview(chunk), done)
            done += len(chunk)
        shared.close()                # the child's descriptor only
        self._resources[:] = [own, ThreadPoolExecutor(max_workers=1, thread_name_prefix="autorecompute-disk")]


def _what(name: str) -> str:
    return "parameter gradient" if name.startswith(GRADIENT) else "activation"


_OPEN: weakref.WeakSet = weakref.WeakSet()                                # every DiskTier of this process
_SHARED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()      # directory -> its tier, while used
_SHARED_LOCK = threading.Lock()


def disk_tier(directory: str | None = None) -> DiskTier:
    """The process's disk tier for ``directory`` (None: the system temporary directory), opened on first use
    and shared by every plan and compiled module offloading there, so a model trained at many input shapes
    (a plan each) holds one file, as large as the most it has offloaded at once."""
    key = os.path.abspath(os.path.expanduser(directory)) if directory else ""
    with _SHARED_LOCK:
        tier = _SHARED.get(key)
        if tier is None:
            tier = DiskTier(directory)
            _SHARED[key] = tier
        return tier


def _after_fork_in_child() -> None:
    global _SHARED_LOCK
    _SHARED_LOCK = threading.Lock()
    for tier in list(_OPEN):
        tier._reopen_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _write_at(file, view: memoryview, offset: int) -> None:
    """Writes all of ``view`` at ``offset`` of the unbuffered ``file``."""
    file.seek(offset)
    while view:
        written = file.write(view)
        if not written:
            raise OSError(errno.EIO, f"the file took none of {len(view)} bytes")
        view = view[written:]


def _read_at(file, view: memoryview, offset: int) -> int:
    """Reads into ``view`` from ``offset`` of the unbuffered ``file``; the bytes read (fewer at its end)."""
    file.seek(offset)
    done = 0
    while done < len(view):
        got = file.readinto(view[done:])
        if not got:
            break
        done += got
    return done


def _close(resources: list) -> None:
    file, pool = resources
    pool.shutdown(wait=True)
    file.close()


class PinnedPool:
    """A bounded, reused pool of pinned host buffers (by exact byte size)."""

    def __init__(self, capacity: int):
        self.capacity, self.in_use = capacity, 0
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A pinned uint8 buffer of ``nbytes``, or None when the pool is full."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self.in_use += nbytes
                return free.pop()
            if self.in_use + nbytes > self.capacity:
                return None
            # make room by dropping idle buffers of other sizes (shapes change, e.g. sequence lengths)
            while self.in_use + nbytes + self._idle() > self.capacity:
                size = max(self._free, key=lambda n: n * len(self._free[n]))
                self._free[size].pop()
                if not self._free[size]:
                    del self._free[size]
            self.in_use += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _idle(self) -> int:
        return sum(n * len(b) for n, b in self._free.items())

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self.in_use -= buffer.numel()
            self._free.setdefault(buffer.numel(), []).append(buffer)


class HostTier:
    """CUDA → pinned host memory: copies on a side stream issued after the tensor's last forward use and
    prefetched on it before backward needs them; the compute stream waits on events, never on the host.
    When the pinned pool is full the tensor goes one level down, to ``disk``."""

    def __init__(self, pool: PinnedPool, disk: DiskTier, device: torch.device):
        self.pool, self.disk, self.device = pool, disk, device
        self.stream = torch.cuda.Stream(device=device)

    def store(self, flat: torch.Tensor, name: str) -> tuple[object, Transfer]:
        nbytes = flat.numel() * flat.element_size()
        buffer = self.pool.take(nbytes)
        if buffer is None:
            stored, transfer = self.disk.store(flat, name)
            return ("disk", stored), transfer
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            buffer.copy_(flat.view(torch.uint8), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        flat.record_stream(self.stream)     # the allocator keeps the block until the copy is done
        return ("host", buffer), Transfer(event=event, what=name, device=self.device)

    def load(self, stored: object, out: torch.Tensor, name: str) -> Transfer:
        kind, where = stored
        if kind == "disk":
            return self.disk.load(where, out, name)
        # ``out`` was allocated on the compute stream: the copy starts after what is queued there
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            out.view(torch.uint8).copy_(where, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        out.record_stream(self.stream)
        return Transfer(event=event, what=name, device=self.device)

    def release(self, stored: object) -> None:
        kind, where = stored
        if kind == "disk":
            self.disk.release(where)
        else:
            self.pool.give(where)


class SimulatedTier:
    """For fake and meta tensors (planning, verification): moves nothing, allocates what a real tier would
    on the device, so the measured memory of a step is the real one."""

    def store(self, flat: torch.Tensor, name: str) -> tuple[object, Transfer]:
        return None, Transfer(what=name)

    def load(self, stored: object, out: torch.Tensor, name: str) -> Transfer:
        return Transfer(what=name)

    def release(self, stored: object) -> None:
        pass
