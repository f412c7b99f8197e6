"""Capture: ``torch.export`` (non-strict, training IR) → a differentiable GraphModule the planner can plan.

The GraphModule shares the model's Parameters and buffers (same objects). Export runs here, with what it needs
to trace a model as eager runs it (:func:`_eager_mask_decisions`); what no captured graph can run as eager
does is refused with its fix (:class:`~autorecompute.errors.CaptureError`), and what it runs otherwise is said
in a warning. Clean-ups, each a module of its own, then make the graph plannable, in this order:

1. :mod:`~autorecompute.passes.drop_guards`: the input guard and assertion nodes go (a plan is keyed on the
   input signature itself);
2. :mod:`~autorecompute.passes.inline_attention`: attention run as PyTorch's math composite becomes that
   composite's ops, so the attention matrix, the softmax and the dropout mask are separate tensors;
   :mod:`~autorecompute.passes.gpu_attention`: on ``meta`` (a model planned for a GPU) attention runs the
   fused kernel the GPU runs, so it holds what that kernel holds;
3. :mod:`~autorecompute.passes.functionalize_mutations`: in-place ops on an activation nothing else reads
   become out-of-place, so that recomputing a region never replays a mutation of its own input (after step 2:
   the inlined composite fills its dropout mask in place);
4. lean ops, the same values for less memory (:mod:`~autorecompute.passes.rewrite_lean_ops` switches them
   back where a plan fits without): :mod:`~autorecompute.passes.softmax_in_place`, a softmax whose gradient is
   its own writes its backward into that gradient; :mod:`~autorecompute.passes.cross_entropy_in_chunks`, a
   cross-entropy over class indices makes its log-softmax a chunk of rows at a time;
5. :mod:`~autorecompute.passes.widen_at_readers`: a cheap op widening a tensor no gradient flows through (a
   boolean attention mask made float) runs again next to each later reader, so the narrow tensor is what is
   kept between them.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import sys
import traceback
import unittest.mock
import warnings
from typing import Iterator

import torch
import torch.fx

from autorecompute import errors
from autorecompute.errors import CaptureError, user_stacklevel
from autorecompute.passes.autocast import callers_autocast
from autorecompute.passes.drop_guards import drop_guards_and_asserts
from autorecompute.passes.functionalize_mutations import functionalize_activation_mutations
from autorecompute.passes.gpu_attention import size_attention_as_a_gpu_runs_it
from autorecompute.passes.inline_attention import inline_math_attention
from autorecompute.passes.sharded_units import (bracket_sharded_units, full_shape_placeholders, sharded_units,
                                                without_forward_hooks)
from autorecompute.passes.side_effects import refuse_or_warn, side_effects_recorded
from autorecompute.passes.softmax_in_place import write_softmax_backward_in_place
from autorecompute.passes.cross_entropy_in_chunks import chunk_cross_entropies
from autorecompute.passes.widen_at_readers import widen_at_each_reader

# callers_autocast: imported from here by autorecompute/api.py and autorecompute/planner.py
__all__ = ["capture", "callers_autocast"]


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
    units = sharded_units(model)
    with full_shape_placeholders(units) as placeholders, without_forward_hooks(units):
        _warn_of_hooks(model)
        try:
            with _eager_mask_decisions(model, args, kwargs), _quiet_export_diagnostics(), \
                    _autograd_functions_applied() as functions, side_effects_recorded(model) as side_effects, \
                    _checkpoints_run() as checkpoints, _stack_traces(recorded=False):
                exported = torch.export.export(model, tuple(args), dict(kwargs), strict=False)
        except Exception as exc:  # export raises many types; all mean "cannot capture"
            raise CaptureError(_capture_failure(model, exc)) from exc
        gm = _traced_where_refused(exported, model, args, kwargs).module()
        _share_state_with(gm, model)
    refuse_or_warn(model, side_effects)
    _refuse_reentrant_checkpoint(model, functions)
    _refuse_custom_backward(model, functions)
    # the model's own checkpoints are traced through (the plan decides what runs again); a fractional budget
    # is of the step the model had with them (planner._fraction_base)
    gm.meta["checkpoints_itself"] = bool(checkpoints)
    _refuse_data_dependent_shapes(gm, model)
    _warn_of_autocast_regions(gm, model)
    drop_guards_and_asserts(gm)
    inline_math_attention(gm)
    size_attention_as_a_gpu_runs_it(gm)
    functionalize_activation_mutations(gm)
    write_softmax_backward_in_place(gm)
    chunk_cross_entropies(gm)
    widen_at_each_reader(gm)
    bracket_sharded_units(gm, units, placeholders)
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


@contextlib.contextmanager
def _checkpoints_run() -> Iterator[list]:
    """Whether the traced forward runs non-reentrant ``torch.utils.checkpoint`` (its generator, looked up at
    each call; the reentrant one is refused: :func:`_refuse_reentrant_checkpoint`)."""
    import torch.utils.checkpoint as checkpoint_module

    ran: list = []
    original = checkpoint_module._checkpoint_without_reentrant_generator

    def generator(*args, **kwargs):
        ran.append(True)
        return original(*args, **kwargs)

    checkpoint_module._checkpoint_without_reentrant_generator = generator
    try:
        yield ran
    finally:
        checkpoint_module._checkpoint_without_reentrant_generator = original


def _refuse_reentrant_checkpoint(model: torch.nn.Module, functions: set) -> None:
    """Reentrant ``torch.utils.checkpoint`` runs its function under ``no_grad`` and recomputes it in its own
    backward, which ``torch.export`` drops: the captured graph would give the checkpointed parameters no
    gradients. Refused, with the way out."""
    from torch.utils.checkpoint import CheckpointFunction

    if CheckpointFunction in functions:
        raise CaptureError(
            f"{type(model).__name__} calls torch.utils.checkpoint with use_reentrant=True: it runs the checkpointed "
            "function under no_grad and recomputes it in its own backward, which a captured graph drops, so the "
            "function's parameters would get no gradients. Fix: use_reentrant=False (what PyTorch recommends; "
            "Hugging Face: gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})) "
            "— autorecompute then plans what the checkpoints ran again — or turn the model's checkpointing off.")


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
    # torch's, autorecompute's and these passes' folders (errors.py is in autorecompute's)
    inside = tuple(os.path.dirname(path) + os.sep for path in (torch.__file__, errors.__file__, __file__))
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


def _traced_where_refused(exported: torch.export.ExportedProgram, model: torch.nn.Module, args: tuple,
                          kwargs: dict) -> torch.export.ExportedProgram:
    """``exported``; where it has a shape that depends on values, which capture refuses naming the user's line
    (:func:`_refuse_data_dependent_shapes`), the model traced again with the node stack traces capture leaves
    out (a fifth of export's time at depth), its Python's effects not recorded a second time."""
    refused = [node for node in exported.graph.nodes if _depends_on_values(node)]
    if all(node.meta.get("stack_trace") for node in refused):
        return exported
    try:
        with _eager_mask_decisions(model, args, kwargs), _quiet_export_diagnostics(), _stack_traces(recorded=True):
            return torch.export.export(model, tuple(args), dict(kwargs), strict=False)
    except Exception:  # noqa: BLE001 — the refusal follows either way; without traces it names no line
        return exported


@contextlib.contextmanager
def _stack_traces(recorded: bool) -> Iterator[None]:
    """FX tracing records node stack traces inside the block or not (always, on a torch without the switch).
    The switch is torch's, for the process: a trace in another thread meanwhile follows it too."""
    try:
        from torch.fx import config
    except ImportError:
        config = None
    if not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    saved = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = not recorded
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = saved


def _depends_on_values(node: torch.fx.Node) -> bool:
    """Whether ``node``'s tensor has a size known only from values (an unbacked symbol)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and bool(free_unbacked_symbols(value))


def _refuse_data_dependent_shapes(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """A tensor whose shape depends on values (boolean-mask indexing ``x[x > 0]``, ``masked_select``,
    ``nonzero``): its bytes are not known until the step runs, so no plan can bound them. torch.export traces
    it with a symbolic size, on which planning would fail with an untyped fake-tensor exception."""
    for node in gm.graph.nodes:
        if _depends_on_values(node):
            value = node.meta["val"]
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
    recompute nor offload, so the minimum peak stays near eager's. Said, with the fix, instead of a minimum that
    reads as a model too large."""
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
    keys take another kernel, whose gradients differ). Decisions that read values the caller passes (a padding
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
