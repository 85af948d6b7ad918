"""Retention: traffic classes, their TTLs, and the decisions a daemon's GC makes with them.

The policy types are pure (no clock, no I/O); the storage daemon
(:mod:`kvcache.server.store`) applies them to its shards.
"""

from kvcache.retention.policy import (
    DAY_S,
    DEFAULT_CLASS_NAME,
    DEFAULT_CLASSES,
    RetentionPolicy,
    merged_expiry,
    parse_duration,
)

__all__ = [
    "DAY_S",
    "DEFAULT_CLASSES",
    "DEFAULT_CLASS_NAME",
    "RetentionPolicy",
    "merged_expiry",
    "parse_duration",
]
