"""Retention hints per request, as the engine adapters receive them.

An engine request may carry ``{"kvcache": {"traffic_class": "agent", "ttl": "6h",
"pin": false, "store": true}}``:

* vLLM: the request's ``kv_transfer_params`` (``SamplingParams(extra_args=...)`` is
  not used: ``kv_transfer_params`` is what vLLM hands its KV connector per request);
* SGLang: the ``extra_info`` dict of the ``HiCacheStorageExtraInfo`` each storage
  call receives (``docs/engine.md`` says how it gets there).

Every field is optional: a request without a hint, or without ``traffic_class``,
gets the adapter's default class, which is the client's ``traffic_class``
(:class:`kvcache.client.ClientConfig`, ``"default"``) for every adapter. A
malformed hint never fails the request: it is logged, counted, and the request
proceeds as if it had none. The daemons clamp the TTL into its class's bounds and
honour a pin only within the tenant's pin quota (``docs/spec/retention.md``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kvcache.errors import ArgumentError
from kvcache.retention.decide import Hint

__all__ = ["HINT_KEY", "hint_from_params"]

log = logging.getLogger(__name__)

#: The key of a request's parameters (vLLM ``kv_transfer_params``, SGLang ``extra_info``)
#: that holds its kvcache hint.
HINT_KEY = "kvcache"


def hint_from_params(params: object, *, request: str) -> tuple[Hint | None, str | None]:
    """(the hint in ``params[HINT_KEY]`` or None, an error text when it was malformed).

    ``params`` is whatever the engine passed (a dict, None, or anything else); a
    malformed hint is logged with ``request`` and reported, never raised.
    """
    if not isinstance(params, Mapping) or params.get(HINT_KEY) is None:
        return None, None
    try:
        hint = Hint.from_mapping(params[HINT_KEY], source=f"request {request}: {HINT_KEY}")
    except ArgumentError as exc:
        log.warning("kvcache: ignoring the retention hint of request %s: %s", request, exc)
        return None, str(exc)
    return (None if hint.is_default else hint), None
