"""Topic names, subscription patterns and the subscription trie used for routing.

Every published message is routed by calling :meth:`SubscriptionTrie.match` with its
topic, so matching is on the hot path.  The trie is a tree of small nodes whose literal
children live in plain dicts (one dict lookup per topic level), and results are kept in a
NATS-sublist-style cache (topic -> frozenset of values) that is bounded in size and
dropped wholesale whenever the set of subscriptions changes.

Topic levels are separated by ``/``.  Two pattern syntaxes are supported, chosen per
pattern, and both compile to the same normalised tokens so they share one trie:

``"smf"`` (Solace, the default)
    * a level that is exactly ``*`` matches exactly one level (any content, even empty);
    * a level ending in ``*`` such as ``ab*`` matches one level starting with ``ab``;
      a ``*`` anywhere else in a level is a literal character (``a*b`` is literal);
    * a last level that is exactly ``>`` matches ONE or more further levels
      (``a/>`` matches ``a/b`` and ``a/b/c`` but not ``a``); any other ``>`` is literal;
    * ``+`` and ``#`` are literal characters.

``"mqtt"``
    * ``+`` must be a whole level and matches exactly one level (may be empty);
    * ``#`` must be the whole last level and matches ZERO or more levels, including the
      parent (``a/#`` matches ``a``, ``a/b``, ``a/b/c``);
    * ``+``/``#`` anywhere else is an invalid pattern (:class:`TopicError`);
    * ``*`` and ``>`` are literal characters.

``$`` rule (both syntaxes, MQTT 3.1.1 section 4.7.2): a topic whose first level starts with
``$`` is never matched by a whole-level wildcard (``+``, ``#``, ``*``, ``>``) in the first
level.  A first-level prefix wildcard needs no special case: ``ab*`` can only match a
``$`` topic if its prefix starts with ``$`` (``$SYS*`` matches ``$SYS`` and ``$SYSx``).

Names and patterns must be non-empty, at most 65535 UTF-8 bytes (the MQTT string limit),
valid UTF-8 (no lone surrogates) and free of U+0000.  Empty levels are allowed
(``a//b``, ``/a``, ``a/``) as in MQTT.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Iterator
from itertools import islice
from typing import Any, Final, Generic, TypeAlias, TypeVar

__all__ = [
    "DEFAULT_CACHE_SIZE",
    "LIT",
    "MAX_TOPIC_BYTES",
    "MQTT",
    "ONE",
    "ONE_OR_MORE",
    "PREFIX",
    "SMF",
    "SYNTAXES",
    "TEMPORARY_TOPIC_LEVEL",
    "ZERO_OR_MORE",
    "SubscriptionTrie",
    "Token",
    "TopicError",
    "literal_prefix",
    "parse_pattern",
    "pattern_matcher",
    "pattern_matches",
    "reaches_temporary_topics",
    "temporary_topic_name",
    "validate_topic",
]

SMF: Final = "smf"
MQTT: Final = "mqtt"
SYNTAXES: Final = frozenset({SMF, MQTT})

MAX_TOPIC_BYTES: Final = 65535
DEFAULT_CACHE_SIZE: Final = 4096

# Token kinds.  A token is ("lit", text), ("prefix", text) or a 1-tuple of the kind.
LIT: Final = "lit"  # the level must equal the text
ONE: Final = "one"  # exactly one level, any content  (smf "*", mqtt "+")
PREFIX: Final = "prefix"  # one level starting with the text (smf "ab*")
ONE_OR_MORE: Final = "1+"  # one or more levels, always last (smf ">")
ZERO_OR_MORE: Final = "0+"  # zero or more levels, always last (mqtt "#")

Token: TypeAlias = tuple[str, ...]

_ONE_TOKEN: Final[Token] = (ONE,)
_ONE_OR_MORE_TOKEN: Final[Token] = (ONE_OR_MORE,)
_ZERO_OR_MORE_TOKEN: Final[Token] = (ZERO_OR_MORE,)
_EMPTY: Final[frozenset[Any]] = frozenset()

T = TypeVar("T", bound=Hashable)


class TopicError(ValueError):
    """A topic name or subscription pattern is malformed; the message says what and where."""


# --------------------------------------------------------------------------- validation


def _show(text: str, limit: int = 60) -> str:
    """Repr of ``text`` short enough for an error message (names may be 64 KiB long)."""
    if len(text) <= limit:
        return repr(text)
    return repr(text[:limit]) + f"... ({len(text)} characters)"


def _check_syntax(syntax: str) -> None:
    # An unknown syntax is a programming error, not a bad topic: plain ValueError.
    if syntax not in SYNTAXES:
        raise ValueError(f"unknown topic syntax {syntax!r}; expected 'smf' or 'mqtt'")


def _check_common(text: str, what: str) -> None:
    """Rules shared by names and patterns of both syntaxes (emptiness, NUL, size, UTF-8)."""
    if not isinstance(text, str):
        raise TypeError(f"{what} must be str, not {type(text).__name__}")
    if not text:
        raise TopicError(f"{what} is empty")
    nul = text.find("\x00")
    if nul >= 0:
        raise TopicError(f"{what} {_show(text)} contains U+0000 at character offset {nul}")
    if text.isascii():  # O(1) in CPython; the common case needs no encoding
        size = len(text)
    else:
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise TopicError(
                f"{what} {_show(text)} is not valid UTF-8: lone surrogate at character "
                f"offset {exc.start}"
            ) from None
    if size > MAX_TOPIC_BYTES:
        raise TopicError(
            f"{what} {_show(text)} is {size} UTF-8 bytes long; the limit is {MAX_TOPIC_BYTES}"
        )


def validate_topic(name: str, syntax: str = SMF) -> None:
    """Check a topic name used for publishing; raise :class:`TopicError` if it is invalid.

    MQTT forbids wildcard characters in published names (they would be ambiguous to
    subscribers); Solace treats ``*`` and ``>`` in a published name as literals.
    """
    _check_syntax(syntax)
    _check_common(name, "topic")
    if syntax == MQTT:
        for ch in "+#":
            pos = name.find(ch)
            if pos >= 0:
                level = name.count("/", 0, pos) + 1
                raise TopicError(
                    f"MQTT topic name {_show(name)} contains wildcard {ch!r} at character "
                    f"offset {pos} (level {level}); wildcards are only allowed in filters"
                )


def parse_pattern(pattern: str, syntax: str = SMF) -> tuple[Token, ...]:
    """Validate ``pattern`` and return its normalised tokens, one per level.

    Both syntaxes map onto the same tokens so that one trie can hold subscriptions from
    every protocol: ``("lit", s)``, ``("one",)``, ``("prefix", p)``, ``("1+",)`` (Solace
    ``>``) and ``("0+",)`` (MQTT ``#``).  Multi-level tokens only ever appear last.
    """
    _check_syntax(syntax)
    _check_common(pattern, "pattern")
    levels = pattern.split("/")
    last = len(levels) - 1
    tokens: list[Token] = []
    if syntax == SMF:
        for i, level in enumerate(levels):
            if level == "*":
                tokens.append(_ONE_TOKEN)
            elif level == ">" and i == last:
                tokens.append(_ONE_OR_MORE_TOKEN)
            elif level.endswith("*"):
                # Only the trailing "*" is a wildcard; "a**" is the prefix "a*".
                tokens.append((PREFIX, level[:-1]))
            else:
                tokens.append((LIT, level))
    else:
        for i, level in enumerate(levels):
            if level == "+":
                tokens.append(_ONE_TOKEN)
            elif level == "#":
                if i != last:
                    raise TopicError(
                        f"invalid MQTT pattern {_show(pattern)}: '#' must be the last level, "
                        f"but it is level {i + 1} of {last + 1}"
                    )
                tokens.append(_ZERO_OR_MORE_TOKEN)
            elif "+" in level or "#" in level:
                ch = "+" if "+" in level else "#"
                raise TopicError(
                    f"invalid MQTT pattern {_show(pattern)}: {ch!r} must occupy a whole level, "
                    f"but level {i + 1} is {_show(level)}"
                )
            else:
                tokens.append((LIT, level))
    return tuple(tokens)


def _tokens_match(tokens: tuple[Token, ...], levels: list[str]) -> bool:
    """Match parsed tokens against topic levels (no trie; used by :func:`pattern_matches`)."""
    n = len(levels)
    dollar = levels[0].startswith("$")
    for i, tok in enumerate(tokens):
        kind = tok[0]
        if kind == ZERO_OR_MORE:
            return not (i == 0 and dollar)  # i <= n here: earlier tokens consumed i levels
        if i >= n:
            return False
        if kind == ONE_OR_MORE:
            return not (i == 0 and dollar)  # i < n: at least one level remains
        level = levels[i]
        if kind == LIT:
            if level != tok[1]:
                return False
        elif kind == ONE:
            if i == 0 and dollar:
                return False
        elif not level.startswith(tok[1]):  # PREFIX
            return False
    return len(tokens) == n


def pattern_matches(pattern: str, topic: str, syntax: str = SMF) -> bool:
    """Whether one pattern matches one topic; for tests, admin tools and one-off checks.

    The topic gets the same syntax-independent checks as :meth:`SubscriptionTrie.match`
    (``syntax`` describes the pattern), so both always agree.
    """
    return pattern_matcher(pattern, syntax)(topic)


def pattern_matcher(pattern: str, syntax: str = SMF) -> Callable[[str], bool]:
    """:func:`pattern_matches` for one pattern and many topics: the pattern is parsed once."""
    tokens = parse_pattern(pattern, syntax)

    def matches(topic: str) -> bool:
        _check_common(topic, "topic")
        return _tokens_match(tokens, topic.split("/"))

    return matches


def literal_prefix(pattern: str, syntax: str = SMF) -> tuple[str, bool]:
    """What every topic ``pattern`` matches starts with (its levels before the first
    wildcard), and whether the pattern has no wildcard, so it matches that topic alone."""
    text = ""
    for i, token in enumerate(parse_pattern(pattern, syntax)):
        kind = token[0]
        if kind == ZERO_OR_MORE:  # "a/#" matches "a" itself
            return text, False
        if i:
            text += "/"
        if kind == LIT:
            text += token[1]
            continue
        return (text + token[1] if kind == PREFIX else text), False
    return text, True


# --------------------------------------------------------------------------------- trie


class _Node:
    """One trie level.  Value buckets map value -> number of entries that put it there.

    Counts are needed because different entries can normalise to the same tokens (the
    same value under ``a/+`` mqtt and ``a/*`` smf); the value stays until both are gone.
    """

    __slots__ = ("exact", "lits", "one", "one_plus", "prefixes", "zero_plus")

    def __init__(self) -> None:
        self.lits: dict[str, _Node] = {}
        self.one: _Node | None = None
        self.prefixes: dict[str, _Node] | None = None
        self.exact: dict[Any, int] | None = None  # pattern ends exactly here
        self.one_plus: dict[Any, int] | None = None  # ">" here: one or more levels follow
        self.zero_plus: dict[Any, int] | None = None  # "#" here: zero or more levels follow

    def is_empty(self) -> bool:
        return not (
            self.lits
            or self.one is not None
            or self.prefixes
            or self.exact
            or self.one_plus
            or self.zero_plus
        )


def _bump(bucket: dict[Any, int] | None, value: Any) -> dict[Any, int]:
    if bucket is None:
        return {value: 1}
    bucket[value] = bucket.get(value, 0) + 1
    return bucket


def _drop(bucket: dict[Any, int] | None, value: Any) -> dict[Any, int] | None:
    assert bucket is not None  # guaranteed by the entries registry
    count = bucket[value] - 1
    if count:
        bucket[value] = count
    else:
        del bucket[value]
    return bucket or None


class SubscriptionTrie(Generic[T]):
    """Maps subscription patterns (either syntax) to values and routes topics to them.

    An entry is a ``(pattern, syntax, value)`` triple; adding the same triple twice is a
    no-op.  ``match`` results are cached per topic (at most ``cache_size`` topics; 0
    disables the cache) and the cache is cleared on every change, so it is never stale.
    Not thread-safe: use it from one thread / event loop, as the gateway does.
    """

    __slots__ = ("_cache", "_cache_size", "_entries", "_root")

    def __init__(self, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, not {cache_size}")
        self._root = _Node()
        # Insertion-ordered registry of entries; the trie holds only counted values.
        self._entries: dict[tuple[str, str, T], None] = {}
        self._cache: dict[str, frozenset[T]] = {}
        self._cache_size = cache_size

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"<SubscriptionTrie entries={len(self._entries)} cached={len(self._cache)}>"

    def entries(self) -> Iterator[tuple[str, str, T]]:
        """Yield ``(pattern, syntax, value)`` in insertion order (snapshot: safe to mutate)."""
        yield from list(self._entries)

    def clear(self) -> None:
        """Drop every entry and cached result."""
        self._root = _Node()
        self._entries.clear()
        self._cache.clear()

    def add(self, pattern: str, value: T, syntax: str = SMF) -> bool:
        """Subscribe ``value`` to ``pattern``; True if the entry is new.

        Raises :class:`TopicError` for an invalid pattern.
        """
        tokens = parse_pattern(pattern, syntax)
        key = (pattern, syntax, value)
        if key in self._entries:
            return False
        node = self._root
        for tok in tokens:
            kind = tok[0]
            if kind == LIT:
                child = node.lits.get(tok[1])
                if child is None:
                    child = node.lits[tok[1]] = _Node()
            elif kind == ONE:
                child = node.one
                if child is None:
                    child = node.one = _Node()
            elif kind == PREFIX:
                if node.prefixes is None:
                    node.prefixes = {}
                child = node.prefixes.get(tok[1])
                if child is None:
                    child = node.prefixes[tok[1]] = _Node()
            elif kind == ONE_OR_MORE:
                node.one_plus = _bump(node.one_plus, value)
                break
            else:  # ZERO_OR_MORE
                node.zero_plus = _bump(node.zero_plus, value)
                break
            node = child
        else:
            node.exact = _bump(node.exact, value)
        self._entries[key] = None
        self._cache.clear()
        return True

    def remove(self, pattern: str, value: T, syntax: str = SMF) -> bool:
        """Unsubscribe; True if the entry existed.  Nodes left empty are pruned.

        An invalid pattern raises :class:`TopicError` (it can never have been added, so
        passing one is a caller bug worth surfacing).
        """
        tokens = parse_pattern(pattern, syntax)
        key = (pattern, syntax, value)
        if key not in self._entries:
            return False
        del self._entries[key]
        self._cache.clear()

        path: list[tuple[_Node, Token]] = []  # (parent, token leading to the child)
        node = self._root
        for tok in tokens:
            kind = tok[0]
            if kind == ONE_OR_MORE:
                node.one_plus = _drop(node.one_plus, value)
                break
            if kind == ZERO_OR_MORE:
                node.zero_plus = _drop(node.zero_plus, value)
                break
            path.append((node, tok))
            if kind == LIT:
                node = node.lits[tok[1]]
            elif kind == ONE:
                assert node.one is not None
                node = node.one
            else:  # PREFIX
                assert node.prefixes is not None
                node = node.prefixes[tok[1]]
        else:
            node.exact = _drop(node.exact, value)

        # Prune bottom-up while the child is empty.
        for parent, tok in reversed(path):
            if not node.is_empty():
                break
            kind = tok[0]
            if kind == LIT:
                del parent.lits[tok[1]]
            elif kind == ONE:
                parent.one = None
            else:  # PREFIX
                assert parent.prefixes is not None
                del parent.prefixes[tok[1]]
                if not parent.prefixes:
                    parent.prefixes = None
            node = parent
        return True

    def match(self, topic: str) -> frozenset[T]:
        """Values of every entry whose pattern matches ``topic``.

        Cache hits cost one dict lookup.  On a miss the topic gets the syntax-independent
        checks (non-empty, size, NUL, UTF-8; :class:`TopicError`) -- per-protocol checks
        such as MQTT's ban on ``+``/``#`` belong at ingress, via :func:`validate_topic`.
        """
        hit = self._cache.get(topic)
        if hit is not None:
            return hit
        _check_common(topic, "topic")
        result: frozenset[T] = frozenset(self._collect(topic)) if self._entries else _EMPTY
        size = self._cache_size
        if size:
            cache = self._cache
            if len(cache) >= size:
                # Evict the oldest quarter in one O(n) rebuild: amortised O(1) per miss,
                # and unlike repeated deletes at the front it leaves no dummy slots.
                cache = self._cache = dict(islice(cache.items(), max(1, size // 4), None))
            cache[topic] = result
        return result

    def _collect(self, topic: str) -> set[T]:
        """Walk all matching trie branches level by level (NFA-style, no recursion)."""
        out: set[T] = set()
        nodes = [self._root]
        # Whole-level wildcards in the first level never match "$" topics.
        wild = not topic.startswith("$")
        for level in topic.split("/"):
            nxt: list[_Node] = []
            for node in nodes:
                if wild:
                    if node.zero_plus:
                        out.update(node.zero_plus)
                    if node.one_plus:
                        out.update(node.one_plus)
                    if node.one is not None:
                        nxt.append(node.one)
                child = node.lits.get(level)
                if child is not None:
                    nxt.append(child)
                prefixes = node.prefixes
                if prefixes:
                    if len(prefixes) <= len(level):
                        for prefix, child in prefixes.items():
                            if level.startswith(prefix):
                                nxt.append(child)
                    else:  # many prefixes, short level: probe each prefix of the level
                        for k in range(1, len(level) + 1):
                            child = prefixes.get(level[:k])
                            if child is not None:
                                nxt.append(child)
            if not nxt:
                return out
            nodes = nxt
            wild = True
        for node in nodes:
            if node.exact:
                out.update(node.exact)
            if node.zero_plus:  # "#" also matches its parent level
                out.update(node.zero_plus)
        return out


# Temporary topics (JMS TemporaryTopic: an AMQP dynamic node with the temporary-topic
# capability) are "$tmp/<node>/<random>", read by the connection that made one alone: a
# first-level wildcard matches no "$" topic, and a subscription naming the level is refused
# to everyone else (reaches_temporary_topics).
TEMPORARY_TOPIC_LEVEL = "$tmp"


def temporary_topic_name(node_id: str) -> str:
    return f"{TEMPORARY_TOPIC_LEVEL}/{node_id}/{os.urandom(8).hex()}"


def reaches_temporary_topics(pattern: str, syntax: str) -> bool:
    """Whether a subscription may match temporary topics (False for an invalid one, which
    is refused for that)."""
    try:
        first = parse_pattern(pattern, syntax)[0]
    except TopicError:
        return False
    return (first[0] == LIT and first[1] == TEMPORARY_TOPIC_LEVEL) or (
        first[0] == PREFIX and TEMPORARY_TOPIC_LEVEL.startswith(first[1])
    )
