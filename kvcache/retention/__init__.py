"""Retention: traffic classes, their TTLs, and the decisions a daemon's GC makes with them.

The policy types and the rules (:mod:`kvcache.retention.decide`) are pure (no
clock, no I/O); the storage daemon (:mod:`kvcache.server.store`) and the trace
simulator (:mod:`kvcache.retention.simulate`) apply the same rules.
"""

from kvcache.retention.decide import NO_HINT, Applied, Hint, clamp, merged_expiry
from kvcache.retention.policy import (
    DAY_S,
    DEFAULT_CLASS_NAME,
    DEFAULT_CLASSES,
    RetentionPolicy,
    parse_duration,
)

__all__ = [
    "DAY_S",
    "DEFAULT_CLASSES",
    "DEFAULT_CLASS_NAME",
    "NO_HINT",
    "Applied",
    "Hint",
    "RetentionPolicy",
    "clamp",
    "merged_expiry",
    "parse_duration",
]
