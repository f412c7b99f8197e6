"""Capture: ``torch.export`` (non-strict, training IR) → a differentiable GraphModule.

The GraphModule shares the model's Parameters and buffers (same objects). Three clean-ups make it plannable:
assertion nodes and the input guard are dropped (autorecompute keys plans on the input signature itself);
``scaled_dot_product_attention`` calls that PyTorch runs as its math composite on this device (on a CPU:
with dropout) are replaced by the ops that composite runs, so the planner sees the attention matrix, the
softmax and the dropout mask as separate tensors (a fused kernel stays one op); and in-place ops on an
activation that nothing else reads are made out-of-place, so that recomputing a region never replays a
mutation of its own input. In-place updates of buffers (BatchNorm's ``num_batches_tracked``) stay as they are.
Last, a cheap op that widens a tensor no gradient flows through (a boolean attention mask made float) runs
again next to each of its later readers, so that the narrow tensor, not the wide one, is kept between them.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import logging
import operator
import os
import sys
import traceback
import unittest.mock
import warnings
from typing import Iterator

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from autorecompute.errors import CaptureError, user_stacklevel
from autorecompute.passes.rewrite_softmax import IN_PLACE
from autorecompute.passes.side_effects import refuse_or_warn, side_effects_recorded
from autorecompute.runtime.softmax import AUTOGRAD_SOFTMAX, softmax_backward_in_place

_DROPPED_TARGETS = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
}


def capture(model: torch.nn.Module, args: tuple, kwargs: dict) -> torch.fx.GraphModule:
    """Exports ``model`` for ``(args, kwargs)`` and returns a plannable GraphModule.

    Example:
        >>> gm = capture(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), (torch.randn(2, 4),), {})
        >>> [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"]
        ['linear.default', 'relu.default']

    Raises:
        CaptureError: when ``torch.export`` cannot trace the model, or its forward draws from Python's random
            module (the graph would repeat capture's draw); the message names the construct.

    Warns:
        CaptureSideEffectWarning: forward reads the clock or changes Python state, which no step repeats.
    """
    _refuse_sparse_gradients(model)
    _refuse_cumulative_batch_norm(model)
    _warn_of_hooks(model)
    try:
        with _eager_mask_decisions(model, args, kwargs), _quiet_export_diagnostics(), \
                _autograd_functions_applied() as functions, side_effects_recorded(model) as side_effects:
            exported = torch.export.export(model, tuple(args), dict(kwargs), strict=False)
    except Exception as exc:  # export raises many types; all mean "cannot capture"
        raise CaptureError(_capture_failure(model, exc)) from exc
    refuse_or_warn(model, side_effects)
    _refuse_custom_backward(model, functions)
    gm = exported.module()
    _refuse_data_dependent_shapes(gm, model)
    _warn_of_autocast_regions(gm, model)
    _share_state_with(gm, model)
    _drop_guards_and_asserts(gm)
    _inline_math_attention(gm)
    _functionalize_activation_mutations(gm)
    _softmax_backward_in_place(gm)
    _widen_at_each_reader(gm)
    gm.graph.lint()
    gm.recompile()
    return gm


@contextlib.contextmanager
def _autograd_functions_applied() -> Iterator[set]:
    """The ``torch.autograd.Function`` classes the traced forward applies."""
    applied: set = set()
    original = torch.autograd.Function.__dict__["apply"]     # a classmethod (a C descriptor in recent torch)

    def apply(cls, *args, **kwargs):
        applied.add(cls)
        return original.__get__(None, cls)(*args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield applied
    finally:
        torch.autograd.Function.apply = original


def _refuse_custom_backward(model: torch.nn.Module, functions: set) -> None:
    """``torch.export`` traces a custom ``autograd.Function``'s forward into the graph and drops its backward:
    the graph's gradients would be autograd's of the forward's ops (a straight-through estimator's would be
    zero), not the Function's. Refused, with the way out (PyTorch's own Functions are not custom)."""
    custom = sorted(f"{cls.__module__}.{cls.__qualname__}" for cls in functions
                    if not cls.__module__.startswith("torch.") and cls.__module__ != "torch")
    if custom:
        raise CaptureError(
            f"{type(model).__name__} applies the custom autograd.Function {', '.join(custom)}: torch.export traces "
            "its forward and drops its backward, so a captured graph would compute other gradients than your "
            "model. Fix: apply autorecompute.compile to the submodules that do not use it (the Function then runs "
            "as itself, outside them), or write it as plain tensor ops if its backward is their derivative.")


@contextlib.contextmanager
def _quiet_export_diagnostics() -> Iterator[None]:
    """What export prints while it traces (FakeTensor's tracebacks of a failing meta kernel, symbolic shapes'
    warnings, the partial FX graph of a failed export printed to stderr, twice) is held back and shown only
    when the export succeeds: on failure the CaptureError says what failed and where, once."""
    loggers = [logging.getLogger(name) for name in _EXPORT_LOGGERS]
    held = _HeldRecords()
    saved = [(logger.propagate, logger.handlers) for logger in loggers]
    for logger in loggers:
        logger.propagate, logger.handlers = False, [held]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            yield
    finally:
        for logger, (propagate, handlers) in zip(loggers, saved):
            logger.propagate, logger.handlers = propagate, handlers
    for record in held.records:          # reached only when the export succeeded
        if record.name != "torch._subclasses.fake_tensor":     # (its tracebacks are of ops export retried)
            logging.getLogger(record.name).handle(record)
    sys.stderr.write(printed.getvalue())


_EXPORT_LOGGERS = ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes")


class _HeldRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _capture_failure(model: torch.nn.Module, exc: Exception) -> str:
    """What a user needs from an export failure: the error's first line, where in their code it happened
    (the line torch names, else the innermost frame outside torch and autorecompute) and the fix."""
    message = str(exc).strip()
    first_line = message.splitlines()[0] if message else type(exc).__name__
    where = _failing_line(message, exc)
    fix = ("pass use_cache=False (or set config.use_cache = False): a key/value cache is for generation, not "
           "training" if "Cache" in message and "output" in message else
           "pass nn.Parameter values (torch.func.functional_call with plain tensors replaces the model's "
           "Parameters, which export requires), or call the compiled module itself" if
           "is not an instance of torch.nn.Parameter" in message else
           "first check that the model runs on these inputs without autorecompute (model(*inputs): a shape or "
           "dtype that does not fit the model fails here too, with the op's own message above); if it does, "
           "make the failing construct traceable (data-dependent Python control flow on tensor values, .item(), "
           ".tolist(), or iterating a tensor are the usual causes), wrap it in a submodule you run outside "
           "autorecompute, or apply autorecompute.compile to a traceable submodule instead")
    return (f"torch.export could not capture {type(model).__name__}: {type(exc).__name__}: {first_line}\n"
            + (f"  where: {where}\n" if where else "") + f"  Fix: {fix}.")


def _failing_line(message: str, exc: Exception) -> str | None:
    marker = "The following call raised this error:"
    if marker in message:
        lines = [line.strip() for line in message.split(marker, 1)[1].splitlines() if line.strip()][:2]
        if lines and lines[0].startswith("File "):
            return ": ".join(lines)
    import autorecompute

    inside = tuple(os.path.dirname(path) + os.sep for path in (torch.__file__, autorecompute.__file__, __file__))
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(inside) and not f.filename.startswith("<")]   # (not generated code)
    if not frames:
        return None
    frame = frames[-1]
    return f'File "{frame.filename}", line {frame.lineno}, in {frame.name}' + (f": {frame.line}" if frame.line else "")


def _refuse_sparse_gradients(model: torch.nn.Module) -> None:
    """Sparse gradients (``nn.Embedding(sparse=True)``) have no storage to measure, and their size depends on
    the indices' values, which a plan made on fake tensors cannot know."""
    for path, module in model.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
            raise CaptureError(
                f"{type(module).__name__} {path or type(model).__name__!r} makes sparse gradients (sparse=True), "
                "whose size depends on the indices' values: autorecompute cannot bound their memory.\n"
                "  Fix: construct it with sparse=False (dense gradients, what most optimizers take), or run it "
                "outside autorecompute.compile and compile the rest of the model.")


def _refuse_cumulative_batch_norm(model: torch.nn.Module) -> None:
    """``BatchNorm(momentum=None)`` in training averages its statistics over every batch seen, with a factor
    ``1 / num_batches_tracked`` read from the buffer's value: export fails on it with a data-dependent guard
    that names neither the module nor a fix a user can apply to a stock module."""
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.momentum is None \
                and module.training and module.track_running_stats:
            raise CaptureError(
                f"{type(module).__name__} {path or type(model).__name__!r} has momentum=None (a cumulative moving "
                "average): its update factor 1/num_batches_tracked is read from a buffer's value at every step, "
                "which a captured graph cannot do.\n"
                "  Fix: give it a numeric momentum (momentum=0.1 is PyTorch's default), or compile the submodules "
                "around it and run it outside autorecompute.compile.")


def _refuse_data_dependent_shapes(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """A tensor whose shape depends on values (boolean-mask indexing ``x[x > 0]``, ``masked_select``,
    ``nonzero``): its bytes are not known until the step runs, so no plan can bound them. torch.export traces
    it with a symbolic size; planning then failed with an untyped fake-tensor exception."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and free_unbacked_symbols(value):
            where = _innermost_frame(node.meta.get("stack_trace") or "")
            raise CaptureError(
                f"{type(model).__name__} makes a tensor whose shape depends on its values ({node.target}, shape "
                f"{tuple(value.shape)}){f' at {where}' if where else ''}: boolean-mask indexing, masked_select or "
                "nonzero. autorecompute plans memory before the step runs and cannot bound such a tensor.\n"
                "  Fix: keep the shape fixed (torch.where(mask, x, 0), or multiply by the mask and divide by its "
                "sum), or compile the submodules before it and run that part outside autorecompute.compile.")


def _innermost_frame(stack_trace: str) -> str | None:
    """The last ``File ...`` line of a node's recorded stack trace, with its code line when recorded."""
    lines = [line.strip() for line in stack_trace.splitlines() if line.strip()]
    files = [i for i, line in enumerate(lines) if line.startswith("File ")]
    if not files:
        return None
    i = files[-1]
    return lines[i] + (f": {lines[i + 1]}" if i + 1 < len(lines) else "")


# Forward hooks whose one effect is to hand a module's output to the model's own return value, so the captured
# graph returns what they collect at every step: transformers 5 installs these on first use of
# ``output_hidden_states`` / ``output_attentions`` / ``output_router_logits`` and keeps them (module, name).
OUTPUT_COLLECTING_HOOKS = {("transformers.utils.output_capturing", "output_capturing_hook")}


def _only_collects_outputs(hook) -> bool:
    function = getattr(hook, "__func__", hook)
    return (getattr(function, "__module__", None), getattr(function, "__name__", None)) in OUTPUT_COLLECTING_HOOKS


def _warn_of_hooks(model: torch.nn.Module) -> None:
    """Module hooks the compiled module cannot honour as eager does, each kind named in a warning.

    * A forward hook runs once, while the model is traced: what it computes on tensors becomes part of the
      graph, but its other effects (storing activations, logging) do not happen again at each step. Hooks
      that only collect outputs into the model's return value (``OUTPUT_COLLECTING_HOOKS``) are silent: the
      graph returns what they collect.
    * A submodule's backward hook (``register_full_backward_hook``, ``register_full_backward_pre_hook``,
      ``register_backward_hook``) wraps that module's inputs and outputs at each eager call; the captured
      graph has no module boundaries, so it never runs. Hooks on tensors — parameters' ``register_hook``
      and ``register_post_accumulate_grad_hook`` — do run, as does a hook on the compiled module itself.
    """
    for kind, tables, effect in (
            ("forward", ("_forward_hooks", "_forward_pre_hooks"),
             "run once, while autorecompute captures the model: the tensor ops they apply are part of every "
             "step, but their other effects (storing activations, logging, counters) happen only at capture, "
             "not at each step. Fix: do that outside the compiled module (on its outputs), or compile a "
             "submodule without the hooks."),
            ("backward", ("_backward_hooks", "_backward_pre_hooks"),
             "do not run in the compiled module: autorecompute runs the captured graph, which has no submodule "
             "boundaries for them to wrap. Fix: hook the parameters' gradients instead (p.register_hook(fn), "
             "or p.register_post_accumulate_grad_hook(fn): both run), hook the compiled module itself, or "
             "compile a submodule without the hooks.")):
        hooked = [path or type(model).__name__ for path, module in model.named_modules()
                  if any(not _only_collects_outputs(hook) for table in tables
                         for hook in getattr(module, table).values())]
        if hooked:
            warnings.warn(f"{kind} hooks on {hooked[:3]}{' …' if len(hooked) > 3 else ''} {effect}",
                          UserWarning, stacklevel=user_stacklevel())


def _warn_of_autocast_regions(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """``torch.autocast`` entered inside ``forward``: ``torch.export`` keeps each such region as one
    higher-order op around a subgraph, which the planner sees as one op whose activations it can neither
    recompute nor offload (a 6-layer MLP under it: minimum peak = eager's 10.76 MiB; autocast entered around
    the call: 6.89 MiB). Said, with the fix, instead of a minimum that reads as a model too large."""
    # (regions that switch autocast off — HF models keeping a softmax in float32 — cannot move outside forward:
    # they stay one op too, unsaid)
    regions = [region for region in gm.graph.find_nodes(op="call_function",
                                                        target=torch.ops.higher_order.wrap_with_autocast)
               if len(region.args) > 2 and region.args[2] is True]
    if not regions:
        return
    inside = sum(sum(1 for n in getattr(gm, region.args[4].target).graph.nodes if n.op == "call_function")
                 for region in regions if isinstance(region.args[4], torch.fx.Node))
    warnings.warn(
        f"{type(model).__name__} enters torch.autocast inside forward: torch.export keeps each such region as one "
        f"op ({len(regions)} region{'s' if len(regions) > 1 else ''}, {inside} ops inside), so autorecompute can "
        "neither recompute nor offload the activations made there; they stay on the device as in eager. Fix: "
        "enter torch.autocast around the call to the compiled model (and the loss) instead of inside forward.",
        UserWarning, stacklevel=user_stacklevel())


@contextlib.contextmanager
def _eager_mask_decisions(model: torch.nn.Module, args: tuple, kwargs: dict) -> Iterator[None]:
    """Hugging Face's attention masks decided as in eager. Its masking utilities skip the causal mask when no
    attention mask is passed and the query is as long as the keys (SDPA then runs with ``is_causal`` and, for
    grouped-query attention, ``enable_gqa``: a fused kernel), but never under ``torch.export``, whose graph
    may be called with other shapes, and read the position ids' values to detect packed sequences. A plan
    serves only calls with its input signature (shapes, and which arguments are passed), for which the first
    decision is fixed, and positions the model makes itself (none passed) are never packed: decided here as
    in eager, a captured Llama computes eager's gradients bit for bit (materialized, its mask and repeated
    keys take another kernel and differ by ~1e-4). Decisions that read values the caller passes (a padding
    mask, position ids) stay export's: the mask is built."""
    masking_utils = sys.modules.get("transformers.masking_utils")    # only where the model imported it
    if masking_utils is None or not callable(getattr(masking_utils, "is_torchdynamo_exporting", None)):
        yield
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(unittest.mock.patch.object(masking_utils, "is_torchdynamo_exporting", lambda: False))
        if callable(getattr(masking_utils, "find_packed_sequence_indices", None)) \
                and _not_passed(model, args, kwargs, "position_ids"):
            stack.enter_context(unittest.mock.patch.object(masking_utils, "find_packed_sequence_indices",
                                                           lambda position_ids: None))
        yield


def _not_passed(model: torch.nn.Module, args: tuple, kwargs: dict, name: str) -> bool:
    """Whether the call ``model(*args, **kwargs)`` leaves its argument ``name`` out (or None)."""
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return False
    return bound.arguments.get(name) is None and name not in bound.arguments.get("kwargs", {})


def _share_state_with(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """Points every get_attr at the model's own Parameter / buffer object (export normally already does)."""
    originals = dict(model.named_parameters(remove_duplicate=False))
    originals.update(model.named_buffers(remove_duplicate=False))
    for node in gm.graph.find_nodes(op="get_attr"):
        original = originals.get(node.target)
        if original is None:
            continue
        owner_path, _, attr = node.target.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        if getattr(owner, attr) is not original:
            if isinstance(original, torch.nn.Parameter):
                owner.register_parameter(attr, original)
            else:
                owner.register_buffer(attr, original)


def _drop_guards_and_asserts(gm: torch.fx.GraphModule) -> None:
    for node in list(gm.graph.nodes):
        is_guard = node.op == "call_module" and node.target == "_guards_fn"
        if (is_guard or (node.op == "call_function" and node.target in _DROPPED_TARGETS)) and not node.users:
            gm.graph.erase_node(node)


_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SDPA_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def _inline_math_attention(gm: torch.fx.GraphModule) -> None:
    """Each ``scaled_dot_product_attention`` node that dispatches to PyTorch's math composite becomes the ops
    that composite runs (traced by ``make_fx`` below autograd: the same kernels, the same random numbers, the
    same gradients). As one node, its backward holds every tensor it saved at once (the attention
    probabilities, the dropout mask and the masked probabilities); as ops, each can be kept, recomputed or
    rematerialized on its own — what ``torch.compile``'s partitioner sees too. A call that runs a fused
    kernel (flash / memory-efficient attention) stays one node.

    Under ``torch.autocast`` every call stays one node: eager runs the composite below autocast (its matmuls
    in the dtype the autocast kernel chose), while inlined ops would each be cast by autocast again when the
    graph runs (with dropout on a CPU: gradients off by 0.25 on a bf16 attention block)."""
    if callers_autocast():
        return
    for node in list(gm.graph.find_nodes(op="call_function", target=_SDPA)):
        tensors, constants = _sdpa_call(node)
        if tensors is None:
            continue
        names = list(tensors)

        def attention(*values):
            return _SDPA(**dict(zip(names, values)), **constants)

        try:
            sub = make_fx(attention, tracing_mode="fake")(*[_example(tensors[n].meta["val"]) for n in names])
        except Exception:  # noqa: BLE001  (a call make_fx cannot trace stays one node: still correct)
            continue
        if any(n.target is _SDPA or "attention" in str(n.target) for n in sub.graph.nodes if n.op == "call_function"):
            continue      # a fused kernel: one op, nothing to split
        _inline(gm, node, sub, [tensors[n] for n in names])


# device types whose enclosing torch.autocast changes the step a plan is made for
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "maia", "privateuseone")


def callers_autocast(devices: tuple[str, ...] | set[str] = ()) -> list[tuple[str, torch.dtype]]:
    """The enclosing ``torch.autocast`` regions of this thread, as (device type, dtype), over
    :data:`AUTOCAST_DEVICES` and ``devices``, in name order."""
    entered = []
    for device_type in sorted({*AUTOCAST_DEVICES, *devices}):
        try:
            if torch.is_autocast_enabled(device_type):
                entered.append((device_type, torch.get_autocast_dtype(device_type)))
        except (RuntimeError, ValueError):      # a device type autocast does not know (meta): nothing to record
            continue
    return entered


def _sdpa_call(node: torch.fx.Node) -> tuple[dict | None, dict]:
    """(tensor arguments by name, the other arguments) of an SDPA node, or (None, {}) when not plannable."""
    bound = dict(zip(_SDPA_ARGUMENTS, node.args))
    bound.update(node.kwargs)
    tensors = {k: v for k, v in bound.items() if isinstance(v, torch.fx.Node)}
    constants = {k: v for k, v in bound.items() if not isinstance(v, torch.fx.Node)}
    values = [t.meta.get("val") for t in tensors.values()]
    if not all(isinstance(v, torch.Tensor) and v.device.type != "meta" for v in values):
        return None, {}
    return tensors, constants


def _example(value: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor with ``value``'s metadata: make_fx only reads shapes, strides and devices."""
    example = torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device=value.device)
    return example.requires_grad_(value.requires_grad)


def _inline(gm: torch.fx.GraphModule, node: torch.fx.Node, sub: torch.fx.GraphModule,
            inputs: list[torch.fx.Node]) -> None:
    """Replaces ``node`` by the graph of ``sub`` (its placeholders bound to ``inputs``)."""
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    placeholders = iter(inputs)
    inherited = {key: node.meta[key] for key in ("nn_module_stack", "stack_trace", "source_fn_stack") if key in node.meta}
    result = None
    with gm.graph.inserting_before(node):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(placeholders)
            elif n.op == "output":
                result = torch.fx.map_arg(n.args[0], env.__getitem__)
            else:
                copied = gm.graph.node_copy(n, env.__getitem__)
                copied.meta.update(inherited)
                env[n] = copied
    if isinstance(result, (tuple, list)):
        result = result[0]
    node.replace_all_uses_with(result)
    gm.graph.erase_node(node)


_SOFTMAXES = {op: safe for safe, op in AUTOGRAD_SOFTMAX.items()}    # → the ``safe`` flag
_aten = torch.ops.aten
# ops whose backward makes a new tensor for the argument (a matmul's ``grad @ other.T``, a mask's product)
_NEW_GRADIENT = {_aten.matmul.default, _aten.bmm.default, _aten.mm.default, _aten.mul.Tensor,
                 _aten.native_dropout.default}
# ops whose backward hands the gradient on as it is, or as a view of it (``to`` its own dtype, dropout at p=0
# on a CPU, which return their input): the gradient is then as much the softmax's own as theirs
_HANDS_GRADIENT_ON = {_aten.to.dtype, _aten._to_copy.default, _aten.dropout.default, _aten.view.default,
                      _aten.reshape.default, _aten._unsafe_view.default, _aten.expand.default, _aten.clone.default,
                      _aten.contiguous.default, _aten.transpose.int, _aten.permute.default,
                      _aten.unsqueeze.default, _aten.alias.default}


def _softmax_backward_in_place(gm: torch.fx.GraphModule) -> None:
    """Each softmax over the last dimension whose result's gradient is its own becomes
    :func:`~autorecompute.runtime.softmax.softmax_backward_in_place`: its backward writes into that gradient,
    so it holds two attention-sized tensors where autograd's holds three. The same values: same kernel. The
    profile counts that memory; a plan that fits without it puts autograd's backward back
    (:mod:`~autorecompute.passes.rewrite_softmax`)."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _SOFTMAXES or node.kwargs:
            continue
        x, result = node.args[0], node.meta.get("val")
        source = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if not (isinstance(result, torch.Tensor) and isinstance(source, torch.Tensor)):
            continue
        dim = node.args[1] if len(node.args) > 1 else None
        if source.dtype != result.dtype or not isinstance(dim, int) or dim % max(result.dim(), 1) != result.dim() - 1:
            continue
        if _owns_its_gradient(node):
            dtype = node.args[2] if len(node.args) > 2 else None
            node.meta[IN_PLACE] = safe = _SOFTMAXES[node.target]
            node.args = (x, dim, dtype, safe)
            node.target = softmax_backward_in_place


def _owns_its_gradient(node: torch.fx.Node) -> bool:
    """Whether the gradient autograd hands ``node``'s backward is read by nothing else: one op reads ``node``
    where a gradient flows, once, and its backward makes a new tensor for it — or hands on its own gradient,
    which it owns in turn. (Readers that take no gradient, ``detach``, do not count; a graph output's gradient
    is the caller's.)"""
    readers = [user for user in node.users if user.op != "call_function" or _takes_gradient(user)]
    if len(readers) != 1 or readers[0].op != "call_function":
        return False
    reader = readers[0]
    read: list[torch.fx.Node] = []
    torch.fx.node.map_arg((reader.args, reader.kwargs), read.append)
    if read.count(node) != 1:
        return False
    return reader.target in _NEW_GRADIENT or (reader.target in _HANDS_GRADIENT_ON and _owns_its_gradient(reader))


def _takes_gradient(node: torch.fx.Node) -> bool:
    """Whether a gradient may flow back through ``node`` (export's values do not say whether they require one)."""
    value = node.meta.get("val")
    floating = not isinstance(value, torch.Tensor) or value.is_floating_point() or value.is_complex()
    return node.target is not torch.ops.aten.detach.default and floating


# elementwise ops without the pointwise tag that widen a tensor: casts, and where with a scalar branch
_WIDENING = {torch.ops.aten.where.ScalarOther, torch.ops.aten.where.ScalarSelf, torch.ops.aten.where.Scalar,
             torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout}


def _widen_at_each_reader(gm: torch.fx.GraphModule) -> None:
    """Runs a cheap widening op again before each of its readers after the first, each reading its own copy.

    HF decoders build the float attention mask once (``where(bool_mask, 0, -inf)``, 4× the boolean's bytes)
    and add it in every layer: the float mask is then on the device from the first layer's forward to its
    backward, and every recomputed layer holds it as a region input. Made again at each layer (one
    elementwise op), the boolean mask is what stays. The rule (XLA's rematerialization of broadcasts and
    converts): an elementwise op, no gradient through it, no random numbers, writing at least twice the
    bytes of its inputs' storages, with several readers. The values are the same op's on the same inputs.
    """
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or len(node.users) < 2 or not _widens(node):
            continue
        for reader in sorted(node.users, key=_position(gm))[1:]:
            with gm.graph.inserting_before(reader):
                again = gm.graph.node_copy(node)
            reader.replace_input_with(node, again)


def _position(gm: torch.fx.GraphModule):
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return order.__getitem__


def _widens(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    target = node.target
    if not isinstance(value, torch.Tensor) or value.requires_grad or is_mutating(node) or _is_view(node):
        return False
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    if target not in _WIDENING and torch.Tag.pointwise not in target.tags:
        return False
    inputs = [n.meta.get("val") for n in node.all_input_nodes]
    if not all(isinstance(v, torch.Tensor) and not v.requires_grad for v in inputs):
        return False
    storages = {v.untyped_storage()._cdata: v.untyped_storage().nbytes() for v in inputs}
    out = value.numel() * value.element_size()
    return out >= 2 * sum(storages.values())


def is_mutating(node: torch.fx.Node) -> bool:
    """Whether ``node`` writes into one of its arguments (``add_``, ``relu_``, ``copy_``...)."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _functionalize_activation_mutations(gm: torch.fx.GraphModule) -> None:
    """``relu_(x)`` → ``relu(x)`` when ``x`` is an activation read by nothing else.

    Export tracks the tensor object, so every later use already refers to the in-place node's output; with
    ``x`` having no other user, the out-of-place op computes the same values.
    """
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not is_mutating(node) or not node.args:
            continue
        target_arg = node.args[0]
        if not isinstance(target_arg, torch.fx.Node) or target_arg.op != "call_function":
            continue
        if _fills_fresh_tensor_with_bernoulli(node):
            # empty_like(x).bernoulli_(p) (dropout's mask, as the math attention runs it) → bernoulli(x, p): the
            # same numbers in a fresh tensor like x, and an op that can be recomputed with its RNG replayed
            with gm.graph.inserting_before(node):    # the mask is no function of x (no gradient through it)
                like = gm.graph.call_function(torch.ops.aten.detach.default, (target_arg.args[0],))
            like.meta.update(target_arg.meta)
            node.target = torch.ops.aten.bernoulli.p
            node.args = (like, node.args[1] if len(node.args) > 1 else 0.5)
            gm.graph.erase_node(target_arg)
            continue
        if len(target_arg.users) != 1 or target_arg.target is operator.getitem or _is_view(target_arg):
            continue
        functional = _functional_variant(node.target)
        if functional is not None:
            node.target = functional


def _written(node: torch.fx.Node) -> list:
    """The values ``node`` writes in place, read off its schema (``self`` of ``add_``, ``out`` of an out= op)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return []
    return [node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            for i, argument in enumerate(schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write]


def _storage_root(value):
    """The node whose storage ``value`` is: through views and in-place writes (which return what they wrote)
    to the op that allocated it, or the input / attribute."""
    while isinstance(value, torch.fx.Node) and value.op == "call_function" and value.args \
            and (is_mutating(value) or _is_view(value)):
        written = _written(value)
        value = written[0] if written else value.args[0]
    return value


def written_in_place(graph: torch.fx.Graph) -> set[str]:
    """Ops whose result a later op writes in place (``empty_like`` that ``bernoulli_`` fills, a tensor other ops
    also read and ``add_`` updates): running such an op again would not run the writes."""
    written = set()
    for node in graph.nodes:
        if node.op == "call_function" and is_mutating(node):
            for value in _written(node):
                root = _storage_root(value)
                if isinstance(root, torch.fx.Node) and root.op == "call_function":
                    written.add(root.name)
    return written


def _subgraphs(node: torch.fx.Node) -> list[tuple[int, torch.fx.GraphModule]]:
    """A higher-order op's subgraphs, with their positions among its arguments."""
    owner = node.graph.owning_module
    found = [(i, getattr(owner, arg.target, None)) for i, arg in enumerate(node.args)
             if isinstance(arg, torch.fx.Node) and arg.op == "get_attr" and owner is not None]
    return [(i, sub) for i, sub in found if isinstance(sub, torch.fx.GraphModule)]


def subgraphs_mutate(node: torch.fx.Node) -> bool:
    """Whether a higher-order op's subgraphs write a tensor in place (``wrap_with_set_grad_enabled`` around
    spectral norm's power iteration, which updates its ``_u``/``_v`` buffers with ``out=``)."""
    return any(is_mutating(n) or (isinstance(n.target, torch._ops.HigherOrderOperator) and subgraphs_mutate(n))
               for _, sub in _subgraphs(node) for n in sub.graph.nodes if n.op == "call_function")


def read_before_written(graph: torch.fx.Graph) -> set[str]:
    """Ops that read a tensor (or a view of it) which a later op writes in place — an activation's slice
    assigned (``a[:, :4] = tanh(a[:, :4])``), a buffer the forward updates (spectral norm's power iteration,
    statistics updated under ``torch.no_grad()`` inside a higher-order op's subgraph): run again in backward,
    they would read the written values (and autograd's version check fails)."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    sharing: dict[torch.fx.Node, list[torch.fx.Node]] = {}    # storage root → it, its views and in-place results
    found: set[str] = set()

    def readers_before(node: torch.fx.Node, value) -> None:
        root = _storage_root(value)
        for alias in sharing.get(root, [root] if isinstance(root, torch.fx.Node) else []):
            found.update(reader.name for reader in alias.users
                         if reader is not node and reader.op == "call_function" and order[reader] < order[node])

    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            written, returned = _subgraph_writes(node)
            for user in node.users:       # a result that is a written operand (the buffer's new value) aliases it
                if user.target is operator.getitem and user.args[1] in returned:
                    root = _storage_root(returned[user.args[1]])
                    sharing.setdefault(root, [root]).append(user)
            for value in written:
                readers_before(node, value)
            continue
        if not (_is_view(node) or is_mutating(node)):
            continue
        root = _storage_root(node)
        if isinstance(root, torch.fx.Node):
            sharing.setdefault(root, [root]).append(node)
        if is_mutating(node):
            for value in _written(node):
                readers_before(node, value)
    return found


def _subgraph_writes(node: torch.fx.Node) -> tuple[list, dict]:
    """For a higher-order op (``wrap_with_set_grad_enabled(False, submod, *operands)``): the operands its
    subgraph writes in place, and {result index: the written operand that result is}."""
    subgraphs = _subgraphs(node)
    if not subgraphs:
        return [], {}
    position, sub = subgraphs[0]
    operands = node.args[position + 1:]
    placeholders = {n: i for i, n in enumerate(n for n in sub.graph.nodes if n.op == "placeholder")}
    written: set[int] = set()
    for inner in sub.graph.nodes:
        if inner.op != "call_function":
            continue
        values = _written(inner) if is_mutating(inner) else \
            _subgraph_writes(inner)[0] if isinstance(inner.target, torch._ops.HigherOrderOperator) else []
        written.update(placeholders[root] for root in map(_storage_root, values) if root in placeholders)
    results = next(n for n in sub.graph.nodes if n.op == "output").args[0]
    results = results if isinstance(results, (tuple, list)) else [results]
    returned = {k: operands[placeholders[root]] for k, root in enumerate(map(_storage_root, results))
                if root in placeholders and placeholders[root] in written and placeholders[root] < len(operands)}
    return [operands[i] for i in sorted(written) if i < len(operands)], returned


def _fills_fresh_tensor_with_bernoulli(node: torch.fx.Node) -> bool:
    """``bernoulli_(empty_like(x), p)`` with nothing else reading the empty tensor and ``x`` contiguous (so the
    fresh tensor ``bernoulli.p`` makes has the same layout)."""
    if node.target is not torch.ops.aten.bernoulli_.float or node.kwargs.get("generator") is not None:
        return False
    empty = node.args[0]
    if empty.target is not torch.ops.aten.empty_like.default or len(empty.users) != 1 or not empty.args:
        return False
    like = empty.args[0].meta.get("val") if isinstance(empty.args[0], torch.fx.Node) else None
    plain = all(empty.kwargs.get(k) is None for k in ("dtype", "layout", "device", "pin_memory")) and \
        empty.kwargs.get("memory_format") in (None, torch.preserve_format, torch.contiguous_format)
    return plain and isinstance(like, torch.Tensor) and like.is_contiguous()


def _is_view(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


def _functional_variant(op):
    packet_name = op._schema.name.split("::")[-1]
    if not packet_name.endswith("_"):
        return None
    packet = getattr(torch.ops.aten, packet_name[:-1], None)
    if packet is None:
        return None
    return getattr(packet, op._overloadname, None)
