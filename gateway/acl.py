"""Topic ACLs (the `[[acl]]` rules): the topics a user may not publish to or subscribe to.

They bind every client of the user, whatever its protocol, as Solace's ACL profiles bind
SMF, MQTT and AMQP clients alike: a rule written for MQTT clients would be worth nothing if
the same user could publish to the topic over AMQP. Patterns are in MQTT syntax.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gateway.config import AclRule
from gateway.topics import (
    LIT,
    MQTT,
    ONE,
    ONE_OR_MORE,
    PREFIX,
    ZERO_OR_MORE,
    Token,
    TopicError,
    parse_pattern,
    pattern_matches,
)


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

    def may_route(self, pattern: str, syntax: str) -> bool:
        """A queue subscription (admin API): refused when some topic a denied pattern
        covers could match it. A queue's messages are read by whoever may read the queue,
        past any filter of the user's: a broader pattern would hand out denied topics."""
        if not self.deny_subscribe:
            return True
        tokens = parse_pattern(pattern, syntax)
        return not any(_overlap(tokens, _denied(d), first=True) for d in self.deny_subscribe)

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


def literal_denials(rules: Iterable[AclRule]) -> list[tuple[str, str]]:
    """(user, pattern) of the deny patterns MQTT cannot read as filters (`a/#/b`, `c++`):
    each denies that one topic name, as it is written. An AMQP topic may hold `+` or `#`,
    so such a rule can be meant; a start-up warning tells it from a mistyped filter."""
    found = []
    for rule in rules:
        for pattern in (*rule.deny_publish, *rule.deny_subscribe):
            try:
                parse_pattern(pattern, MQTT)
            except TopicError:
                found.append((rule.user, pattern))
    return found


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


def _denied(pattern: str) -> tuple[Token, ...]:
    """A deny pattern's tokens; one MQTT cannot parse is a topic name, as `covered` reads it."""
    try:
        return parse_pattern(pattern, MQTT)
    except TopicError:
        return tuple((LIT, level) for level in pattern.split("/"))


_WILD = (ONE, ONE_OR_MORE, ZERO_OR_MORE)  # whole-level wildcards


def _overlap(a: tuple[Token, ...], b: tuple[Token, ...], first: bool = False) -> bool:
    """Whether some topic matches both patterns (as parsed tokens). At the `first` level a
    whole-level wildcard matches no topic starting with '$' (MQTT §4.7.2, topics.py)."""
    if (
        first
        and a
        and b
        and ((_dollar(a[0]) and b[0][0] in _WILD) or (_dollar(b[0]) and a[0][0] in _WILD))
    ):
        return False
    if (a and a[0][0] == ZERO_OR_MORE) or (b and b[0][0] == ZERO_OR_MORE):
        return True
    if a and a[0][0] == ONE_OR_MORE:
        return bool(b)
    if b and b[0][0] == ONE_OR_MORE:
        return bool(a)
    if not a or not b:
        return not a and not b
    return _same_level(a[0], b[0]) and _overlap(a[1:], b[1:])


def _dollar(token: Token) -> bool:
    """A literal or prefix level that only '$' topics can have."""
    return token[0] in (LIT, PREFIX) and token[1].startswith("$")


def _same_level(x: Token, y: Token) -> bool:
    """Whether one topic level can match both tokens."""
    if x[0] == ONE or y[0] == ONE:
        return True
    if x[0] == LIT and y[0] == LIT:
        return x[1] == y[1]
    if x[0] == PREFIX and y[0] == PREFIX:
        return x[1].startswith(y[1]) or y[1].startswith(x[1])
    literal, prefix = (x, y) if x[0] == LIT else (y, x)
    return literal[0] == LIT and prefix[0] == PREFIX and literal[1].startswith(prefix[1])
