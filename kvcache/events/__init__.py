"""The store's event stream for routers: vLLM's KV events from each storage daemon.

- :mod:`kvcache.events.format`: the wire format (vLLM's msgspec events, topics, sequence
  framing), no I/O;
- :mod:`kvcache.events.publisher`: the daemon's publisher thread (XPUB + ROUTER replay);
- :mod:`kvcache.events.subscriber`: a subscriber with gap detection, replay and resync;
- :mod:`kvcache.events.cli`: ``kvcache events --follow``.

``docs/spec/events.md`` is the normative description.
"""
