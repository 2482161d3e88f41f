"""JMS / Solace SQL-92 message selectors.

A selector is parsed once by :func:`compile_selector` into a :class:`Selector`, whose
``matches`` method evaluates a tree of Python closures against one message.  User
text is never passed to ``eval``/``exec``; literals become closure constants.

Grammar (JMS 2.0 section 3.8.1), lowest to highest precedence::

    OR
    AND
    NOT
    =  <>  <  <=  >  >=  [NOT] BETWEEN a AND b  [NOT] IN ('x', ...)
        [NOT] LIKE 'pattern' [ESCAPE 'c']  IS [NOT] NULL        (non-associative)
    +  -                                                      (left-associative)
    *  /                                                      (left-associative)
    unary +  -
    literal | identifier | ( expression )

Literals: ``'string'`` (``''`` is an embedded quote); exact numerics in Java integer syntax
(``57``, ``-957``, ``+62``, ``57L``, hex ``0x1F``, octal ``017``; magnitude below ``2**64``);
approximate numerics (``7E3``, ``-57.9E2``, ``7.``, ``.5``, ``1.0e-3``); ``TRUE``/``FALSE``.
Keywords are case-insensitive, identifiers (Java identifier rules) case-sensitive.

Semantics:

* Three-valued (Kleene) logic: a NULL (absent) operand makes a comparison or an
  arithmetic result UNKNOWN; a message is selected only if the selector is TRUE.
* Only like types compare: numbers (``int``/``float``, with numeric promotion) with
  numbers, strings with strings, booleans with booleans.  Strings and booleans only
  support ``=`` and ``<>``.  Comparing anything else (other types, ``bytes`` or other
  unsupported value types) is FALSE, as JMS 2.0 §3.8.1.1 says (so ``NOT (a = 'x')`` is
  TRUE for a number ``a``); so are ``[NOT] BETWEEN`` on a value that is not a number and
  ``LIKE`` on one that is not a string (``NOT LIKE`` is its negation: TRUE), while
  ``[NOT] IN`` on one that is not a string is UNKNOWN, and an identifier used as a
  condition whose value is not a boolean is FALSE (``NOT urgent`` is TRUE for
  ``urgent = 'yes'``), as Qpid Broker-J and ActiveMQ evaluate them.  ``bool`` values are
  booleans, never numbers.
* Integer arithmetic is exact; ``/`` on two integers truncates toward zero (Java
  semantics).  Division by zero, and an integer result outside
  ``[-2**63, 2**64)`` (the signed/unsigned 64-bit range), are UNKNOWN.
* ``IS NULL`` is TRUE when the identifier is absent (the lookup returns ``None``).
* An empty or all-whitespace selector means "no selector" and matches every message.

Statically detectable type errors (``'a' + 1``, ``NOT 5``, ``'a' < 'b'``, a selector
that is not a boolean expression) are rejected at compile time with
:class:`SelectorError`; identifiers are dynamically typed and checked at run time.
"""

from __future__ import annotations

import functools
import math
import operator
import re
import unicodedata
from collections.abc import Callable, Mapping
from typing import Any, Final

__all__ = [
    "HEADER_FIELDS",
    "MAX_DEPTH",
    "MAX_SELECTOR_BYTES",
    "Lookup",
    "Selector",
    "SelectorError",
    "compile_selector",
    "make_lookup",
]

#: Maximum selector length in UTF-8 bytes.
MAX_SELECTOR_BYTES: Final = 1023
#: Maximum expression nesting (parse recursion and expression-tree depth).
MAX_DEPTH: Final = 100

#: Identifiers that resolve from message headers; every other identifier is a user property.
HEADER_FIELDS: Final[frozenset[str]] = frozenset(
    {
        "JMSPriority",
        "JMSCorrelationID",
        "JMSMessageID",
        "JMSType",
        "JMSTimestamp",
        "JMSDeliveryMode",
        "JMSExpiration",
        "JMSXGroupID",
        "JMSXDeliveryCount",
    }
)

Lookup = Callable[[str], object | None]
_Fn = Callable[[Lookup], Any]

_INT_MIN: Final = -(2**63)
_INT_MAX: Final = 2**64 - 1


class SelectorError(ValueError):
    """Invalid selector; ``position`` is the 0-based character offset of the problem."""

    def __init__(self, message: str, position: int) -> None:
        super().__init__(f"{message} at position {position}")
        self.reason = message
        self.position = position

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.reason, self.position))


# --------------------------------------------------------------------------- tokens

_KEYWORDS: Final = frozenset(
    {"NULL", "TRUE", "FALSE", "NOT", "AND", "OR", "BETWEEN", "LIKE", "IN", "IS", "ESCAPE"}
)
_WS: Final = frozenset(" \t\n\r\f\v")
_OPS1: Final = frozenset("=<>+-*/(),")
_HEX: Final = frozenset("0123456789abcdefABCDEF")
_OCT: Final = frozenset("01234567")
_ID_START_CATS: Final = frozenset({"Lu", "Ll", "Lt", "Lm", "Lo", "Nl", "Sc", "Pc"})
_ID_PART_CATS: Final = _ID_START_CATS | {"Nd", "Mn", "Mc"}

_EOF, _NUM, _STR, _IDENT, _KW, _OP = "eof", "num", "str", "ident", "kw", "op"


class _Tok:
    __slots__ = ("kind", "pos", "text", "value")

    def __init__(self, kind: str, value: Any, pos: int, text: str) -> None:
        self.kind = kind
        self.value = value
        self.pos = pos
        self.text = text

    def is_op(self, op: str) -> bool:
        return self.kind == _OP and self.value == op

    def is_kw(self, kw: str) -> bool:
        return self.kind == _KW and self.value == kw


def _describe(s: str) -> str:
    if len(s) > 32:
        s = s[:29] + "..."
    return f"'{s}'" if s.isprintable() else repr(s)


def _is_digit(ch: str) -> bool:
    return "0" <= ch <= "9"


def _is_id_start(ch: str) -> bool:
    if ch < "\x80":
        return ch.isalpha() or ch == "_" or ch == "$"
    return unicodedata.category(ch) in _ID_START_CATS


def _is_id_part(ch: str) -> bool:
    if ch < "\x80":
        return ch.isalnum() or ch == "_" or ch == "$"
    return unicodedata.category(ch) in _ID_PART_CATS


def _scan_number(text: str, start: int) -> tuple[int | float, int]:
    n = len(text)
    j = start
    value: int | float
    if text[j] == "0" and j + 1 < n and text[j + 1] in "xX":
        j += 2
        while j < n and text[j] in _HEX:
            j += 1
        if j == start + 2:
            raise SelectorError("invalid hexadecimal literal", start)
        value = int(text[start + 2 : j], 16)
        if j < n and text[j] in "lL":
            j += 1
    else:
        is_float = False
        while j < n and _is_digit(text[j]):
            j += 1
        if j < n and text[j] == ".":
            is_float = True
            j += 1
            while j < n and _is_digit(text[j]):
                j += 1
        if j < n and text[j] in "eE":
            k = j + 1
            if k < n and text[k] in "+-":
                k += 1
            if not (k < n and _is_digit(text[k])):
                raise SelectorError("invalid numeric literal", start)
            while k < n and _is_digit(text[k]):
                k += 1
            j = k
            is_float = True
        if is_float:
            value = float(text[start:j])
            if math.isinf(value):
                raise SelectorError("approximate numeric literal out of range", start)
        else:
            digits = text[start:j]
            if len(digits) > 1 and digits[0] == "0":  # Java octal literal, e.g. 017 == 15
                if not all(c in _OCT for c in digits):
                    raise SelectorError("invalid octal literal", start)
                value = int(digits, 8)
            else:
                value = int(digits)
            if j < n and text[j] in "lL":
                j += 1
    if type(value) is int and value > _INT_MAX:
        raise SelectorError("exact numeric literal out of range", start)
    if j < n and (_is_id_part(text[j]) or text[j] in ".'"):
        raise SelectorError("invalid numeric literal", start)
    return value, j


def _tokenize(text: str) -> list[_Tok]:
    out: list[_Tok] = []
    n = len(text)
    i = 0
    while i < n:
        ch = text[i]
        if ch in _WS:
            i += 1
            continue
        start = i
        if ch == "'":
            parts: list[str] = []
            j = i + 1
            while True:
                k = text.find("'", j)
                if k < 0:
                    raise SelectorError("unterminated string literal", start)
                parts.append(text[j:k])
                if k + 1 < n and text[k + 1] == "'":
                    parts.append("'")
                    j = k + 2
                    continue
                i = k + 1
                break
            out.append(_Tok(_STR, "".join(parts), start, text[start:i]))
        elif _is_digit(ch) or (ch == "." and i + 1 < n and _is_digit(text[i + 1])):
            value, i = _scan_number(text, i)
            out.append(_Tok(_NUM, value, start, text[start:i]))
        elif _is_id_start(ch):
            j = i + 1
            while j < n and _is_id_part(text[j]):
                j += 1
            word = text[i:j]
            upper = word.upper()
            if word.isascii() and upper in _KEYWORDS:
                out.append(_Tok(_KW, upper, start, word))
            else:
                out.append(_Tok(_IDENT, word, start, word))
            i = j
        elif text.startswith(("<>", "<=", ">="), i):
            out.append(_Tok(_OP, text[i : i + 2], start, text[i : i + 2]))
            i += 2
        elif ch in _OPS1:
            out.append(_Tok(_OP, ch, start, ch))
            i += 1
        else:
            raise SelectorError(f"unexpected character {_describe(ch)}", i)
    out.append(_Tok(_EOF, None, n, ""))
    return out


# --------------------------------------------------------------------------- AST

_T_BOOL, _T_NUM, _T_STR, _T_ANY = "boolean", "numeric", "string", "any"
_CMP_OPS: Final = frozenset({"=", "<>", "<", "<=", ">", ">="})
_ORDERING: Final = frozenset({"<", "<=", ">", ">="})


class _Node:
    __slots__ = ("args", "constant", "depth", "kind", "pos", "stype")

    def __init__(
        self, kind: str, stype: str, pos: int, args: tuple[Any, ...], children: list[_Node]
    ) -> None:
        self.kind = kind
        self.stype = stype
        self.pos = pos
        self.args = args
        self.constant = kind == "const" or (kind != "ident" and all(c.constant for c in children))
        self.depth = 1 + max((c.depth for c in children), default=0)
        if self.depth > MAX_DEPTH:
            raise SelectorError(f"selector nesting exceeds {MAX_DEPTH} levels", pos)

    def add_child(self, child: _Node) -> None:
        """Account for a child appended to an n-ary chain node."""
        self.constant = self.constant and child.constant
        self.depth = max(self.depth, 1 + child.depth)
        if self.depth > MAX_DEPTH:
            raise SelectorError(f"selector nesting exceeds {MAX_DEPTH} levels", child.pos)


def _const_type(value: object) -> str:
    if type(value) is bool:
        return _T_BOOL
    if type(value) is str:
        return _T_STR
    return _T_NUM


# --------------------------------------------------------------------------- LIKE

_ANY1: Final = object()


class _Seg:
    """A fixed-width LIKE segment (no '%'): a literal string or a '_'-containing regex."""

    __slots__ = ("lit", "rx", "width")

    def __init__(self, items: list[Any]) -> None:
        self.width = len(items)
        self.lit = ""
        self.rx: re.Pattern[str] | None = None
        if any(it is _ANY1 for it in items):
            self.rx = re.compile(
                "".join("." if it is _ANY1 else re.escape(it) for it in items), re.DOTALL
            )
        else:
            self.lit = "".join(items)

    def at(self, s: str, pos: int) -> bool:
        if self.rx is None:
            return s.startswith(self.lit, pos)
        return self.rx.match(s, pos) is not None

    def find(self, s: str, pos: int, end: int) -> int:
        if self.rx is None:
            return s.find(self.lit, pos, end)
        m = self.rx.search(s, pos, end)
        return -1 if m is None else m.start()


def _compile_like(pattern: str, escape: str | None, pos: int) -> Callable[[str], bool]:
    """Compile a LIKE pattern into a predicate without backtracking regexes.

    The pattern is split on '%' into fixed-width segments; the first is anchored at the
    start, the last at the end and the middle ones are matched leftmost-first, which is
    exact for patterns made of fixed-width pieces and any-sequence wildcards.
    """
    segments: list[list[Any]] = [[]]
    i = 0
    n = len(pattern)
    while i < n:
        ch = pattern[i]
        if escape is not None and ch == escape:
            if i + 1 >= n:
                raise SelectorError("LIKE pattern ends with the escape character", pos)
            segments[-1].append(pattern[i + 1])
            i += 2
            continue
        if ch == "%":
            segments.append([])
        elif ch == "_":
            segments[-1].append(_ANY1)
        else:
            segments[-1].append(ch)
        i += 1

    segs = [_Seg(items) for items in segments]
    if len(segs) == 1:
        only = segs[0]
        if only.rx is None:
            lit = only.lit
            return lambda s: s == lit
        rx, width = only.rx, only.width
        return lambda s: len(s) == width and rx.fullmatch(s) is not None

    first, last = segs[0], segs[-1]
    mids = [s for s in segs[1:-1] if s.width]
    min_len = sum(s.width for s in segs)
    if not mids and first.rx is None and last.rx is None:
        prefix, suffix = first.lit, last.lit
        if not suffix:
            return lambda s: s.startswith(prefix)
        if not prefix:
            return lambda s: s.endswith(suffix)
        return lambda s: len(s) >= min_len and s.startswith(prefix) and s.endswith(suffix)

    def match(s: str) -> bool:
        n = len(s)
        if n < min_len:
            return False
        if first.width and not first.at(s, 0):
            return False
        end = n - last.width
        if last.width and not last.at(s, end):
            return False
        p = first.width
        for seg in mids:
            k = seg.find(s, p, end)
            if k < 0:
                return False
            p = k + seg.width
        return True

    return match


# --------------------------------------------------------------------------- parser


class _Parser:
    def __init__(self, tokens: list[_Tok]) -> None:
        self.toks = tokens
        self.i = 0
        self.depth = 0
        self.idents: set[str] = set()

    def peek(self) -> _Tok:
        return self.toks[self.i]

    def advance(self) -> _Tok:
        tok = self.toks[self.i]
        if tok.kind != _EOF:
            self.i += 1
        return tok

    @staticmethod
    def unexpected(tok: _Tok) -> SelectorError:
        if tok.kind == _EOF:
            return SelectorError("unexpected end of selector", tok.pos)
        return SelectorError(f"unexpected token {_describe(tok.text)}", tok.pos)

    @staticmethod
    def expected(what: str, tok: _Tok) -> SelectorError:
        found = "end of selector" if tok.kind == _EOF else _describe(tok.text)
        return SelectorError(f"expected {what} but found {found}", tok.pos)

    @staticmethod
    def require(node: _Node, allowed: str, what: str) -> None:
        if node.stype != _T_ANY and node.stype != allowed:
            raise SelectorError(f"{what} requires a {allowed} operand, not {node.stype}", node.pos)

    # Binding powers: OR 1, AND 2, NOT 3, comparison 4, + - 5, * / 6, unary 7.
    def parse_expr(self, min_bp: int) -> _Node:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise SelectorError(f"selector nesting exceeds {MAX_DEPTH} levels", self.peek().pos)
        left = self.parse_prefix(min_bp)
        level = 0  # binding power of the node this loop built last (0: none yet)
        while True:
            tok = self.peek()
            if tok.kind == _KW:
                kw = tok.value
                if kw == "OR" or kw == "AND":
                    bp = 1 if kw == "OR" else 2
                    if bp < min_bp:
                        break
                    self.advance()
                    right = self.parse_expr(bp + 1)
                    self.require(right, _T_BOOL, kw)
                    if level == bp:
                        left.args[0].append(right)
                        left.add_child(right)
                    else:
                        self.require(left, _T_BOOL, kw)
                        kind = "or" if kw == "OR" else "and"
                        left = _Node(kind, _T_BOOL, left.pos, ([left, right],), [left, right])
                        level = bp
                    continue
                if kw in ("NOT", "BETWEEN", "LIKE", "IN", "IS"):
                    if min_bp > 4:
                        break
                    negated = False
                    if kw == "NOT":
                        nxt = self.toks[self.i + 1]
                        if not (nxt.kind == _KW and nxt.value in ("BETWEEN", "LIKE", "IN")):
                            break
                        if level == 4:
                            raise self.unexpected(tok)
                        self.advance()
                        negated = True
                        kw = nxt.value
                    elif level == 4:
                        raise self.unexpected(tok)
                    self.advance()
                    left = self.parse_predicate(kw, negated, left)
                    level = 4
                    continue
                break
            if tok.kind == _OP:
                op = tok.value
                if op in _CMP_OPS:
                    if min_bp > 4:
                        break
                    if level == 4:
                        raise self.unexpected(tok)
                    self.advance()
                    right = self.parse_expr(5)
                    if op in _ORDERING:
                        self.require(left, _T_NUM, f"operator '{op}'")
                        self.require(right, _T_NUM, f"operator '{op}'")
                    left = _Node("cmp", _T_BOOL, left.pos, (op, left, right), [left, right])
                    level = 4
                    continue
                if op in ("+", "-", "*", "/"):
                    bp = 5 if op in ("+", "-") else 6
                    if bp < min_bp:
                        break
                    self.advance()
                    right = self.parse_expr(bp + 1)
                    self.require(right, _T_NUM, f"operator '{op}'")
                    if level == bp:
                        left.args[1].append((op, right))
                        left.add_child(right)
                    else:
                        self.require(left, _T_NUM, f"operator '{op}'")
                        left = _Node(
                            "arith", _T_NUM, left.pos, (left, [(op, right)]), [left, right]
                        )
                        level = bp
                    continue
            break
        self.depth -= 1
        return left

    def parse_prefix(self, min_bp: int) -> _Node:
        tok = self.peek()
        kind = tok.kind
        if kind == _IDENT:
            self.advance()
            self.idents.add(tok.value)
            return _Node("ident", _T_ANY, tok.pos, (tok.value,), [])
        if kind in (_NUM, _STR):
            self.advance()
            return _Node("const", _const_type(tok.value), tok.pos, (tok.value,), [])
        if kind == _KW:
            if tok.value in ("TRUE", "FALSE"):
                self.advance()
                return _Node("const", _T_BOOL, tok.pos, (tok.value == "TRUE",), [])
            if tok.value == "NOT" and min_bp <= 3:
                self.advance()
                operand = self.parse_expr(3)
                self.require(operand, _T_BOOL, "NOT")
                return _Node("not", _T_BOOL, tok.pos, (operand,), [operand])
        elif kind == _OP:
            if tok.value == "(":
                self.advance()
                inner = self.parse_expr(0)
                close = self.peek()
                if not close.is_op(")"):
                    raise self.expected("')'", close)
                self.advance()
                return inner
            if tok.value in ("-", "+"):
                self.advance()
                operand = self.parse_expr(7)
                self.require(operand, _T_NUM, f"unary '{tok.value}'")
                if operand.kind == "const":  # fold signed literals such as -957
                    value = -operand.args[0] if tok.value == "-" else operand.args[0]
                    if type(value) is int and not _INT_MIN <= value <= _INT_MAX:
                        raise SelectorError("exact numeric literal out of range", tok.pos)
                    return _Node("const", _T_NUM, tok.pos, (value,), [])
                kind = "neg" if tok.value == "-" else "pos"
                return _Node(kind, _T_NUM, tok.pos, (operand,), [operand])
        raise self.unexpected(tok)

    def parse_predicate(self, kw: str, negated: bool, left: _Node) -> _Node:
        if kw == "BETWEEN":
            self.require(left, _T_NUM, "BETWEEN")
            lo = self.parse_expr(5)
            if not self.peek().is_kw("AND"):
                raise self.expected("AND", self.peek())
            self.advance()
            hi = self.parse_expr(5)
            self.require(lo, _T_NUM, "BETWEEN")
            self.require(hi, _T_NUM, "BETWEEN")
            return _Node("between", _T_BOOL, left.pos, (negated, left, lo, hi), [left, lo, hi])
        if kw == "IN":
            self.require(left, _T_STR, "IN")
            if not self.peek().is_op("("):
                raise self.expected("'('", self.peek())
            self.advance()
            values: set[str] = set()
            while True:
                tok = self.peek()
                if tok.kind != _STR:
                    if tok.kind == _NUM or (tok.kind == _KW and tok.value in ("TRUE", "FALSE")):
                        raise SelectorError("IN list accepts only string literals", tok.pos)
                    raise self.expected("a string literal", tok)
                self.advance()
                values.add(tok.value)
                tok = self.peek()
                if tok.is_op(","):
                    self.advance()
                    continue
                if tok.is_op(")"):
                    self.advance()
                    break
                raise self.expected("',' or ')'", tok)
            return _Node("in", _T_BOOL, left.pos, (negated, left, frozenset(values)), [left])
        if kw == "LIKE":
            self.require(left, _T_STR, "LIKE")
            pat = self.peek()
            if pat.kind != _STR:
                raise self.expected("a string literal pattern", pat)
            self.advance()
            escape: str | None = None
            if self.peek().is_kw("ESCAPE"):
                self.advance()
                esc = self.peek()
                if esc.kind != _STR:
                    raise self.expected("a string literal escape character", esc)
                if len(esc.value) != 1:
                    raise SelectorError("ESCAPE must be a single character", esc.pos)
                self.advance()
                escape = esc.value
            matcher = _compile_like(pat.value, escape, pat.pos)
            return _Node("like", _T_BOOL, left.pos, (negated, left, matcher), [left])
        # IS [NOT] NULL
        neg = False
        if self.peek().is_kw("NOT"):
            self.advance()
            neg = True
        if not self.peek().is_kw("NULL"):
            raise self.expected("NULL", self.peek())
        self.advance()
        return _Node("isnull", _T_BOOL, left.pos, (neg, left), [left])


# --------------------------------------------------------------------------- evaluation


class _Unsupported:
    """A looked-up value of a type selectors do not compare: present (not NULL), and
    like no other value."""


_UNSUPPORTED: Final = _Unsupported()


def _normalize(v: object) -> object:
    """Map a non-exact-typed looked-up value to str/int/float, or _UNSUPPORTED."""
    if isinstance(v, str):
        return str.__str__(v)
    if isinstance(v, int):  # int subclasses such as IntEnum (bool is handled by callers)
        return int.__int__(v)
    if isinstance(v, float):
        return float.__float__(v)
    return _UNSUPPORTED


def _add(a: Any, b: Any) -> Any:
    try:
        r = a + b
    except OverflowError:
        return None
    if type(r) is int and not _INT_MIN <= r <= _INT_MAX:
        return None
    return r


def _sub(a: Any, b: Any) -> Any:
    try:
        r = a - b
    except OverflowError:
        return None
    if type(r) is int and not _INT_MIN <= r <= _INT_MAX:
        return None
    return r


def _mul(a: Any, b: Any) -> Any:
    try:
        r = a * b
    except OverflowError:
        return None
    if type(r) is int and not _INT_MIN <= r <= _INT_MAX:
        return None
    return r


def _div(a: Any, b: Any) -> Any:
    if b == 0:
        return None
    if type(a) is int and type(b) is int:
        q = abs(a) // abs(b)
        r = -q if (a < 0) != (b < 0) else q
        return r if _INT_MIN <= r <= _INT_MAX else None
    try:
        return a / b
    except OverflowError:
        return None


_ARITH: Final = {"+": _add, "-": _sub, "*": _mul, "/": _div}
_CMP_FUNCS: Final = {
    "=": operator.eq,
    "<>": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}
_FLIPPED: Final = {"=": "=", "<>": "<>", "<": ">", "<=": ">=", ">": "<", ">=": "<="}
_KIND: Final = {str: 1, bool: 2, int: 3, float: 3}
_NUM_KIND: Final = 3


def _no_lookup(name: str) -> None:  # pragma: no cover - constant subtrees never look up
    return None


def _const_fn(value: object) -> _Fn:
    return lambda lk: value


def _num_cmp3(f: Callable[[Any, Any], bool], a: Any, b: Any) -> bool | None:
    """Three-valued numeric comparison on normalized values: UNKNOWN with a NULL operand,
    FALSE unless both are numbers."""
    if a is None or b is None:
        return None
    ta, tb = type(a), type(b)
    if (ta is int or ta is float) and (tb is int or tb is float):
        return bool(f(a, b))
    return False


def _ident_value(name: str) -> _Fn:
    def ident(lk: Lookup) -> Any:
        v = lk(name)
        t = type(v)
        if t is str or t is int or t is float or t is bool or v is None:
            return v
        return _normalize(v)

    return ident


def _ident_bool(name: str) -> _Fn:
    def ident_bool(lk: Lookup) -> bool | None:
        v = lk(name)
        return v if v is True or v is False or v is None else False

    return ident_bool


def _compile_bool(node: _Node) -> _Fn:
    """Compile a node whose result must be True, False or None (UNKNOWN)."""
    if node.kind == "ident":
        return _ident_bool(node.args[0])
    return _compile_value(node)  # static typing guarantees a boolean-valued node


def _compile_value(node: _Node) -> _Fn:
    if node.kind == "const":
        return _const_fn(node.args[0])
    if node.kind == "ident":
        return _ident_value(node.args[0])
    fn = _BUILDERS[node.kind](node)
    if node.constant:
        return _const_fn(fn(_no_lookup))
    return fn


def _build_or(node: _Node) -> _Fn:
    children = tuple(_compile_bool(c) for c in node.args[0])
    if len(children) == 2:
        c1, c2 = children

        def or2(lk: Lookup) -> bool | None:
            a = c1(lk)
            if a is True:
                return True
            b = c2(lk)
            if b is True:
                return True
            return False if a is False and b is False else None

        return or2

    def or_n(lk: Lookup) -> bool | None:
        r: bool | None = False
        for c in children:
            v = c(lk)
            if v is True:
                return True
            if v is None:
                r = None
        return r

    return or_n


def _build_and(node: _Node) -> _Fn:
    children = tuple(_compile_bool(c) for c in node.args[0])
    if len(children) == 2:
        c1, c2 = children

        def and2(lk: Lookup) -> bool | None:
            a = c1(lk)
            if a is False:
                return False
            b = c2(lk)
            if b is False:
                return False
            return True if a is True and b is True else None

        return and2

    def and_n(lk: Lookup) -> bool | None:
        r: bool | None = True
        for c in children:
            v = c(lk)
            if v is False:
                return False
            if v is None:
                r = None
        return r

    return and_n


def _build_not(node: _Node) -> _Fn:
    child = _compile_bool(node.args[0])

    def not_(lk: Lookup) -> bool | None:
        v = child(lk)
        return None if v is None else not v

    return not_


def _ident_cmp_const(name: str, op: str, c: object) -> _Fn:
    f = _CMP_FUNCS[op]
    if type(c) is bool:

        def cmp_bool(lk: Lookup) -> bool | None:
            v = lk(name)
            if v is True or v is False:
                return f(v, c)
            return None if v is None else False

        return cmp_bool
    if type(c) is str:

        def cmp_str(lk: Lookup) -> bool | None:
            v = lk(name)
            if type(v) is str:
                return f(v, c)
            if isinstance(v, str):
                return f(str.__str__(v), c)
            return None if v is None else False

        return cmp_str

    def cmp_num(lk: Lookup) -> bool | None:
        v = lk(name)
        t = type(v)
        if t is int or t is float:
            return f(v, c)
        if v is None:
            return None
        if t is str or t is bool:
            return False
        v = _normalize(v)
        t = type(v)
        if t is int or t is float:
            return f(v, c)
        return False

    return cmp_num


def _build_cmp(node: _Node) -> _Fn:
    op, left, right = node.args
    if left.kind == "ident" and right.kind == "const":
        return _ident_cmp_const(left.args[0], op, right.args[0])
    if left.kind == "const" and right.kind == "ident":
        return _ident_cmp_const(right.args[0], _FLIPPED[op], left.args[0])
    lf = _compile_value(left)
    rf = _compile_value(right)
    f = _CMP_FUNCS[op]
    ordering = op in _ORDERING
    kinds = _KIND

    def cmp_(lk: Lookup) -> bool | None:
        a = lf(lk)
        if a is None:
            return None
        b = rf(lk)
        if b is None:
            return None
        ka = kinds.get(type(a))
        if ka is None or ka != kinds.get(type(b)) or (ordering and ka != _NUM_KIND):
            return False  # not like types
        return bool(f(a, b))

    return cmp_


def _build_between(node: _Node) -> _Fn:
    negated, x, lo, hi = node.args
    if x.kind == "ident" and lo.kind == "const" and hi.kind == "const":
        name, a, b = x.args[0], lo.args[0], hi.args[0]

        def between_const(lk: Lookup) -> bool | None:
            v = lk(name)
            t = type(v)
            if t is not int and t is not float:
                if v is None:
                    return None
                if t is str or t is bool:
                    return False  # NOT BETWEEN too: v < a OR v > b compare no like types
                v = _normalize(v)
                t = type(v)
                if t is not int and t is not float:
                    return False
            r = a <= v <= b
            return (not r) if negated else r

        return between_const
    xf, lof, hif = _compile_value(x), _compile_value(lo), _compile_value(hi)

    def between(lk: Lookup) -> bool | None:
        v, lo_, hi_ = xf(lk), lof(lk), hif(lk)
        if negated:  # v < lo OR v > hi
            r1, r2 = _num_cmp3(operator.lt, v, lo_), _num_cmp3(operator.gt, v, hi_)
            if r1 is True or r2 is True:
                return True
            return False if r1 is False and r2 is False else None
        r1, r2 = _num_cmp3(operator.le, lo_, v), _num_cmp3(operator.le, v, hi_)
        if r1 is False or r2 is False:
            return False
        return True if r1 is True and r2 is True else None

    return between


def _string_predicate(
    x: _Node, negated: bool, test: Callable[[str], bool], other: bool | None
) -> _Fn:
    """`test` on a string value (negated for NOT); UNKNOWN for NULL, `other` for a value
    that is not a string."""
    if x.kind == "ident":
        name = x.args[0]

        def pred_ident(lk: Lookup) -> bool | None:
            v = lk(name)
            if type(v) is not str:
                if not isinstance(v, str):
                    return None if v is None else other
                v = str.__str__(v)
            return (not test(v)) if negated else test(v)

        return pred_ident
    xf = _compile_value(x)

    def pred(lk: Lookup) -> bool | None:
        v = xf(lk)
        if type(v) is not str:
            return None if v is None else other
        return (not test(v)) if negated else test(v)

    return pred


def _build_in(node: _Node) -> _Fn:
    negated, x, values = node.args
    return _string_predicate(x, negated, values.__contains__, None)


def _build_like(node: _Node) -> _Fn:
    negated, x, matcher = node.args
    return _string_predicate(x, negated, matcher, negated)


def _build_isnull(node: _Node) -> _Fn:
    negated, x = node.args
    if x.kind == "ident":
        name = x.args[0]
        if negated:
            return lambda lk: lk(name) is not None
        return lambda lk: lk(name) is None
    xf = _compile_value(x)
    if negated:
        return lambda lk: xf(lk) is not None
    return lambda lk: xf(lk) is None


def _build_arith(node: _Node) -> _Fn:
    first_node, rest_nodes = node.args
    first = _compile_value(first_node)
    rest = tuple((_ARITH[op], _compile_value(n)) for op, n in rest_nodes)

    def arith(lk: Lookup) -> Any:
        acc = first(lk)
        t = type(acc)
        if t is not int and t is not float:
            return None
        for f, g in rest:
            v = g(lk)
            t = type(v)
            if t is not int and t is not float:
                return None
            acc = f(acc, v)
            if acc is None:
                return None
        return acc

    return arith


def _build_neg(node: _Node) -> _Fn:
    child = _compile_value(node.args[0])

    def neg(lk: Lookup) -> Any:
        v = child(lk)
        t = type(v)
        if t is float:
            return -v
        if t is int:
            return -v if _INT_MIN <= -v <= _INT_MAX else None
        return None

    return neg


def _build_pos(node: _Node) -> _Fn:
    child = _compile_value(node.args[0])

    def pos(lk: Lookup) -> Any:
        v = child(lk)
        t = type(v)
        return v if t is int or t is float else None

    return pos


_BUILDERS: Final[dict[str, Callable[[_Node], _Fn]]] = {
    "or": _build_or,
    "and": _build_and,
    "not": _build_not,
    "cmp": _build_cmp,
    "between": _build_between,
    "in": _build_in,
    "like": _build_like,
    "isnull": _build_isnull,
    "arith": _build_arith,
    "neg": _build_neg,
    "pos": _build_pos,
}


def _match_all(lk: Lookup) -> bool:
    return True


def _check_length(text: str) -> None:
    if len(text) <= MAX_SELECTOR_BYTES // 4:
        return  # at most 4 UTF-8 bytes per character
    total = 0
    for i, ch in enumerate(text):
        o = ord(ch)
        total += 1 if o < 0x80 else 2 if o < 0x800 else 3 if o < 0x10000 else 4
        if total > MAX_SELECTOR_BYTES:
            raise SelectorError(f"selector exceeds {MAX_SELECTOR_BYTES} bytes (UTF-8)", i)


def _compile(text: str) -> tuple[_Fn, frozenset[str]]:
    _check_length(text)
    tokens = _tokenize(text)
    if tokens[0].kind == _EOF:
        return _match_all, frozenset()
    parser = _Parser(tokens)
    try:
        node = parser.parse_expr(0)
        if parser.peek().kind != _EOF:
            raise parser.unexpected(parser.peek())
        if node.stype not in (_T_BOOL, _T_ANY):
            raise SelectorError(
                f"selector must be a boolean expression, not {node.stype}", node.pos
            )
        fn = _compile_bool(node)
    except RecursionError:  # pragma: no cover - MAX_DEPTH keeps the stack shallow
        raise SelectorError("selector too deeply nested", 0) from None
    return fn, frozenset(parser.idents)


# --------------------------------------------------------------------------- public API


class Selector:
    """A compiled, immutable selector; equal and hashed by its text."""

    __slots__ = ("_fn", "identifiers", "text")

    text: str
    #: Identifiers (header fields and property names) the selector references.
    identifiers: frozenset[str]

    def __init__(self, text: str) -> None:
        if not isinstance(text, str):
            raise TypeError(f"selector must be str, not {type(text).__name__}")
        fn, idents = _compile(text)
        object.__setattr__(self, "text", text)
        object.__setattr__(self, "identifiers", idents)
        object.__setattr__(self, "_fn", fn)

    def matches(self, lookup: Lookup) -> bool:
        """True iff the selector is TRUE for the message ``lookup`` describes.

        ``lookup(identifier)`` returns the header field or property value, or ``None``
        when absent.  Supported value types are ``str``, ``bool``, ``int`` and ``float``
        (and their subclasses); any other value compares as UNKNOWN.
        """
        return self._fn(lookup) is True

    def matches_mapping(self, values: Mapping[str, object]) -> bool:
        """``matches`` with headers and properties given as one mapping."""
        return self._fn(values.get) is True

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Selector is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Selector is immutable")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Selector):
            return self.text == other.text
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.text)

    def __repr__(self) -> str:
        return f"Selector({self.text!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (compile_selector, (self.text,))


@functools.lru_cache(maxsize=4096)
def compile_selector(text: str) -> Selector:
    """Parse and compile ``text``; raise :class:`SelectorError` if it is invalid.

    Compiled selectors are cached by text (they are immutable and thread-safe).
    """
    return Selector(text)


def make_lookup(headers: Mapping[str, object], properties: Mapping[str, object]) -> Lookup:
    """Build a lookup: :data:`HEADER_FIELDS` from ``headers``, the rest from ``properties``."""
    header_get = headers.get
    prop_get = properties.get
    fields = HEADER_FIELDS

    def lookup(name: str) -> object | None:
        return header_get(name) if name in fields else prop_get(name)

    return lookup
