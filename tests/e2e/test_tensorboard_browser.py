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

The PYTORCH_PROFILER tests open torch-tb-profiler's tab on the run's traces: its left pane as it is offline, then
its Trace view drawing rank0's trace with the page's two external scripts answered through DevTools (Fetch) by
test-only stand-ins: npm's copy of the web-components polyfill (``WEBCOMPONENTS_JS``; missing: skip, or fail under
``CI=true``, as for Chromium) and a do-nothing shim for Google Charts' loader (``CHARTS_SHIM_JS``).
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
from meshkit.profiling.trace import PHASE_MARKERS
from tests.e2e.conftest import free_port, wait_for
from tests.e2e.test_tensorboard import PROFILER_TAB_EXTERNAL_SCRIPTS

pytestmark = pytest.mark.slow
CHROMIUM = os.environ.get("MESHKIT_CHROMIUM", "/usr/bin/chromium")
VIEWPORT = (1440, 900)  # a laptop's browser window
# No network beyond 127.0.0.1: every other host name resolves to nothing and no proxy is used (a request that
# DevTools.route answers never reaches the resolver).
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-extensions", f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}",
                  "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", "--no-proxy-server"]

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


# Scroll (no click) the scrollable panel that holds a given text by some pixels (TIME SERIES renders only
# the cards near the viewport, so a card is looked for on screen, not in the DOM).
SCROLL_DOWN_JS = """
(() => {
  const find = (n) => {
    if (n.nodeType === Node.TEXT_NODE) return n.textContent.trim() === %s ? n.parentElement : null;
    for (const c of [...(n.shadowRoot ? [n.shadowRoot] : []), ...n.childNodes]) { const r = find(c); if (r) return r; }
    return null;
  };
  let el = find(document.body);
  while (el && !(el.scrollHeight > el.clientHeight + 10 && getComputedStyle(el).overflowY !== 'visible'))
    el = el.parentElement;
  if (!el) return false;
  el.scrollTop = Math.min(el.scrollTop + %d, el.scrollHeight - el.clientHeight);
  return true;
})()
"""

# The middle [x, y] of the first node inside the viewport whose text is the given one (same walk as above), or null.
CENTER_OF_TEXT_JS = """
(() => {
  const want = %s, H = window.innerHeight, W = window.innerWidth;
  const visit = (node, dx, dy) => {
    if (node.nodeType === Node.TEXT_NODE) {
      if (node.textContent.trim() !== want) return null;
      const r = document.createRange(); r.selectNodeContents(node);
      const b = r.getBoundingClientRect(), x = b.left + b.width / 2 + dx, y = b.top + b.height / 2 + dy;
      return b.width > 0 && b.height > 0 && x > 0 && x < W && y > 0 && y < H ? [x, y] : null;
    }
    if (node.nodeType !== Node.ELEMENT_NODE && node.nodeType !== Node.DOCUMENT_FRAGMENT_NODE
        && node.nodeType !== Node.DOCUMENT_NODE) return null;
    const kids = [...(node.shadowRoot ? [[node.shadowRoot, dx, dy]] : [])];
    if (node.tagName === 'IFRAME') {
      try { const b = node.getBoundingClientRect(); kids.push([node.contentDocument, dx + b.left, dy + b.top]); }
      catch (e) {}
    }
    for (const c of node.childNodes) kids.push([c, dx, dy]);
    for (const [c, x, y] of kids) { const r = c && visit(c, x, y); if (r) return r; }
    return null;
  };
  return visit(document, 0, 0);
})()
"""


class DevTools:
    """A minimal DevTools-protocol client over one page target's websocket (``websocket-client``)."""

    def __init__(self, ws_url: str, timeout_s: float = 90.0) -> None:  # a loaded 2-core CI box: navigations take long
        import websocket

        self.ws = websocket.create_connection(ws_url, timeout=timeout_s, suppress_origin=True)
        self.next_id = 0
        self.routes: dict[str, tuple[str, bytes]] = {}
        self.served: list[str] = []  # the routed URLs the page requested, in order
        self._answers: set[int] = set()  # ids of the Fetch.fulfillRequest commands sent from inside call()

    def _send(self, method: str, params: dict[str, Any]) -> int:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        return self.next_id

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one command and return its result. Meanwhile a request paused by :meth:`route` is answered; other
        events are dropped."""
        own = self._send(method, params)
        while True:  # each recv is bounded by the socket timeout
            msg = json.loads(self.ws.recv())
            if msg.get("method") == "Fetch.requestPaused":
                self._answer(msg["params"])
            elif msg.get("id") in self._answers:
                self._answers.discard(msg["id"])
                if "error" in msg:
                    raise RuntimeError(f"DevTools Fetch.fulfillRequest: {msg['error']}")
            elif msg.get("id") == own:
                if "error" in msg:
                    raise RuntimeError(f"DevTools {method}: {msg['error']}")
                return msg.get("result", {})

    def route(self, routes: dict[str, tuple[str, bytes]]) -> None:
        """Answer requests for these exact URLs with (content type, body) instead of the network, in every frame of
        the page (DevTools' Fetch domain pauses them before name resolution)."""
        self.routes.update(routes)
        self.call("Fetch.enable", patterns=[{"urlPattern": url, "requestStage": "Request"} for url in self.routes])

    def _answer(self, paused: dict[str, Any]) -> None:
        url = paused["request"]["url"]
        if url not in self.routes:  # a pattern matched more than the exact URL: leave it to the (blocked) network
            self._answers.add(self._send("Fetch.continueRequest", {"requestId": paused["requestId"]}))
            return
        mime, body = self.routes[url]
        self.served.append(url)
        self._answers.add(self._send("Fetch.fulfillRequest", {
            "requestId": paused["requestId"], "responseCode": 200,
            "responseHeaders": [{"name": "Content-Type", "value": mime}],
            "body": base64.b64encode(body).decode()}))

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"DevTools evaluate: {result['exceptionDetails']}")
        return result["result"].get("value")

    def click_text(self, text: str) -> None:
        """Click (mouse down, up) the middle of the first node on screen whose text is ``text``, in any frame."""
        at = self.evaluate(CENTER_OF_TEXT_JS % json.dumps(text))
        if at is None:
            raise AssertionError(f"no {text!r} on screen to click")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=at[0], y=at[1], button="left", clickCount=1)

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
    """The visible texts, with TIME SERIES card titles joined (it draws ``MFU`` and ``/mfu_pct`` apart)."""
    seen = tools.visible_text()
    return {t for t, _ in seen} | {a + b for (a, ya), (b, yb) in zip(seen, seen[1:]) if b.startswith("/") and ya == yb}


def _card_value(seen: list[tuple[str, int]], title: str, run: str) -> float:
    """The "Value" cell of ``run``'s row in the data table of the TIME SERIES card titled ``title``."""
    group, rest = title.split("/", 1)
    i = next(i for i, ((a, _), (b, _)) in enumerate(zip(seen, seen[1:])) if a == group and b == "/" + rest)
    j = next(j for j in range(i, len(seen)) if seen[j][0] == run)
    return float(seen[j + 2][0])  # run, smoothed, value


def test_first_screen_shows_where_the_mfu_went(browser, tensorboard_port, tb_run, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    shots = tmp_path / "screenshots"
    shots.mkdir()
    base = f"http://127.0.0.1:{tensorboard_port}/"
    bucket_tags = [R.breakdown_tag(p) for p in R.BREAKDOWN_PARTS]
    _, log_dir = tb_run
    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    run = os.path.relpath(log_dir, os.path.dirname(os.path.dirname(log_dir)))  # "demo/version_0"

    # 1. the first screen: no fragment, nothing clicked
    browser.goto(base)
    wait_for(lambda: {R.WATERFALL_TAG, R.MFU_TAG} <= _texts(browser), 90, "the MFU cards on the first screen", every_s=0.25)
    wait_for(lambda: browser.visible_images(), 30, "the waterfall image on the first screen", every_s=0.25)
    time.sleep(1.0)  # the charts' last paint
    first = browser.visible_text()
    browser.screenshot(str(shots / "1_first_screen.png"))
    texts = _texts(browser)
    top = {t: y for t, y in reversed(first)}  # the highest occurrence of each text
    assert "Time Series" in texts, sorted(texts)
    # the two meshkit groups are expanded, first, and above Lightning's hp_metric / epoch (further down, if at all)
    assert top[R.HEADLINE_GROUP] < top[R.BREAKDOWN_GROUP] < top.get("hp_metric", 1e9), first
    assert "epoch" not in texts or top["epoch"] > top[R.BREAKDOWN_GROUP], first
    visible_buckets = [t for t in bucket_tags if t in texts]
    assert len(visible_buckets) >= 2, (visible_buckets, first)  # the breakdown group's first row
    # the waterfall: top left, drawn across the card (≥ 330 px), not a thumbnail
    (waterfall,) = [im for im in browser.visible_images() if "imageData" in im["src"]]
    assert waterfall["width"] >= 330 and waterfall["top"] < top[R.BREAKDOWN_GROUP], waterfall
    # MFU in percent: the card shows the last logged MFU_TAG value, which is 100 x the MFU fraction
    logged = acc.Scalars(R.MFU_TAG)[-1].value
    assert _card_value(first, R.MFU_TAG, run) == pytest.approx(logged, rel=2e-3, abs=1e-4)
    assert acc.Scalars(R.window_tag("mfu_pct"))[-1].value > 0

    # 2. every bucket card is in the expanded group: scroll to it (no click) and look
    seen = set(visible_buckets)

    def scrolled_to_last_bucket() -> bool:
        # one step down, then wait (bounded) for the cards now on screen to render before the next step:
        # under load TIME SERIES renders a card some time after it scrolls into view
        assert browser.evaluate(SCROLL_DOWN_JS % (json.dumps(R.BREAKDOWN_GROUP), 250)), "no scrollable card panel"
        on_screen = wait_for(lambda: [t for t in bucket_tags if t in _texts(browser)], 10,
                             "a bucket card after scrolling", every_s=0.25)
        seen.update(on_screen)
        return R.breakdown_tag("validation") in seen

    wait_for(scrolled_to_last_bucket, 90, "the last bucket card, scrolling down", every_s=0.1)
    time.sleep(1.0)
    browser.screenshot(str(shots / "2_breakdown_cards.png"))
    # every bucket has its own card in the expanded group, each seen on screen while scrolling
    assert seen == set(bucket_tags), sorted(set(bucket_tags) - seen)

    # 3. the custom-scalar layout: one chart per series, each titled with its bucket and unit
    browser.goto(base + "#custom_scalars")
    wait_for(lambda: "compute (% of step)" in _texts(browser), 60, "the custom-scalar charts", every_s=0.25)
    time.sleep(1.0)
    browser.screenshot(str(shots / "3_custom_scalars.png"))
    assert R.LAYOUT_TITLE in _texts(browser)

    # 4. the waterfall in the IMAGES dashboard
    browser.goto(base + "#images")
    wait_for(lambda: browser.visible_images(), 60, "the waterfall in the images dashboard", every_s=0.25)
    time.sleep(1.0)
    browser.screenshot(str(shots / "4_waterfall.png"))
    assert R.WATERFALL_TAG in _texts(browser)

    # 5. the tables in the TEXT dashboard: the breakdown table and the pre-formatted overlap tables
    browser.goto(base + "#text")
    wait_for(lambda: "achieved MFU" in _texts(browser), 60, "the breakdown table", every_s=0.25)
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


def test_pytorch_profiler_tab_opens_on_the_run_offline(browser, tensorboard_port, tb_run, tmp_path):
    """The PYTORCH_PROFILER tab (meshkit[tb-profiler], in the test extra) opens on the run's profiler windows with
    nothing beyond 127.0.0.1 reachable: the run, its views (Trace among them) and a worker per rank are listed from
    the traces. Its charts are not drawn offline: the plugin loads Google Charts (www.gstatic.com) for them and a
    web-components polyfill (cdnjs) for its Trace view; README says so and names Perfetto and chrome://tracing for
    offline use (tests/e2e/test_tensorboard.py: those are the only external scripts, and the trace is served)."""
    shots = tmp_path / "screenshots"
    shots.mkdir()
    root, log_dir = tb_run
    run = os.path.relpath(os.path.join(log_dir, "profiler"), str(root))  # "demo/version_0/profiler"
    browser.goto(f"http://127.0.0.1:{tensorboard_port}/#pytorch_profiler")
    wanted = {run, "Views", "Overview", "Workers", "rank0"}
    wait_for(lambda: wanted <= _texts(browser), 120, "the profiler tab's run, views and workers", every_s=0.5)
    time.sleep(1.0)
    browser.screenshot(str(shots / "6_pytorch_profiler.png"))
    out = os.environ.get("MESHKIT_ARTIFACTS")
    if out:
        os.makedirs(os.path.join(out, "tensorboard"), exist_ok=True)
        shutil.copy(shots / "6_pytorch_profiler.png", os.path.join(out, "tensorboard"))


# The web-components polyfill the Trace view's iframe loads from cdnjs (BSD-3-Clause), as npm has it:
# `npm install --prefix ~/.cache/meshkit/npm webcomponents.js@0.7.24` (.ci/run's `browser` step installs it there).
WEBCOMPONENTS_JS = os.environ.get("MESHKIT_WEBCOMPONENTS_JS", os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
    "meshkit", "npm", "node_modules", "webcomponents.js", "webcomponents.min.js"))

# TEST-ONLY stand-in for Google Charts' loader (https://www.gstatic.com/charts/loader.js), which Google's terms do
# not allow to be served from anywhere but gstatic. The plugin's page awaits google.charts.load before it draws any
# pane; its Trace view draws nothing with Charts (catapult's trace viewer, vendored in the plugin, draws it), so
# here `load` and `setOnLoadCallback` just run the callback, and every google.visualization call (the other panes'
# charts and tables, e.g. the Overview's, drawn before the Trace view is picked) does nothing and returns an object
# that does nothing either (without it the Overview's first `new google.visualization.DataTable` throws and React
# unmounts the whole page).
CHARTS_SHIM_JS = b"""
(() => {
  const inert = () => new Proxy(function () {}, {
    get: (f, key) => key === "then" ? undefined
      : key === Symbol.toPrimitive ? () => 0
      : key === Symbol.iterator ? function* () {}
      : inert(),
    apply: () => inert(),
    construct: () => inert(),
  });
  window.google = {
    charts: {
      load: (version, options) => Promise.resolve().then(() => options && options.callback && options.callback()),
      setOnLoadCallback: (callback) => { Promise.resolve().then(callback); },
    },
    visualization: inert(),
  };
})();
"""

# What catapult's trace viewer (in the Trace view's iframe, inside the plugin's iframe) imported, or null before it
# has a model: per thread, [process name, thread name, slice count, distinct slice titles].
TRACE_VIEWER_MODEL_JS = """
(() => {
  const frames = (doc) => {
    const out = [], visit = (n) => {
      if (n.shadowRoot) visit(n.shadowRoot);
      if (n.tagName === 'IFRAME') out.push(n);
      for (const c of (n.children || [])) visit(c);
    };
    visit(doc);
    return out;
  };
  const find = (doc) => {
    for (const f of frames(doc)) {
      try {
        if ((f.getAttribute('src') || '').includes('trace_embedding.html')) return f.contentWindow;
        const w = find(f.contentDocument); if (w) return w;
      } catch (e) {}
    }
    return null;
  };
  const w = find(document), viewer = w && w.document.getElementById('trace-viewer');
  if (!viewer || !viewer.model) return null;
  return JSON.stringify(viewer.model.getAllThreads().map(t => [
    t.parent.userFriendlyName, t.userFriendlyName, t.sliceGroup.slices.length,
    [...new Set(t.sliceGroup.slices.map(s => s.title))]]));
})()
"""


def _need_webcomponents() -> bytes:
    if os.path.exists(WEBCOMPONENTS_JS):
        with open(WEBCOMPONENTS_JS, "rb") as f:
            return f.read()
    why = (f"no web-components polyfill at {WEBCOMPONENTS_JS} (npm install --prefix ~/.cache/meshkit/npm "
           "webcomponents.js@0.7.24; .ci/run does it on CI)")
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(why + ": the browser test must run on CI")
    pytest.skip(why)


def test_pytorch_profiler_trace_view_renders_the_run_offline(browser, tensorboard_port, tb_run, tmp_path):
    """The PYTORCH_PROFILER tab's Trace view draws rank0's trace with nothing beyond 127.0.0.1 reachable, once its two
    external scripts are stood in for: the web-components polyfill (cdnjs) by npm's copy of the same release, Google
    Charts' loader (gstatic) by CHARTS_SHIM_JS (test-only; the Trace view draws nothing with Charts). Picked as a
    user picks it (Views: Trace, Workers: rank0), catapult's viewer shows the trace's process and thread rows, and
    it imported every slice of the file: the ProfilerStep#N spans and meshkit's phase markers among them."""
    polyfill = _need_webcomponents()
    (charts_url,) = PROFILER_TAB_EXTERNAL_SCRIPTS["index.html"]
    (polyfill_url,) = PROFILER_TAB_EXTERNAL_SCRIPTS["trace_embedding.html"]
    shots = tmp_path / "screenshots"
    shots.mkdir()
    root, log_dir = tb_run
    (trace_file,) = [f for f in os.listdir(os.path.join(log_dir, "profiler")) if f.startswith("rank0.")]
    with open(os.path.join(log_dir, "profiler", trace_file), encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    meta = {(e["name"], e["pid"], e.get("tid")): e["args"] for e in events if e.get("ph") == "M"}
    slices: dict[str, list[str]] = {}  # thread name -> the titles of its complete events, as the file has them
    for e in events:
        if e.get("ph") == "X":
            thread = meta.get(("thread_name", e["pid"], e["tid"]), {}).get("name", str(e["tid"]))  # unnamed: its id
            slices.setdefault(thread, []).append(e["name"])
    steps = {n for names in slices.values() for n in names if n.startswith("ProfilerStep#")}
    markers = {n for names in slices.values() for n in names if n in PHASE_MARKERS}
    assert steps and markers, (steps, markers)  # meshkit's window wrote them (else this test checks nothing)
    processes = {f"{a['name']} (pid {pid})" for (kind, pid, _), a in meta.items()
                 if kind == "process_name"}  # catapult's row title: "python (pid 11625): CPU"

    browser.route({charts_url: ("text/javascript", CHARTS_SHIM_JS), polyfill_url: ("text/javascript", polyfill)})
    browser.goto(f"http://127.0.0.1:{tensorboard_port}/#pytorch_profiler")
    run = os.path.relpath(os.path.join(log_dir, "profiler"), str(root))
    wait_for(lambda: {run, "Views", "Overview", "Workers", "rank0"} <= _texts(browser), 120,
             "the profiler tab's run, views and workers", every_s=0.5)
    browser.click_text("Overview")  # the Views menu
    wait_for(lambda: "Trace" in _texts(browser), 30, "the Views menu's Trace item", every_s=0.25)
    browser.click_text("Trace")
    model = wait_for(lambda: browser.evaluate(TRACE_VIEWER_MODEL_JS), 180, "the trace viewer's model", every_s=0.5)
    threads = {thread: (n, set(titles)) for _, thread, n, titles in json.loads(model)}
    # the rows on screen: every process and thread of the trace (DOM headings; the slices are drawn on a canvas)
    wait_for(lambda: set(slices) <= _texts(browser), 60, "the trace's thread rows", every_s=0.5)
    texts = _texts(browser)
    assert all(any(t.startswith(p) for t in texts) for p in processes), (processes, sorted(texts))
    assert {"Trace", "rank0"} <= texts  # the left pane shows the view and worker picked
    # the viewer imported every complete event of the file, per thread, steps and meshkit's markers among them
    assert {t: (len(names), set(names)) for t, names in slices.items()} == {t: threads.get(t) for t in slices}
    time.sleep(2.0)  # the track canvas's last paint
    browser.screenshot(str(shots / "7_pytorch_profiler_trace.png"))
    assert browser.served == [charts_url, polyfill_url], browser.served  # the stand-ins were used, each once
    out = os.environ.get("MESHKIT_ARTIFACTS")
    if out:
        os.makedirs(os.path.join(out, "tensorboard"), exist_ok=True)
        shutil.copy(shots / "7_pytorch_profiler_trace.png", os.path.join(out, "tensorboard"))
