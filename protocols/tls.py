"""The server TLS context both protocol listeners use."""

from __future__ import annotations

import ssl

from gateway.config import Settings, tls_server_context


def tls_context(settings: Settings) -> ssl.SSLContext | None:
    """The context of settings.tls_cert / tls_key; None when they are not set."""
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    return tls_server_context(settings.tls_cert, settings.tls_key)
