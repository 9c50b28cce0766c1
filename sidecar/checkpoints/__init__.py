"""Checkpoints on disk: the watcher, the safetensors inspector, the promotion gate."""
