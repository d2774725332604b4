"""A page as a reader's browser shows it: headless Chromium (Debian's `chromium`) driven over the Chrome
DevTools protocol on a pipe (`--remote-debugging-pipe`: the browser reads commands on its fd 3 and writes
answers and events on its fd 4, each a JSON message ended by a NUL byte), so neither a websocket library
nor a port is needed.

    found = check_page(Path("reports/mini/report.html"))
    assert found.problems == [], found.problems

`check_page` opens the page unmodified and lists what a reader who got the file alone would find broken:

- a request for anything but a data: URL or the page itself, seen where the browser makes it (the
  Network domain of the page and of every frame and worker it starts, websockets included): an
  http(s) URL means the page needs the network, another file: URL that it needs files beside it;
- an <img> that did not load or decode (naturalWidth 0) or is drawn zero pixels wide,
  and a <figure> without an image: a plot missing or broken;
- a <table> without a data row with text in it.

The browser's DNS answers nothing (`--host-resolver-rules`), so nothing leaves the machine and a page
that reaches out fails fast; virtual time runs the page's timers ahead (up to `budget_ms`) and waits for
pending fetches, so a request a script makes after the load is seen too, without waiting for real."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
LOCAL_SCHEMES = ("data:", "blob:", "about:")  # in the page itself or made by it: no network, no file
MAX_VIEWPORT_HEIGHT = 30000  # pixels: the whole of any report (a viewport this tall takes ~150 MB to draw)


def chromium_path() -> str | None:
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


def chromium_unavailable() -> str | None:
    """Why this machine cannot run the browser tests; None when it can."""
    return None if chromium_path() else f"Chromium is not installed (none of {', '.join(CHROMIUM_NAMES)} on PATH)"


class BrowserError(RuntimeError):
    pass


class Chromium:
    """One headless Chromium with a fresh profile in `profile`; `send` a DevTools command and get its
    result; every event is kept in `events` as (method, params, session id)."""

    def __init__(self, profile: Path, width: int = 1280, height: int = 2400) -> None:
        executable = chromium_path()
        if executable is None:
            raise BrowserError(chromium_unavailable())
        self.profile = profile
        commands_read, self._commands = os.pipe()
        self._answers, answers_write = os.pipe()
        arguments = [
            executable, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
            f"--user-data-dir={profile}", "--no-first-run", "--no-default-browser-check",
            "--disable-background-networking", "--disable-extensions", "--disable-sync", "--mute-audio",
            "--host-resolver-rules=MAP * ~NOTFOUND", f"--window-size={width},{height}", "--hide-scrollbars",
        ]  # fmt: skip
        self._log = (profile / "chromium.log").open("wb")
        # The pipe ends must be the browser's fds 3 and 4: they come to the shell as its stdin and stdout, and
        # it moves them there (no preexec_fn in a threaded test process; sh redirects single-digit fds only).
        self.process = subprocess.Popen(
            ["sh", "-c", 'exec "$@" 3<&0 4>&1 0</dev/null 1>&2', "sh", *arguments],
            stdin=commands_read, stdout=answers_write, stderr=self._log,
        )  # fmt: skip
        os.close(commands_read)
        os.close(answers_write)
        self._buffer = b""
        self._next_id = 0
        self.events: list[tuple[str, dict, str | None]] = []
        self._started_by: dict[str, str] = {}  # session of a frame or worker -> the session of what started it
        self._targets: dict[str, str] = {}  # session of a tab -> its target id

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self._post("Browser.close")
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        for fd in (self._commands, self._answers):
            try:
                os.close(fd)
            except OSError:
                pass
        self._log.close()

    def _stderr_tail(self) -> str:
        self._log.flush()
        return (self.profile / "chromium.log").read_text(errors="replace")[-2000:]

    def _post(self, method: str, params: dict | None = None, session: str | None = None) -> int:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self._commands, data):]
        return self._next_id

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError("Chromium did not answer in time")
            if select.select([self._answers], [], [], left)[0]:
                chunk = os.read(self._answers, 1 << 20)
                if not chunk:
                    raise BrowserError(f"Chromium closed its DevTools pipe; its log ends:\n{self._stderr_tail()}")
                self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def _keep(self, message: dict) -> None:
        if "method" not in message:
            return  # the answer to a command posted without waiting
        method, params, session = message["method"], message.get("params", {}), message.get("sessionId")
        self.events.append((method, params, session))
        if method == "Target.attachedToTarget":  # a frame in its own process or a worker: watch it too
            self._started_by[params["sessionId"]] = session
            self._watch(params["sessionId"])
            self._post("Runtime.runIfWaitingForDebugger", session=params["sessionId"])

    def _watch(self, session: str) -> None:
        """Report this target's requests, and hold every frame or worker it starts until it is watched too."""
        self._post("Network.enable", session=session)
        self._post("Target.setAutoAttach", {"autoAttach": True, "waitForDebuggerOnStart": True, "flatten": True}, session)

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30) -> dict:
        sent = self._post(method, params, session)
        deadline = time.monotonic() + timeout
        while True:
            message = self._read(deadline)
            if message.get("id") == sent:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error'].get('message')}")
                return message.get("result", {})
            self._keep(message)

    def wait_for(self, method: str, session: str | None, timeout: float = 30) -> dict:
        """The first event `method` of `session` (one already received counts)."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for name, params, from_session in self.events[seen:]:
                if name == method and from_session == session:
                    return params
            seen = len(self.events)
            self._keep(self._read(deadline))

    def open_tab(self) -> str:
        """A new blank tab, watched (its requests and those of every frame and worker it starts); its session id."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self._targets[session] = target
        self._watch(session)
        self.send("Page.enable", session=session)
        return session

    def close_tab(self, session: str) -> None:
        self.send("Target.closeTarget", {"targetId": self._targets.pop(session)})

    def requests(self, session: str) -> list[str]:
        """Every URL the tab asked for, in order: its own requests and those of the frames and workers it started."""

        def of_tab(at: str | None) -> bool:
            while at is not None and at != session:
                at = self._started_by.get(at)
            return at == session

        urls = []
        for method, params, at in self.events:
            if method == "Network.requestWillBeSent" and of_tab(at):
                urls.append(params["request"]["url"])
            elif method == "Network.webSocketCreated" and of_tab(at):
                urls.append(params["url"])
        return urls

    def load(self, session: str, url: str, budget_ms: int = 5000) -> None:
        """Navigate to `url`, wait for its load event, then let the page run `budget_ms` of virtual time: its
        timers run ahead, and time stands still while a fetch is pending, so whatever the page loads after its
        load event is loaded too. (The policy is set after the load: set on the blank tab, its budget can run
        out before the navigation has begun.)"""
        navigated = self.send("Page.navigate", {"url": url}, session)
        if navigated.get("errorText"):
            raise BrowserError(f"{url}: {navigated['errorText']}")
        self.wait_for("Page.loadEventFired", session)
        # A viewport as tall as the page, as a reader who scrolls through it: lazy images and frames load too.
        height = self.evaluate(session, "document.documentElement.scrollHeight")
        width = self.evaluate(session, "window.innerWidth")
        metrics = {"width": width, "height": min(height, MAX_VIEWPORT_HEIGHT), "deviceScaleFactor": 1, "mobile": False}
        self.send("Emulation.setDeviceMetricsOverride", metrics, session)
        # two frames drawn at that size: the second runs after the lazy elements' intersection checks of the first
        self.evaluate(session, "new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)))")
        policy = {"policy": "pauseIfNetworkFetchesPending", "budget": budget_ms}
        self.send("Emulation.setVirtualTimePolicy", policy, session)
        self.wait_for("Emulation.virtualTimeBudgetExpired", session)

    def evaluate(self, session: str, expression: str) -> Any:
        """The value of a JavaScript expression in the page (a promise is awaited)."""
        result = self.send("Runtime.evaluate", {"expression": expression, "awaitPromise": True, "returnByValue": True}, session)
        if "exceptionDetails" in result:
            raise BrowserError(f"the page's script failed: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")


# What a reader would see, gathered in the page: each image (its decoded size, the size it is drawn), each
# figure without an image, each table's data rows; each named by the heading above it.
PAGE_FACTS = """(() => {
  const text = node => (node ? node.textContent.replace(/\\s+/g, " ").trim() : "");
  const heading = node => {  // its own heading (a figure's), else the nearest one before it
    const own = node.querySelector("h1,h2,h3,h4,h5,h6");
    if (own) return text(own);
    for (let at = node; at; at = at.previousElementSibling || at.parentElement) {
      if (/^H[1-6]$/.test(at.tagName)) return text(at);
      const inner = at !== node && at.querySelectorAll ? at.querySelectorAll("h1,h2,h3,h4,h5,h6") : [];
      if (inner.length) return text(inner[inner.length - 1]);
    }
    return "(no heading)";
  };
  const images = [...document.images].map(img => {
    const box = img.getBoundingClientRect();
    return {name: img.alt || heading(img), src: img.currentSrc.slice(0, 60),
            naturalWidth: img.naturalWidth, naturalHeight: img.naturalHeight, drawnWidth: box.width, drawnHeight: box.height};
  });
  const bare = [...document.querySelectorAll("figure")].filter(figure => !figure.querySelector("img")).map(heading);
  const tables = [...document.querySelectorAll("table")].map(table => {
    const rows = [...table.rows].filter(row => row.querySelector("td"));
    return {name: heading(table), dataRows: rows.length,
            filledRows: rows.filter(row => [...row.cells].some(cell => cell.tagName === "TD" && text(cell))).length};
  });
  return {images, figuresWithoutImage: bare, tables};
})()"""


@dataclass
class PageCheck:
    """What `check_page` found: the problems (empty when none) and the facts they come from."""

    problems: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)  # every URL the page asked for, itself first
    images: list[dict] = field(default_factory=list)
    tables: list[dict] = field(default_factory=list)


def check_page(page: Path, browser: Chromium | None = None, budget_ms: int = 5000) -> PageCheck:
    """Open `page` in a new tab of `browser` (default: a Chromium of its own) and list what is broken in it
    (see the module's docstring)."""
    if browser is None:
        with tempfile.TemporaryDirectory(prefix="fp4lab-chromium-") as profile, Chromium(Path(profile)) as own:
            return check_page(page, own, budget_ms)
    url = page.resolve().as_uri()
    session = browser.open_tab()
    try:
        browser.load(session, url, budget_ms)
        facts = browser.evaluate(session, PAGE_FACTS)
        requests = browser.requests(session)
    finally:
        browser.close_tab(session)
    found = PageCheck(requests=requests, images=facts["images"], tables=facts["tables"])
    for request in requests:
        if request.startswith(LOCAL_SCHEMES) or request == url:
            continue
        short = request if len(request) <= 100 else request[:97] + "..."
        if request.startswith("file:"):
            found.problems.append(f"loads {short} from beside the page: it does not stand on its own")
        else:
            found.problems.append(f"needs the network: it requests {short}")
    for image in found.images:
        if image["naturalWidth"] == 0:
            found.problems.append(f"image {image['name']!r} ({image['src']}) did not decode (naturalWidth 0)")
        elif image["drawnWidth"] == 0 or image["drawnHeight"] == 0:
            found.problems.append(f"image {image['name']!r} is drawn {image['drawnWidth']} x {image['drawnHeight']} pixels")
    found.problems += [f"figure {name!r} has no image" for name in facts["figuresWithoutImage"]]
    for table in found.tables:
        if table["filledRows"] == 0:
            found.problems.append(f"table under {table['name']!r} is empty ({table['dataRows']} data rows, none with text)")
    return found
