"""What a PromQL expression reads: metric names, label matchers, grouping labels.

A tokenizer, not a full parser: enough to list every vector selector (name and the labels
its matchers use) and every label named in `by`, `without`, `on`, `ignoring`,
`group_left` and `group_right`, which is what the contract test compares with what the
agent and supervisor export. Syntax itself is checked by promtool (the rules) and by
Prometheus (the integration test evaluates every panel query).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Grafana's variables, replaced before reading an expression.
_GRAFANA_INTERVALS = re.compile(r"\$__(rate_interval|interval|range)\b")
_GRAFANA_VAR = re.compile(r"\$\{?(\w+)\}?")
_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<duration>\d+(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*(?![\w:]))
  | (?P<number>(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+)(?![\w:]))
  | (?P<ident>[A-Za-z_:][\w:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=,(){}])
    """,
    re.VERBOSE,
)
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "by", "without", "on",
                      "ignoring", "group_left", "group_right", "inf", "nan"})  # fmt: skip
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})


@dataclass
class Selector:
    metric: str
    labels: dict[str, str] = field(default_factory=dict)  # label -> matched value (as written)


@dataclass
class Reads:
    selectors: list[Selector] = field(default_factory=list)
    grouping: set[str] = field(default_factory=set)  # labels in by/on/... clauses
    # the labels an aggregation at the very top keeps (`sum by (a, b) (...)`), else None
    top_by: tuple[str, ...] | None = None

    @property
    def metrics(self) -> set[str]:
        return {s.metric for s in self.selectors}


class PromQLSyntaxError(ValueError):
    pass


def substitute_variables(expr: str, interval: str = "1m", value: str = ".*") -> str:
    """Grafana's $__rate_interval and friends become `interval`; $var becomes `value`."""
    return _GRAFANA_VAR.sub(value, _GRAFANA_INTERVALS.sub(interval, expr))


def tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise PromQLSyntaxError(f"cannot read {expr[pos : pos + 20]!r} in {expr!r}")
        kind = m.lastgroup
        if kind != "ws":
            out.append((kind, m.group()))
        pos = m.end()
    return out


def reads(expr: str) -> Reads:
    """Selectors and grouping labels of `expr` (Grafana variables allowed)."""
    toks = tokens(substitute_variables(expr))
    result = Reads()
    i = 0
    if len(toks) > 2 and toks[0][0] == "ident" and toks[1] == ("ident", "by"):
        result.top_by = tuple(_label_list(toks, 2)[0])
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1][1] if i + 1 < len(toks) else None
        if kind == "ident" and text in GROUPING:
            labels, i = _label_list(toks, i + 1) if nxt == "(" else ([], i + 1)
            result.grouping.update(labels)
            continue
        if kind == "ident" and nxt in ("by", "without"):
            i += 1  # an aggregation written `sum by (a) (...)`
            continue
        if kind == "ident" and text not in KEYWORDS and nxt != "(":
            selector = Selector(text)
            i += 1
            if nxt == "{":
                selector.labels, i = _matchers(toks, i)
            result.selectors.append(selector)
            continue
        if kind == "op" and text == "{":
            raise PromQLSyntaxError(f"a selector without a metric name in {expr!r}")
        i += 1
    return result


def _label_list(toks: list[tuple[str, str]], i: int) -> tuple[list[str], int]:
    """`(a, b)` starting at toks[i] == '(' -> (["a", "b"], index after ')')."""
    if toks[i][1] != "(":
        raise PromQLSyntaxError("expected a label list")
    labels, i = [], i + 1
    while toks[i][1] != ")":
        if toks[i][0] == "ident":
            labels.append(toks[i][1])
        i += 1
    return labels, i + 1


def _matchers(toks: list[tuple[str, str]], i: int) -> tuple[dict[str, str], int]:
    """`{a="x", b=~"y"}` starting at toks[i] == '{'."""
    labels, i = {}, i + 1
    while toks[i][1] != "}":
        kind, name = toks[i]
        if kind == "ident":
            if toks[i + 1][0] != "op" or toks[i + 2][0] != "string":
                raise PromQLSyntaxError(f"bad matcher at {name!r}")
            labels[name] = toks[i + 2][1][1:-1]
            i += 3
        else:
            i += 1  # commas
    return labels, i + 1
