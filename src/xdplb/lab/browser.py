"""Headless Chromium for tests of the status page, optionally inside a lab namespace.

Debian's ``chromium`` and ``chromium-driver`` (scripts/deps.sh installs them) are driven
through Selenium with both paths given explicitly, so Selenium Manager never looks for,
or downloads, a browser or a driver. Selenium is a test dependency (the dev extra),
imported where the browser is driven: importing this module does not need it.

The daemon listens on 127.0.0.1 inside the lab's ``lb`` namespace, which the test
process cannot reach. So with ``ns`` every WebDriver call runs on one worker thread
that stays in that namespace (:func:`xdplb.lab.netns.enter`): chromedriver and chromium
are started from that thread and inherit the namespace, and the client's connections
to chromedriver's 127.0.0.1 port are opened there too (including the reconnects that a
connection pool makes later, which a block that switched back would send to the wrong
127.0.0.1). Without ``ns`` the same worker simply stays in the caller's namespace.

::

    with Browser(ns=lab.ns("lb")) as b:
        b.open(f"http://127.0.0.1:{port}/")
        b.wait_for(lambda b: int(b.attr("body", "data-updated") or 0) >= 2)
        b.click('[data-backend="198.18.0.11"] button[data-action]')
        b.screenshot("/tmp/status.png")
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from xdplb.core.closing import Closing
from xdplb.core.errors import LabError
from xdplb.lab import netns
from xdplb.lab.wait import wait_for

if TYPE_CHECKING:
    from selenium import webdriver
    from selenium.webdriver.remote.webelement import WebElement

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")

T = TypeVar("T")

#: Seconds between two evaluations of a wait_for condition.
POLL_INTERVAL = 0.05


class ElementMissing(LabError):
    """No element matches the selector (yet): wait_for retries on it."""


def chromium_version(chromium: Path = CHROMIUM) -> str:
    """``Chromium 120.0.6099.224 built on Debian ...``, from ``chromium --version``."""
    done = subprocess.run(
        [str(chromium), "--version"], capture_output=True, text=True, check=True, timeout=30
    )
    return done.stdout.strip()


def _options(chromium: Path, profile: Path, width: int, height: int) -> webdriver.ChromeOptions:
    from selenium import webdriver

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(chromium)
    for arg in (
        "--headless=new",
        # We run as root, where Chromium's sandbox refuses to start.
        "--no-sandbox",
        f"--user-data-dir={profile}",
        f"--window-size={width},{height}",
        "--force-device-scale-factor=1",
        "--hide-scrollbars",
        "--disable-gpu",
        # Containers often have a tiny /dev/shm; /tmp is fine for the renderer's memory.
        "--disable-dev-shm-usage",
        # A test browser talks to the page under test and to nothing else.
        "--no-proxy-server",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
    ):
        opts.add_argument(arg)
    # Keep the page's console so tests can show it (Browser.console()).
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return opts


class Browser(Closing):
    """One headless Chromium window (``width`` x ``height``), closed on exit.

    ``ns``: the full name of a network namespace (``lab.ns("lb")``) to run the browser
    in; None keeps the caller's. Selectors are CSS. Methods that read one element use
    the first match and raise :class:`ElementMissing` if there is none.
    """

    def __init__(
        self,
        ns: str | None = None,
        *,
        width: int = 1280,
        height: int = 900,
        chromium: Path = CHROMIUM,
        chromedriver: Path = CHROMEDRIVER,
        timeout: float = 10.0,
    ) -> None:
        self.ns = ns
        self.width = width
        self.height = height
        self.chromium = chromium
        self.chromedriver = chromedriver
        #: Default timeout of wait_for, and of page loads.
        self.timeout = timeout
        self._worker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="browser"
        )
        self._worker_ident: int | None = None
        self._ns_stack = contextlib.ExitStack()
        self._profile: Path | None = None
        self._driver: webdriver.Chrome | None = None

    # -- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> Browser:
        try:
            self._call(self._start)
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        from selenium import webdriver
        from selenium.common.exceptions import WebDriverException
        from selenium.webdriver.chrome.service import Service

        for path in (self.chromium, self.chromedriver):
            if not path.is_file():
                raise LabError(f"{path} is missing: apt-get install chromium chromium-driver")
        if self.ns is not None:
            self._ns_stack.enter_context(netns.enter(self.ns))
        self._profile = Path(tempfile.mkdtemp(prefix="xdplb-chromium-"))
        # chromedriver's log stays in the profile directory, which close() removes: it
        # holds the URLs the test opened (a status page URL may carry ?token=).
        service = Service(
            str(self.chromedriver), log_output=str(self._profile / "chromedriver.log")
        )
        opts = _options(self.chromium, self._profile / "profile", self.width, self.height)
        try:
            driver = webdriver.Chrome(service=service, options=opts)
        except WebDriverException as exc:
            raise LabError(f"chromium did not start: {exc.msg}") from exc
        self._driver = driver
        driver.set_page_load_timeout(self.timeout)
        # --window-size is the outer size; the page should get width x height itself (a
        # 1280x900 screenshot), so grow the window by what the browser's frame takes.
        inner = driver.execute_script("return [window.innerWidth, window.innerHeight]")
        if inner != [self.width, self.height]:
            driver.set_window_size(2 * self.width - inner[0], 2 * self.height - inner[1])

    def close(self) -> None:
        """Quit the browser and the driver, leave the namespace, remove the profile.
        Safe to call twice."""
        if self._worker_ident is not None or self._driver is not None:
            with contextlib.suppress(Exception):
                self._call(self._quit)
        self._worker.shutdown(wait=True)
        if self._profile is not None:
            shutil.rmtree(self._profile, ignore_errors=True)
            self._profile = None

    def _quit(self) -> None:
        try:
            if self._driver is not None:
                driver, self._driver = self._driver, None
                try:
                    driver.quit()
                finally:
                    # quit() stops chromedriver; make sure of it if the session was dead.
                    proc = driver.service.process
                    if proc is not None and proc.poll() is None:
                        proc.kill()
                        proc.wait()
        finally:
            self._ns_stack.close()

    # -- the worker thread --------------------------------------------------------------

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the worker thread (the one in ``ns``) and return its result."""
        if threading.get_ident() == self._worker_ident:
            return fn(*args)

        def on_worker() -> T:
            self._worker_ident = threading.get_ident()
            return fn(*args)

        return self._worker.submit(on_worker).result()

    @property
    def driver(self) -> webdriver.Chrome:
        """The Selenium driver. Use it only through :meth:`run` (from the worker thread)."""
        if self._driver is None:
            raise LabError("the browser is not running (use it as a context manager)")
        return self._driver

    def run(self, fn: Callable[[webdriver.Chrome], T]) -> T:
        """``fn(driver)`` on the worker thread: anything the methods here do not cover."""
        return self._call(lambda: fn(self.driver))

    def _all(self, css: str) -> list[WebElement]:
        from selenium.webdriver.common.by import By

        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def _first(self, css: str) -> WebElement:
        found = self._all(css)
        if not found:
            raise ElementMissing(f"no element matches {css!r}")
        return found[0]

    # -- what tests use -----------------------------------------------------------------

    def open(self, url: str) -> None:
        """Load ``url`` and wait for its load event."""
        self._call(lambda: self.driver.get(url))

    @property
    def url(self) -> str:
        """The address bar now (the status page removes ?token= once it has read it)."""
        return self._call(lambda: self.driver.current_url)

    def wait_for(
        self,
        what: str | Callable[[Browser], T],
        timeout: float | None = None,
        *,
        visible: bool = False,
        message: str = "",
    ) -> T | bool:
        """Wait until ``what`` holds; returns its value (True for a selector).

        ``what``: a CSS selector (some element matches it, and is displayed if
        ``visible``) or a callable taking this Browser, retried until it returns
        something truthy (ElementMissing and stale elements count as "not yet").
        Raises LabError after ``timeout`` seconds (default: ``self.timeout``) with
        ``message``, the last value or error, and the page's connection state.
        """
        from selenium.common.exceptions import (
            NoSuchElementException,
            StaleElementReferenceException,
        )

        # Raised while the page is still changing under a condition: tried again.
        retry = (ElementMissing, NoSuchElementException, StaleElementReferenceException)
        if isinstance(what, str):
            css = what

            def check(b: Browser) -> bool:
                if not visible:
                    return b.count(css) > 0
                return b._call(lambda: b._first(css).is_displayed())

            cond: Callable[[Browser], Any] = check
            desc = f"selector {css!r}" + (" visible" if visible else "")
        else:
            cond = what
            desc = getattr(what, "__name__", "condition")
        return wait_for(  # type: ignore[no-any-return]
            lambda: cond(self),
            f"{message}: {desc}" if message else desc,
            timeout=self.timeout if timeout is None else timeout,
            interval=POLL_INTERVAL,
            retry=retry,
            detail=self._page_state,
        )

    def _page_state(self) -> str:
        try:
            return str(
                self.js(
                    "return `body data-connection=${document.body.dataset.connection}"
                    " data-updated=${document.body.dataset.updated}`"
                )
            )
        except Exception as exc:  # the page itself may be what failed
            return f"page state unknown ({exc.__class__.__name__})"

    def count(self, css: str) -> int:
        """How many elements match ``css``."""
        return self._call(lambda: len(self._all(css)))

    def text(self, css: str) -> str:
        """The rendered text of the first match (empty if it is hidden)."""
        return self._call(lambda: self._first(css).text)

    def texts(self, css: str) -> list[str]:
        """The rendered text of every match, in document order."""
        return self._call(lambda: [e.text for e in self._all(css)])

    def attr(self, css: str, name: str) -> str | None:
        """Attribute ``name`` of the first match as written in the DOM (None: absent)."""
        return self._call(lambda: self._first(css).get_dom_attribute(name))

    def click(self, css: str) -> None:
        """Click the first match (scrolled into view first, as a user would)."""
        self._call(lambda: self._first(css).click())

    def js(self, script: str, *args: Any) -> Any:
        """Run ``script`` in the page (a function body: ``return ...``) and return its
        value. Elements passed in ``args`` must come from :meth:`run`."""
        return self._call(lambda: self.driver.execute_script(script, *args))

    def console(self) -> list[str]:
        """The page's console messages since the last call ("LEVEL message")."""

        def read() -> list[dict[str, Any]]:
            return self.driver.get_log("browser")  # type: ignore[no-untyped-call,no-any-return]

        entries = self._call(read)
        return [f"{e.get('level')} {e.get('message')}" for e in entries]

    def screenshot(self, path: str | os.PathLike[str]) -> Path:
        """Save the viewport as a PNG at ``path``; returns the path."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        if not self._call(lambda: self.driver.save_screenshot(str(out))):
            raise LabError(f"screenshot to {out} failed")
        return out
