"""Open a study report in a real browser: Debian's Chromium driven by Playwright.

``scripts/setup.sh`` installs both (apt ``chromium``, PyPI ``playwright``; Playwright's own
browser download is not used). Without them a test skips, except under CI, where it fails:
a green CI must have looked at the page.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("AUTOTUNE_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _missing() -> str:
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (bash scripts/setup.sh)"
    if not (Path(CHROMIUM).exists() or shutil.which("chromium")):
        return f"{CHROMIUM} is missing (apt-get install chromium; bash scripts/setup.sh)"
    return ""


def require_browser() -> None:
    why = _missing()
    if why and os.environ.get("CI"):
        pytest.fail(f"browser test cannot run in CI: {why}")
    if why:
        pytest.skip(why)


@dataclass
class Page:
    page: Any
    errors: list[str] = field(default_factory=list)  # console errors and page exceptions
    requests: list[str] = field(default_factory=list)  # anything not file:// (must be none)

    def sections(self) -> list[str]:
        return [s.get_attribute("id") for s in self.page.query_selector_all("main > section")]

    def text(self, selector: str) -> str:
        return str(self.page.text_content(selector) or "")

    def hover_a_point(self, plot_id: str) -> str:
        """Move the mouse onto the first data point of a Plotly figure; return the text of
        the hover label Plotly draws (raises if none appears)."""
        page = self.page
        page.wait_for_selector(f"#{plot_id} .main-svg")
        page.locator(f"#{plot_id}").scroll_into_view_if_needed()
        pt = page.query_selector(f"#{plot_id} .scatterlayer .point")
        assert pt is not None, f"{plot_id} has no data point"
        box = pt.bounding_box()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.wait_for_selector(f"#{plot_id} .hoverlayer .hovertext", timeout=5000)
        return str(page.text_content(f"#{plot_id} .hoverlayer") or "")


@contextmanager
def open_report(path: Path) -> Iterator[Page]:
    """The report loaded in headless Chromium, every figure drawn."""
    from playwright.sync_api import sync_playwright

    require_browser()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM if Path(CHROMIUM).exists()
                                    else shutil.which("chromium"), args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            out = Page(page)
            page.on("console", lambda m: out.errors.append(m.text) if m.type == "error"
                    else None)
            page.on("pageerror", lambda e: out.errors.append(str(e)))
            page.on("request", lambda r: None if r.url.startswith(("file:", "data:", "blob:"))
                    else out.requests.append(r.url))
            page.goto(path.resolve().as_uri(), wait_until="load")
            n = page.locator("div.plotly-graph-div").count()
            page.wait_for_function(
                f"document.querySelectorAll('div.plotly-graph-div .main-svg').length >= {n}",
                timeout=20000)
            yield out
        finally:
            browser.close()


