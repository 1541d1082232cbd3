"""The Open Inference Protocol (KServe v2) next to `/prefill`."""
