"""The cluster status page: served by every daemon's admin HTTP at ``/dashboard`` and by
``kvcache dashboard``.

:mod:`~kvcache.dashboard.view` builds the page's JSON from each node's
``/stats`` without I/O; :class:`Collector` polls the nodes for it;
:func:`add_dashboard` adds the routes (page, login, JSON, static files) to an
aiohttp app; :class:`Access` decides who may see it (the admin token).
"""

from kvcache.dashboard.auth import Access
from kvcache.dashboard.collector import Collector, LocalNode
from kvcache.dashboard.view import ViewContext, build_view
from kvcache.dashboard.web import PREFIX, add_dashboard

__all__ = [
    "PREFIX",
    "Access",
    "Collector",
    "LocalNode",
    "ViewContext",
    "add_dashboard",
    "build_view",
]
