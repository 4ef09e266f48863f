"""Trainer, metrics (MFU), checkpoints."""
