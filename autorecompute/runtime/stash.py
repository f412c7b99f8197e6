"""Runtime of the offload, compress and rematerialize actions: saved-tensor hooks driven by graph nodes.

The rewrite (``passes/rewrite_stash.py``) inserts, for every activation the plan stashes:

* ``stash_offload(runtime, t, name)`` / ``stash_compress(runtime, t, name, dtype)`` /
  ``stash_rematerialize(runtime, t, name, op, args, kwargs, rng)`` right after ``t`` is made: from then on,
  whenever autograd saves ``t`` (or a view of it) for a kept op's backward, the saved copy is the stash —
  written to the offload tier, encoded smaller, or nothing but the recipe ``op(*args, **kwargs)`` (run
  again, with the RNG state ``stash_rng_state`` took before ``op``, when backward first needs ``t``) —
  instead of ``t`` itself;
* ``stash_release(handle)`` right after ``t``'s last forward use: waits for the copy out (on CUDA it ran while
  the forward computed; a CPU tensor's was done at the first save) and drops the device reference, so ``t``'s
  memory is free from here;
* ``stash_prefetch(handle, trigger)`` right after ``trigger`` is made: when backward reaches
  ``trigger``'s backward, the copy back starts, ahead of the first op that needs ``t`` (none for
  ``offload:late``, the CPU's only offload: the copy back runs at the first use).

The hooks are pushed by graph nodes only around the ops that make or save a stashed tensor, inside
:meth:`StashRuntime.active` (the compiled module enters it around every call); other saved tensors never
reach Python. Saved tensors are matched by storage, the way autograd shares them, so one copy serves every op
that saves ``t`` or a view of it. The restored tensor lives until the last such op's backward is done.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from functools import partial
from typing import Iterator

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.weak import WeakIdKeyDictionary

from autorecompute.decisions import Action, ActionKind
from autorecompute.runtime.codecs import channel_dim, codec
from autorecompute.runtime.tiers import HostTier, PinnedPool, SimulatedTier, Transfer, check_writable, disk_tier

DEFAULT_PINNED_BYTES = 8 << 30   # pinned host memory the CUDA tier may hold before it falls back to disk
DELIVERED = "delivered"          # the recipe of a tensor a later chain rematerialization makes again
_OFFLOAD, _REMATERIALIZE = Action(ActionKind.OFFLOAD), Action(ActionKind.REMATERIALIZE)


def _is_simulated(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, FakeTensor) or tensor.device.type == "meta"


def _fills_its_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements are exactly its storage, in some order of dimensions (contiguous,
    channels-last): its storage is then ``as_strided(tensor, (numel,), (1,), 0)``."""
    if tensor.storage_offset() != 0 or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        return False
    expected = 1        # dense: by increasing stride, each dimension steps over all the ones before it
    for size, stride in sorted(zip(tensor.shape, tensor.stride()), key=lambda pair: pair[1]):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


class _Stash:
    """One stashed storage: its stored copy, and the restored tensor while backward needs it."""

    def __init__(self, runtime: "StashRuntime", name: str, tensor: torch.Tensor, action: Action, recipe=None):
        storage = tensor.untyped_storage()
        self.key = storage._cdata
        self.name, self.action = name, action
        # compress encodes in place on the device, as its variant's dtype; offload (either way) goes to the
        # device's tier; rematerialize stores nothing but the recipe (op, args, kwargs, rng state)
        compressed = action.kind is ActionKind.COMPRESS
        self.codec = codec(action.variant) if compressed else None
        self.recipe = recipe
        self.tier = None if compressed or recipe is not None else runtime.tier(tensor)
        self.dtype, self.device = tensor.dtype, tensor.device
        self.numel = storage.nbytes() // tensor.element_size()
        # the whole storage as one flat tensor: saved views of it are rebuilt over the restored copy
        self.flat: torch.Tensor | None = torch.as_strided(tensor.detach(), (self.numel,), (1,), 0)
        # a dense tensor is encoded in its memory order (the identity when contiguous), with its channel there:
        # encoded as a flat storage, a channels-last int8 had one scale for all channels (100% error in the small)
        self.layout: tuple[tuple[int, ...], int | None] | None = None
        if compressed and tensor.numel() == self.numel:
            order = sorted(range(tensor.dim()), key=tensor.stride, reverse=True)     # (stable: contiguous → identity)
            if tensor.permute(order).is_contiguous():
                channel = order.index(channel_dim(tuple(tensor.shape))) if tensor.dim() >= 2 else None
                self.layout = (tuple(tensor.shape[d] for d in order), channel)
        self.stride = tuple(tensor.stride())   # a recipe's result must have it to stand for the storage
        self.stored = None            # tier handle (offload) or encoded tensors (compress)
        self.out: Transfer | None = None
        self.restored: torch.Tensor | None = None
        self.back: Transfer | None = None
        self.refs = 0
        self.started = False
        self.source: _Stash | None = None          # the chain rematerialization that makes this one again
        self.delivered: list[_Stash | None] = []   # what this one's recipe makes again on its way

    # forward ---------------------------------------------------------------------------------------
    def start(self) -> None:
        """Makes the stored copy (at the first save); the forward keeps using the original meanwhile."""
        if self.started or self.flat is None:
            return
        if self.recipe is not None:    # the inputs the recipe holds are the stored copy
            self.started = True
            return
        with torch.no_grad():
            if self.codec is not None:
                shape, channel = self.layout if self.layout is not None else (self.flat.shape, None)
                self.stored = self.codec.encode(self.flat.view(shape), channel=channel)
            else:
                self.stored, self.out = self.tier.store(self.flat, self.name)
        # ``flat`` stays until stash_release: it pins the storage, so its address (the registration key)
        # cannot be reused by another tensor while the stash is registered
        self.started = True

    def release_device(self) -> None:
        """After the last forward use: the copy out is complete, the device copy may go."""
        if self.out is not None:
            self.out.wait()
            self.out = None
        self.flat = None

    # backward --------------------------------------------------------------------------------------
    def prefetch(self) -> None:
        """Starts bringing an offloaded tensor back (allocated now, on the compute stream)."""
        if (self.restored is not None or not self.started or self.refs == 0 or self.codec is not None
                or self.recipe is not None):
            return
        self.restored = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        self.back = self.tier.load(self.stored, self.restored, self.name)

    def restore(self, size, stride, offset, dtype) -> torch.Tensor:
        if self.flat is not None:      # not released yet (a backward inside the forward): still on device
            return torch.as_strided(self._as(self.flat, dtype), size, stride, offset)
        if self.restored is None:
            if self.recipe is DELIVERED:
                if self.source is None:
                    raise RuntimeError(f"autorecompute: {self.name!r} was to be made again by a chain "
                                       "rematerialization that never ran its stash node (a bug: please report it)")
                self.source._rematerialize()
                if self.restored is None:
                    raise RuntimeError(f"autorecompute: the recipe of {self.source.name!r} did not make "
                                       f"{self.name!r} again (a bug: please report it)")
            elif self.recipe is not None:
                self._rematerialize()
            elif self.codec is not None:
                with torch.no_grad():
                    decoded = self.codec.decode(self.stored, self.dtype)
                self.restored = decoded.reshape(-1)
            else:
                self.prefetch()
        if self.back is not None:
            self.back.wait()
            self.back = None
        return torch.as_strided(self._as(self.restored, dtype), size, stride, offset)

    def _rematerialize(self) -> None:
        """Runs the recipe: sets ``restored`` of this stash and of those its recipe delivers that still
        wait for it (a chain rematerialization makes them all at once, where backward first needs one)."""
        op, args, kwargs, rng, autocast, versions = self.recipe
        changed = [i for i, (t, v) in enumerate(versions) if t._version != v]
        if changed:
            raise RuntimeError(f"autorecompute: {self.name!r} is rematerialized in backward from inputs that were "
                               f"modified in place after forward (inputs {changed}); do not modify the model's "
                               "inputs or buffers between forward and backward, or plan without 'recompute'")
        device_type, enabled, dtype = autocast
        # as in forward: no gradient, the same autocast state, the same random numbers (each context only
        # where it changes something: backward usually runs without gradient and autocast, and entering
        # both took a third of a small rematerialization's time)
        grad_off = torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext()
        same_autocast = not enabled and not (torch.amp.is_autocast_available(device_type)
                                             and torch.is_autocast_enabled(device_type))
        cast = contextlib.nullcontext() if same_autocast else torch.autocast(device_type, dtype=dtype, enabled=enabled)
        with grad_off, cast:
            if rng is None:
                out = op(*args, **kwargs)
            else:
                cpu, device, device_state = rng
                with torch.random.fork_rng(devices=[device] if device is not None else [], enabled=True):
                    torch.set_rng_state(cpu)
                    if device is not None:
                        torch.cuda.set_rng_state(device_state, device)
                    out = op(*args, **kwargs)
        outs = tuple(out) if self.delivered else (out,)
        for stash, made in zip((self, *self.delivered), outs):
            if stash is None or stash.refs == 0 or stash.restored is not None:
                continue           # nothing saved it, or its backward is done
            if made.dtype != stash.dtype or not _fills_its_storage(made) or made.numel() != stash.numel \
                    or tuple(made.stride()) != stash.stride:
                raise RuntimeError(f"autorecompute: rematerializing {stash.name!r} gave {made.dtype}"
                                   f"{tuple(made.shape)} with strides {tuple(made.stride())}, forward made "
                                   f"{stash.dtype} with {stash.numel} elements and strides {stash.stride} "
                                   "(a bug: please report it)")
            # its storage in memory order (channels-last too): the saved views are rebuilt over it
            stash.restored = torch.as_strided(made, (made.numel(),), (1,), 0)

    def _as(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A saved view may have another dtype than the stash (``view_as_real``): its sizes count those."""
        return flat if dtype == flat.dtype else flat.view(dtype)

    def discard(self) -> None:
        """Its step failed in forward: the stored copy goes, and nothing can be restored."""
        self._release_stored()
        self.flat, self.restored, self.recipe = None, None, None

    def _release_stored(self) -> None:
        """The stored copy goes (its extent of the file is free), once any write still filling it has ended."""
        if self.out is not None:
            try:
                self.out.wait()    # an extent a write is still filling must not be reused
            except Exception:      # noqa: BLE001 — raised in the forward already; a finalizer must not raise
                pass
            self.out = None
        if self.tier is not None and self.started and self.stored is not None:
            self.tier.release(self.stored)
        self.stored, self.started = None, False

    def drop_ref(self) -> None:
        """A saved reference died (its op's backward is done): the last one frees everything."""
        self.refs -= 1
        if self.refs == 0:
            self.restored = None
            if self.flat is None and not any(d is not None and d.refs and d.restored is None for d in self.delivered):
                self.recipe = None     # released: its inputs may go when autograd lets them
            self._release_stored()


class _SavedRef:
    """What autograd keeps instead of a saved tensor: the tensor itself, or a view into a stash."""

    __slots__ = ("tensor", "stash", "view", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.stash, self.view = tensor, None, None

    def attach(self, stash: _Stash) -> None:
        t = self.tensor
        self.view = (tuple(t.size()), tuple(t.stride()), t.storage_offset(), t.dtype)
        self.stash, self.tensor = stash, None
        stash.refs += 1
        stash.start()

    def unpack(self) -> torch.Tensor:
        return self.tensor if self.stash is None else self.stash.restore(*self.view)

    def __del__(self):
        # autograd dropped this saved reference (its op's backward is done, or the graph was freed)
        if self.stash is not None:
            try:
                self.stash.drop_ref()
            except Exception:  # noqa: BLE001 — late in interpreter shutdown; a finalizer must not raise
                pass


class _Step:
    """Hook state of one forward call."""

    def __init__(self):
        self.stashes: dict[int, _Stash] = {}                        # storage key → stash (registered)
        self.made: list[_Stash] = []                                # every stash of this forward, released too
        self.saved: dict[int, list[weakref.ref]] = {}               # storage key → refs saved before that
        self.scope: list[tuple[int, _SavedRef]] | None = None       # saves of the op in a stash scope
        self.watching = 0      # stashes announced (stash_watch) and not registered yet: wrap what is saved
        self.hooked = 0        # saved-tensor hooks this step pushed and has not popped yet

    def hooks_on(self) -> None:
        torch._C._autograd._push_saved_tensors_default_hooks(self.pack, self.unpack)
        self.hooked += 1

    def hooks_off(self) -> None:
        if self.hooked:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self.hooked -= 1

    def pack(self, tensor: torch.Tensor):
        if tensor.is_leaf and tensor.requires_grad and self.scope is None:
            return tensor          # parameters (and inputs that require grad): never stashed
        try:
            key = tensor.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return tensor          # no plain storage (sparse, nested): never an activation the plan stashes
        stash = self.stashes.get(key)
        if stash is None and self.scope is None and (not self.watching or tensor.is_leaf):
            return tensor          # nothing stashes this storage: autograd keeps the tensor, no Python object
        ref = _SavedRef(tensor)
        if stash is not None:
            ref.attach(stash)
        else:
            self.saved.setdefault(key, []).append(weakref.ref(ref))
            if self.scope is not None:
                self.scope.append((key, ref))
        return ref

    @staticmethod
    def unpack(packed):
        return packed.unpack() if isinstance(packed, _SavedRef) else packed

    def register(self, stash: _Stash) -> None:
        self.stashes[stash.key] = stash
        self.made.append(stash)
        for ref in self.saved.pop(stash.key, []):      # saved by the op that made it (e.g. relu saves its result)
            saved = ref()
            if saved is not None and saved.stash is None:
                saved.attach(stash)

    def forget(self, stash: _Stash) -> None:
        """After the last forward use: the storage may die and its address be reused by another tensor."""
        if self.stashes.get(stash.key) is stash:
            del self.stashes[stash.key]


class StashRuntime(torch.nn.Module):
    """The offload tiers and the hook state of a rewritten module (its ``stash_runtime`` submodule).

    Args:
        offload_dir: directory of the disk tier (None: the system temporary directory); checked writable
            at once.
        pinned_bytes: pinned host memory the CUDA tier may use before it falls back to the disk tier.
    """

    def __init__(self, offload_dir: str | None = None, pinned_bytes: int = DEFAULT_PINNED_BYTES):
        super().__init__()
        if offload_dir is not None:
            check_writable(offload_dir)
        self.offload_dir, self.pinned_bytes = offload_dir, pinned_bytes
        self._start_fresh()

    _PER_PROCESS = ("_tiers", "_local", "_gradients", "_hooked", "_offloaded")

    def _start_fresh(self) -> None:
        """The state that lives in this process only: tiers (the disk file, threads, pinned memory), the step's hook
        state, the hooks on parameters and the gradients out until backward ends."""
        self._tiers: dict[str, object] = {}
        self._local = threading.local()
        self._gradients = WeakIdKeyDictionary()     # parameter → name: gradients to offload in this backward
        self._hooked = WeakIdKeyDictionary()        # parameters that carry our post-accumulate hook
        self._offloaded: list[tuple] = []                                          # gradients out until backward ends
        self._warned_create_graph = False

    def __getstate__(self):
        # a copy (``copy.deepcopy``, ``pickle``, ``torch.save``) carries the settings, not this process's tiers
        # and hooks: it starts fresh, as a new runtime would, and opens its own tiers when it first offloads
        return {k: v for k, v in super().__getstate__().items() if k not in self._PER_PROCESS}

    def __setstate__(self, state):
        super().__setstate__(state)
        self._start_fresh()

    # parameter gradients -----------------------------------------------------------------------------
    def offload_gradient(self, param: torch.Tensor, name: str) -> None:
        """Once backward has accumulated ``param``'s gradient, it goes to the offload tier until backward
        ends (then it is back in ``param.grad``, as the optimizer expects)."""
        self._gradients[param] = name
        if param not in self._hooked:
            # the hook lives on the user's parameter: it must not keep this runtime (and its module) alive,
            # and it goes when the runtime does
            handle = param.register_post_accumulate_grad_hook(partial(_gradient_accumulated, weakref.ref(self)))
            self._hooked[param] = handle
            weakref.finalize(self, handle.remove)

    def _gradient_accumulated(self, param: torch.Tensor) -> None:
        name = self._gradients.pop(param, None)
        grad = param.grad
        if name is None or grad is None or not grad.is_contiguous() or grad.layout != torch.strided:
            return
        if grad.requires_grad:
            # backward(create_graph=True): the gradient carries the graph of the backward (a gradient
            # penalty differentiates it); a stored copy would drop that graph, so it stays
            if not self._warned_create_graph:
                self._warned_create_graph = True
                warnings.warn(
                    "backward(create_graph=True) keeps the graph of the backward, which the plan's budget does "
                    "not cover, and the parameter gradients the plan offloads stay on the device (they carry "
                    "that graph): this step can go over the budget. Fix: for a gradient penalty on the inputs "
                    "use torch.autograd.grad(..., create_graph=True) on them, or budget for the double backward.",
                    UserWarning, stacklevel=2)
            return
        if not self._offloaded:     # the first of this backward: bring them all back when it ends
            torch.autograd.Variable._execution_engine.queue_callback(_RestoreAtBackwardEnd(self))
        tier = self.tier(grad)
        stored, out = tier.store(grad.detach().view(-1), name)
        try:
            out.wait()              # written: the device copy may go now
        except BaseException:
            tier.release(stored)    # (a failed write on the background thread)
            raise
        self._offloaded.append((param, tier, stored, tuple(grad.shape), grad.dtype, grad.device, name))
        param.grad = None

    def _restore_gradients(self) -> None:
        offloaded, self._offloaded = self._offloaded, []
        released = 0
        try:
            for param, tier, stored, shape, dtype, device, name in offloaded:
                grad = torch.empty(shape, dtype=dtype, device=device)
                try:
                    tier.load(stored, grad.view(-1), name).wait()
                finally:
                    tier.release(stored)
                    released += 1
                # a gradient accumulated again after it left (a parameter used twice) adds up as autograd would
                param.grad = grad if param.grad is None else param.grad.add_(grad)
        finally:
            for _, tier, stored, *_ in offloaded[released:]:   # a read failed: the rest are lost, their space freed
                tier.release(stored)

    @property
    def disk(self):
        """The disk tier this runtime offloads to (shared by the process, see ``tiers.disk_tier``), or None
        before its first offload."""
        return self._tiers.get("disk")

    def tier(self, tensor: torch.Tensor):
        """The tier for ``tensor``'s device: CUDA → pinned host (then disk); any other device → disk."""
        if _is_simulated(tensor):
            return SimulatedTier()
        device = str(tensor.device)
        if device not in self._tiers:
            disk = self._tiers.get("disk") or disk_tier(self.offload_dir)
            self._tiers["disk"] = disk
            if tensor.device.type == "cuda":
                pool = self._tiers.get("pinned") or PinnedPool(self.pinned_bytes)    # one budget for all GPUs
                self._tiers["pinned"] = pool
                self._tiers[device] = HostTier(pool, disk, tensor.device)
            else:
                self._tiers[device] = disk
        return self._tiers[device]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The hook state of one forward call of the rewritten module. The graph's nodes switch the
        saved-tensor hooks on only around the ops that make or save a stashed tensor (``stash_watch`` …
        its stash node, ``stash_hooks_on`` … ``stash_hooks_off``, a stash scope): every other saved tensor
        is left to autograd with no Python call."""
        step = _Step()
        previous = getattr(self._local, "step", None)
        self._local.step = step
        try:
            yield
        except BaseException:
            # the forward failed (a full disk): its stored copies go now, not when the traceback that holds
            # its partial graph is freed — they would take the space the next step needs
            for stash in step.made:
                stash.discard()
            raise
        finally:
            while step.hooked:         # an op raised inside a window: leave autograd's hook stack as it was
                step.hooks_off()
            self._local.step = previous

    def step(self) -> _Step:
        step = getattr(self._local, "step", None)
        if step is None:
            raise RuntimeError("a stash node ran outside StashRuntime.active(): call the compiled module, or "
                               "run the graph module inside `with gm.stash_runtime.active():`")
        return step


def _register(runtime: StashRuntime, tensor: torch.Tensor, name: str, action: Action, recipe=None,
              skip: bool = False) -> _Stash | None:
    """Ends the tensor's watch window and, unless ``skip``, registers its stash."""
    step = runtime.step()
    step.watching = max(0, step.watching - 1)
    step.hooks_off()
    if skip or not torch.is_grad_enabled() or not isinstance(tensor, torch.Tensor):
        return None
    stash = _Stash(runtime, name, tensor, action, recipe)
    step.register(stash)
    return stash


def stash_watch(runtime: StashRuntime) -> None:
    """Graph node before the op that makes a stashed tensor: what autograd saves until the tensor's stash
    node runs (the op saving its own output, say) is wrapped, so the stash can take it over. Outside these
    windows saved tensors are left to autograd as they are: a stash costs nothing to the other tensors."""
    step = runtime.step()
    step.watching += 1
    step.hooks_on()


def stash_hooks_on(runtime: StashRuntime) -> None:
    """Graph node before an op that saves a stashed tensor: its saves go through the stash hooks."""
    runtime.step().hooks_on()


def stash_hooks_off(runtime: StashRuntime, _after=None) -> None:
    """Graph node after that op (``_after``, its output, orders the node after it)."""
    runtime.step().hooks_off()


def stash_offload(runtime: StashRuntime, tensor: torch.Tensor, name: str) -> _Stash | None:
    """Graph node: from here, what autograd saves of ``tensor`` is offloaded (device → host → disk)."""
    return _register(runtime, tensor, name, _OFFLOAD)


def stash_compress(runtime: StashRuntime, tensor: torch.Tensor, name: str, dtype: str) -> _Stash | None:
    """Graph node (a cast): from here, what autograd saves of ``tensor`` is kept encoded as ``dtype``."""
    return _register(runtime, tensor, name, Action(ActionKind.COMPRESS, dtype))


def stash_rng_state(device: str) -> tuple:
    """Graph node right before a random op whose output is rematerialized: the RNG state it draws from
    (CPU, and the op's CUDA device when it runs on one; the planner offers nothing else)."""
    where = torch.device(device)
    cuda = where if where.type == "cuda" else None
    return torch.get_rng_state(), cuda, (torch.cuda.get_rng_state(cuda) if cuda is not None else None)


def stash_rematerialize(runtime: StashRuntime, tensor: torch.Tensor, name: str, op, args: tuple, kwargs: dict,
                        rng: tuple | None = None, delivers: tuple = (), unchecked: tuple[int, ...] = ()
                        ) -> _Stash | None:
    """Graph node: from here, what autograd saves of ``tensor`` is the recipe ``op(*args, **kwargs)``;
    backward runs it again (replaying ``rng`` and the autocast state) when it first needs ``tensor``. The
    inputs it holds stay on the device no longer than autograd keeps them anyway (the planner checks
    that); an input modified in place meanwhile is an error, not a silent difference.

    A chain rematerialization's recipe returns ``tensor`` and then the tensors of ``delivers`` (the
    handles of their :func:`stash_delivered` nodes): backward makes them all when it first needs one.

    ``unchecked``: positions in ``args`` whose in-place changes do not matter to the recipe (BatchNorm's
    running statistics: in training mode its output depends on the batch alone, and a second forward
    before backward updates them again)."""
    # a view into a larger storage (the recipe would make only the view): kept rather than restored wrongly;
    # a dense tensor in any layout (channels-last) is made again in the same layout by the same op
    keep = isinstance(tensor, torch.Tensor) and not _fills_its_storage(tensor)
    if keep and not delivers:
        return _register(runtime, tensor, name, _REMATERIALIZE, skip=True)
    device_type = tensor.device.type if isinstance(tensor, torch.Tensor) else "cpu"
    # (a device autocast does not know — meta, when planning allocates nothing — is never under it)
    autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)) \
        if torch.amp.is_autocast_available(device_type) else (device_type, False, None)
    skip = set(unchecked)
    tensors = [a for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in skip]
    tensors += [a for a in kwargs.values() if isinstance(a, torch.Tensor)]
    versions = tuple((t, t._version) for t in tensors)
    recipe = (op, tuple(args), dict(kwargs), rng, autocast, versions)
    stash = _register(runtime, tensor, name, _REMATERIALIZE, recipe, skip=keep)
    if keep and torch.is_grad_enabled():
        stash = _Stash(runtime, name, tensor, _REMATERIALIZE, recipe)   # registered nowhere: makes the others only
    if stash is not None and delivers:
        stash.delivered = list(delivers)
        for made in delivers:
            if made is not None:
                made.source = stash
    return stash


def distributed() -> bool:
    """Whether ``torch.distributed`` is initialized: parameter gradients then stay on the device. Offloaded
    from their accumulation (a post-accumulate-grad hook, which runs inside AccumulateGrad, before that node's
    own hooks), they are gone when DistributedDataParallel's reducer reads them there to fill its buckets: it
    reduced zeros, and its buckets hold every gradient anyway."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class _RestoreAtBackwardEnd:
    """Queued on autograd's engine at a backward's first offloaded gradient; called when that backward ends,
    it puts the gradients back in ``.grad``. A backward that fails — an exception in a hook, Ctrl-C — drops
    its queued callbacks without calling them: this object is then freed at once (the engine releases them
    with the failed backward, before the exception reaches the caller), and brings the gradients back from
    there, so ``.grad`` holds what eager's failed backward leaves. (Left out, those parameters had no
    gradient at any later step: the next backward found gradients still out and queued nothing.)"""

    def __init__(self, runtime: "StashRuntime"):
        self.runtime, self.called = runtime, False

    def __call__(self) -> None:
        self.called = True
        self.runtime._restore_gradients()

    def __del__(self) -> None:
        if not self.called:
            self.runtime._restore_gradients()


def _gradient_accumulated(runtime: "weakref.ref[StashRuntime]", param: torch.Tensor) -> None:
    live = runtime()
    if live is not None:
        live._gradient_accumulated(param)


def stash_gradient(runtime: StashRuntime, param: torch.Tensor, name: str) -> None:
    """Graph node after a parameter is read: its gradient is offloaded from its accumulation to the end of
    backward (``StashRuntime.offload_gradient``)."""
    if torch.is_grad_enabled() and isinstance(param, torch.Tensor) and param.requires_grad and param.is_leaf:
        runtime.offload_gradient(param, name)


def stash_delivered(runtime: StashRuntime, tensor: torch.Tensor, name: str) -> _Stash | None:
    """Graph node: from here, what autograd saves of ``tensor`` is made again in backward by the recipe of a
    later chain rematerialization (whose :func:`stash_rematerialize` node takes this handle)."""
    return _register(runtime, tensor, name, _REMATERIALIZE, DELIVERED)


def stash_release(runtime: StashRuntime, handle: _Stash | None) -> None:
    """Graph node after the last forward use: the copy out is waited for and the device copy dropped."""
    if handle is None:
        return
    runtime.step().forget(handle)
    handle.release_device()


def stash_scope_begin(runtime: StashRuntime, *inputs: torch.Tensor) -> frozenset[int]:
    """Graph node before an op whose internal saved tensors (a dropout mask, a reshaped copy, layer-norm
    statistics) are stashed: its saves are collected until :func:`stash_scope_end`."""
    step = runtime.step()
    step.scope = []
    step.hooks_on()
    return frozenset(t.untyped_storage()._cdata for t in inputs if isinstance(t, torch.Tensor))


def stash_scope_end(runtime: StashRuntime, input_keys: frozenset[int], output, internal: tuple[str, ...],
                    actions: dict[str, str]) -> dict[str, _Stash]:
    """Graph node after that op: its saved tensors that are neither inputs nor outputs are, in the order
    autograd saved them, the op's ``internal`` tensors (the profile's names); those in ``actions`` (by action
    name: what the graph's code prints) are stashed at once, and an offloaded one leaves the device when its
    copy is written."""
    step = runtime.step()
    step.hooks_off()
    saves, step.scope = step.scope or [], None
    outputs = output if isinstance(output, (tuple, list)) else (output,)
    skip = set(input_keys) | {t.untyped_storage()._cdata for t in outputs if isinstance(t, torch.Tensor)}
    order: list[int] = []
    refs: dict[int, list[_SavedRef]] = {}
    for key, ref in saves:
        if key in skip:
            continue
        if key not in refs:
            order.append(key)
        refs.setdefault(key, []).append(ref)
    stashes: dict[str, _Stash] = {}
    if not torch.is_grad_enabled():
        return stashes
    for name, key in zip(internal, order):
        action = actions.get(name)
        if action is None:
            continue
        stash = _Stash(runtime, name, refs[key][0].tensor, Action.parse(action))
        for ref in refs[key]:
            if ref.stash is None:
                ref.attach(stash)
        step.saved.pop(key, None)
        stash.release_device()
        stashes[name] = stash
    return stashes


def stash_prefetch(handle: _Stash | dict | None, trigger: torch.Tensor, name: str | None = None) -> None:
    """Graph node: the copy back of ``handle`` (or of ``handle[name]``, for a stash scope's tensors) starts
    when backward reaches ``trigger``'s backward."""
    if isinstance(handle, dict):
        handle = handle.get(name)
    if handle is None or handle.codec is not None:
        return
    grad_fn = getattr(trigger, "grad_fn", None)
    if grad_fn is None:
        return         # no backward to hang it on: the first unpack loads it
    ref = weakref.ref(handle)

    def start(_grad_outputs):
        stash = ref()
        if stash is not None and stash.refs > 0:
            stash.prefetch()
    grad_fn.register_prehook(start)


class StashedModule(torch.nn.Module):
    """A rewritten GraphModule with stash nodes, run with its runtime's hooks active.

    ``graph_module`` is the GraphModule itself (``print(m.graph_module.code)`` shows the stash nodes).
    """

    def __init__(self, graph_module: torch.fx.GraphModule):
        super().__init__()
        self.graph_module = graph_module

    def forward(self, *args, **kwargs):
        with self.graph_module.stash_runtime.active():
            return self.graph_module(*args, **kwargs)
