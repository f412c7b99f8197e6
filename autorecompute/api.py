"""Public entry points: :func:`compile` and :func:`plan`."""
from __future__ import annotations

import copy
import dataclasses
import difflib
import inspect
import logging
import os
import re
import sys
import warnings
import weakref
from functools import lru_cache, partial
from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

from autorecompute.budget import format_bytes, parse_budget
from autorecompute.errors import (EngineError, InfeasibleBudgetError, OverlappingStepsWarning, PartialBackwardWarning,
                                  ReplanningWarning, StepOverBudgetWarning, user_location, user_stacklevel)
from autorecompute.passes.autocast import callers_autocast
from autorecompute.passes.sharded_units import is_sharded
from autorecompute.loss import TARGET, LossOfModel, plan_name, users_model, with_loss
from autorecompute.plan import Plan
from autorecompute.planner import DEFAULT_ACTIONS, Planned, PlannerOptions, make_plan
from autorecompute.runtime.memory import (ALLOCATOR_SLACK, device_bytes_outside, differentiable_outputs,
                                           output_tensors_for_backward,
                                          step_state, tensor_bytes)
from autorecompute.runtime.first_step import FirstStep
from autorecompute.runtime.stash import distributed
from autorecompute.throughputs import TransferModel

log = logging.getLogger("autorecompute")
if os.environ.get("AUTORECOMPUTE_LOG"):
    logging.basicConfig()
    log.setLevel(os.environ["AUTORECOMPUTE_LOG"].upper())


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        grad = ",grad" if value.requires_grad else ""
        return f"{str(value.dtype).replace('torch.', '')}{list(value.shape)}{_layout(value)}@{value.device}{grad}"
    return repr(value)


def _layout(value: torch.Tensor) -> str:
    """"" for a contiguous tensor, else its layout (another layout runs other kernels, with other sizes of
    temporaries): " channels_last" or its strides."""
    if value.is_contiguous() or value.layout != torch.strided:
        return ""
    if value.dim() == 4 and value.is_contiguous(memory_format=torch.channels_last):
        return " channels_last"
    if value.dim() == 5 and value.is_contiguous(memory_format=torch.channels_last_3d):
        return " channels_last_3d"
    return f" strides{list(value.stride())}"


def _autocast_state(devices: set[str]) -> str:
    """The enclosing ``torch.autocast`` regions: " under autocast(cpu, bfloat16)", or "" outside any (checked
    every call, with the inputs' device types: the model may move inputs onto its own device inside forward)."""
    return "".join(f" under autocast({device_type}, {str(dtype).replace('torch.', '')})"
                   for device_type, dtype in callers_autocast(devices))


def input_signature(args: tuple, kwargs: dict) -> str:
    """What a plan depends on, readable: shapes, dtypes, devices, requires_grad of tensors; other values by
    repr; keyword names; an enclosing ``torch.autocast`` (it changes the dtypes, so the sizes, of the step);
    an initialized ``torch.distributed`` (parameter gradients then stay on the device: :func:`distributed`).
    ``input_signature((torch.ones(2, 3),), {}) == "(float32[2, 3]@cpu)"``."""
    named = [("", v) for v in tree_flatten(list(args))[0]]
    named += [(f"{k}=", v) for k, value in kwargs.items() for v in tree_flatten(value)[0]]
    parts = [f"{name}{_describe(v)}" for name, v in named]
    devices = {v.device.type for _, v in named if isinstance(v, torch.Tensor)}
    return f"({', '.join(parts)}){_autocast_state(devices)}{' under torch.distributed' if distributed() else ''}"


# plans of one compiled module at which it warns, and again at each doubling: shapes that change every step
# (sequences padded to each batch's longest) are planned again every step, as torch.compile recompiles
MANY_SIGNATURES = 8
RELEARNS = 2     # times a signature is planned again with the reserve its first step showed
# a step torch.compile runs is planned apart from an eager step with the same inputs
_ENGINE_KEYS = {"eager": "", "torch.compile": " under torch.compile"}


def gradient_state(model: torch.nn.Module) -> str:
    """The part of a step's starting state a plan depends on beyond its inputs: gradients that exist when it
    starts (from the second micro-batch of gradient accumulation on, or kept by
    ``zero_grad(set_to_none=False)``) are resident from its first op, where a step that starts without them
    makes them during backward. ``""`` when none exist, else " with gradients of 3 parameters (1.50 KiB)".

    Example:
        >>> m = torch.nn.Linear(16, 16)
        >>> gradient_state(m)
        ''
        >>> m(torch.ones(1, 16)).sum().backward()
        >>> gradient_state(m)
        ' with gradients of 2 parameters (1.06 KiB)'
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return ""
    return f" with gradients of {len(grads)} parameters ({format_bytes(tensor_bytes(grads))})"


def frozen_state(model: torch.nn.Module) -> str:
    """Parameters that do not require grad (fine-tuning part of a model), for a plan's signature: ``""`` when
    every parameter trains, else " with 3 of 8 parameters frozen" (their gradients are neither made nor held).

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        >>> _ = m[0].requires_grad_(False)
        >>> frozen_state(m)
        ' with 2 of 4 parameters frozen'
    """
    params = list(model.parameters())
    frozen = sum(not p.requires_grad for p in params)
    return f" with {frozen} of {len(params)} parameters frozen" if frozen else ""


def mode_state(model: torch.nn.Module) -> str:
    """The modes a step runs in, for a plan's signature: ``""`` in training mode throughout, else
    " in eval mode" or " with 2 submodules in eval mode" (a frozen BatchNorm, dropout turned off).

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout())
        >>> m[1].eval()
        Dropout(p=0.5, inplace=False)
        >>> mode_state(m)
        ' with 1 submodule in eval mode'
    """
    if not model.training:
        return " in eval mode"
    frozen = sum(not module.training for module in model.modules())
    return f" with {frozen} submodule{'s' if frozen > 1 else ''} in eval mode" if frozen else ""


_PLAIN = frozenset({bool, int, float, str, type(None), torch.dtype, tuple})


def model_state(model: torch.nn.Module) -> int:
    """What a captured graph fixes about the model beyond its inputs, hashed, in one walk of its modules:
    each submodule — the object itself, its mode, its forward hooks (traced into the graph), its backward
    hooks (which the graph does not run: capture warns), and its attributes of plain types (numbers, strings,
    tuples of them: ``Dropout.p``, ``eps`` — tracing reads them as constants) — each parameter and buffer —
    name, object, dtype — and which parameters require grad, and the gradients that exist. A change to any
    of them (``module.eval()``, a hook added, a parameter frozen or replaced, ``model.half()``, a submodule
    swapped, ``dropout.p`` set, a first micro-batch's gradients) makes the next step use (or make) the plan
    of that state instead of running a graph that no longer matches.

    Checked on every training call, so it is one loop over the modules' own dicts: ``named_modules()`` /
    ``named_parameters()`` walks cost several times as much.

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout())
        >>> before = model_state(m)
        >>> _ = m[1].eval()
        >>> model_state(m) == before
        False
    """
    return _state_hash(*_state_parts(model))


def _state_parts(model: torch.nn.Module) -> tuple[tuple, tuple[int, ...]]:
    """:func:`model_state`'s walk: (the values, the object ids), in the walk's order."""
    # (not the global hooks: instruments such as FlopCounterMode's module tracker register them around a step)
    state: list = []
    add = state.append
    ids: list[int] = []      # object ids apart: a deep copy's are its originals' through copy's memo
    grads = []
    stack, seen = [model], set()
    while stack:
        module = stack.pop()
        if module is None or id(module) in seen:   # a child set to None; a module shared under two names
            if module is None:
                add(None)
            else:
                ids.append(id(module))
            continue
        seen.add(id(module))
        ids.append(id(module))     # a submodule swapped for another (one without parameters: GELU for ReLU)
        # plain attributes, ``training`` among them (the Module's own tables are dicts and sets)
        state += [value for value in module.__dict__.values() if type(value) in _PLAIN]
        if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks \
                or module._backward_pre_hooks:
            add(tuple(module._forward_hooks))
            add(tuple(module._forward_pre_hooks))
            add(tuple(module._backward_hooks))
            add(tuple(module._backward_pre_hooks))
        for name, tensor in module._parameters.items():
            add(name)
            if tensor is not None:      # ids: a replaced Parameter is another state (the graph reads the old one)
                ids.append(id(tensor))
                add(tensor.dtype)
                add(tensor.requires_grad)
                if tensor.grad is not None:
                    grads.append(tensor.grad)
        for name, tensor in module._buffers.items():
            add(name)
            if tensor is not None:
                ids.append(id(tensor))
                add(tensor.dtype)
        add(len(module._modules))
        for name, child in module._modules.items():
            add(name)
            stack.append(child)
    if grads:       # gradient accumulation: the later micro-batches start with these resident
        add((len(grads), tensor_bytes(grads)))
    return tuple(state), tuple(ids)


def _state_hash(state: tuple, ids: tuple[int, ...]) -> int:
    try:
        return hash((state, ids))
    except TypeError:       # a tuple attribute holding a list or dict: its text stands for it
        return hash((tuple(repr(value) if type(value) is tuple else value for value in state), ids))


def step_signature(model: torch.nn.Module, args: tuple, kwargs: dict, inputs: str | None = None) -> str:
    """A plan's readable signature: the inputs (``inputs`` if already computed), then the gradients that
    exist, the frozen parameters and the modes of the step."""
    inputs = input_signature(args, kwargs) if inputs is None else inputs
    return inputs + gradient_state(model) + frozen_state(model) + mode_state(model)


def _without_gradients(signature: str) -> str:
    """A signature without its :func:`gradient_state` part."""
    return _GRADIENT_STATE.sub("", signature)


_GRADIENT_STATE = re.compile(r" with gradients of \d+ parameters \([^)]*\)")


def _reads_replaced_tensors(planned: Planned, model: torch.nn.Module) -> bool:
    """Whether the plan's graph reads a Parameter or buffer object the model no longer has under that name
    (``model.head.weight = nn.Parameter(...)``, an adapter swapped in): it would train the old one."""
    graph_module = planned.graph_module
    own = dict(graph_module.named_parameters(remove_duplicate=False))
    own.update(graph_module.named_buffers(remove_duplicate=False))
    current = dict(model.named_parameters(remove_duplicate=False))
    current.update(model.named_buffers(remove_duplicate=False))
    # (FSDP2's shards are read through its gathered parameters: the graph holds placeholders under their names)
    return any(own.get(name, tensor) is not tensor for name, tensor in current.items() if not _is_dtensor(tensor))


def _is_dtensor(tensor: torch.Tensor) -> bool:
    module = sys.modules.get("torch.distributed.tensor")     # (not imported: no DTensor exists)
    return module is not None and isinstance(tensor, module.DTensor)


def _cache_key(signature: str, args: tuple, kwargs: dict, state: int) -> str:
    return f"{signature} {tree_flatten((args, kwargs))[1]} {state}"   # + the nesting structure, the model's state


class CompiledModule(torch.nn.Module):
    """``model`` with a memory plan per input signature. Made by :func:`compile`.

    It shares the model's parameters, buffers and submodules (same objects, same ``state_dict`` keys), and
    passes ``train()`` / ``eval()`` through. Under ``torch.no_grad()``, or when nothing requires grad, it runs
    the original model; in eval mode with autograd on, a step is planned too (a plan of its own).
    """

    def __init__(self, model: torch.nn.Module, budget, options: PlannerOptions, learn_outputs: bool = False):
        super().__init__()
        # Share the model's state dicts themselves: parameters(), state_dict() and optimizers see the
        # same objects under the same names as on the model (the user's model, not the loss around it).
        self._parameters = users_model(model)._parameters
        self._buffers = users_model(model)._buffers
        self._modules = users_model(model)._modules
        self.__dict__["_model"] = model
        self.__dict__["_budget"] = budget
        self.__dict__["_options"] = options
        self.__dict__["_learn_outputs"] = learn_outputs   # outputs="auto": the first step says kept or dropped
        self.__dict__["_outputs_seen"] = None   # what the watched step did with them, at the start of its backward
        self.__dict__["_plans"] = {}
        self.__dict__["_states"] = {}          # each plan's model state (values, object ids), by key
        self.__dict__["_last"] = None
        self.__dict__["_watch"] = None         # a plan's first step's verdict, filled at the end of its backward
        self.__dict__["_pending"] = None       # the last step's graph until its backward (_check_overlapping_step)
        self.__dict__["_first_step"] = None    # (inputs, planned, FirstStep): a plan's first step being measured
        self.__dict__["_reserves"] = {}        # inputs → the reserve their first step showed (bytes), and times

    def __deepcopy__(self, memo: dict) -> "CompiledModule":
        # plans and all: the copy's rewritten modules use the copy's parameters (the memo maps them)
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        for name, value in self.__getstate__(keep_plans=True).items():
            copied.__dict__[name] = copy.deepcopy(value, memo)
        # each plan under the key of its state on the copy: the same values, the copies' object ids (under
        # the original's ids the copy's steps would find none of the keys and keep two plans per signature)
        plans, states = {}, {}
        for key, planned in copied._plans.items():
            values, ids = self._states[key]
            state = values, tuple(id(memo[i]) if i in memo else i for i in ids)
            new_key = f"{key.rsplit(' ', 1)[0]} {_state_hash(*state)}"
            plans[new_key], states[new_key] = planned, state
        copied.__dict__.update(_plans=plans, _states=states)
        return copied

    def __copy__(self) -> "CompiledModule":
        # the same model, so the same plans: kept (in a cache of the copy's own); copy's default would go
        # through __getstate__ and drop them, planning again on the copy's first training call
        copied = type(self).__new__(type(self))
        copied.__setstate__({**self.__getstate__(keep_plans=True), "_plans": dict(self._plans),
                             "_states": dict(self._states)})
        return copied

    def __setstate__(self, state: dict) -> None:
        # a module pickled without a cache of plan states (or a warning mark) starts with none
        super().__setstate__({"_states": {}, "_warned_at": None, "_learn_outputs": False, "_outputs_seen": None,
                              "_first_step": None, "_reserves": {}, **state})

    def __getstate__(self, keep_plans: bool = False) -> dict:
        # pickle / torch.save: the model and the settings; plans are this process's cache (rewritten graph
        # modules, offload tiers), made again — the same plans, the planner is deterministic — on the first
        # training call after loading. nn.Module's own state first (it drops what Module.compile() bound)
        state = super().__getstate__()
        state.update(_watch=None, _pending=None, _outputs_seen=None, _first_step=None)   # this process's graphs
        if not keep_plans:
            state.update(_plans={}, _states={}, _last=None, _warned_at=None)
        return state

    @property
    def model(self) -> torch.nn.Module:
        """The original model."""
        return users_model(self._model)

    @property
    def plan(self) -> Plan | None:
        """The plan of the most recent input signature (None before the first training call)."""
        return self._last.plan if self._last else None

    @property
    def graph_module(self) -> torch.fx.GraphModule | None:
        """The rewritten GraphModule of the most recent input signature (``print(opt.graph_module.code)``
        shows its recompute regions and its offload, prefetch and cast nodes)."""
        return self._last.graph_module if self._last else None

    @property
    def plans(self) -> dict[str, Plan]:
        """Every plan made so far, by input signature; a signature planned again for another model state
        the signature does not show (a forward hook added) is listed again with " #2", " #3"..."""
        out: dict[str, Plan] = {}
        for planned in self._plans.values():
            key, n = planned.plan.signature, 1
            while key in out:
                n += 1
                key = f"{planned.plan.signature} #{n}"
            out[key] = planned.plan
        return out

    def train(self, mode: bool = True) -> "CompiledModule":
        self._model.train(mode)
        return self

    @property
    def training(self) -> bool:
        """The model's mode: ``model.eval()`` on the original shows here too (code that reads the wrapper's
        flag, a trainer's, must see the mode the step runs in)."""
        model = self.__dict__.get("_model")
        return model.training if model is not None else self.__dict__.get("_training", True)

    @training.setter
    def training(self, mode: bool) -> None:
        model = self.__dict__.get("_model")
        if model is None:          # nn.Module.__init__, before the model is set
            self.__dict__["_training"] = mode
        else:
            model.training = mode

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(users_model(self.__dict__["_model"]), name)

    def _wants_plan(self, args: tuple, kwargs: dict) -> bool:
        # whenever autograd records, a backward may follow — in eval mode too (fine-tuning with dropout off)
        if not torch.is_grad_enabled():
            return False
        if any(p.requires_grad for p in self._model.parameters()):
            return True
        flat, _ = tree_flatten((args, kwargs))
        return any(isinstance(v, torch.Tensor) and v.requires_grad for v in flat)

    def prepare(self, *args, **kwargs) -> Plan:
        """Plans for these inputs now (as the first training call would) without running a step."""
        if self._sharded_around():
            raise EngineError(
                "prepare() cannot plan a compiled module that fully_shard wraps: FSDP2 gathers its parameters only "
                "around its forward. Fix: shard the model first and compile it after (the plan is then per rank), "
                "or let the first call plan.")
        if isinstance(self._model, LossOfModel):
            _model_keywords(kwargs, self._model.loss_fn)       # the loss's target is there, or how to pass it
        self._check_first_step()
        return self._planned(args, self._without_cache(kwargs)).plan

    def _without_cache(self, kwargs: dict) -> dict:
        """:func:`_without_cache`, telling it once per compiled module."""
        changed = _without_cache(self._model, kwargs, tell=not self.__dict__.get("_told_cache"))
        if changed is not kwargs:
            self.__dict__["_told_cache"] = True
        return changed

    # planning is Python over fake tensors: under torch.compile(opt) dynamo would trace into it (recompiling
    # its helpers per tensor until its limit, for seconds); it graph-breaks here instead and runs it as is
    @torch.compiler.disable
    def _planned(self, args: tuple, kwargs: dict, engine: str = "eager") -> Planned:
        # every call: the key from the inputs and the model's state (one walk; the gradients that exist make a
        # state of their own: with gradient accumulation the later micro-batches start with them resident);
        # the readable signature only when planning
        inputs = input_signature(args, kwargs) + _ENGINE_KEYS[engine]
        state = _state_parts(self._model)
        key = _cache_key(inputs, args, kwargs, _state_hash(*state))
        planned = self._plans.get(key)
        new = planned is None or self._device_grew(planned, args, kwargs)
        if new:
            # a Parameter or buffer replaced (the state holds their ids): the plans made before read the old
            # objects; dropped, so they do not keep them alive
            for stale in [k for k, p in self._plans.items() if _reads_replaced_tensors(p, self._model)]:
                del self._plans[stale]
                self._states.pop(stale, None)
            signature = step_signature(self._model, args, kwargs, inputs)
            log.info("planning %s for %s", plan_name(self._model), signature)
            self._warn_if_sharded_around()
            with torch.random.fork_rng(devices=[]):   # planning must not move the user's RNG stream
                planned = make_plan(self._model, args, kwargs, self._budget, self._options_for(inputs, engine),
                                    signature)
            # a library can change the model during the capture's forward (transformers installs its output
            # collecting hooks on the first call with output_router_logits): the plan is for the model as
            # its next steps find it
            state = _state_parts(self._model)
            key = _cache_key(inputs, args, kwargs, _state_hash(*state))
            self._plans[key] = planned
            self._states[key] = state
        self.__dict__["_last"] = planned
        # with gradient accumulation each step has two plans (its first micro-batch starts without gradients,
        # the others with them): the larger of the two groups is counted, so that a few fixed shapes do not
        # read as many
        if not new:
            return planned
        accumulating = [p for p in self._plans.values() if _GRADIENT_STATE.search(p.plan.signature)]
        starting = [p for p in self._plans.values() if not _GRADIENT_STATE.search(p.plan.signature)]
        group = max(starting, accumulating, key=len)
        count = len(group)
        if count >= MANY_SIGNATURES and count & (count - 1) == 0 \
                and self.__dict__.get("_warned_at") != count:      # the 8th, 16th, 32nd... plan of a group
            self.__dict__["_warned_at"] = count
            same = sum(_without_gradients(p.plan.signature) == _without_gradients(signature) for p in group)
            if same > count // 2:       # mostly the same inputs: the model's state keeps changing
                cause = (f"{same} of them for the same inputs ({signature}): the model's state changed before "
                         "each (a plain attribute such as dropout.p, a mode, hook, submodule or parameter). Fix: "
                         "pass a value that changes every step as an input (a tensor argument), or change it "
                         "between a few fixed values")
            else:
                cause = (f"the latest {signature}. Fix: give the steps a few fixed shapes (pad sequences to a "
                         "multiple of 64 or to the longest, drop or pad the last batch)")
            twins = len(self._plans) - count
            also = f" (and {twins} for steps that start with other gradients)" if twins else ""
            warnings.warn(
                f"autorecompute has made {count} plans{also} for {plan_name(self._model)}: each new one is "
                f"captured and solved again, seconds of planning, and its plan is kept; {cause}.",
                ReplanningWarning, stacklevel=user_stacklevel())
        return planned

    def _sharded_around(self) -> bool:
        """Whether FSDP2 shards this compiled module from outside, the model inside it unsharded."""
        return is_sharded(self) and not is_sharded(self._model)

    def _warn_if_sharded_around(self) -> None:
        """Once: FSDP2 shards this compiled module from outside (``fully_shard(autorecompute.compile(m))``),
        so its plan sees the parameters gathered and this module's step alone, not what the rank holds."""
        if self._sharded_around() and not self.__dict__.get("_told_sharded"):
            self.__dict__["_told_sharded"] = True
            warnings.warn(
                f"fully_shard wraps autorecompute.compile({plan_name(self._model)}): the plan counts its "
                "parameters gathered and plans this module's step alone, so its budget is not the rank's memory. "
                "Fix: shard the model first and compile it after (fully_shard each block, then the root, then "
                "autorecompute.compile(model, budget=per-rank bytes)): the plan is then for what one rank holds.",
                UserWarning, stacklevel=user_stacklevel())

    def _device_grew(self, planned: Planned, args: tuple, kwargs: dict) -> bool:
        """Whether more is allocated on the CUDA device than when ``planned`` was made (optimizer state
        created by the first ``optimizer.step()``, tensors the program keeps): the plan counted what was
        there, so it is made again, counting this (once per growth beyond the allocator's slack)."""
        counted = planned.plan.resident.get("other on device")
        if counted is None:        # not planned on a CUDA device
            return False
        now = device_bytes_outside(step_state(self._model, args, kwargs))
        if now <= counted + ALLOCATOR_SLACK:
            return False
        log.info("%s more allocated on the device than when the plan for %s was made: planning again",
                 format_bytes(now - counted), planned.plan.signature)
        return True

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            module, kwargs = self._compiled_step(args, kwargs)
            return module(*args, **kwargs)
        if isinstance(self._model, LossOfModel):
            _model_keywords(kwargs, self._model.loss_fn)       # the loss's target is there, or how to pass it
        if not self._wants_plan(args, kwargs):
            return self._model(*args, **kwargs)
        self._check_last_backward()
        self._check_overlapping_step()
        self._check_outputs()
        self._check_first_step()
        kwargs = self._without_cache(kwargs)
        planned = self._planned(args, kwargs)
        step = self._measure_first_step(planned, args, kwargs)
        outputs = planned.module(*args, **kwargs)
        if step is not None:
            step.watch(outputs)
        if not planned.backward_watched:
            if not self.__dict__.get("_told_retain"):
                _watch_retained_graph(self, outputs)
            planned.backward_watched = True
            self._watch_backward(outputs)
            self._watch_outputs(outputs)
        self._watch_overlapping_step(outputs)
        return outputs

    @torch.compiler.disable
    def _compiled_step(self, args: tuple, kwargs: dict) -> tuple[torch.nn.Module, dict]:
        """(the module dynamo traces for this step, its keyword arguments) under ``torch.compile(compiled)``:
        the plan made for torch.compile (its recomputation as checkpointed regions the partitioner honours,
        measured as compiled), or the model where no backward can follow. The first-step checks of eager steps
        (outputs' lifetime, partial backwards) need hooks on the outputs, which a compiled graph has not."""
        if not self._wants_plan(args, kwargs):
            return self._model, kwargs
        kwargs = self._without_cache(kwargs)
        return self._planned(args, kwargs, engine="torch.compile").module, kwargs

    def _options_for(self, inputs: str, engine: str) -> PlannerOptions:
        """The planner's options for these inputs: the engine's, with the reserve their first step showed."""
        options = self._engine_options(engine)
        learned = self._reserves.get(inputs)
        return options if learned is None else dataclasses.replace(options, loss_reserve=learned[0])

    def _measure_first_step(self, planned: Planned, args: tuple, kwargs: dict) -> FirstStep | None:
        """Starts measuring the first step of ``planned`` (one at a time), through the caller's code to the
        end of its backward."""
        if planned.step_measured or self.__dict__.get("_first_step") is not None or _in_backward():
            return None
        step = FirstStep.start(self._model, args, kwargs)
        if step is None:
            planned.step_measured = True     # not measurable here: no attempt at every later step
        else:
            self.__dict__["_first_step"] = (input_signature(args, kwargs), planned, step)
        return step

    def _check_first_step(self) -> None:
        """After a measured first step: where it went over its budget, its inputs are planned again with
        what the caller's code held beyond the plan as their reserve (at most :data:`RELEARNS` times)."""
        entry = self.__dict__.get("_first_step")
        if entry is None or _in_backward():      # (a caller's checkpoint recomputing the forward)
            return
        inputs, planned, step = entry
        step.close()
        self.__dict__["_first_step"] = None
        if not step.done:
            return       # no backward: its next step is measured
        planned.step_measured = True
        plan = planned.plan
        if step.peak <= plan.budget:
            return
        _, times = self._reserves.get(inputs, (plan.loss_reserve, 0))
        if times >= RELEARNS:
            return
        # an eighth more: the caller's code holds its tensors over a stretch of backward, where the reserve
        # counts them at its start
        excess = max(0, step.peak - plan.predicted_peak)
        learned = plan.loss_reserve + excess + excess // 8
        self._reserves[inputs] = (learned, times + 1)
        warnings.warn(
            f"autorecompute: the first step of {plan_name(self._model)}'s plan for {plan.signature} measured "
            f"{format_bytes(step.peak)}, over its budget of {format_bytes(plan.budget)} (the plan predicted "
            f"{format_bytes(plan.predicted_peak)} with {format_bytes(plan.loss_reserve)} reserved for the code "
            "between forward and backward, a loss over the outputs): that code held more. Planning these inputs "
            f"again with {format_bytes(learned)} reserved; the next steps fit. To plan it from the start, pass "
            f"compile(..., loss_reserve={learned}), or compute the loss inside the model.",
            StepOverBudgetWarning, stacklevel=user_stacklevel())
        for key in [k for k, p in self._plans.items() if p is planned]:
            del self._plans[key]
            self._states.pop(key, None)

    def _engine_options(self, engine: str) -> PlannerOptions:
        """The planner's options for a step ``engine`` runs: under torch.compile recomputation only."""
        if engine == "eager":
            return self._options
        if is_sharded(self._model):
            raise EngineError(
                f"torch.compile over autorecompute.compile of the fully_shard-ed {plan_name(self._model)}: the "
                "plan runs FSDP2's gathers and hooks around each sharded module's ops, which a compiled graph "
                "does not. Fix: call the compiled module without torch.compile (FSDP2's collectives run as in "
                "eager), or torch.compile the model and shard it without autorecompute.")
        if "recompute" not in self._options.actions:
            raise EngineError(
                f"torch.compile over autorecompute.compile(..., actions={self._options.actions!r}): a compiled "
                "graph recomputes checkpointed regions but runs none of the hooks that offload or compress "
                "tensors, so these actions cannot hold the budget under it. Fix: include 'recompute' in actions "
                "(offload and compress then apply to steps run without torch.compile), or call the module "
                "without torch.compile.")
        if self._options.actions != ("recompute",) and not self.__dict__.get("_told_engine"):
            self.__dict__["_told_engine"] = True
            log.info("under torch.compile %s is planned with recomputation only (the compiled graph runs no "
                     "offload or compress hooks)", plan_name(self._model))
        return dataclasses.replace(self._options, engine=engine, actions=("recompute",), compress_dtypes=None,
                                   offload_dir=None)

    def _watch_overlapping_step(self, outputs) -> None:
        """Every step until it has warned (a loop may overlap only some steps): marks the outputs' graph (alive
        as long as a tensor or node of it is) until backward reaches one of them, for
        :meth:`_check_overlapping_step` at the next forward. One hook per output, a few µs."""
        # every differentiable output, the model's own loss or not: a caller's loss may start from the logits
        # and leave the returned loss alone (each reached marks the step done; each kept alive keeps the mark)
        tensors = [t for t in differentiable_outputs(outputs) if t.grad_fn is not None]
        if not tensors or self.__dict__.get("_told_overlap"):
            return
        pending = _PendingBackward()

        def reached(grad):
            pending.done = True

        for tensor in tensors:
            tensor.register_hook(reached)      # held by the graph: ``pending`` lives exactly as long as it
        self.__dict__["_pending"] = weakref.ref(pending)

    def _check_overlapping_step(self) -> None:
        pending = self.__dict__.get("_pending")
        pending = pending and pending()
        if pending is None or pending.done:
            return
        self.__dict__["_pending"] = None
        self.__dict__["_told_overlap"] = True
        warnings.warn(
            f"A forward of {plan_name(self._model)} began while the graph of its previous forward, whose "
            "backward has not run, is still alive: the plan covers one forward and its backward, so the saved "
            "activations of both forwards are on the device at once, which it did not count, and this step "
            "can go over the budget (gradients are eager's). Fix: one forward per backward — run the inputs as "
            "one batch (torch.cat, then split the outputs), or call backward on each forward's loss before the "
            "next forward (gradients accumulate); if both forwards must be alive (a contrastive loss over two "
            "views), give each call its share of the budget; outputs kept only for metrics: detach them.",
            OverlappingStepsWarning, stacklevel=user_stacklevel())

    def _watch_outputs(self, outputs) -> None:
        """The first step of each plan: whether the outputs backward does not start from (the logits beside a
        returned loss) are still on the device when its backward ends — kept — or freed — dropped. (At its
        start they may be alive for backward's own sake: a lean cross-entropy saves the logits.)"""
        seeds = output_tensors_for_backward(outputs)
        reached = {t.untyped_storage()._cdata for t in seeds}
        others = [StorageWeakRef(t.untyped_storage()) for t in tree_flatten(outputs)[0]
                  if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in reached]
        if not seeds or not others:
            return
        seen: dict = {}
        queued: list = []

        def at_end_of_backward():
            seen.setdefault("dropped", all(ref.expired() for ref in others))

        def at_backward(grad):
            if not queued:
                queued.append(True)
                torch.autograd.Variable._execution_engine.queue_callback(at_end_of_backward)
        for tensor in seeds:
            tensor.register_hook(at_backward)
        self.__dict__["_outputs_seen"] = seen

    def _check_outputs(self) -> None:
        """After a watched step: plans made for outputs kept are made again for outputs dropped where the
        step dropped them (``outputs="auto"``); a step that kept outputs planned as dropped is told, and its
        plans made again for them kept (its backward held more than the plan counted)."""
        seen = self.__dict__.get("_outputs_seen")
        if not seen:
            return
        self.__dict__["_outputs_seen"] = None
        planned_for, found = self._options.outputs, "dropped" if seen["dropped"] else "kept"
        if found == planned_for or (found == "dropped" and not self._learn_outputs):
            return
        if found == "kept":
            warnings.warn(
                f"autorecompute: {plan_name(self._model)}'s plan is for outputs dropped before backward "
                "(outputs='dropped'), but the last step held them through its backward, which the plan did not "
                "count: that step may have gone over the budget. Planning again for outputs kept. Fix: drop the "
                "outputs before backward (loss = model(x).loss), or compile with outputs='kept' or 'auto'.",
                PartialBackwardWarning, stacklevel=user_stacklevel())
        else:
            log.info("%s's first step dropped the outputs before backward: planning again for that (one "
                     "outputs-sized tensor less held)", plan_name(self._model))
        self.__dict__["_options"] = dataclasses.replace(self._options, outputs=found)
        self._plans.clear()
        self._states.clear()

    def _watch_backward(self, outputs) -> None:
        """The first step of each plan: whether its backward leaves out an output the plan gave a gradient
        while that output (and the activations only it needs) is still alive. An output that shares its
        storage with one backward reached (a view of it) holds nothing more."""
        tensors = output_tensors_for_backward(outputs)
        if len(tensors) < 2:
            return
        refs = [weakref.ref(t) for t in tensors]
        storages = [t.untyped_storage()._cdata for t in tensors]
        reached = [False] * len(tensors)
        watch: dict = {"done": False}

        def at_end_of_backward():
            through = {key for key, done in zip(storages, reached) if done}
            left = sum(1 for ref, key, done in zip(refs, storages, reached)
                       if not done and key not in through and ref() is not None)
            watch.update(done=True, left=left, reached=sum(reached), total=len(reached))

        def mark(grad, i):
            if not any(reached):
                torch.autograd.Variable._execution_engine.queue_callback(at_end_of_backward)
            reached[i] = True

        for i, tensor in enumerate(tensors):
            tensor.register_hook(partial(mark, i=i))
        self.__dict__["_watch"] = watch

    def _check_last_backward(self) -> None:
        watch = self.__dict__.get("_watch")
        if watch is None or not watch["done"]:
            return      # no backward since the watched step (gradient accumulation: its next forward comes first)
        self.__dict__["_watch"] = None
        if watch["left"]:
            warnings.warn(
                f"autorecompute: the last step ran backward from {watch['reached']} of the {watch['total']} outputs "
                "its plan gives gradients (as a loss over every differentiable output would) while the others were "
                "alive: the activations only they need stayed on the device through that backward, which the plan "
                "did not count, so the budget may not hold. Fix: detach the outputs no loss uses (return "
                "out.detach(), or compute metrics under torch.no_grad()), or put every output into the loss.",
                PartialBackwardWarning, stacklevel=user_stacklevel())


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _options(actions, compress_dtypes, offload_dir, transfer, solver_time_limit, seed, objective,
             loss_reserve="auto", outputs="kept") -> PlannerOptions:
    return PlannerOptions(actions=_names(actions, "actions", "('recompute', 'offload')"),
                          compress_dtypes=None if compress_dtypes is None else
                          _names(_dtype_names(compress_dtypes), "compress_dtypes",
                                 "('bfloat16',) or (torch.bfloat16,)"),
                          offload_dir=offload_dir, transfer=transfer, solver_time_limit=solver_time_limit, seed=seed,
                          objective=objective, loss_reserve=loss_reserve, outputs=outputs)


# the torch dtypes a compress codec stores as, by the codec's name
_CODEC_OF_DTYPE = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float8_e4m3fn: "float8",
                   torch.int8: "int8"}


def _dtype_names(value):
    """``compress_dtypes`` with torch dtypes given by their codec's name (``torch.bfloat16`` → "bfloat16");
    a dtype no codec stores as is left as it is, for PlannerOptions to name the accepted ones."""
    if isinstance(value, torch.dtype):
        value = (value,)
    if isinstance(value, (list, tuple, set, frozenset)):     # (a set stays one, for _names to order)
        kind = tuple if isinstance(value, list) else type(value)
        return kind(_CODEC_OF_DTYPE.get(v, str(v).replace("torch.", "")) if isinstance(v, torch.dtype) else v
                    for v in value)
    return value


def _names(value, argument: str, example: str):
    """A tuple of the names given (a bare string is left for PlannerOptions to explain)."""
    if isinstance(value, str):
        return value
    try:
        names = tuple(sorted(value) if isinstance(value, (set, frozenset)) else value)   # (a set in a fixed order)
    except TypeError:
        names = None
    if names is None or not all(isinstance(v, str) for v in names):
        raise ValueError(f"{argument}={value!r} must be a tuple of names such as {example}")
    return tuple(str(v) for v in names)


def compile(model: torch.nn.Module, budget: int | float | str, *, actions: tuple[str, ...] = DEFAULT_ACTIONS,
            compress_dtypes: tuple[str, ...] | None = None, offload_dir: str | None = None,
            transfer: TransferModel | None = None, solver_time_limit: float | None = None, seed: int = 0,
            objective: str = "time", loss_reserve: int | str = "auto", outputs: str = "auto",
            loss_fn: Callable | None = None) -> CompiledModule:
    """Wraps ``model`` so each training step fits in ``budget`` bytes, planning lazily per input signature.

    Args:
        model: the module to train. Its parameters and buffers are shared, not copied.
        budget: an int of bytes, a string such as ``"12GB"`` / ``"1.5GiB"``, or a float in (0, 1] meaning
            that fraction of the unoptimized peak. It bounds everything live on the device from the start
            of forward to the end of backward: parameters, buffers, inputs, existing gradients, activations,
            temporaries and the gradients produced.
        actions: what the solver may do besides keeping a tensor: ``"recompute"``, ``"offload"`` (CUDA:
            to pinned host memory, then disk; CPU: to disk) — both exact, the default — and ``"compress"``
            (lossy, opt-in).
        compress_dtypes: what ``"compress"`` may store activations as, among ``"bfloat16"`` (the default),
            ``"float16"``, ``"float8"`` (e4m3fn, per-tensor scale) and ``"int8"`` (per-channel scale), by
            name or as torch dtypes (``(torch.bfloat16, torch.float8_e4m3fn)``; one dtype alone is taken as one).
        offload_dir: directory of the disk tier (None: the system temporary directory); checked now.
        transfer: compute and transfer throughputs of the cost model (``autorecompute.transfer``); None
            takes the device's defaults, ``autorecompute.transfer.measure()`` times this machine.
        solver_time_limit: None (the default) lets the planner choose: a model of repeated blocks (a
            transformer's layers) is planned by its layers — a menu of each block's decisions, one per block
            by dynamic programming, then a local search — in seconds at any depth; any other graph by CP-SAT
            as below with a limit of 8. A number asks for the whole-model search on every graph, with this
            limit: about the seconds of the cost solve (the minimum-peak solve gets a quarter),
            as deterministic CP-SAT work, so the plan does not depend on the machine's load; the best plan
            found by then is used. A cost solve CP-SAT does not prove optimal is improved after it by
            windows of it, up to three times the limit (CP-SAT over windows of the chain where it found
            nothing, then windows across repeated layers), each window ending early once solved.
            Capturing, profiling and checking candidate plans on fake tensors take time besides, in
            proportion to the model's ops and whatever the limit.
        seed: CP-SAT's seed: same model, inputs and seed give the same plan.
        objective: what "least extra" means: ``"time"`` (the default) prices recomputation with the
            device's speeds — FLOPs, bytes of memory-bound ops, random numbers, one call per op and per
            checkpointed region; ``"flops"`` counts FLOPs alone (what ``FlopCounterMode`` reports; fastest
            only where elementwise recomputation is fused away, as under ``torch.compile``); offload
            transfers, where allowed, are priced by the time they expose in both, so a least-FLOPs plan may
            recompute rather than offload where the copy would not be hidden.
        loss_reserve: bytes your code holds beside the outputs' gradients as backward starts — a loss
            computed outside the model over its outputs. ``"auto"`` (the default): none when the model
            returns a scalar loss (or ``outputs["loss"]``), else three float32 tensors of each output's size
            less the gradient the step counts anyway (cross-entropy's log-softmax, its gradient and the
            gradient of the logits); ``0`` when the loss is inside the model; an int for another loss.
            ``plan.loss_reserve`` says what was reserved.
        outputs: what your step does with the outputs backward does not start from — the logits beside the
            loss a model returns: ``"kept"`` through backward (``out = model(x, labels=y);
            out.loss.backward()``), ``"dropped"`` before it (``model(x, labels=y).loss.backward()``, Hugging
            Face Trainer's step: one logits tensor less at the peak). ``"auto"`` (the default) plans them kept
            and looks at the first step: found dropped, the step is planned again for that (logged; the first
            step stays within its budget either way). ``plan.outputs`` says which a plan is for.
        loss_fn: ``loss_fn(outputs, target) -> loss``, captured and planned with the model (its tensors counted,
            not reserved); then ``loss = compiled(*inputs, target=labels)`` returns the loss.

    Example:
        >>> import autorecompute, torch
        >>> model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh())
        ...                               for _ in range(8)])
        >>> opt = autorecompute.compile(model, budget=0.7, solver_time_limit=1.0)
        >>> opt(torch.randn(4096, 256)).sum().backward()
        >>> opt.plan.predicted_peak <= opt.plan.budget
        True
        >>> classify = autorecompute.compile(torch.nn.Linear(256, 10), budget=1.0, loss_fn=torch.nn.CrossEntropyLoss())
        >>> classify(torch.randn(64, 256), target=torch.randint(0, 10, (64,))).backward()
        >>> classify.plan.model_name
        'Linear with its loss'

    Raises:
        ValueError: for a malformed budget, an unknown action or compress dtype (at once).
        autorecompute.OffloadError: when ``offload_dir`` cannot be written (at once), or when a disk fills
            up during a step (the step stops; nothing is lost silently).
        autorecompute.InfeasibleBudgetError: on the first training call, if no plan fits.
        autorecompute.CaptureError: on the first training call, if the model cannot be captured.
    """
    model = with_loss(_original(model), loss_fn)
    parse_budget(budget)     # a malformed budget is refused now, not at the first step
    options = _options(actions, compress_dtypes, offload_dir, transfer, solver_time_limit, seed, objective,
                       loss_reserve, "kept" if outputs == "auto" else outputs)
    return CompiledModule(model, budget, options, learn_outputs=outputs == "auto")


def _without_cache(model: torch.nn.Module, kwargs: dict, tell: bool = True) -> dict:
    """``kwargs`` with ``use_cache=False`` for a model whose config turns a key/value cache on (HF decoders'
    default) and whose forward takes it, unless the caller passed it. A training step does not read the
    cache, and export cannot flatten one; transformers' own gradient checkpointing turns it off too. A warning
    says so when ``tell`` and the model generates (an encoder such as BERT takes the flag and makes no cache:
    nothing changes for it)."""
    if isinstance(model, LossOfModel):
        return _without_cache(model.model, kwargs, tell)
    if "use_cache" in kwargs or getattr(getattr(model, "config", None), "use_cache", None) is not True:
        return kwargs
    if not _takes_keyword(getattr(model.forward, "__func__", model.forward), "use_cache"):
        return kwargs
    generates = getattr(model, "can_generate", None)
    if tell and callable(generates) and generates():
        warnings.warn(f"{type(model).__name__}.config.use_cache is True: autorecompute passes use_cache=False to "
                      "its training steps (a key/value cache is for generation; transformers' gradient "
                      "checkpointing does the same). Set config.use_cache = False, or pass use_cache=False, to "
                      "silence this.", UserWarning, stacklevel=user_stacklevel())
    return {**kwargs, "use_cache": False}


def _check_model_keywords(model: torch.nn.Module, kwargs: dict, planner_call) -> None:
    """The keywords :func:`plan` hands to ``model.forward``, checked so that a misspelled option of
    ``planner_call`` is named as such, not left to fail as a capture error about tracing or to go silently to
    a forward taking ``**kwargs``."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    options = [n for n, p in inspect.signature(planner_call).parameters.items() if p.kind is p.KEYWORD_ONLY]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    for name in kwargs:
        if name in parameters:
            continue
        close = difflib.get_close_matches(name, options, n=1, cutoff=0.75)
        hint = f" Did you mean {close[0]}= (an option of autorecompute.{planner_call.__name__})?" if close else ""
        if not takes_any:
            raise TypeError(f"{name}= is neither an option of autorecompute.{planner_call.__name__} nor an argument "
                            f"of {type(model).__name__}.forward (keywords that are not options go to the "
                            f"model).{hint}")
        if close:
            warnings.warn(f"{name}= goes to {type(model).__name__}.forward (it takes **kwargs), not to the "
                          f"planner.{hint}", UserWarning, stacklevel=3)


@lru_cache(maxsize=None)
def _takes_keyword(function, name: str) -> bool:
    """Whether ``function`` has a parameter ``name`` (read once per function: the check runs every step)."""
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


class _PendingBackward:
    """Put on a step's autograd graph by a hook: alive while the graph is, ``done`` once backward reaches it."""

    __slots__ = ("done", "__weakref__")

    def __init__(self):
        self.done = False


def _watch_retained_graph(compiled: CompiledModule, outputs) -> None:
    """Warns, once, when a backward from ``outputs`` keeps the graph (``retain_graph=True``): autograd then
    keeps every saved tensor until the graph is freed, where the plan counts each freed after its op's
    backward, so the step can go well over the budget. Eager keeps everything anyway, so this is no worse
    than eager's peak. Checked on each plan's first step, as :meth:`CompiledModule._watch_backward` is (the
    hook is a graph break under compiled autograd)."""
    keeps_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    if keeps_graph is None:
        return
    ref, called_at = weakref.ref(compiled), user_location()

    def check(grad):
        live = ref()
        if live is None or live.__dict__.get("_told_retain") or not keeps_graph():
            return
        live.__dict__["_told_retain"] = True
        # the user's backward() line; on autograd's device threads (CUDA) there is none: the forward call's
        filename, line = user_location(in_backward=True) or called_at or ("<unknown>", 0)
        warnings.warn_explicit(
            f"A backward through {type(live.model).__name__} keeps its graph (retain_graph=True, or create_graph="
            "True): autograd keeps every tensor it saved until the graph is freed, where the plan counts each "
            "freed once its op's backward is done, so this step can go over the budget. Fix: one backward per "
            "forward (sum the losses first); for a double backward (a gradient penalty), budget for all saved "
            "tensors at once.", UserWarning, filename, line)

    for tensor in output_tensors_for_backward(outputs):
        tensor.register_hook(check)


def _original(model: torch.nn.Module) -> torch.nn.Module:
    """The model to plan: a compiled module's own model (compiling it again makes a second wrapper with the
    new settings; the first keeps working). A compiled submodule inside ``model`` is refused: its wrapper
    would plan on its own inside the capture of the whole."""
    if isinstance(model, CompiledModule):
        model = users_model(model.__dict__["_model"])
    if not isinstance(model, torch.nn.Module):
        what = f"the class {model.__name__}" if isinstance(model, type) else f"a {type(model).__name__}"
        raise TypeError(f"autorecompute plans a torch.nn.Module instance; got {what}. Fix: pass the model "
                        "object (e.g. MyModel(...), not MyModel); a function can be wrapped in a Module whose "
                        "forward calls it.")
    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        fix = ("it wraps a compiled module already: use it as is" if isinstance(model.module, CompiledModule) else
               "compile the module it wraps and wrap the compiled module instead: DistributedDataParallel("
               "autorecompute.compile(model, budget=...))" + (" (PyTorch recommends DistributedDataParallel over "
                                                               "DataParallel)" if isinstance(model, torch.nn.DataParallel) else ""))
        raise ValueError(f"{type(model).__name__} cannot be captured (it synchronizes gradients outside its "
                         f"forward). Fix: {fix}.")
    inner = [path for path, module in model.named_modules() if isinstance(module, CompiledModule)]
    if inner:
        raise ValueError(
            f"{type(model).__name__} holds modules compiled by autorecompute already ({inner[:3]}): their plans "
            "and this one would each count only part of the step. Fix: compile either the whole model (put the "
            "original submodules back) or only its parts.")
    return model


def plan(model: torch.nn.Module, *args, budget: int | float | str, actions: tuple[str, ...] = DEFAULT_ACTIONS,
         compress_dtypes: tuple[str, ...] | None = None, offload_dir: str | None = None,
         transfer: TransferModel | None = None, solver_time_limit: float | None = None, seed: int = 0,
         objective: str = "time", loss_reserve: int | str = "auto", outputs: str = "kept",
         loss_fn: Callable | None = None, **kwargs) -> Plan:
    """Plans ``model`` for the example inputs without running a training step (arguments as :func:`compile`).

    Inputs and model may live on the ``meta`` device: planning runs on fake tensors and allocates nothing.
    Keywords that are not options here go to ``model.forward`` as inputs (one close to an option's name is
    refused, or told when ``forward`` takes ``**kwargs``). Under ``torch.no_grad()`` too, the plan is for a
    training step. With ``loss_fn``, the loss's target is the keyword ``target=``, as the compiled module takes it.

    Example:
        >>> import autorecompute, torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
        >>> p = autorecompute.plan(model, torch.randn(32, 64), budget="1GB")
        >>> p.count("recompute")
        0
    """
    model = _original(model)
    _check_model_keywords(model, _model_keywords(kwargs, loss_fn), plan)
    model = with_loss(model, loss_fn)
    options = _options(actions, compress_dtypes, offload_dir, transfer, solver_time_limit, seed, objective,
                       loss_reserve, outputs)
    return _plan(model, args, kwargs, budget, options)


def _model_keywords(kwargs: dict, loss_fn: Callable | None) -> dict:
    """The keywords that go to the model: all of them, or, with a ``loss_fn``, all but the loss's target, which
    must be there."""
    if loss_fn is None:
        return kwargs
    if TARGET not in kwargs:
        raise TypeError(f"with loss_fn=, pass the loss's target as the keyword {TARGET}= (the compiled module takes "
                        f"it so: loss = compiled(*inputs, {TARGET}=labels))")
    return {k: v for k, v in kwargs.items() if k != TARGET}


def _plan(model: torch.nn.Module, args: tuple, kwargs: dict, budget, options: PlannerOptions) -> Plan:
    """:func:`plan` once its arguments are checked (every keyword in ``kwargs`` is the model's)."""
    kwargs = _without_cache(model, kwargs)
    planned: Planned = make_plan(model, args, kwargs, budget, options, step_signature(model, args, kwargs))
    return planned.plan


def minimum_peak(model: torch.nn.Module, *args, actions: tuple[str, ...] = DEFAULT_ACTIONS,
                 compress_dtypes: tuple[str, ...] | None = None, offload_dir: str | None = None,
                 transfer: TransferModel | None = None, solver_time_limit: float | None = None, seed: int = 0,
                 loss_reserve: int | str = "auto", outputs: str = "kept", loss_fn: Callable | None = None,
                 **kwargs) -> int:
    """The least peak, in bytes, that a plan with ``actions`` reaches for one training step of ``model`` on
    the example inputs: the smallest budget :func:`compile` and :func:`plan` accept for them (arguments as
    :func:`compile`; ``InfeasibleBudgetError.breakdown`` says what it is made of).

    It is measured, as every plan is, on fake tensors: model and inputs may be on the ``meta`` device.
    Gradients the model holds now count, as they would in the step (``model.zero_grad(set_to_none=True)``
    first for the step that starts without them). A model of repeated layers gets its layers' minimum (by
    default: in the seconds a plan takes); with a ``solver_time_limit``, the whole-model search spends its whole
    limit on it.

    Example:
        >>> import autorecompute, torch
        >>> model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())
        ...                               for _ in range(6)])
        >>> x = torch.randn(512, 64)
        >>> low = autorecompute.minimum_peak(model, x, actions=("recompute",), solver_time_limit=1.0)
        >>> low < autorecompute.plan(model, x, budget=1.0, solver_time_limit=1.0).baseline_peak
        True
        >>> p = autorecompute.plan(model, x, budget=low, actions=("recompute",), solver_time_limit=1.0)
        >>> p.predicted_peak <= low
        True
    """
    model = _original(model)
    _check_model_keywords(model, _model_keywords(kwargs, loss_fn), minimum_peak)
    model = with_loss(model, loss_fn)
    options = _options(actions, compress_dtypes, offload_dir, transfer, solver_time_limit, seed, "time",
                       loss_reserve, outputs)
    try:
        # a 1-byte budget is below any step's: the planner searches its lowest peak, then says what it is
        met = _plan(model, args, kwargs, 1, options)
    except InfeasibleBudgetError as error:
        return error.minimum
    return met.predicted_peak        # a step that holds nothing (no parameters, an empty batch)
