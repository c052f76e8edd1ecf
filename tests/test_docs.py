"""The documentation stays true: the README's usage snippet runs as written, every relative link
points at a file, and the settings page is the one tilewise/config.py generates."""
import os
import pathlib
import re
import subprocess
import sys

from tilewise import settings_doc

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]

# A Markdown link or image: [text](target).
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def first_python_block(markdown: str) -> str:
    match = re.search(r"^```python\n(.*?)^```", markdown, re.S | re.M)
    if match is None:
        raise ValueError("README.md has no ```python block")
    return match.group(1)


def relative_links(markdown: str) -> list[str]:
    """Link targets outside code blocks and code spans that name a file of this repository."""
    text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", markdown))
    targets = (target.split("#", 1)[0] for target in LINK.findall(text))
    return [target for target in targets if target and not re.match(r"[a-z][a-z0-9+.-]*:", target)]


def test_readme_usage_snippet_runs_and_prints_what_it_claims(tmp_path):
    snippet = first_python_block(README.read_text())
    env = {**os.environ, "TILEWISE_MODE": "adaptive", "TILEWISE_CACHE_DIR": "off",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for name in ("TILEWISE_THRESHOLD", "TILEWISE_BACKGROUND_COMPILE"):
        env.pop(name, None)
    process = subprocess.run([sys.executable, "-c", snippet], stdin=subprocess.DEVNULL, capture_output=True,
                             text=True, cwd=tmp_path, env=env, timeout=300)
    assert process.returncode == 0, process.stderr[-3000:]
    losses = re.findall(r"^loss (\d+\.\d{4})$", process.stdout, re.M)
    assert len(losses) == 8, process.stdout  # "It prints eight losses"
    assert "tilewise statistics" in process.stdout
    # "from the fourth step on the step runs as a compiled region, served from the cache"
    assert int(re.search(r"compiles (\d+)", process.stdout).group(1)) >= 1, process.stdout
    assert int(re.search(r"ops seen \d+: (\d+) in compiled regions", process.stdout).group(1)) > 0, process.stdout
    assert int(re.search(r"cache hits (\d+)", process.stdout).group(1)) > 0, process.stdout
    assert int(re.search(r"not run again yet (\d+)", process.stdout).group(1)) == 0, process.stdout


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 250, "README.md grew past 250 lines: move detail to docs/"


def test_every_relative_link_points_at_a_file():
    broken = [f"{page.relative_to(ROOT)}: {target}"
              for page in PAGES for target in relative_links(page.read_text())
              if not (page.parent / target).exists()]
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_every_docs_page_is_linked_from_the_index():
    index = ROOT / "docs" / "index.md"
    linked = {(index.parent / target).resolve() for target in relative_links(index.read_text())}
    unlisted = [str(page.relative_to(ROOT)) for page in sorted((ROOT / "docs").rglob("*.md"))
                if page != index and page.resolve() not in linked]
    assert not unlisted, f"docs/index.md does not link {unlisted}"


def test_settings_page_is_current():
    committed = (ROOT / "docs" / "guide" / "settings.md").read_text()
    assert committed == settings_doc.page(), (
        f"docs/guide/settings.md is not what tilewise/config.py generates; run `{settings_doc.REGENERATE}`")


def test_settings_page_lists_every_setting_with_what_its_validator_accepts():
    from tilewise.config import SETTINGS
    page = settings_doc.page()
    for name, setting in SETTINGS.items():
        assert f"\n## {name}\n" in page and f"`{setting.env}`" in page, name
    assert "- must be one of eager, adaptive, compiled\n" in page
    assert "- must be at most 128" in page  # a second check of one validator (cores) is found too
    home = os.path.expanduser("~")
    assert len(home) < 2 or home not in page  # no machine's own paths in the committed page


def test_link_check_can_fail(tmp_path):
    page = "see [a](missing.md) and [b](index.md#part), `[c](code.md)`, [d](https://example.com)\n"
    assert relative_links(page) == ["missing.md", "index.md"]
