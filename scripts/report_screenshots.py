"""The screenshots of report.html in docs/REPORTS.md, made again: the README's quickstart sweep and the published
ledger, each page checked first (tests/browser.py: every plot decoded, every table filled, nothing fetched)
and then photographed in headless Chromium in a 1280-pixel-wide window.

    python scripts/report_screenshots.py                       # runs sweeps/quickstart.toml (~1-3 min on 2 cores)
    python scripts/report_screenshots.py --catalog sweep_catalog.json   # a quickstart sweep already run

Each picture is the top of the page (the title and the whole recipe ledger, which is wider than the window:
the page scrolls sideways to it) above its first two plots side by side (the loss curves and the loss
excess, with their captions), a grey band where the page's glossary and method text are left out; 256
colours keep each PNG small. Writes docs/img/report_quickstart.png and docs/img/report_ledger.png.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests/browser.py: the one Chromium driver

from tests.browser import Chromium, check_page  # noqa: E402

WIDTH = 1280  # the window's width in CSS pixels
BAND = 28  # the grey band's height where the page is left out
PLOTS_SHOWN = 2

# The page's parts as clips in page pixels: the top (title to the ledger table's end, the table's full
# width), then each plot shown (its heading, image and caption).
PARTS = """(() => {
  const box = node => node.getBoundingClientRect();
  const clip = (left, top, right, bottom) => ({x: left, y: top, width: Math.ceil(right - left), height: Math.ceil(bottom - top), scale: 1});
  const table = document.querySelector("table");
  const figures = [...document.querySelectorAll("figure")].slice(0, %d);
  return [clip(0, 0, Math.max(box(table).right + 32, window.innerWidth), box(table).bottom + 16),
          ...figures.map(f => clip(0, box(f).top - 8, box(f.querySelector("img")).right + 16, box(f).bottom + 8))];
})()""" % PLOTS_SHOWN


def fp4lab(*args: str, cwd: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-m", "fp4lab.cli", *args], cwd=cwd, env=env, check=True)


def quickstart_report(work: Path, catalog: Path | None) -> Path:
    """The quickstart's page; the report runs beside its catalog, so the page names it as a user's would."""
    if catalog is None:
        fp4lab("sweep", str(ROOT / "sweeps" / "quickstart.toml"), cwd=work)
        catalog = work / "sweep_catalog.json"
    fp4lab("report", "quickstart", "--catalog", catalog.name, "--out", str(work / "quickstart"), cwd=catalog.resolve().parent)
    return work / "quickstart" / "report.html"


def ledger_report(work: Path) -> Path:
    """The published ledger's page, from the committed catalog and runs, as docs/LEDGER.md makes it."""
    (work / "docs" / "ledger").mkdir(parents=True)
    shutil.copy(ROOT / "docs" / "ledger" / "sweep_catalog.json", work / "docs" / "ledger")
    with tarfile.open(ROOT / "docs" / "ledger" / "runs.tar.xz") as archive:
        archive.extractall(work, filter="data")
    claims = str(ROOT / "sweeps" / "ledger_claims.toml")
    fp4lab("report", "ledger", "--catalog", "docs/ledger/sweep_catalog.json", "--out", "ledger", "--claims", claims, cwd=work)
    return work / "ledger" / "report.html"


def photograph(browser: Chromium, page: Path) -> Image.Image:
    """The page's top above its first plots side by side, a grey band between them."""
    session = browser.open_tab()
    try:
        browser.load(session, page.resolve().as_uri())
        shots = []
        for clip in browser.evaluate(session, PARTS):
            shot = browser.send("Page.captureScreenshot", {"format": "png", "clip": clip, "captureBeyondViewport": True}, session)
            shots.append(Image.open(io.BytesIO(base64.b64decode(shot["data"]))).convert("RGB"))
    finally:
        browser.close_tab(session)
    top, plots = shots[0], shots[1:]
    width = max(top.width, sum(plot.width for plot in plots))
    picture = Image.new("RGB", (width, top.height + BAND + max(plot.height for plot in plots)), "white")
    picture.paste(top, (0, 0))
    picture.paste((232, 232, 232), (0, top.height, width, top.height + BAND))
    left = 0
    for plot in plots:
        picture.paste(plot, (left, top.height + BAND))
        left += plot.width
    return picture


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--catalog", type=Path, help="a catalog holding the quickstart sweep (default: run it)")
    args = parser.parse_args()
    out = ROOT / "docs" / "img"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fp4lab-screenshots-") as folder:
        work = Path(folder)
        pages = {"quickstart": quickstart_report(work, args.catalog), "ledger": ledger_report(work)}
        (work / "chromium").mkdir()
        with Chromium(work / "chromium", width=WIDTH) as browser:
            for name, page in pages.items():
                problems = check_page(page, browser).problems
                if problems:
                    sys.exit(f"{page}: not photographed, the page is broken: {'; '.join(problems)}")
                target = out / f"report_{name}.png"
                photograph(browser, page).quantize(256).save(target, optimize=True)
                print(f"wrote {target.relative_to(ROOT)} ({target.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
