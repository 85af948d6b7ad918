"""Who may see the status page: holders of the cluster's admin token.

A browser shows the token once (the login form, or ``?token=`` in a link) and
gets a session cookie back. The cookie holds an HMAC of the token, not the
token: it opens the page and its data and nothing else (``PUT /retention``
still needs the token itself), it dies when the token is rotated, and it is
``HttpOnly`` and ``SameSite=Strict`` so page scripts and other sites cannot
use it. Scripts may send ``Authorization: Bearer <token>`` instead.

With no admin token configured the page is open, and says so.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["COOKIE_NAME", "Access", "session_value"]

COOKIE_NAME = "kvcache_dashboard"
_SESSION_TAG = b"kvcache:dashboard-session:v1"


def session_value(token: str) -> str:
    """The cookie value that stands for ``token`` (HMAC-SHA256, hex)."""
    return hmac.new(token.encode(), _SESSION_TAG, hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class Access:
    """The admin token the page requires (None: open) and the checks against it."""

    token: str | None = field(repr=False)

    @property
    def open(self) -> bool:
        """Whether no token is required."""
        return self.token is None

    def token_ok(self, given: str) -> bool:
        """Whether ``given`` is the admin token (constant time)."""
        if self.token is None:
            return True
        return hmac.compare_digest(given.encode(), self.token.encode())

    def allows(self, headers: Mapping[str, str], cookies: Mapping[str, str]) -> bool:
        """Whether a request with these headers and cookies may see the page's data."""
        if self.token is None:
            return True
        auth = headers.get("Authorization", "")
        if auth.startswith("Bearer ") and self.token_ok(auth[7:]):
            return True
        cookie = cookies.get(COOKIE_NAME, "")
        return bool(cookie) and hmac.compare_digest(
            cookie.encode(), session_value(self.token).encode()
        )

    def cookie(self) -> str:
        """The session cookie's value (only meaningful when a token is set)."""
        return session_value(self.token or "")
