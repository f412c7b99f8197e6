"""Python side effects of ``forward`` that a captured graph does not repeat, found while ``torch.export`` traces.

Python in ``forward`` runs once, at capture; the graph then replays only its tensor ops. Four kinds of effect
would make the compiled module silently differ from eager, and each is found, with the user's line:

* a draw from Python's ``random`` module or numpy's global generator (LayerDrop's ``random.random() < p``):
  the graph keeps capture's draw at every step, so training differs — a :class:`CaptureError`;
* a read of the clock (``time.time()``, ``datetime.now()``): the graph never reads it again, and a value
  computed from it is a constant — a :class:`CaptureSideEffectWarning` (timing and logging, its usual
  purposes, do not change what a step computes);
* an assignment to a module attribute that is no parameter, buffer, submodule or tensor (a call counter),
  and the rebinding of a global of a module that defines a ``forward``: never updated again (torch.export
  even undoes the attributes' changes) — a :class:`CaptureSideEffectWarning`.

Draws and clock reads are recorded by wrapping the module-level functions (and names the forwards' modules
imported from them) for the duration of the export; attributes by wrapping ``nn.Module.__setattr__``;
globals by comparing before and after. Only calls from the capturing thread count, and only from code
outside torch, autorecompute and the standard library; attributes and globals only from code outside any
installed package (Hugging Face models keep their own bookkeeping state, which their users cannot change).
"""
from __future__ import annotations

import contextlib
import datetime
import dis
import functools
import inspect
import linecache
import os
import random
import sys
import sysconfig
import threading
import time
import types
import warnings
from dataclasses import dataclass
from typing import Iterator

import torch

from autorecompute.errors import CaptureError, CaptureSideEffectWarning, _library_paths, user_stacklevel

CLOCK_FUNCTIONS = ("time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns",
                   "process_time", "process_time_ns", "thread_time", "thread_time_ns")
_GENERATOR_CONTROL = {"seed", "getstate", "setstate", "get_state", "set_state", "get_bit_generator",
                      "set_bit_generator"}


@dataclass(frozen=True)
class SideEffect:
    """One kind of effect at one place: ``kind`` is "random", "clock" or "state"; ``what`` names it
    (``random.random()``, ``attribute calls of Counter (the model)``); ``where`` is ``file:line: code``, or None."""
    kind: str
    what: str
    where: str | None


class _Recorder:
    """The effects seen so far, counted, from the capturing thread only."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.counts: dict[SideEffect, int] = {}
        self.draws_seen = 0     # draws through the wrappers from any code: explains a generator's new state

    def call(self, kind: str, what: str, frame) -> None:
        """A wrapped generator or clock was called from ``frame``."""
        if threading.get_ident() != self.thread:
            return
        self.draws_seen += kind == "random"
        self.note(kind, what, frame, packages_count=True)

    def note(self, kind: str, what: str, frame, packages_count: bool) -> None:
        while frame is not None and frame.f_code.co_name == "__setattr__" and _origin(frame) == "user":
            frame = frame.f_back          # (a module's own __setattr__ passing the assignment on)
        if frame is None or _origin(frame) == "library" or (_origin(frame) == "package" and not packages_count):
            return
        effect = SideEffect(kind, what, _location(frame.f_code.co_filename, frame.f_lineno))
        self.counts[effect] = self.counts.get(effect, 0) + 1


def _origin(frame) -> str:
    """"library" (torch, autorecompute, the standard library), "package" (another installed package,
    Hugging Face's wherever installed) or "user"."""
    return _origin_of(frame.f_code.co_filename, str(frame.f_globals.get("__name__", "")).partition(".")[0])


@functools.lru_cache(maxsize=None)
def _origin_of(filename: str, package: str) -> str:
    installed = any(f"{os.sep}{name}{os.sep}" in filename for name in ("site-packages", "dist-packages"))
    standard = tuple(os.path.join(sysconfig.get_paths()[key], "") for key in ("stdlib", "platstdlib"))
    if package in ("torch", "autorecompute") or filename.startswith(_library_paths(True)) \
            or filename.startswith("<frozen") or (filename.startswith(standard) and not installed):
        return "library"
    return "package" if installed or package == "transformers" else "user"


def _location(filename: str, line: int) -> str:
    code = linecache.getline(filename, line).strip()
    return f"{filename}:{line}" + (f": {code}" if code else "")


@contextlib.contextmanager
def side_effects_recorded(model: torch.nn.Module) -> Iterator[list[tuple[SideEffect, int]]]:
    """Records the effects of what runs inside (the export of ``model``); the list it yields is filled, with
    each effect's count, when the block ends without an exception. Pass it to :func:`refuse_or_warn`."""
    recorder, found = _Recorder(), []
    namespaces = _forward_globals(model)
    globals_before = [_plain_values(namespace) for namespace in namespaces]
    generators_before = _generator_states()
    with _ONE_AT_A_TIME, contextlib.ExitStack() as patches:
        _wrap_draws_and_clocks(patches, recorder, namespaces)
        _wrap_module_setattr(patches, recorder, model)
        yield found
    if recorder.draws_seen == 0 and _generator_states(like=generators_before) != generators_before:
        recorder.counts[SideEffect("random", "a generator's state changed, with no call to it seen", None)] = 1
    for namespace, before in zip(namespaces, globals_before):
        for name in _rebound(namespace, before):
            module = namespace.get("__name__", "?")
            for where in _stores_of(name, namespace) or [None]:
                recorder.counts[SideEffect("state", f"global {name} of module {module}", where)] = 1
    found.extend(recorder.counts.items())


# Captures in other threads wait: each puts back the functions it wrapped, which interleaved would not undo
_ONE_AT_A_TIME = threading.RLock()


def _forward_globals(model: torch.nn.Module) -> list[dict]:
    """The global namespaces of the user's modules that define the forwards of ``model``'s modules."""
    namespaces: dict[int, dict] = {}
    for module in model.modules():
        forward = _unwrapped(getattr(type(module), "forward", None))
        if forward is None:
            continue
        package = str(forward.__globals__.get("__name__", "")).partition(".")[0]
        if _origin_of(forward.__code__.co_filename, package) == "user":
            namespaces[id(forward.__globals__)] = forward.__globals__
    return list(namespaces.values())


def _unwrapped(function) -> types.FunctionType | None:
    """The Python function under ``functools.wraps`` decorators, or None for anything else."""
    try:
        function = inspect.unwrap(function) if isinstance(function, types.FunctionType) else None
    except ValueError:      # (a cycle of __wrapped__)
        return None
    return function if isinstance(function, types.FunctionType) else None


def _plain_values(namespace: dict) -> dict:
    """A namespace's values that are data (not modules, classes, functions or dunder names)."""
    return {name: value for name, value in namespace.items()
            if not name.startswith("__") and not isinstance(value, (types.ModuleType, type)) and not callable(value)}


def _rebound(namespace: dict, before: dict) -> list[str]:
    after = _plain_values(namespace)
    return sorted(name for name in after.keys() | before.keys()
                  if name not in before or name not in after or after[name] is not before[name])


def _stores_of(name: str, namespace: dict) -> list[str]:
    """``file:line: code`` of each ``global name`` assignment in the functions and methods (nested ones too)
    that ``namespace``'s module defines."""
    codes = [function.__code__ for function in map(_unwrapped, _functions_of(namespace)) if function is not None
             and function.__module__ == namespace.get("__name__")]
    lines: set[tuple[str, int]] = set()
    while codes:
        code = codes.pop()
        codes.extend(const for const in code.co_consts if isinstance(const, types.CodeType))
        starts = list(code.co_lines())
        for instruction in dis.get_instructions(code):
            if instruction.opname in ("STORE_GLOBAL", "DELETE_GLOBAL") and instruction.argval == name:
                lines.update((code.co_filename, line) for start, end, line in starts
                             if start <= instruction.offset < end and line)
    return [_location(filename, line) for filename, line in sorted(lines)]


def _functions_of(namespace: dict) -> Iterator:
    """The functions in ``namespace`` and the methods (properties' getters too) of the classes in it."""
    for value in list(namespace.values()):
        if isinstance(value, type) and value.__module__ == namespace.get("__name__"):
            for attribute in vars(value).values():
                yield getattr(attribute, "__func__", getattr(attribute, "fget", attribute))
        else:
            yield value


def _generator_states(like: dict | None = None) -> dict:
    """The global generators' states: Python's, and numpy's where numpy is imported (or, with ``like``, only
    where it was then: a model importing numpy in forward has not drawn from it)."""
    states = {"random": random.getstate()}
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None and hasattr(numpy_random, "get_state") and (like is None or "numpy" in like):
        state = numpy_random.get_state()
        states["numpy"] = (state[0], state[1].tobytes(), *state[2:])
    return states


def _wrap_draws_and_clocks(patches: contextlib.ExitStack, recorder: _Recorder, namespaces: list[dict]) -> None:
    """Wraps the generators' and clocks' module-level functions, ``datetime.datetime`` and ``datetime.date``,
    and the names the forwards' modules imported them as (``from time import perf_counter``)."""
    replaced: dict[int, tuple] = {}         # id(original) → (original, wrapper)
    owners = {id(datetime): datetime}
    for owner, names, kind, label in _drawing_functions():
        owners[id(owner)] = owner
        for name in names:
            original = getattr(owner, name)
            replaced[id(original)] = (original, _recording(original, kind, f"{label}.{name}()", recorder))
    for name, methods in (("datetime", ("now", "utcnow", "today")), ("date", ("today",))):
        original = getattr(datetime, name)
        replaced[id(original)] = (original, _recording_class(original, methods, recorder))
    for namespace in [*map(vars, owners.values()), *namespaces]:
        for name, value in list(namespace.items()):
            original, wrapper = replaced.get(id(value), (None, None))
            if original is value:
                namespace[name] = wrapper
                patches.callback(_put_back, namespace, name, wrapper, original)


def _put_back(namespace: dict, name: str, wrapper, original) -> None:
    if namespace.get(name) is wrapper:        # (unless forward bound the name to something else since)
        namespace[name] = original


def _drawing_functions() -> Iterator[tuple]:
    """(owner module, names, kind, label) of the functions that draw from a global generator or read a clock."""
    generators = [(random, random.random.__self__, "random")]
    numpy_random = sys.modules.get("numpy.random")      # (only where something imported numpy already)
    if numpy_random is not None and hasattr(numpy_random, "random_sample"):
        generators.append((numpy_random, numpy_random.random_sample.__self__, "numpy.random"))
    for owner, generator, label in generators:
        names = sorted(name for name in dir(owner) if name not in _GENERATOR_CONTROL
                       and getattr(getattr(owner, name, None), "__self__", None) is generator)
        yield owner, names, "random", label
    yield time, [name for name in CLOCK_FUNCTIONS if hasattr(time, name)], "clock", "time"


def _recording(original, kind: str, what: str, recorder: _Recorder):
    @functools.wraps(original)
    def recorded(*args, **kwargs):
        recorder.call(kind, what, sys._getframe(1))
        return original(*args, **kwargs)
    return recorded


class _StandsFor(type):
    """The metaclass of a recording stand-in for a class: instances and subclasses of the original are its."""

    def __instancecheck__(cls, instance) -> bool:
        return isinstance(instance, cls.__wrapped__)

    def __subclasscheck__(cls, subclass) -> bool:
        return issubclass(subclass, cls.__wrapped__)


def _recording_class(original: type, methods: tuple, recorder: _Recorder) -> type:
    """A stand-in for ``datetime.datetime`` (or ``date``) whose clock-reading constructors are recorded; what
    it makes are instances of the original."""
    def reading(name: str):
        read = getattr(original, name)

        def recorded(cls, *args, **kwargs):
            recorder.call("clock", f"datetime.{original.__name__}.{name}()", sys._getframe(1))
            return read(*args, **kwargs)
        return classmethod(recorded)
    namespace = {name: reading(name) for name in methods}
    namespace.update(__new__=lambda cls, *args, **kwargs: original(*args, **kwargs), __wrapped__=original,
                     __module__=original.__module__, __qualname__=original.__qualname__)
    return _StandsFor(original.__name__, (original,), namespace)


def _wrap_module_setattr(patches: contextlib.ExitStack, recorder: _Recorder, model: torch.nn.Module) -> None:
    """Records assignments to the model's modules' attributes that are not parameters, buffers, submodules
    or tensors (torch.export warns of a tensor assigned to a plain attribute itself)."""
    labels = {id(module): f"{type(module).__name__} {path!r}" if path else f"{type(module).__name__} (the model)"
              for path, module in model.named_modules(remove_duplicate=False)}
    original = torch.nn.Module.__dict__["__setattr__"]

    def __setattr__(module, name, value):
        if id(module) in labels and threading.get_ident() == recorder.thread \
                and not isinstance(value, (torch.Tensor, torch.nn.Module)) and not _registered(module, name):
            recorder.note("state", f"attribute {name} of {labels[id(module)]}", sys._getframe(1),
                          packages_count=False)
        original(module, name, value)

    torch.nn.Module.__setattr__ = __setattr__
    patches.callback(setattr, torch.nn.Module, "__setattr__", original)


def _registered(module: torch.nn.Module, name: str) -> bool:
    return any(name in module.__dict__.get(table, ()) for table in ("_parameters", "_buffers", "_modules"))


def refuse_or_warn(model: torch.nn.Module, found: list[tuple[SideEffect, int]]) -> None:
    """Warns of the clock reads and the Python state changed, then refuses the random draws. A generator
    advanced through no call seen (so no line to name) is warned of instead: it may be a library's own."""
    name = type(model).__name__
    of = {kind: sorted((pair for pair in found if pair[0].kind == kind), key=lambda pair: pair[0].where or "")
          for kind in ("state", "clock", "random")}
    located = all(effect.where for effect, _ in of["random"])
    unlocated = [] if located else of["random"]
    for kind, effects in (("state", of["state"]), ("clock", of["clock"]), ("unlocated", unlocated)):
        if effects:
            warnings.warn(_MESSAGES[kind].format(name=name, listing=_listing(effects)), CaptureSideEffectWarning,
                          stacklevel=user_stacklevel())
    if of["random"] and located:
        raise CaptureError(_MESSAGES["random"].format(name=name, listing=_listing(of["random"])))


def _listing(effects: list[tuple[SideEffect, int]], most: int = 6) -> str:
    rows = [f"    {effect.what}{f' ({count} times)' if count > 1 else ''} at {effect.where}"
            if effect.where else f"    {effect.what}" for effect, count in effects[:most]]
    return "\n".join(rows + [f"    … and {len(effects) - most} more"] * (len(effects) > most))


_RUNS_ONCE = "Python in forward runs once, while autorecompute captures the model; the graph it runs at each step " \
             "replays only the tensor ops."
_MESSAGES = {
    "random": "{name}'s forward draws from Python's random module or numpy's global generator:\n{listing}\n  "
              + _RUNS_ONCE + " The graph keeps what capture drew: every step would repeat those draws (a "
              "LayerDrop that kept a layer at capture never drops it) and train differently from eager. This is "
              "an error, not a warning, because nothing else would show that training differs.\n  Fix: draw with "
              "torch (torch.rand, torch.bernoulli), which the plan replays at every step, and compute with the "
              "draw instead of branching on it (x = torch.where(torch.rand(()) < p, x, layer(x)) for a LayerDrop); "
              "keep draws that change nothing the step computes (sampled logging) out of forward; or apply "
              "autorecompute.compile only to the submodules without them.",
    "unlocated": "{name}'s forward, or a library it calls, advanced the global generator of Python's random "
                 "module or numpy's while autorecompute captured it, through a call autorecompute could not see "
                 "(a function bound to another name in another module, or the generator's own methods), so it "
                 "cannot name the line. " + _RUNS_ONCE + " If forward uses those numbers, every step repeats "
                 "capture's and trains differently from eager.\n  Fix: draw with torch (torch.rand, "
                 "torch.bernoulli), which the plan replays at every step, or apply autorecompute.compile only to "
                 "the submodules without the draws.",
    "clock": "{name}'s forward reads the clock:\n{listing}\n  " + _RUNS_ONCE + " The compiled module never reads "
             "the clock again: a time measured in forward is capture's, and a value computed from it is a constant "
             "of the graph at every step (a warning: timing and logging, the usual reasons, do not change what "
             "a step computes).\n  Fix: time the call to the compiled module from outside it; if the "
             "computation needs the time, pass it in as a tensor argument.",
    "state": "{name}'s forward changes Python state:\n{listing}\n  " + _RUNS_ONCE + " This state is never "
             "updated at a step: torch.export undoes the attributes' changes (a call counter stays at its value "
             "before capture) and a global keeps the one change capture made; what forward computes from such "
             "state is what it computed at capture, at every step.\n  Fix: update the state outside the compiled "
             "module (after each call), keep it in a registered buffer updated with tensor ops "
             "(self.calls.add_(1): buffer updates are part of the graph), or apply autorecompute.compile only to "
             "the submodules without it.",
}
