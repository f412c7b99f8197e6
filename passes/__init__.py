"""Graph passes of autorecompute, in pipeline order.

capture (export, then its clean-ups: drop_guards, inline_attention, gpu_attention, functionalize_mutations,
softmax_in_place, cross_entropy_in_chunks, widen_at_readers) → profile (sizes, saved tensors, FLOPs, memory timeline) → build_problem →
[solver, Plan] → rewrite_recompute → rewrite_stash → verify → rewrite_lean_ops → rewrite_calls. Passes annotate
the graph under the keys of :mod:`~autorecompute.passes.meta`, whose readers
(:func:`~autorecompute.passes.meta.node_info`...) say which pass to run when a key is missing. graph_facts
holds what the passes read off the graph's in-place writes and views; throughputs the speeds the cost model
prices with.
"""
