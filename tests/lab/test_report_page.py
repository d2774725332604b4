"""report.html as the person it is sent to sees it: opened in headless Chromium (tests/browser.py), every
plot decoded and drawn, every table with rows, nothing asked of the network or of files beside the page.
Then the check itself: the real page broken on purpose, one way at a time, and small pages of the ways a
page can reach out that only a browser sees (a timer, a lazy image below the fold, a worker, a websocket),
each caught."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from PIL import Image

from fp4lab.lab.records.catalog import Catalog
from fp4lab.lab.records.ledger import build_report
from fp4lab.lab.records.plots import PLOTS
from fp4lab.lab.records.render import write_report
from tests.browser import Chromium, check_page

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with Chromium(tmp_path_factory.mktemp("chromium")) as chromium:
        yield chromium


@pytest.fixture(scope="module")
def sweep_page(real_sweep, tmp_path_factory) -> Path:
    """report.html of the real 2-run sweep, with its PNGs beside it."""
    written = write_report(build_report(real_sweep, sweep="mini"), tmp_path_factory.mktemp("report"))
    return written["html"]


def test_the_sweep_report_reads_whole_and_offline_in_a_browser(sweep_page, real_sweep, browser):
    found = check_page(sweep_page, browser)
    assert found.problems == []
    plots = [name for name in PLOTS if (sweep_page.parent / f"{name}.png").exists()]
    assert len(plots) == 5  # loss curves, train and val loss excess, attention entropy, max logit: each on the page
    assert [image["name"] for image in found.images] == plots
    for image in found.images:  # the browser decoded the very plot written beside the page, at its size
        with Image.open(sweep_page.parent / f"{image['name']}.png") as png:
            assert (image["naturalWidth"], image["naturalHeight"]) == png.size
        assert image["drawnWidth"] > 0 and image["drawnHeight"] > 0
    runs = len(Catalog(real_sweep).records(sweep="mini"))
    assert [(t["name"], t["filledRows"]) for t in found.tables] == [("Recipe ledger", 2), ("Runs", runs)]
    assert found.requests[0] == sweep_page.resolve().as_uri()
    assert len(found.requests) == 1 + len(plots) and all(r.startswith("data:image/png;base64,") for r in found.requests[1:])


def _first_image_payload(page: str) -> str:
    return re.search(r'src="(data:image/png;base64,[^"]*)"', page).group(1)


def _empty_ledger_table(page: str) -> str:
    table = re.search(r"<h2>Recipe ledger</h2>\n<table>.*?</table>", page, re.S).group(0)
    return page.replace(table, re.sub(r"<tr><td>.*?</tr>", "", table, flags=re.S))


BREAKS = {  # name -> (the edit of the real page, the one problem it must give)
    "plot that does not decode": (
        lambda page: page.replace(_first_image_payload(page), "data:image/png;base64,bm90IGEgcG5n"),
        "image 'loss_curves' (data:image/png;base64,bm90IGEgcG5n) did not decode (naturalWidth 0)",
    ),
    "plot missing": (
        lambda page: re.sub(r"<img [^>]*>", "", page, count=1),
        "figure 'loss curves' has no image",
    ),
    "empty ledger table": (
        _empty_ledger_table,
        "table under 'Recipe ledger' is empty (0 data rows, none with text)",
    ),
    "script from a CDN": (
        lambda page: page.replace("</head>", '<script src="https://cdn.example.com/plot.js"></script></head>'),
        "needs the network: it requests https://cdn.example.com/plot.js",
    ),
    "plot read from beside the page": (
        lambda page: page.replace(_first_image_payload(page), "loss_curves.png"),
        "loads {folder}/loss_curves.png from beside the page: it does not stand on its own",
    ),
}


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_each_break_of_the_real_page_is_caught(name, sweep_page, browser, tmp_path):
    edit, problem = BREAKS[name]
    page = sweep_page.read_text()
    broken = edit(page)
    assert broken != page
    copy = sweep_page.parent / f"broken-{name.replace(' ', '-')}.html"  # beside the PNGs, as the page is
    copy.write_text(broken)
    assert check_page(copy, browser).problems == [problem.format(folder=sweep_page.parent.resolve().as_uri())]


PNG_1PX = (  # a 1 x 1 white PNG
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGP4//8/AwAI/AL+hc2rNAAAAABJRU5ErkJggg=="
)
REACHING_OUT = {  # name -> (a page's body, its problems)
    "fine": (f'<h2>Plot</h2><figure><img alt="dot" src="{PNG_1PX}" width="10"></figure><table><tr><td>1</td></tr></table>', []),
    "fetch 3 s after the load": (
        '<script>setTimeout(() => fetch("https://api.example.com/late").catch(() => 0), 3000)</script>',
        ["needs the network: it requests https://api.example.com/late"],
    ),
    "lazy image far below the fold": (
        '<div style="height:9000px"></div><img alt="far" loading="lazy" src="https://img.example.com/far.png">',
        ["needs the network: it requests https://img.example.com/far.png",
         "image 'far' (https://img.example.com/far.png) did not decode (naturalWidth 0)"],
    ),  # fmt: skip
    "worker that fetches": (
        "<script>new Worker(URL.createObjectURL(new Blob([\"fetch('https://worker.example.com/').catch(() => 0)\"])))</script>",
        ["needs the network: it requests https://worker.example.com/"],
    ),
    "websocket": ('<script>new WebSocket("wss://live.example.com/")</script>', ["needs the network: it requests wss://live.example.com/"]),
    "hidden plot": (
        f'<figure><h3>loss</h3><img src="{PNG_1PX}" style="display:none"></figure>', ["image 'loss' is drawn 0 x 0 pixels"]
    ),
    "table of blank cells": (
        "<h2>Runs</h2><table><tr><th>run</th></tr><tr><td> </td></tr></table>",
        ["table under 'Runs' is empty (1 data rows, none with text)"],
    ),
}


@pytest.mark.parametrize("name", sorted(REACHING_OUT))
def test_what_only_a_browser_sees_is_caught(name, browser, tmp_path):
    body, problems = REACHING_OUT[name]
    page = tmp_path / "page.html"
    page.write_text(f'<!doctype html><html><head><meta charset="utf-8"></head><body>{body}</body></html>')
    assert check_page(page, browser).problems == problems
