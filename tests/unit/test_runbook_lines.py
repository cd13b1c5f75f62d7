"""The log lines a runbook tells operators to look for are the lines the
proxy writes: each quote of a runbook (with "…" for what varies) is found in
a line the code logs, and each line the code logs for the alert's cause is
quoted. An SRE trial grepped for a WARNING the proxy did not write for a
continued cut (the code's INFO line had another shape)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from dataplane.http.resume import CUT_LINES
from tests.helm.test_chart import ROOT
from tests.monitoring import render

HELM_DOC = ROOT / "docs" / "helm.md"


def quotes(text: str) -> list[str]:
    """The double-quoted spans of `text`, whitespace collapsed (both the
    Markdown and the folded YAML wrap their lines)."""
    return re.findall(r'"([^"]+)"', " ".join(text.split()))


def written(line_format: str) -> str:
    """A line as the code writes it, each argument a value of its kind."""
    return line_format.replace("%s", "origin-a why").replace("%d", "5")


def pattern(quote: str) -> re.Pattern[str]:
    return re.compile(".+".join(re.escape(part) for part in quote.split("…")))


def assert_quotes_lines(runbook: str, lines: tuple[str, ...]) -> None:
    said = [pattern(q) for q in quotes(runbook)]
    logged = [written(line) for line in lines]
    for quote in said:
        assert any(quote.search(line) for line in logged), f"quoted, never logged: {quote.pattern}"
    for line, text in zip(lines, logged, strict=True):
        assert any(quote.match(text) for quote in said), f"logged, never quoted: {line}"


def doc_section(title: str) -> str:
    text = HELM_DOC.read_text()
    start = text.index(f"#### {title}\n")
    end = text.find("\n#### ", start + 1)
    return text[start:end]


def test_cutting_streams_doc_quotes_the_cut_lines() -> None:
    assert_quotes_lines(doc_section("PontoOriginCuttingStreams"), CUT_LINES)


@pytest.fixture(scope="module")
def rules() -> dict[str, dict[str, Any]]:
    docs = render("--set", "alerts.enabled=true")
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    return {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}


def test_cutting_streams_rule_quotes_the_cut_lines(rules: dict[str, dict[str, Any]]) -> None:
    runbook = rules["PontoOriginCuttingStreams"]["annotations"]["runbook"]
    assert_quotes_lines(runbook, CUT_LINES)
