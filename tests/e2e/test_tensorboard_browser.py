"""TensorBoard in a real browser: Debian's headless Chromium, driven over the DevTools protocol.

The run and the TensorBoard serving it are tests/e2e/conftest.py's session fixtures (shared with
test_tensorboard.py). Chromium starts headless with a fresh profile and no network beyond
127.0.0.1; the test loads TensorBoard's first screen (``http://127.0.0.1:PORT/``, no fragment),
waits (bounded) for it to render, and asserts from the DOM, without clicking, that the MFU
breakdown is what it shows: the ``MFU`` and ``MFU_breakdown_pct`` groups expanded, their cards in
view, MFU in percent. Then it visits the custom-scalar, image and text dashboards. A screenshot of
each view goes to ``<tmp>/screenshots`` and, if ``MESHKIT_ARTIFACTS`` is set, to
``$MESHKIT_ARTIFACTS/tensorboard``. Without Chromium the test skips, except under ``CI=true``,
where it fails (``.ci/run`` installs it).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from typing import Any

import pytest

from meshkit.profiling import report as R
from tests.e2e.conftest import free_port, wait_for

pytestmark = pytest.mark.slow
CHROMIUM = os.environ.get("MESHKIT_CHROMIUM", "/usr/bin/chromium")
VIEWPORT = (1440, 900)  # a laptop's browser window
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-extensions", f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}"]

# Text of the nodes inside the viewport, walking shadow roots and same-origin iframes (TensorBoard's
# legacy dashboards are Polymer elements with shadow DOM). One string per node, with its top edge.
VISIBLE_TEXT_JS = """
(() => {
  const out = [], H = window.innerHeight, W = window.innerWidth;
  const visit = (node, dx, dy, win) => {
    if (node.nodeType === Node.TEXT_NODE) {
      const t = node.textContent.trim();
      if (!t) return;
      const r = document.createRange(); r.selectNodeContents(node);
      const b = r.getBoundingClientRect();
      const el = node.parentElement, st = el && win.getComputedStyle(el);
      if (b.width > 0 && b.height > 0 && b.bottom + dy > 0 && b.top + dy < H && b.right + dx > 0 && b.left + dx < W
          && (!st || (st.visibility !== 'hidden' && st.display !== 'none' && st.opacity !== '0')))
        out.push([t, Math.round(b.top + dy)]);
      return;
    }
    if (node.nodeType !== Node.ELEMENT_NODE && node.nodeType !== Node.DOCUMENT_FRAGMENT_NODE
        && node.nodeType !== Node.DOCUMENT_NODE) return;
    if (node.shadowRoot) visit(node.shadowRoot, dx, dy, win);
    if (node.tagName === 'IFRAME') {
      try { const b = node.getBoundingClientRect();
            visit(node.contentDocument, dx + b.left, dy + b.top, node.contentWindow); } catch (e) {}
    }
    for (const c of node.childNodes) visit(c, dx, dy, win);
  };
  visit(document, 0, 0, window);
  return JSON.stringify(out);
})()
"""

# Images inside the viewport (same walk), with their drawn and natural sizes.
VISIBLE_IMAGES_JS = """
(() => {
  const out = [], H = window.innerHeight;
  const visit = (node) => {
    if (!node) return;
    if (node.shadowRoot) visit(node.shadowRoot);
    if (node.tagName === 'IMG') {
      const b = node.getBoundingClientRect();
      if (b.width > 0 && b.top < H && b.bottom > 0 && node.complete && node.naturalWidth > 0)
        out.push({src: node.src, width: Math.round(b.width), natural: node.naturalWidth, top: Math.round(b.top)});
    }
    for (const c of (node.children || [])) visit(c);
  };
  visit(document);
  return JSON.stringify(out);
})()
"""


class DevTools:
    """A minimal DevTools-protocol client over one page target's websocket (``websocket-client``)."""

    def __init__(self, ws_url: str, timeout_s: float = 30.0) -> None:
        import websocket

        self.ws = websocket.create_connection(ws_url, timeout=timeout_s, suppress_origin=True)
        self.next_id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one command and return its result (events that arrive meanwhile are dropped)."""
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:  # each recv is bounded by the socket timeout
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"DevTools {method}: {msg['error']}")
                return msg.get("result", {})

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"DevTools evaluate: {result['exceptionDetails']}")
        return result["result"].get("value")

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url="about:blank")  # a fragment-only change would not reload
        self.call("Page.navigate", url=url)

    def visible_text(self) -> list[tuple[str, int]]:
        return [tuple(x) for x in json.loads(self.evaluate(VISIBLE_TEXT_JS))]

    def visible_images(self) -> list[dict[str, Any]]:
        return json.loads(self.evaluate(VISIBLE_IMAGES_JS))

    def screenshot(self, path: str) -> str:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
        return path

    def close(self) -> None:
        self.ws.close()


def _need_chromium() -> None:
    if os.path.exists(CHROMIUM):
        return
    why = f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run does it on CI)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(why + ": the browser test must run on CI")
    pytest.skip(why)


@pytest.fixture
def browser(tmp_path):
    """A headless Chromium with a fresh profile; yields a DevTools client on its page."""
    _need_chromium()
    try:
        import websocket  # noqa: F401
    except ImportError:
        pytest.fail("websocket-client is missing: pip install -e '.[test]'")
    profile = tempfile.mkdtemp(prefix="meshkit-chromium-", dir=tmp_path)
    port = free_port()
    proc = subprocess.Popen([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                             f"--remote-debugging-port={port}", "--remote-allow-origins=*", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tools = None
    try:
        def page_target():
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
                return next((t["webSocketDebuggerUrl"] for t in json.loads(r.read()) if t["type"] == "page"), None)

        tools = DevTools(wait_for(page_target, 60, "Chromium's DevTools page target", every_s=0.5))
        tools.call("Page.enable")
        tools.call("Emulation.setDeviceMetricsOverride", width=VIEWPORT[0], height=VIEWPORT[1],
                   deviceScaleFactor=1, mobile=False)
        yield tools
    finally:
        if tools is not None:
            tools.close()
        proc.kill()
        proc.wait(timeout=30)


def _texts(tools: DevTools) -> set[str]:
    return {t for t, _ in tools.visible_text()}


def test_first_screen_shows_where_the_mfu_went(browser, tensorboard_port, tb_run, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    shots = tmp_path / "screenshots"
    shots.mkdir()
    base = f"http://127.0.0.1:{tensorboard_port}/"
    bucket_tags = [R.breakdown_tag(p) for p in R.BREAKDOWN_PARTS]

    # 1. the first screen: no fragment, nothing clicked
    browser.goto(base)
    wait_for(lambda: {R.MFU_TAG, R.HFU_TAG} <= _texts(browser), 90, "the MFU cards on TensorBoard's first screen")
    wait_for(lambda: browser.visible_images(), 30, "the waterfall image on the first screen")
    time.sleep(1.0)  # the charts' last paint
    first = browser.visible_text()
    browser.screenshot(str(shots / "1_first_screen.png"))
    texts = {t for t, _ in first}
    top = {t: y for t, y in reversed(first)}  # the highest occurrence of each text
    assert "Time Series" in texts or "TIME SERIES" in texts, sorted(texts)
    # both meshkit groups are expanded and first, above Lightning's epoch / hp_metric
    assert R.HEADLINE_GROUP in texts and R.BREAKDOWN_GROUP in texts, sorted(texts)
    visible_buckets = [t for t in bucket_tags if t in texts]
    assert len(visible_buckets) >= 3, (visible_buckets, sorted(texts))
    assert top[R.MFU_TAG] < top[visible_buckets[0]]
    assert all(t not in texts for t in ("epoch", "hp_metric")) or top.get("epoch", 1e9) > top[R.BREAKDOWN_GROUP]
    # the waterfall image is drawn at card width, not a thumbnail
    (waterfall, *_) = browser.visible_images()
    assert "waterfall" in waterfall["src"] or "individualImage" in waterfall["src"], waterfall
    assert waterfall["width"] >= 330, waterfall
    # MFU in percent: the MFU card's y axis spans the logged percentages (a fraction would top out below 1)
    _, log_dir = tb_run
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    mfu_pct = [e.value for e in acc.Scalars(R.MFU_TAG)]
    assert max(mfu_pct) > 1.0  # the tiny CPU run's MFU is a few percent: a fraction would be < 1
    assert all(t in acc.Tags()["scalars"] for t in bucket_tags)

    # 2. every bucket card is in the expanded group: scroll to it (no click) and look
    browser.evaluate(f"""(() => {{ const walk = (n) => {{ if (!n) return null;
        if (n.nodeType === 3 && n.textContent.trim() === {json.dumps(R.breakdown_tag('validation'))})
          return n.parentElement;
        for (const c of n.childNodes) {{ const r = walk(c); if (r) return r; }}
        return n.shadowRoot ? walk(n.shadowRoot) : null; }};
      const el = walk(document.body); if (el) el.scrollIntoView({{block: 'center'}}); return !!el; }})()""")
    wait_for(lambda: R.breakdown_tag("validation") in _texts(browser), 20, "the last bucket card after scrolling")
    time.sleep(1.0)
    browser.screenshot(str(shots / "2_breakdown_cards.png"))
    seen = set(visible_buckets) | {t for t in bucket_tags if t in _texts(browser)}
    assert seen == set(bucket_tags), sorted(set(bucket_tags) - seen)

    # 3. the custom-scalar layout: one chart per series, each titled with its bucket and unit
    browser.goto(base + "#custom_scalars")
    wait_for(lambda: "compute (% of step)" in _texts(browser), 60, "the custom-scalar charts")
    time.sleep(1.5)
    browser.screenshot(str(shots / "3_custom_scalars.png"))
    assert R.LAYOUT_TITLE in _texts(browser)

    # 4. the waterfall in the IMAGES dashboard
    browser.goto(base + "#images")
    wait_for(lambda: browser.visible_images(), 60, "the waterfall in the images dashboard")
    time.sleep(1.0)
    browser.screenshot(str(shots / "4_waterfall.png"))
    assert R.WATERFALL_TAG in _texts(browser)

    # 5. the tables in the TEXT dashboard: the breakdown table and the pre-formatted overlap tables
    browser.goto(base + "#text")
    wait_for(lambda: "achieved MFU" in _texts(browser), 60, "the breakdown table")
    time.sleep(1.0)
    browser.screenshot(str(shots / "5_tables.png"))
    text = browser.visible_text()
    cells = {t for t, _ in text}
    assert {"part", "% of step", "MFU points lost"} <= cells, sorted(cells)
    # no cell wrapped letter by letter: every bucket name is one text node on one line
    assert {"compute", "exposed_comm", "data_wait"} <= cells, sorted(cells)

    out = os.environ.get("MESHKIT_ARTIFACTS")
    if out:
        dest = os.path.join(out, "tensorboard")
        os.makedirs(dest, exist_ok=True)
        for png in sorted(shots.iterdir()):
            shutil.copy(png, dest)
