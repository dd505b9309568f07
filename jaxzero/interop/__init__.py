"""Checkpoint interop with other training frameworks (DeepSpeed; torch helpers move here later)."""
