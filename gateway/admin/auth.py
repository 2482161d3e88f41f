"""Who is calling the admin API, as a production broker's management API decides it.

With users configured every request (but the health probe) needs HTTP Basic credentials of
one of them: an admin user is the operator (no checks), any other user acts as itself, so
queue ownership and permissions apply. With no users configured, as on a fresh machine,
the API is the operator's from loopback only; other addresses are refused.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import logging
from collections.abc import Iterable

from gateway.admin.http import HttpError
from gateway.config import User

log = logging.getLogger(__name__)

CHALLENGE = ("WWW-Authenticate", 'Basic realm="gateway"')
_NO_PASSWORD = b"\0" * 32  # compared against when the user is unknown: same work either way


class AdminAuth:
    def __init__(self, users: Iterable[User] = ()) -> None:
        self._users = {u.name: u for u in users}
        if not self._users:
            log.warning(
                "admin API is unauthenticated: no users are configured, so loopback clients "
                "are the operator and other addresses are refused"
            )

    def caller(self, authorization: str | None, peer: str) -> str | None:
        """The user a request acts as; None is the operator. Raises HttpError 401 for
        missing or bad credentials, 403 for a non-loopback peer while no users exist."""
        if not self._users:
            if is_loopback(peer):
                return None
            raise HttpError(403, "the admin API is open to loopback clients only")
        name, password = _basic_credentials(authorization)
        user = self._users.get(name)
        expected = user.password.encode() if user is not None else _NO_PASSWORD
        if not hmac.compare_digest(password.encode(), expected) or user is None:
            raise HttpError(401, "bad user name or password", [CHALLENGE])
        return None if user.admin else user.name


def is_loopback(peer: str) -> bool:
    """Whether a peer address (IPv4, IPv6 or IPv4-mapped IPv6) is this machine's loopback."""
    try:
        address = ipaddress.ip_address(peer.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _basic_credentials(authorization: str | None) -> tuple[str, str]:
    """(user, password) from an `Authorization: Basic ...` header, else 401."""
    if not authorization:
        raise HttpError(401, "authentication required", [CHALLENGE])
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "basic":
        raise HttpError(401, "use HTTP Basic authentication", [CHALLENGE])
    try:
        decoded = base64.b64decode(token.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise HttpError(401, "malformed Basic credentials", [CHALLENGE]) from None
    name, sep, password = decoded.partition(":")
    if not sep:
        raise HttpError(401, "malformed Basic credentials", [CHALLENGE])
    return name, password
