"""Tests for gateway.topics: validation, pattern rules, and the trie against a reference."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from gateway.topics import (
    MAX_TOPIC_BYTES,
    SubscriptionTrie,
    TopicError,
    parse_pattern,
    pattern_matches,
    validate_topic,
)

# --------------------------------------------------------------------------- reference
# Deliberately slow and written straight from the rules, on raw strings (not tokens).


def ref_matches(pattern: str, topic: str, syntax: str) -> bool:
    """Recursive reference matcher: pattern level i against topic level j."""
    p = pattern.split("/")
    t = topic.split("/")
    dollar_topic = t[0].startswith("$")

    def go(i: int, j: int) -> bool:
        if i == len(p):
            return j == len(t)
        lvl = p[i]
        is_last = i == len(p) - 1
        # A whole-level wildcard in the first pattern level never matches a $ topic.
        blocked = i == 0 and dollar_topic
        if syntax == "mqtt":
            if lvl == "#" and is_last:
                return not blocked  # zero or more remaining levels, whatever they are
            if j == len(t):
                return False
            if lvl == "+":
                return not blocked and go(i + 1, j + 1)
            return lvl == t[j] and go(i + 1, j + 1)
        # smf
        if lvl == ">" and is_last:
            return not blocked and j < len(t)  # one or more remaining levels
        if j == len(t):
            return False
        if lvl == "*":
            return not blocked and go(i + 1, j + 1)
        if lvl.endswith("*"):
            return t[j].startswith(lvl[:-1]) and go(i + 1, j + 1)
        return lvl == t[j] and go(i + 1, j + 1)

    return go(0, 0)


def ref_valid_mqtt_pattern(pattern: str) -> bool:
    levels = pattern.split("/")
    for i, lvl in enumerate(levels):
        if "+" in lvl and lvl != "+":
            return False
        if "#" in lvl and not (lvl == "#" and i == len(levels) - 1):
            return False
    return True


def ref_match_all(entries: set[tuple[str, str, int]] | list, topic: str) -> frozenset:
    return frozenset(v for (p, s, v) in entries if ref_matches(p, topic, s))


# -------------------------------------------------------------------------- strategies

LIT_LEVELS = ["a", "b", "ab", "abc", "", "$s"]
# Published names may carry the other syntax's wildcard characters as literals.
TOPIC_LEVELS = [*LIT_LEVELS, "$", "*", ">", "a*", "a*b", "+", "#"]
SMF_LEVELS = [*LIT_LEVELS, "*", ">", "a*", "ab*", "$*", "$s*", "a*b", "**", "+", "#"]
MQTT_BODY_LEVELS = [*LIT_LEVELS, "+", "*", ">", "a*"]

topics = st.lists(st.sampled_from(TOPIC_LEVELS), min_size=1, max_size=5).map("/".join).filter(bool)
smf_patterns = st.lists(st.sampled_from(SMF_LEVELS), min_size=1, max_size=4).map("/".join)
mqtt_patterns = st.builds(
    lambda body, hash_tail: "/".join(body + (["#"] if hash_tail else [])),
    st.lists(st.sampled_from(MQTT_BODY_LEVELS), min_size=0, max_size=4),
    st.booleans(),
)
patterns = st.one_of(
    st.tuples(smf_patterns, st.just("smf")),
    st.tuples(mqtt_patterns, st.just("mqtt")),
).filter(lambda ps: ps[0] != "")

FAST = settings(max_examples=200, deadline=None)


# ----------------------------------------------------------------------- sanity checks


def test_reference_matcher_agrees_with_spec_examples() -> None:
    # The reference is the oracle below, so check it against the spec on its own too.
    assert ref_matches("sport/tennis/player1/#", "sport/tennis/player1", "mqtt")
    assert not ref_matches("sport/+", "sport", "mqtt")
    assert ref_matches("+/+", "/finance", "mqtt")
    assert not ref_matches("#", "$SYS/x", "mqtt")
    assert not ref_matches("a/>", "a", "smf")
    assert ref_matches("a/>", "a/b/c", "smf")
    assert ref_valid_mqtt_pattern("a/+/#")
    assert not ref_valid_mqtt_pattern("a/#/b")


# ------------------------------------------------------------------------- validation


class TestValidateTopic:
    @pytest.mark.parametrize("syntax", ["smf", "mqtt"])
    @pytest.mark.parametrize("name", ["a", "a/b", "/a", "a/", "a//b", "/", "$SYS/x", "é/ü"])
    def test_valid(self, name: str, syntax: str) -> None:
        validate_topic(name, syntax)

    @pytest.mark.parametrize("syntax", ["smf", "mqtt"])
    def test_empty(self, syntax: str) -> None:
        with pytest.raises(TopicError, match="empty"):
            validate_topic("", syntax)

    def test_nul_reports_offset(self) -> None:
        with pytest.raises(TopicError, match=r"U\+0000 at character offset 2"):
            validate_topic("a/\x00b")

    def test_length_limit_is_in_utf8_bytes(self) -> None:
        validate_topic("a" * MAX_TOPIC_BYTES)
        with pytest.raises(TopicError, match="65536 UTF-8 bytes"):
            validate_topic("a" * (MAX_TOPIC_BYTES + 1))
        validate_topic("é" * (MAX_TOPIC_BYTES // 2))  # 65534 bytes
        with pytest.raises(TopicError, match="65536 UTF-8 bytes"):
            validate_topic("é" * (MAX_TOPIC_BYTES // 2 + 1))

    def test_long_name_message_is_truncated(self) -> None:
        with pytest.raises(TopicError) as info:
            validate_topic("a" * 70000)
        assert len(str(info.value)) < 300

    def test_lone_surrogate(self) -> None:
        with pytest.raises(TopicError, match="not valid UTF-8"):
            validate_topic("a/\ud800")

    @pytest.mark.parametrize("name", ["a/+", "+", "a/#", "#", "a/b+c", "x#"])
    def test_mqtt_name_rejects_wildcards(self, name: str) -> None:
        with pytest.raises(TopicError, match="wildcard"):
            validate_topic(name, "mqtt")
        validate_topic(name, "smf")  # literal characters in Solace

    @pytest.mark.parametrize("name", ["a/*", "a/>", "*", ">"])
    def test_star_and_gt_are_literal_in_names(self, name: str) -> None:
        validate_topic(name, "smf")
        validate_topic(name, "mqtt")

    def test_mqtt_wildcard_message_says_where(self) -> None:
        with pytest.raises(TopicError, match=r"'\+' at character offset 4 \(level 3\)"):
            validate_topic("a/b/+", "mqtt")

    def test_unknown_syntax(self) -> None:
        with pytest.raises(ValueError, match="unknown topic syntax"):
            validate_topic("a", "amqp")

    def test_not_a_string(self) -> None:
        with pytest.raises(TypeError):
            validate_topic(b"a")  # type: ignore[arg-type]


class TestParsePattern:
    def test_smf_tokens(self) -> None:
        assert parse_pattern("a/*/ab*/a*b/>") == (
            ("lit", "a"),
            ("one",),
            ("prefix", "ab"),
            ("lit", "a*b"),
            ("1+",),
        )

    def test_smf_literal_wildcard_lookalikes(self) -> None:
        assert parse_pattern("a/>/b") == (("lit", "a"), ("lit", ">"), ("lit", "b"))
        assert parse_pattern("a/b>") == (("lit", "a"), ("lit", "b>"))
        assert parse_pattern("+/#") == (("lit", "+"), ("lit", "#"))
        assert parse_pattern("a**") == (("prefix", "a*"),)

    def test_mqtt_tokens(self) -> None:
        assert parse_pattern("a/+/#", "mqtt") == (("lit", "a"), ("one",), ("0+",))
        assert parse_pattern("#", "mqtt") == (("0+",),)
        assert parse_pattern("*/a*/>", "mqtt") == (("lit", "*"), ("lit", "a*"), ("lit", ">"))

    def test_both_syntaxes_share_tokens(self) -> None:
        assert parse_pattern("a/+", "mqtt") == parse_pattern("a/*", "smf")
        assert parse_pattern("a//b", "mqtt") == parse_pattern("a//b", "smf")

    @pytest.mark.parametrize(
        ("pattern", "where"),
        [
            ("a+", r"'\+' must occupy a whole level, but level 1 is 'a\+'"),
            ("a/+b/c", r"level 2 is '\+b'"),
            ("a#", r"'#' must occupy a whole level"),
            ("a/#/b", r"'#' must be the last level, but it is level 2 of 3"),
            ("#/#", r"'#' must be the last level"),
            ("sport/tennis#", r"'#' must occupy a whole level"),
            ("sport/tennis/#/ranking", r"'#' must be the last level"),
        ],
    )
    def test_invalid_mqtt_patterns(self, pattern: str, where: str) -> None:
        with pytest.raises(TopicError, match=where):
            parse_pattern(pattern, "mqtt")
        parse_pattern(pattern, "smf")  # all literal in Solace syntax

    @pytest.mark.parametrize("syntax", ["smf", "mqtt"])
    def test_common_rules_apply_to_patterns(self, syntax: str) -> None:
        for bad in ["", "a\x00", "a" * (MAX_TOPIC_BYTES + 1), "\udfff"]:
            with pytest.raises(TopicError):
                parse_pattern(bad, syntax)
        parse_pattern("a" * MAX_TOPIC_BYTES, syntax)

    def test_unknown_syntax(self) -> None:
        with pytest.raises(ValueError, match="unknown topic syntax"):
            parse_pattern("a", "nats")

    @FAST
    @given(st.lists(st.sampled_from([*MQTT_BODY_LEVELS, "#", "a+", "+a", "a#", "#b"])))
    def test_mqtt_validity_matches_reference(self, levels: list[str]) -> None:
        pattern = "/".join(levels)
        if not pattern:
            return
        if ref_valid_mqtt_pattern(pattern):
            assert len(parse_pattern(pattern, "mqtt")) == len(levels)
        else:
            with pytest.raises(TopicError):
                parse_pattern(pattern, "mqtt")


# --------------------------------------------------------------------- matching rules

MATCH_CASES = [
    # MQTT 3.1.1 section 4.7 examples
    ("sport/tennis/player1/#", "mqtt", "sport/tennis/player1", True),
    ("sport/tennis/player1/#", "mqtt", "sport/tennis/player1/ranking", True),
    ("sport/tennis/player1/#", "mqtt", "sport/tennis/player1/score/wimbledon", True),
    ("sport/tennis/player1/#", "mqtt", "sport/tennis/player2", False),
    ("sport/#", "mqtt", "sport", True),
    ("#", "mqtt", "sport/tennis", True),
    ("#", "mqtt", "/", True),
    ("sport/tennis/+", "mqtt", "sport/tennis/player1", True),
    ("sport/tennis/+", "mqtt", "sport/tennis/player1/ranking", False),
    ("sport/+", "mqtt", "sport", False),
    ("sport/+", "mqtt", "sport/", True),
    ("+/+", "mqtt", "/finance", True),
    ("/+", "mqtt", "/finance", True),
    ("+", "mqtt", "/finance", False),
    ("+/tennis/#", "mqtt", "sport/tennis", True),
    ("a//b", "mqtt", "a//b", True),
    ("a//b", "mqtt", "a/b", False),
    # $ topics (MQTT 3.1.1 section 4.7.2)
    ("#", "mqtt", "$SYS/x", False),
    ("#", "mqtt", "$SYS", False),
    ("+/monitor/Clients", "mqtt", "$SYS/monitor/Clients", False),
    ("$SYS/#", "mqtt", "$SYS/x", True),
    ("$SYS/#", "mqtt", "$SYS", True),
    ("$SYS/monitor/+", "mqtt", "$SYS/monitor/Clients", True),
    ("a/+", "mqtt", "a/$x", True),  # only the first level is special
    ("a/#", "mqtt", "a/$x/y", True),
    # * and > are literals in MQTT
    ("a/*", "mqtt", "a/b", False),
    ("a/*", "mqtt", "a/*", True),
    ("a/>", "mqtt", "a/b", False),
    ("a/>", "mqtt", "a/>", True),
    # Solace one-level and multi-level wildcards
    ("a/*", "smf", "a/b", True),
    ("a/*", "smf", "a/", True),
    ("a/*", "smf", "a", False),
    ("a/*", "smf", "a/b/c", False),
    ("a/>", "smf", "a", False),
    ("a/>", "smf", "a/b", True),
    ("a/>", "smf", "a/b/c", True),
    ("a/>", "smf", "a/", True),
    (">", "smf", "a", True),
    (">", "smf", "a/b", True),
    ("*/b", "smf", "a/b", True),
    ("a/*/c", "smf", "a/b/c", True),
    ("a/*/>", "smf", "a/b", False),
    ("a/*/>", "smf", "a/b/c/d", True),
    # Solace prefix wildcard and literal stars
    ("ab*", "smf", "ab", True),
    ("ab*", "smf", "abc", True),
    ("ab*", "smf", "a", False),
    ("ab*", "smf", "ab/c", False),
    ("x/ab*/y", "smf", "x/abz/y", True),
    ("x/ab*/y", "smf", "x/b/y", False),
    ("a*b", "smf", "a*b", True),
    ("a*b", "smf", "axb", False),
    ("a*b", "smf", "ab", False),
    ("a**", "smf", "a*x", True),
    ("a**", "smf", "ax", False),
    # > that is not the whole last level is literal; + and # are literal in Solace
    ("a/>/b", "smf", "a/x/b", False),
    ("a/>/b", "smf", "a/>/b", True),
    ("a/b>", "smf", "a/b>", True),
    ("a/b>", "smf", "a/bc", False),
    ("a/+", "smf", "a/b", False),
    ("a/+", "smf", "a/+", True),
    ("a/#", "smf", "a", False),
    ("a/#", "smf", "a/#", True),
    # $ topics in Solace syntax
    ("*", "smf", "$s", False),
    (">", "smf", "$SYS/x", False),
    ("*/x", "smf", "$SYS/x", False),
    ("a*", "smf", "$a", False),
    ("$*", "smf", "$SYS", True),
    ("$SYS*", "smf", "$SYS", True),
    ("$SYS*", "smf", "$SYSx", True),
    ("$SYS/>", "smf", "$SYS/x", True),
    ("a/*", "smf", "a/$x", True),
]


@pytest.mark.parametrize(("pattern", "syntax", "topic", "expected"), MATCH_CASES)
def test_match_rules(pattern: str, syntax: str, topic: str, expected: bool) -> None:
    assert ref_matches(pattern, topic, syntax) is expected
    assert pattern_matches(pattern, topic, syntax) is expected
    trie: SubscriptionTrie[str] = SubscriptionTrie()
    trie.add(pattern, "v", syntax)
    assert trie.match(topic) == (frozenset({"v"}) if expected else frozenset())


def test_pattern_matches_validates() -> None:
    with pytest.raises(TopicError):
        pattern_matches("a/#/b", "a/x/b", "mqtt")
    with pytest.raises(TopicError):
        pattern_matches("a", "")
    with pytest.raises(TopicError):
        pattern_matches("a", "a\x00")


# ------------------------------------------------------------------------- trie units


def test_add_remove_return_values_and_len() -> None:
    trie: SubscriptionTrie[str] = SubscriptionTrie()
    assert len(trie) == 0
    assert trie.add("a/b", "q1")
    assert not trie.add("a/b", "q1")
    assert trie.add("a/b", "q2")
    assert trie.add("a/b", "q1", "mqtt")  # same text, other syntax: separate entry
    assert len(trie) == 3
    assert trie.match("a/b") == {"q1", "q2"}
    assert trie.remove("a/b", "q1")
    assert not trie.remove("a/b", "q1")
    assert trie.match("a/b") == {"q1", "q2"}  # still there via the mqtt entry
    assert trie.remove("a/b", "q1", "mqtt")
    assert trie.match("a/b") == {"q2"}
    assert not trie.remove("x/y", "q2")
    assert len(trie) == 1


def test_equivalent_patterns_across_syntaxes_are_two_entries() -> None:
    trie: SubscriptionTrie[str] = SubscriptionTrie()
    assert trie.add("a/+", "v", "mqtt")
    assert trie.add("a/*", "v", "smf")
    assert len(trie) == 2
    assert trie.match("a/b") == {"v"}
    assert trie.remove("a/+", "v", "mqtt")
    assert trie.match("a/b") == {"v"}
    assert trie.remove("a/*", "v", "smf")
    assert trie.match("a/b") == frozenset()
    assert len(trie) == 0


def test_entries_in_insertion_order_and_snapshot() -> None:
    trie: SubscriptionTrie[int] = SubscriptionTrie()
    trie.add("a/#", 1, "mqtt")
    trie.add("a/>", 2)
    trie.add("b", 3)
    assert list(trie.entries()) == [("a/#", "mqtt", 1), ("a/>", "smf", 2), ("b", "smf", 3)]
    for pattern, syntax, value in trie.entries():  # removing while iterating is fine
        trie.remove(pattern, value, syntax)
    assert len(trie) == 0


def test_invalid_patterns_raise_and_leave_trie_unchanged() -> None:
    trie: SubscriptionTrie[str] = SubscriptionTrie()
    trie.add("a", "v")
    for bad in ["a/#/b", "a+", ""]:
        with pytest.raises(TopicError):
            trie.add(bad, "v", "mqtt")
        with pytest.raises(TopicError):
            trie.remove(bad, "v", "mqtt")
    with pytest.raises(ValueError):
        trie.add("a", "v", "MQTT")
    assert list(trie.entries()) == [("a", "smf", "v")]


def test_match_validates_topic() -> None:
    trie: SubscriptionTrie[str] = SubscriptionTrie()
    trie.add(">", "v")
    for bad in ["", "a\x00b", "a" * (MAX_TOPIC_BYTES + 1), "\ud800"]:
        with pytest.raises(TopicError):
            trie.match(bad)
    assert trie.match("a/+") == {"v"}  # syntax-specific checks are the caller's job


def test_clear() -> None:
    trie: SubscriptionTrie[str] = SubscriptionTrie()
    trie.add("a/#", "v", "mqtt")
    assert trie.match("a/b") == {"v"}
    trie.clear()
    assert len(trie) == 0
    assert trie.match("a/b") == frozenset()
    assert list(trie.entries()) == []


def test_many_prefixes_and_short_levels_take_both_prefix_paths() -> None:
    trie: SubscriptionTrie[str] = SubscriptionTrie()
    names = [f"u{i}" for i in range(50)]
    for name in names:
        trie.add(f"x/{name}*", name)
    assert trie.match("x/u1") == {"u1"}  # few level chars: probe level prefixes
    assert trie.match("x/u12") == {"u1", "u12"}
    long_level = "u1" + "z" * 100  # more level chars than prefixes: scan prefixes
    assert trie.match(f"x/{long_level}") == {"u1"}
    assert trie.match("x/v") == frozenset()
    trie.add("x/u*", "u")  # one-character prefix, found by probing level[:1]
    assert trie.match("x/u1") == {"u", "u1"}


def test_cache_hits_and_is_invalidated() -> None:
    trie: SubscriptionTrie[str] = SubscriptionTrie()
    trie.add("a/*", "v1")
    first = trie.match("a/b")
    assert trie.match("a/b") is first  # served from the cache
    trie.add("a/b", "v2")
    assert trie.match("a/b") == {"v1", "v2"}
    trie.remove("a/*", "v1")
    assert trie.match("a/b") == {"v2"}
    trie.add("a/b", "v2")  # no-op add keeps the (still correct) cache
    assert trie.match("a/b") == {"v2"}


def test_cache_is_bounded() -> None:
    trie: SubscriptionTrie[int] = SubscriptionTrie(cache_size=8)
    trie.add(">", 1)
    for i in range(100):
        assert trie.match(f"t/{i}") == {1}
        assert len(trie._cache) <= 8
    # Recently used topics survive an eviction round; results stay right either way.
    assert "t/99" in trie._cache
    assert all(trie.match(f"t/{i}") == {1} for i in range(100))


def test_cache_disabled() -> None:
    trie: SubscriptionTrie[int] = SubscriptionTrie(cache_size=0)
    trie.add("a", 1)
    assert trie.match("a") == {1}
    assert trie._cache == {}
    with pytest.raises(ValueError):
        SubscriptionTrie(cache_size=-1)


def test_values_can_be_any_hashable() -> None:
    trie: SubscriptionTrie[tuple[str, int]] = SubscriptionTrie()
    trie.add("a/b", ("queue", 1))
    trie.add("a/#", ("sub", 7), "mqtt")
    assert trie.match("a/b") == {("queue", 1), ("sub", 7)}


def _trie_is_pruned(trie: SubscriptionTrie) -> bool:
    # White-box: after removing everything no node may be left behind.
    return trie._root.is_empty()


def test_remove_prunes_nodes() -> None:
    trie: SubscriptionTrie[str] = SubscriptionTrie()
    trie.add("a/b/c/d", "v")
    trie.add("a/b/x", "v")
    trie.add("a/*/ab*/>", "v")
    trie.add("a/+/#", "v", "mqtt")
    trie.remove("a/b/c/d", "v")
    assert "c" not in trie._root.lits["a"].lits["b"].lits  # pruned up to the shared node
    trie.remove("a/b/x", "v")
    assert "b" not in trie._root.lits["a"].lits
    trie.remove("a/*/ab*/>", "v")
    one = trie._root.lits["a"].one
    assert one is not None
    assert one.prefixes is None
    trie.remove("a/+/#", "v", "mqtt")
    assert _trie_is_pruned(trie)


# ---------------------------------------------------------------- property-based tests


@FAST
@given(
    entries=st.lists(patterns, min_size=1, max_size=8),
    probe=st.lists(topics, min_size=1, max_size=10),
)
def test_trie_agrees_with_reference(entries: list[tuple[str, str]], probe: list[str]) -> None:
    trie: SubscriptionTrie[int] = SubscriptionTrie()
    model = set()
    for value, (pattern, syntax) in enumerate(entries):
        assert trie.add(pattern, value, syntax)
        model.add((pattern, syntax, value))
    for topic in probe:
        expected = ref_match_all(model, topic)
        assert trie.match(topic) == expected, topic
        assert trie.match(topic) == expected, topic  # cached path too
        for pattern, syntax, value in model:
            assert pattern_matches(pattern, topic, syntax) is (value in expected)


@FAST
@given(pattern=patterns, topic=topics)
def test_single_pattern_agrees_with_reference(pattern: tuple[str, str], topic: str) -> None:
    text, syntax = pattern
    expected = ref_matches(text, topic, syntax)
    assert pattern_matches(text, topic, syntax) is expected
    trie: SubscriptionTrie[str] = SubscriptionTrie()
    trie.add(text, "v", syntax)
    assert ("v" in trie.match(topic)) is expected


@FAST
@given(
    entries=st.lists(st.tuples(patterns, st.integers(0, 3)), min_size=1, max_size=10, unique=True),
    probe=st.lists(topics, min_size=1, max_size=5),
    seed=st.randoms(use_true_random=False),
)
def test_add_then_remove_restores_empty(
    entries: list[tuple[tuple[str, str], int]], probe: list[str], seed: random.Random
) -> None:
    trie: SubscriptionTrie[int] = SubscriptionTrie()
    for (pattern, syntax), value in entries:
        assert trie.add(pattern, value, syntax)
    for topic in probe:
        trie.match(topic)  # fill the cache so removal has something to invalidate
    order = list(entries)
    seed.shuffle(order)
    for (pattern, syntax), value in order:
        assert trie.remove(pattern, value, syntax)
    assert len(trie) == 0
    assert list(trie.entries()) == []
    assert _trie_is_pruned(trie)
    for topic in probe:
        assert trie.match(topic) == frozenset()


@FAST
@given(
    prefixes=st.lists(st.text("ab$*", min_size=1, max_size=3), min_size=1, max_size=8),
    probe=st.lists(st.text("ab$*", max_size=4), min_size=1, max_size=8),
)
def test_prefix_wildcards_agree_with_reference(prefixes: list[str], probe: list[str]) -> None:
    # Many prefix wildcards on one level exercise both prefix lookup strategies.
    trie: SubscriptionTrie[str] = SubscriptionTrie()
    model = set()
    for prefix in prefixes:
        for pattern in (f"{prefix}*", f"x/{prefix}*", f"x/{prefix}*/>"):
            trie.add(pattern, pattern)
            model.add((pattern, "smf", pattern))
    for level in probe:
        for topic in (level, f"x/{level}", f"x/{level}/y"):
            if topic:
                assert trie.match(topic) == ref_match_all(model, topic), topic


class TrieMachine(RuleBasedStateMachine):
    """Interleaves add/remove/match/clear and compares every match with the reference."""

    added = Bundle("added")

    def __init__(self) -> None:
        super().__init__()
        self.trie: SubscriptionTrie[int] = SubscriptionTrie()
        self.model: set[tuple[str, str, int]] = set()

    @initialize(cache_size=st.sampled_from([1, 3, 4096]))
    def make_trie(self, cache_size: int) -> None:
        self.trie = SubscriptionTrie(cache_size=cache_size)

    @rule(target=added, pattern=patterns, value=st.integers(0, 3))
    def add(self, pattern: tuple[str, str], value: int) -> tuple[str, str, int]:
        text, syntax = pattern
        entry = (text, syntax, value)
        assert self.trie.add(text, value, syntax) is (entry not in self.model)
        self.model.add(entry)
        return entry

    @rule(entry=added)
    def remove_added(self, entry: tuple[str, str, int]) -> None:
        text, syntax, value = entry
        assert self.trie.remove(text, value, syntax) is (entry in self.model)
        self.model.discard(entry)

    @rule(pattern=patterns, value=st.integers(0, 3))
    def remove_any(self, pattern: tuple[str, str], value: int) -> None:
        text, syntax = pattern
        entry = (text, syntax, value)
        assert self.trie.remove(text, value, syntax) is (entry in self.model)
        self.model.discard(entry)

    @rule(topic=topics)
    def match(self, topic: str) -> None:
        assert self.trie.match(topic) == ref_match_all(self.model, topic)

    @rule(topic=topics)
    def match_twice(self, topic: str) -> None:
        expected = ref_match_all(self.model, topic)
        assert self.trie.match(topic) == expected
        assert self.trie.match(topic) == expected

    @rule(roll=st.integers(0, 4))
    def clear(self, roll: int) -> None:
        if roll == 0:  # keep clears rare so state can build up
            self.trie.clear()
            self.model.clear()

    @invariant()
    def sizes_agree(self) -> None:
        assert len(self.trie) == len(self.model)
        assert set(self.trie.entries()) == self.model
        if not self.model:
            assert _trie_is_pruned(self.trie)


TrieMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_trie_state_machine = TrieMachine.TestCase
