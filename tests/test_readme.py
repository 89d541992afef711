"""The README stays a short page for users whose links all lead somewhere."""

from __future__ import annotations

import os
import re

from tests.script_runner import ROOT

README = os.path.join(ROOT, "README.md")
MAX_LINES = 250
#: ``[text](target)`` and ``![alt](target)``; the target ends at whitespace or ``)``
LINK = re.compile(r"\]\(([^)\s]+)\)")


def readme() -> str:
    with open(README, encoding="utf-8") as f:
        return f.read()


def github_anchor(heading: str) -> str:
    """The ``#anchor`` GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_is_at_most_250_lines():
    lines = readme().count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines; keep it to {MAX_LINES}"


def test_every_relative_link_leads_to_a_file_or_heading():
    text = readme()
    anchors = {github_anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}
    targets = LINK.findall(text)
    assert targets, "no links found: the pattern no longer matches the README"
    broken = []
    for target in targets:
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        if not path:
            if anchor not in anchors:
                broken.append(target)
        elif not os.path.isfile(os.path.join(ROOT, path)):
            broken.append(target)
    assert not broken, f"README.md links to what does not exist: {broken}"
