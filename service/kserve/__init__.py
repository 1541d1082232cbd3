"""The Open Inference Protocol (KServe v2) next to `/prefill`: its routes, its infer request
in and answer out, and the system shared memory extension."""
