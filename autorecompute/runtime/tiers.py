"""Where offloaded activations go: the host (CUDA: pinned memory, side stream) and the disk (any device).

A tier copies a flat device tensor out (:meth:`store`) and back into a device buffer (:meth:`load`)
without blocking the compute stream; both return a :class:`Transfer` to wait on. Errors in a background
copy (a full disk) are raised by :meth:`Transfer.wait` as :class:`~autorecompute.errors.OffloadError`
naming the tensor: a step never continues with lost data.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from autorecompute.budget import format_bytes
from autorecompute.errors import OffloadError


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
    """Files in a private temporary directory (removed when the tier is closed or collected), written and
    read by one background thread, so the forward and backward keep computing meanwhile."""

    def __init__(self, directory: str | None = None):
        root = check_writable(directory) if directory else None
        self.directory = tempfile.mkdtemp(prefix="autorecompute-offload-", dir=root)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autorecompute-disk")
        self._count = 0
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _remove_tree, self.directory, self._pool)

    def close(self) -> None:
        self._finalizer()

    def _path(self, name: str) -> str:
        with self._lock:
            self._count += 1
            return os.path.join(self.directory, f"{self._count:06d}-{name.replace('/', '_')[:80]}.bin")

    def store(self, flat: torch.Tensor, name: str) -> tuple[object, Transfer]:
        """Starts writing ``flat`` (a contiguous 1-D tensor) to a new file; returns (file, transfer)."""
        path = self._path(name)
        data = flat.detach().cpu() if flat.device.type != "cpu" else flat.detach()
        nbytes = data.numel() * data.element_size()
        # the thread takes the tensor out of the box, so no reference outlives the write: the device
        # memory is free by the time the waiting thread wakes up (measured peaks must not depend on timing)
        box = [data]
        del data

        def write() -> None:
            try:
                try:
                    f = open(path, "wb")
                except FileNotFoundError:
                    if not os.path.isdir(os.path.dirname(self.directory)):
                        raise       # offload_dir itself is gone: the error below names it
                    # our folder removed under us (a cleaner of the temporary directory; offload_dir deleted and
                    # made again): made again, checked only when a write finds it missing
                    os.makedirs(self.directory, exist_ok=True)
                    f = open(path, "wb")
                with f:
                    written = f.write(memoryview(box.pop().view(torch.uint8).numpy()))
                    f.flush()
                if written != nbytes:
                    raise OSError(f"wrote {written} of {nbytes} bytes")
            except OSError as error:
                _unlink(path)
                fix = ("make the directory again or pass offload_dir= an existing one"
                       if isinstance(error, FileNotFoundError) else "free space there, pass offload_dir= another disk")
                raise OffloadError(
                    f"offloading activation {name!r} ({format_bytes(nbytes)}) to {path} failed: "
                    f"{error.strerror or error}. The step is stopped so no activation is lost. Fix: {fix}, "
                    f"or allow fewer offloads (actions=('recompute',)).") from error

        return path, Transfer(self._pool.submit(write), what=name)

    def load(self, stored: object, out: torch.Tensor, name: str) -> Transfer:
        """Starts reading the file ``stored`` into ``out`` (allocated by the caller on the device). For a
        device other than the CPU the thread fills a host buffer and the waiting thread copies it over."""
        path = str(stored)
        on_host = out.device.type == "cpu"
        target = out if on_host else torch.empty(out.shape, dtype=out.dtype,
                                                 pin_memory=out.device.type == "cuda")

        box = [target]     # as in store: no reference to the buffer outlives the read in the thread
        expected = target.numel() * target.element_size()

        def read() -> None:
            try:
                with open(path, "rb") as f:
                    got = f.readinto(memoryview(box.pop().view(torch.uint8).numpy()))
            except OSError as error:
                raise OffloadError(
                    f"reading offloaded activation {name!r} back from {path} failed: {error.strerror or error}. "
                    "The backward cannot go on without it. Fix: do not remove or change offload_dir (or the "
                    "system temporary directory) while a step runs, or plan without offload "
                    "(actions=('recompute',)).") from error
            if got != expected:
                raise OffloadError(f"reading offloaded activation {name!r} from {path}: got {got} bytes of "
                                   f"{expected} (was the file changed?)")
        then = None if on_host else (lambda: out.copy_(target, non_blocking=out.device.type == "cuda"))
        if on_host:
            del target
        return Transfer(self._pool.submit(read), what=name, then=then)

    def release(self, stored: object) -> None:
        _unlink(str(stored))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_tree(directory: str, pool: ThreadPoolExecutor) -> None:
    pool.shutdown(wait=True)
    shutil.rmtree(directory, ignore_errors=True)


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
