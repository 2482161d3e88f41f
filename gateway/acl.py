"""Topic ACLs (the `[[acl]]` rules): the topics a user may not publish to or subscribe to.

They bind every client of the user, whatever its protocol, as Solace's ACL profiles bind
SMF, MQTT and AMQP clients alike: a rule written for MQTT clients would be worth nothing if
the same user could publish to the topic over AMQP. Patterns are in MQTT syntax.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gateway.config import AclRule
from gateway.topics import MQTT, TopicError, pattern_matches


@dataclass(frozen=True, slots=True)
class TopicAccess:
    """One user's denials, gathered from the rules for it, "*" (everyone) included."""

    deny_publish: tuple[str, ...] = ()
    deny_subscribe: tuple[str, ...] = ()

    def may_publish(self, topic: str) -> bool:
        return not covered(self.deny_publish, topic)

    def may_receive(self, topic: str) -> bool:
        """A message on `topic`, matched by a broader subscription the user may hold."""
        return not covered(self.deny_subscribe, topic)

    def may_subscribe(self, topic_filter: str) -> bool:
        """A filter is refused when a denied pattern covers it taken as a name (`a/#` covers
        `a/b/+` and `a/>`); a broader one is allowed, its denied topics then held back by
        may_receive."""
        return not covered(self.deny_subscribe, topic_filter)


NO_DENIALS = TopicAccess()


def topic_access(rules: Iterable[AclRule], user: str) -> TopicAccess:
    """`user`: a user name, or ANONYMOUS for clients that did not authenticate."""
    deny_publish: list[str] = []
    deny_subscribe: list[str] = []
    for rule in rules:
        if rule.user in ("*", user):
            deny_publish += rule.deny_publish
            deny_subscribe += rule.deny_subscribe
    if not deny_publish and not deny_subscribe:
        return NO_DENIALS
    return TopicAccess(tuple(deny_publish), tuple(deny_subscribe))


def covered(patterns: tuple[str, ...], topic: str) -> bool:
    """Whether one of `patterns` matches `topic` (a name, or a filter taken literally)."""
    for pattern in patterns:
        try:
            if pattern_matches(pattern, topic, MQTT):
                return True
        except TopicError:
            if pattern == topic:
                return True
    return False
