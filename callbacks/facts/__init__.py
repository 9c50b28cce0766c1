"""Facts read once at train begin: membership, preflight config, heads, stop token, rows, resume."""
