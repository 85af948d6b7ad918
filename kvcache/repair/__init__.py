"""Repair: rebuild the missing shards of live blocks onto their current holders.

:mod:`.listing` (LIST pages in, complete keys out) and :mod:`.plan` (what each
block lacks and where it goes) are pure; :mod:`.run` drives them over the
client's transport, rate-limited and resumable (:mod:`.state`); :mod:`.cli`
is ``kvcache repair``. The daemon-side counterpart, scrub, is
:mod:`kvcache.server.scrub`.
"""

from kvcache.repair.listing import Held, ListingMerge, list_request, parse_listing
from kvcache.repair.plan import BlockPlan, Plan, plan_blocks
from kvcache.repair.run import Repairer, RepairOptions, RepairProgress

__all__ = [
    "BlockPlan",
    "Held",
    "ListingMerge",
    "Plan",
    "RepairOptions",
    "RepairProgress",
    "Repairer",
    "list_request",
    "parse_listing",
    "plan_blocks",
]
