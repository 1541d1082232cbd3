"""The HTTP routes of zen-mla's own API: health and metrics, `/prefill`."""
