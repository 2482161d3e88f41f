"""Endpoint ownership and permissions (Solace semantics).

Every queue has an owner (the user that created it, or none for provisioned queues) and a
permission granting everyone else an access level; each level includes the ones before it.
The owner may do everything; on a queue without an owner the permission applies to every
client. Calls without a user (an admin of the admin API, the configuration file) are the
operator's and are not checked.
"""

from __future__ import annotations

LEVELS = ("none", "read-only", "consume", "modify-topic", "delete")

NO_ACCESS = "none"
BROWSE = "read-only"
CONSUME = "consume"
MODIFY_TOPIC = "modify-topic"
DELETE = "delete"


def allowed(owner: str | None, permission: str, user: str | None, needed: str) -> bool:
    """Whether `user` may do what needs level `needed` on a queue."""
    if user is None or (owner and user == owner):
        return True
    return LEVELS.index(permission) >= LEVELS.index(needed)
