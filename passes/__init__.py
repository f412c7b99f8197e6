"""Graph passes of autorecompute, in pipeline order.

capture → profile (sizes, saved tensors, FLOPs, memory timeline) → [problem, solver, Plan] →
rewrite_recompute → rewrite_stash → verify → rewrite_softmax → rewrite_calls. Analysis passes write
``node.meta["autorecompute"]``; read it through
:func:`autorecompute.passes.profile.node_info`, which says which pass to run when it is missing.
"""
