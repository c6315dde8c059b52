"""Browser checks with headless Chromium (Debian's `chromium` + `chromium-driver`) driven by Selenium.

    python tests/browser/browser_check.py [docs|lab|widget ...]     # all three when none is named

1. docs: every page of the built docs site (`python tools/build_docs.py` -> _docs/, or $BROWSER_DOCS), served over
   http on a free localhost port, loads with no missing image, no failed request to the site, and every internal link
   points to an existing page and anchor.
2. lab: JupyterLab started headless (free localhost port, random token, its own temp root, config and workspace
   folders), one notebook ($BROWSER_NOTEBOOK, default nbs/00a_util.ipynb, copied to the temp root so nothing in the
   repo is written) opened, Run All Cells executed through JupyterLab's own command, the kernel awaited, and no error
   output, both in the page and in the saved file.
3. widget: a temp notebook that displays a harness ($BROWSER_WIDGET = "module:function", default
   static_dist.placement:placement_widget) is run; the widget must render its output, and changing its first control
   (a dropdown, or a slider moved with the arrow keys) must redraw that output, with no error in it.

Screenshots go to $BROWSER_OUT (default /tmp/browser-shots), never into the repo.
"""
from __future__ import annotations

import contextlib, functools, hashlib, http.server, json, os, secrets, shutil, socket, subprocess, sys, tempfile
import threading, time, urllib.request
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else None)
MISSING_BROWSER = None if (CHROMIUM and CHROMEDRIVER) else \
    "chromium and chromium-driver are not installed: apt-get update && apt-get install -y chromium chromium-driver"


def out_dir() -> Path:
    d = Path(os.environ.get("BROWSER_OUT", "/tmp/browser-shots"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


@contextlib.contextmanager
def chrome(width: int = 1400, height: int = 1000):
    "A headless Chromium WebDriver using the system chromedriver (no driver download)."
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", f"--window-size={width},{height}",
              "--no-first-run", "--disable-extensions", "--disable-background-networking"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    drv.set_page_load_timeout(60)
    try: yield drv
    finally: drv.quit()


def wait_for(pred, timeout: float, what: str, every: float = 0.5):
    "Poll `pred()` until it returns a truthy value; AssertionError naming `what` after `timeout` seconds."
    t0, last = time.time(), None
    while time.time() - t0 < timeout:
        try:
            v = pred()
            if v: return v
        except Exception as e: last = e  # page still loading: try again
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}" + (f" (last error: {last})" if last else ""))


# ---------------------------------------------------------------- 1. docs site

@contextlib.contextmanager
def serve(folder: Path):
    "Serve `folder` over http on a free localhost port; yields (base url, list of paths that got a 404)."
    missing = []
    class H(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a): pass
        def send_error(self, code, *a, **k):
            if code == 404: missing.append(self.path)
            return super().send_error(code, *a, **k)
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(H, directory=str(folder)))
    th = threading.Thread(target=srv.serve_forever, daemon=True); th.start()
    try: yield f"http://127.0.0.1:{srv.server_address[1]}/", missing
    finally: srv.shutdown(); srv.server_close()


JS_PAGE = """
const imgs = [...document.images].map(i => ({src: i.currentSrc.slice(0, 120), ok: i.complete && i.naturalWidth > 0}));
const links = [...document.querySelectorAll('a[href]')].map(a => a.getAttribute('href'));
const ids = [...document.querySelectorAll('[id]')].map(e => e.id).concat([...document.querySelectorAll('a[name]')].map(a => a.name));
return {imgs, links, ids, title: document.title, nav: document.querySelectorAll('nav.docs-nav a').length,
        api: document.querySelectorAll('.api-entry').length};
"""


def check_docs(docs: Path, shots: Path) -> dict:
    """Load every page of the built site; return {page: info} and raise AssertionError listing every missing image,
    failed request and broken internal link."""
    pages = sorted(p.name for p in docs.glob("*.html"))
    assert "index.html" in pages, f"no index.html in {docs}: build the site with python tools/build_docs.py"
    problems, info, shot_done = [], {}, set()
    with serve(docs) as (base, missing), chrome() as drv:
        seen = {}
        for name in pages:
            drv.get(urljoin(base, name))
            wait_for(lambda: drv.execute_script("return document.readyState") == "complete", 30, f"{name} to load")
            r = drv.execute_script(JS_PAGE)
            seen[name] = r
            bad_imgs = [i["src"] for i in r["imgs"] if not i["ok"]]
            if bad_imgs: problems.append(f"{name}: {len(bad_imgs)} image(s) did not load: {bad_imgs[:3]}")
            if r["nav"] < len(pages): problems.append(f"{name}: sidebar links {r['nav']} pages, the site has {len(pages)}")
            for e in drv.get_log("browser"):
                if e.get("level") == "SEVERE" and base in e.get("message", ""):
                    problems.append(f"{name}: browser error: {e['message'][:200]}")
            info[name] = dict(images=len(r["imgs"]), links=len(r["links"]), api_entries=r["api"], title=r["title"])
            if r["api"] and "api" not in shot_done:   # one page's API section, as rendered
                drv.execute_script("document.getElementById('api').scrollIntoView()")
                drv.save_screenshot(str(shots / f"docs_api_{name.removesuffix('.html')}.png")); shot_done.add("api")
                drv.execute_script("window.scrollTo(0, 0)")
            if name == "index.html" or (len(r["imgs"]) and "chapter" not in shot_done):
                if name != "index.html":   # show the first plot of the chapter
                    drv.execute_script("document.querySelector('.jp-OutputArea-output img, main img').scrollIntoView()")
                drv.save_screenshot(str(shots / f"docs_{name.removesuffix('.html')}.png"))
                if name != "index.html": shot_done.add("chapter")
        for name, r in seen.items():
            for href in r["links"]:
                u = urlsplit(href)
                if u.scheme or u.netloc or href.startswith(("mailto:", "javascript:", "data:")): continue
                if href.startswith("/"): problems.append(f"{name}: absolute internal link {href!r}"); continue
                target = u.path or name
                if target not in seen: problems.append(f"{name}: link {href!r} to a page that is not in the site"); continue
                frag = u.fragment
                if frag and frag not in seen[target]["ids"] and unquote(frag) not in seen[target]["ids"]:
                    problems.append(f"{name}: link {href!r}: no element with id {frag!r} in {target}")
        if missing: problems.append(f"requests for missing files: {sorted(set(missing))[:5]}")
    if problems: raise AssertionError(f"{len(problems)} problem(s) in the docs site:\n  " + "\n  ".join(problems[:40]))
    return info


# ---------------------------------------------------------------- 2 and 3. JupyterLab

@contextlib.contextmanager
def jupyterlab(root_dir: Path, python: str = sys.executable, timeout: float = 90):
    "JupyterLab on a free localhost port with a random token, its state in temp folders; yields (base url, token)."
    port, token = free_port(), secrets.token_hex(16)
    state = Path(tempfile.mkdtemp(prefix="lab_state_"))
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(state / "config"), JUPYTER_RUNTIME_DIR=str(state / "runtime"),
               JUPYTERLAB_WORKSPACES_DIR=str(state / "workspaces"), JUPYTERLAB_SETTINGS_DIR=str(state / "settings"),
               PYTHONHASHSEED="0")
    env.pop("MPLBACKEND", None)   # as a kernel started from JupyterLab: matplotlib's inline backend
    if shutil.which("nvidia-smi") is None: env.setdefault("TRITON_INTERPRET", "1")
    news = state / "settings" / "@jupyterlab" / "apputils-extension"   # no "get notified about Jupyter news?" popup
    news.mkdir(parents=True); (news / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    log = open(state / "lab.log", "w")
    proc = subprocess.Popen([python, "-m", "jupyter", "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
                             f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
                             f"--ServerApp.root_dir={root_dir}", "--LabApp.expose_app_in_browser=True",
                             "--LabApp.news_url=None",
                             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}/"
    try:
        def up():
            if proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited {proc.returncode}: {(state / 'lab.log').read_text()[-800:]}")
            with urllib.request.urlopen(f"{base}api/status?token={token}", timeout=2) as r: return r.status == 200
        try: wait_for(up, timeout, "JupyterLab's server to answer")
        except RuntimeError as e: raise AssertionError(str(e)) from None
        yield base, token
    finally:
        proc.terminate()
        try: proc.wait(20)
        except subprocess.TimeoutExpired: os.killpg(proc.pid, 9); proc.wait()
        log.close()
        shutil.rmtree(state, ignore_errors=True)


JS_APP_READY = "return !!(window.jupyterapp && window.jupyterapp.shell && window.jupyterapp.shell.currentWidget " \
               "&& window.jupyterapp.shell.currentWidget.sessionContext && window.jupyterapp.shell.currentWidget.sessionContext.session " \
               "&& window.jupyterapp.shell.currentWidget.sessionContext.session.kernel " \
               "&& window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status === 'idle')"
JS_RUN_ALL = """const done = arguments[arguments.length - 1];
window.jupyterapp.commands.execute('notebook:run-all-cells').then(() => done('ok'), e => done('error: ' + e));"""
JS_STATE = """
const nb = window.jupyterapp.shell.currentWidget;
const kernel = nb.sessionContext.session.kernel.status;
const cells = [];
nb.content.widgets.forEach((c, i) => {
  if (c.model.type !== 'code') return;
  const outs = c.model.outputs.toJSON();
  cells.push({i, count: c.model.executionCount, running: (c.promptNode && c.promptNode.textContent || '').includes('*'),
              errors: outs.filter(o => o.output_type === 'error').map(o => o.ename + ': ' + o.evalue)});
});
const domErrors = [...nb.node.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
  .map(e => e.textContent.slice(0, 200));
return {kernel, cells, domErrors};
"""


def open_notebook(drv, base: str, token: str, rel: str, timeout: float = 120):
    drv.get(f"{base}lab/tree/{rel}?token={token}")
    wait_for(lambda: drv.execute_script(JS_APP_READY), timeout, f"JupyterLab to open {rel} with an idle kernel", every=1)


def run_all(drv, timeout: float) -> dict:
    "Run > Run All Cells (JupyterLab's command), then wait until every code cell has run and the kernel is idle."
    drv.set_script_timeout(timeout)
    r = drv.execute_async_script(JS_RUN_ALL)
    assert r == "ok", f"notebook:run-all-cells failed: {r}"
    def finished():
        s = drv.execute_script(JS_STATE)
        return s if s["kernel"] == "idle" and all(c["count"] is not None and not c["running"] for c in s["cells"]) else None
    return wait_for(finished, timeout, "Run All to finish", every=1)


def save(drv):
    drv.set_script_timeout(30)
    r = drv.execute_async_script("""const done = arguments[arguments.length - 1];
        window.jupyterapp.commands.execute('docmanager:save').then(() => done('ok'), e => done('error: ' + e));""")
    assert r == "ok", f"docmanager:save failed: {r}"


def check_lab_run_all(shots: Path, notebook: Path | None = None, timeout: float = 150) -> dict:
    """Open a copy of `notebook` in JupyterLab, Run All, and check there is no error output (page and saved file)."""
    nb = Path(notebook or os.environ.get("BROWSER_NOTEBOOK") or ROOT / "nbs" / "00a_util.ipynb")
    if not nb.is_absolute(): nb = ROOT / nb
    assert nb.exists(), f"no notebook {nb}: set BROWSER_NOTEBOOK to a notebook of the repo"
    with tempfile.TemporaryDirectory(prefix="lab_root_") as tmp:
        tmp = Path(tmp)
        for f in nb.parent.iterdir():  # the notebook and the data files next to it (never written back to the repo)
            if f.is_file() and (f.suffix != ".ipynb" or f == nb): shutil.copy2(f, tmp / f.name)
        with jupyterlab(tmp) as (base, token), chrome() as drv:
            t0 = time.time()
            open_notebook(drv, base, token, nb.name)
            state = run_all(drv, timeout)
            secs = time.time() - t0
            drv.save_screenshot(str(shots / f"lab_run_all_{nb.stem}.png"))
            save(drv)
        saved = json.loads((tmp / nb.name).read_text())
    errors = [f"cell {c['i']}: {e}" for c in state["cells"] for e in c["errors"]]
    file_errors = [f"cell {i}: {o.get('ename')}: {o.get('evalue')}" for i, c in enumerate(saved["cells"])
                   for o in c.get("outputs", []) if o.get("output_type") == "error"]
    ran = sum(1 for c in saved["cells"] if c["cell_type"] == "code" and c.get("execution_count"))
    assert not errors and not file_errors, f"Run All of {nb.name} in JupyterLab left error outputs: {errors or file_errors}"
    assert ran == sum(1 for c in saved["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()), \
        f"Run All of {nb.name}: only {ran} code cells have run"
    return dict(notebook=nb.name, seconds=round(secs, 1), code_cells=len(state["cells"]), stderr_outputs=len(state["domErrors"]))


WIDGET_OUT = ".jp-OutputArea-output .widget-output"


def widget_notebook(spec: str) -> dict:
    mod, _, fn = spec.partition(":")
    assert mod and fn, f"BROWSER_WIDGET={spec!r}: give module:function, e.g. static_dist.placement:placement_widget"
    cells = [dict(cell_type="code", id="c0", metadata={}, execution_count=None, outputs=[],
                  source=f"from {mod} import {fn}\nw = {fn}()\nw")]
    return dict(cells=cells, metadata=dict(kernelspec=dict(name="python3", display_name="python3", language="python")),
                nbformat=4, nbformat_minor=5)


def _output_sig(drv) -> str | None:
    "A fingerprint of what the widget's output area shows now (None while it is empty)."
    html = drv.execute_script(f"const o = document.querySelector('{WIDGET_OUT}'); return o ? o.innerHTML : null;")
    if not html or ("<img" not in html and len(html) < 200): return None
    return hashlib.sha1(html.encode()).hexdigest()


def check_widget(shots: Path, spec: str | None = None, timeout: float = 150) -> dict:
    "Display a harness in JupyterLab, then change its first control and check its output redraws, with no error."
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select
    spec = spec or os.environ.get("BROWSER_WIDGET", "static_dist.placement:placement_widget")
    with tempfile.TemporaryDirectory(prefix="lab_widget_") as tmp:
        (Path(tmp) / "widget_check.ipynb").write_text(json.dumps(widget_notebook(spec), indent=1))
        with jupyterlab(Path(tmp)) as (base, token), chrome() as drv:
            open_notebook(drv, base, token, "widget_check.ipynb")
            state = run_all(drv, timeout)
            errs = [e for c in state["cells"] for e in c["errors"]]
            assert not errs, f"the harness cell raised: {errs}"
            before = wait_for(lambda: _output_sig(drv), 60, f"{spec} to draw its output")
            def no_widget_error():
                return not drv.find_elements(By.CSS_SELECTOR, f"{WIDGET_OUT} .jp-RenderedText[data-mime-type='application/vnd.jupyter.stderr']")
            assert no_widget_error(), f"{spec}: the widget shows an error: " + \
                drv.find_element(By.CSS_SELECTOR, WIDGET_OUT).text[-300:]
            widget = drv.find_element(By.CSS_SELECTOR, ".jp-OutputArea-output .jupyter-widgets")
            drv.execute_script("arguments[0].scrollIntoView()", widget)
            drv.save_screenshot(str(shots / "widget_before.png"))
            selects = drv.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output .widget-dropdown select")
            if selects:
                sel = Select(selects[-1])  # the last dropdown: for placement that is the mesh
                old = sel.first_selected_option.text
                new_i = next(i for i, o in enumerate(sel.options) if o.text != old)
                sel.select_by_index(new_i); control = f"dropdown {old!r} -> {sel.options[new_i].text!r}"
            else:
                handle = drv.find_element(By.CSS_SELECTOR, ".jp-OutputArea-output .widget-slider .noUi-handle")
                handle.click(); handle.send_keys(Keys.ARROW_LEFT); control = "slider moved one step left"
            after = wait_for(lambda: (s := _output_sig(drv)) and s != before and s, timeout,
                             f"{spec} to redraw after the {control}")
            time.sleep(1.0)
            wait_for(lambda: drv.execute_script(JS_STATE)["kernel"] == "idle", timeout, "the kernel to go idle")
            imgs_drawn = f"return [...document.querySelectorAll('{WIDGET_OUT} img')].every(i => i.complete && i.naturalWidth > 0)"
            wait_for(lambda: drv.execute_script(imgs_drawn), 30, "the redrawn plot to finish loading")
            drv.execute_script("arguments[0].scrollIntoView()", widget)
            drv.save_screenshot(str(shots / "widget_after.png"))
            assert no_widget_error(), f"{spec}: after the {control} the widget shows an error: " + \
                drv.find_element(By.CSS_SELECTOR, WIDGET_OUT).text[-300:]
            imgs = len(drv.find_elements(By.CSS_SELECTOR, f"{WIDGET_OUT} img"))
    return dict(widget=spec, control=control, redrawn=before != after, images_after=imgs)


def docs_dir() -> Path:
    "The built site: $BROWSER_DOCS, else _docs/ of the repo (build it first with python tools/build_docs.py)."
    d = Path(os.environ.get("BROWSER_DOCS") or ROOT / "_docs")
    return d


def main(argv=None) -> int:
    which = (argv if argv is not None else sys.argv[1:]) or ["docs", "lab", "widget"]
    if MISSING_BROWSER: print(f"SKIP: {MISSING_BROWSER}"); return 0
    shots, rc = out_dir(), 0
    for w in which:
        t0 = time.time()
        try:
            if w == "docs":
                d = docs_dir()
                if not (d / "index.html").exists():
                    subprocess.run([sys.executable, str(ROOT / "tools" / "build_docs.py"), "--out", str(d)], check=True)
                r = check_docs(d, shots); r = dict(pages=len(r), images=sum(v["images"] for v in r.values()))
            elif w == "lab": r = check_lab_run_all(shots)
            elif w == "widget": r = check_widget(shots)
            else: print(f"unknown check {w!r}: give docs, lab or widget"); return 2
            print(f"ok   {w:7s} {time.time() - t0:5.1f} s  {r}")
        except AssertionError as e:
            print(f"FAIL {w:7s} {time.time() - t0:5.1f} s  {e}"); rc = 1
    print(f"screenshots in {shots}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
