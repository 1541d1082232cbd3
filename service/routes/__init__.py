"""The routes of zen-mla's own HTTP API: health and metrics, and `/prefill` in both body forms."""
