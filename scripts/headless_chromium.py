"""Headless Chromium driven over the Chrome DevTools protocol on a pipe (--remote-debugging-pipe: JSON messages on
file descriptors 3 and 4, each ended by a NUL byte): nothing to install beyond the browser itself (Debian's
`chromium`). tests/test_token_page.py opens the token page with it; from the command line it takes a screenshot:

    python scripts/headless_chromium.py runs/r/tokens.html shot.png [--width 1200] [--hash 'step=10&objective=acr']
"""
import base64
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--hide-scrollbars", "--remote-debugging-pipe")


def find_browser() -> str | None:
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


class BrowserError(RuntimeError):
    pass


class Chromium:
    """One headless browser and one page (`with Chromium() as page: page.open(path)`)."""

    def __init__(self, width: int = 1200, height: int = 900, timeout: float = 30.0):
        browser = find_browser()
        if browser is None:
            raise BrowserError(f"no browser: none of {BROWSERS} is on PATH (Debian: apt-get install chromium)")
        self.timeout, self.profile = timeout, tempfile.mkdtemp(prefix="qurl-chromium-")
        to_browser, self._out = os.pipe()  # we write, the browser reads fd 3
        self._in, from_browser = os.pipe()  # the browser writes fd 4, we read

        def as_fds_3_and_4():
            os.dup2(to_browser, 3)
            os.dup2(from_browser, 4)

        self.proc = subprocess.Popen([browser, *FLAGS, f"--user-data-dir={self.profile}",
                                      f"--window-size={width},{height}", "about:blank"],
                                     preexec_fn=as_fds_3_and_4, pass_fds=(3, 4), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser)
        os.close(from_browser)
        self._buffer, self._next_id = b"", 0
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False,
                  session=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (BrowserError, OSError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._out, self._in):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)

    def call(self, method: str, session: bool = False, **params) -> dict:
        """Send one command (to the page's session if `session`) and return its result."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        deadline = time.time() + self.timeout
        while True:
            while b"\0" not in self._buffer:
                if time.time() > deadline:
                    raise BrowserError(f"{method}: no answer in {self.timeout:.0f} s")
                chunk = os.read(self._in, 1 << 16)
                if not chunk:
                    raise BrowserError(f"{method}: the browser closed its pipe (exit code {self.proc.poll()})")
                self._buffer += chunk
            line, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(line)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def js(self, expression: str):
        """The value of a JavaScript expression in the page (JSON-able values)."""
        result = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression[:60]}...: {result['exceptionDetails'].get('exception', {}).get('description')}")
        return result["result"].get("value")

    def open(self, path: str, hash: str = "", ready: str = "document.readyState === 'complete'") -> None:
        """Load a local file and wait until `ready` is true in it."""
        file_url = pathlib.Path(path).resolve().as_uri()
        self.call("Page.navigate", session=True, url=file_url + (f"#{hash}" if hash else ""))
        deadline = time.time() + self.timeout
        check = (f"(() => {{ try {{ return location.href.split('#')[0] === {json.dumps(file_url)} && ({ready}); }} "
                 f"catch (e) {{ return false; }} }})()")
        while not self.js(check):
            if time.time() > deadline:
                raise BrowserError(f"{path}: not ready ({ready}) after {self.timeout:.0f} s")
            time.sleep(0.05)

    def hover(self, x: float, y: float) -> None:
        """Move the mouse there (viewport coordinates), as a person would."""
        self.call("Input.dispatchMouseEvent", session=True, type="mouseMoved", x=x, y=y)

    def screenshot(self, full_page: bool = False) -> bytes:
        """A PNG of the viewport (or of the whole page)."""
        return base64.b64decode(self.call("Page.captureScreenshot", session=True, format="png",
                                          captureBeyondViewport=full_page)["data"])


def main(argv=None) -> int:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    from qurl_mini.infra.cli import ArgumentParser  # an unknown flag is one line

    parser = ArgumentParser(description="a PNG screenshot of a local HTML page, in headless Chromium")
    parser.add_argument("page")
    parser.add_argument("png")
    parser.add_argument("--width", type=int, default=1200)
    parser.add_argument("--height", type=int, default=900)
    parser.add_argument("--hash", default="", help="the page's URL fragment, e.g. 'step=10&objective=acr'")
    parser.add_argument("--hover", default=None, help="a CSS selector: hover the first element it matches first")
    args = parser.parse_args(argv)
    try:
        with Chromium(args.width, args.height) as page:
            page.open(args.page, args.hash)
            if args.hover:
                box = page.js(f"(() => {{ const e = document.querySelector({json.dumps(args.hover)}); if (!e) return null;"
                              f" e.scrollIntoView({{block: 'nearest'}}); return e.getBoundingClientRect().toJSON(); }})()")
                if box is None:
                    raise BrowserError(f"--hover {args.hover!r} matches nothing")
                page.hover(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
            png = page.screenshot()
    except BrowserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with open(args.png, "wb") as f:
        f.write(png)
    print(f"wrote {args.png} ({len(png)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
