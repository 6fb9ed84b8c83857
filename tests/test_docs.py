"""The README and docs/: the CLI reference matches `--help`, every relative link resolves, the
README stays short, and no development history is written into them."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 200


def _pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def _cli_reference():
    spec = importlib.util.spec_from_file_location("cli_reference",
                                                  ROOT / "scripts" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_matches_help():
    module = _cli_reference()
    want = module.reference()
    have = module.PAGE.read_text() if module.PAGE.exists() else ""
    assert have == want, ("docs/cli.md differs from the command line's --help: run "
                          "`python scripts/cli_reference.py` to update it")


# Markdown links and images, [text](target) or ![alt](target), and reference definitions.
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+).+?\1", re.DOTALL)


def _links(text: str) -> list[str]:
    prose = CODE_SPAN.sub("", FENCE.sub("", text))
    return INLINE_LINK.findall(prose) + REFERENCE_LINK.findall(prose)


def _is_relative(target: str) -> bool:
    return not (re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("#", "//")))


def test_relative_links_resolve():
    broken = []
    for page in _pages():
        for target in _links(page.read_text()):
            if not _is_relative(target):
                continue
            path = target.split("#", 1)[0].split("?", 1)[0]
            if path and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_link_finder_sees_links_and_skips_code():
    text = ("See [a](docs/a.md#top), ![b](img/b.png) and [c](https://x.org).\n"
            "`[d](not/a/link.md)`\n```\n[e](also/not.md)\n```\n[f]: ref/f.md\n")
    assert _links(text) == ["docs/a.md#top", "img/b.png", "https://x.org", "ref/f.md"]


def test_readme_is_short():
    lines = README.read_bytes().count(b"\n")  # as `wc -l` counts them
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; at most {MAX_README_LINES}"


# Development history: session numbers, rounds and host letters of past measurement runs.
HISTORY_WORDS = re.compile(r"(?i:(?<![a-z])sessions?[\s_-]*\d+)|(?i:\brounds?)\s+[A-Z]\b|"
                           r"(?i:\bhosts?)\s+[A-Z]\b")


def test_no_development_history_in_docs():
    found = []
    for page in _pages():
        for number, line in enumerate(page.read_text().splitlines(), start=1):
            match = HISTORY_WORDS.search(line)
            if match:
                found.append(f"{page.relative_to(ROOT)}:{number}: {match.group(0)!r}")
    assert not found, ("development history (sessions, rounds, hosts) belongs in "
                       "benchmarks/history/, not in the README or docs/:\n" + "\n".join(found))


def test_history_pattern():
    for text in ("in session 26", "sessions 18, 21", "gpu_session26.sh", "round B", "Rounds A-E",
                 "host A", "hosts B and C", "host A/B/C"):
        assert HISTORY_WORDS.search(text), text
    for text in ("a test session", "possessions 3", "round a number", "the H200 host",
                 "one host at a time", "a round trip", "each host's figures"):
        assert not HISTORY_WORDS.search(text), text
