"""Check that the built documentation fits its column: code blocks, diagrams, tables, figures.

Two checks on a built site (``python -m sphinx -b html docs docs/_build/html`` first):

* always: the lines of every ``<pre>`` block longer than ``--max-chars`` characters (the text
  column holds about 100 characters of code at a 1400 px window);
* with ``--browser`` (needs Chromium, e.g. Debian's ``chromium`` package): each page is opened
  headless at ``--width`` pixels and every code block, table, image or displayed formula whose
  content is wider than its box (so that it scrolls or is cut) is listed, from the live layout.

Usage::

    python scripts/docs_layout.py docs/_build/html
    python scripts/docs_layout.py docs/_build/html --browser --width 1400 [PAGE.html ...]

The exit status is 1 when something overflows.
"""

from __future__ import annotations

import argparse
import html
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

SKIPPED = ("genindex.html", "search.html", "py-modindex.html")

_PROBE = """<script>window.addEventListener('load', () => setTimeout(() => {
  const article = document.querySelector('.bd-article');
  const right = article ? article.getBoundingClientRect().right : Infinity;
  const found = [];
  const selector = '.bd-article pre, .bd-article table, .bd-article img, '
                 + '.bd-article mjx-container[display="true"]';
  document.querySelectorAll(selector).forEach(e => {
    if (e.scrollWidth > e.clientWidth + 2 || e.getBoundingClientRect().right > right + 2) {
      const text = (e.textContent || e.getAttribute('src') || '').trim().replace(/\\s+/g, ' ');
      found.push(`${e.tagName} ${e.scrollWidth} px in ${e.clientWidth} px: ${text.slice(0, 60)}`);
    }
  });
  document.body.setAttribute('data-overflow', JSON.stringify(found));
}, 1500));</script>"""


def pages(site: pathlib.Path, names: list[str]) -> list[pathlib.Path]:
    if names:
        return [site / name for name in names]
    return [p for p in sorted(site.rglob("*.html"))
            if "_modules" not in p.parts and "_static" not in p.parts and p.name not in SKIPPED]


def long_lines(page: pathlib.Path, limit: int) -> list[str]:
    found = []
    for block in re.findall(r"<pre[^>]*>(.*?)</pre>", page.read_text(encoding="utf-8"), re.S):
        for line in html.unescape(re.sub(r"<[^>]+>", "", block)).split("\n"):
            if len(line) > limit:
                found.append(f"{len(line)} characters: {line[:70]}")
    return found


def overflowing(page: pathlib.Path, width: int, chromium: str) -> list[str]:
    probed = page.with_name(page.stem + ".layout-probe.html")
    probed.write_text(page.read_text(encoding="utf-8").replace("</body>", _PROBE + "</body>"),
                      encoding="utf-8")
    try:
        dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                              "--hide-scrollbars", f"--window-size={width},1000",
                              "--virtual-time-budget=4000", "--dump-dom", probed.as_uri()],
                             capture_output=True, text=True, timeout=120).stdout
    finally:
        probed.unlink()
    match = re.search(r'data-overflow="([^"]*)"', dom)
    return json.loads(html.unescape(match.group(1))) if match else ["(the page did not load)"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=pathlib.Path, help="the built HTML folder")
    parser.add_argument("pages", nargs="*", help="pages relative to it (default: all)")
    parser.add_argument("--max-chars", type=int, default=100)
    parser.add_argument("--browser", action="store_true", help="also measure the layout in Chromium")
    parser.add_argument("--width", type=int, default=1400, help="window width for --browser")
    args = parser.parse_intermixed_args(argv)
    chromium = None
    if args.browser:
        chromium = shutil.which("chromium") or shutil.which("chromium-browser")
        if chromium is None:
            parser.error("--browser needs Chromium on the PATH")
    with tempfile.TemporaryDirectory() as tmp:
        site = pathlib.Path(tmp) / "site"
        shutil.copytree(args.site, site)   # the probe is written next to each page, in a copy
        problems = 0
        for page in pages(site, args.pages):
            found = long_lines(page, args.max_chars)
            if chromium:
                found += overflowing(page, args.width, chromium)
            problems += len(found)
            for item in found:
                print(f"{page.relative_to(site)}: {item}")
    print(f"{problems} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
