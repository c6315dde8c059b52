"""Browser checks with headless Chromium (Debian's `chromium` + `chromium-driver`) driven by Selenium.

    python tests/browser/browser_check.py [docs|docs-features|reader|lab|harness|clone ...]   # all when none is named

1. docs: every page of the built docs site (`python tools/build_docs.py` -> _docs/, or $BROWSER_DOCS), served over
   http on a free localhost port, loads with no missing image, no failed request to the site, and every internal link
   points to an existing page and anchor.
   docs-features: with the network off (Chromium's proxy is a dead port), a page loads from file:// and from
   localhost requesting nothing else; the search box finds an API name and a page; the [source] links of an API
   entry lead to its notebook cell and to its line in the site's copy of the module (and every such line link in the
   site lands on the definition); on the last page of the sidebar, its entry is in the sidebar's visible area.
2. lab: JupyterLab started headless (free localhost port, random token, its own temp root, config and workspace
   folders), one notebook ($BROWSER_NOTEBOOK, default nbs/00a_util.ipynb, copied to the temp root so nothing in the
   repo is written) opened, Run All Cells executed through JupyterLab's own command, the kernel awaited, and no error
   output, both in the page and in the saved file; nothing in JupyterLab's log console (a `No such comm` warning, a
   stray plot); no widget view saved but a harness's (a progress spinner); no cell showing one picture twice.
   reader: the reader's path through the built site (issue 31): see check_reader.
3. harness, clone: every control of the four chapter harnesses, and the chapter notebooks as a fresh clone shows
   them (untrusted, not run; clean on open): see harness_check.py.

Screenshots go to $BROWSER_OUT (default /tmp/browser-shots), never into the repo.
"""
from __future__ import annotations

import contextlib, functools, hashlib, http.server, json, os, secrets, shutil, socket, subprocess, sys, tempfile
import threading, time, urllib.request
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver") or (
    "/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else None
)
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
def chrome(width: int = 1400, height: int = 1000, offline: bool = False):
    """A headless Chromium WebDriver using the system chromedriver (no driver download). `offline`: every request
    but file:// and loopback goes to a proxy on a port nothing listens on, so it fails as with the network off."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",
    ):
        opts.add_argument(a)
    if offline: opts.add_argument(f"--proxy-server=http://127.0.0.1:{free_port()}")   # loopback itself bypasses it
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
    raise AssertionError(
        f"timed out after {timeout:.0f} s waiting for {what}" + (f" (last error: {last})" if last else "")
    )


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
const ids = [...document.querySelectorAll('[id]')].map(e => e.id)
  .concat([...document.querySelectorAll('a[name]')].map(a => a.name));
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
            if r["nav"] < len(pages):
                problems.append(f"{name}: sidebar links {r['nav']} pages, the site has {len(pages)}")
            for e in drv.get_log("browser"):
                if e.get("level") == "SEVERE" and base in e.get("message", ""):
                    problems.append(f"{name}: browser error: {e['message'][:200]}")
            info[name] = dict(images=len(r["imgs"]), links=len(r["links"]), api_entries=r["api"], title=r["title"])
            if r["api"] and "api" not in shot_done:   # one page's first API entry, as rendered
                drv.execute_script("document.querySelector('.api-entry').scrollIntoView()")
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
                if target not in seen and (docs / target).is_file():   # not a page: a module's copy under src/
                    text = (docs / target).read_text(encoding="utf-8")
                    if u.fragment and f'id="{u.fragment}"' not in text:
                        problems.append(f"{name}: link {href!r}: no element with id {u.fragment!r} in {target}")
                    continue
                if target not in seen:
                    problems.append(f"{name}: link {href!r} to a page that is not in the site")
                    continue
                frag = u.fragment
                if frag and frag not in seen[target]["ids"] and unquote(frag) not in seen[target]["ids"]:
                    problems.append(f"{name}: link {href!r}: no element with id {frag!r} in {target}")
        if missing: problems.append(f"requests for missing files: {sorted(set(missing))[:5]}")
    if problems: raise AssertionError(f"{len(problems)} problem(s) in the docs site:\n  " + "\n  ".join(problems[:40]))
    return info


# ---------------------------------------------------------------- 1c. the reader's path (issue 31)

JS_READER = """
const main = document.querySelector('main.docs-main');
const nav = [...document.querySelectorAll('.docs-nav-list > .chapter')].map(c => ({
  head: c.querySelector('a').getAttribute('href'),
  stages: [...c.querySelectorAll('a.stage')].map(a => a.getAttribute('href'))}));
const outs = [...main.querySelectorAll('.jp-OutputArea-output')];
const snaps = [...main.querySelectorAll('.widget-snapshot')].map(s => ({
  controls: s.querySelectorAll('table.widget-controls tr').length,
  images: [...s.querySelectorAll('img')].filter(i => i.complete && i.naturalWidth > 0).length}));
const twice = [...main.querySelectorAll('.jp-Cell')].filter(c => {
  const s = [...c.querySelectorAll('.jp-OutputArea-output img')].map(i => i.getAttribute('src'));
  return new Set(s).size < s.length;}).length;
return {nav, twice, toc: document.querySelectorAll('aside.docs-toc li').length,
        links: [...main.querySelectorAll('a[href]')].map(a => a.getAttribute('href').split('#')[0]),
        code: [...main.querySelectorAll('pre, code')].map(e => e.textContent).join('\\n'),
        outputs: outs.map(o => o.innerText.slice(0, 2000)),
        tables: main.querySelectorAll('.jp-OutputArea-output table').length,
        images: [...main.querySelectorAll('.jp-OutputArea-output img')]
          .filter(i => i.complete && i.naturalWidth > 0).length,
        snaps};
"""
SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"   # rich's dots spinner: a progress widget saved mid-spin
RAW_DICT = r"\{'[\w.]+': "      # a result printed as a raw dict ({'dp.all_gather': 4, ...}), not as a table
SHOWN_PAGES = ("parallel_plan.html", "parallel_verify.html", "parallel_run.html")   # item 3's pages


def check_reader(docs: Path, shots: Path) -> dict:
    """The reader's path through the built site (issue 31): the front page shows `static-dist plan` (run, a plan
    written, its memory plotted) and the torchrun `train --plan` command, and links every chapter; every chapter
    overview links each of its stages; the parallel plan, verify and run pages show plots and tables, no raw dicts; no
    cell shows one picture twice (a returned pyplot figure is also flushed by the inline backend); no page keeps a
    progress spinner or an `Output()`; every harness snapshot has its controls and a picture; every page is named
    without its number prefix and has a table of contents. Raises AssertionError listing the problems; else a
    summary."""
    import re
    pages = sorted(p.name for p in docs.glob("*.html"))
    problems = [f"{n}: page named with its notebook's number prefix" for n in pages if re.match(r"\d+[a-z]*_", n)]
    with serve(docs) as (base, _missing), chrome() as drv:
        seen = {}
        for name in pages:
            _load(drv, urljoin(base, name))
            seen[name] = r = drv.execute_script(JS_READER)
            if not r["toc"]: problems.append(f"{name}: no headings, so no table of contents")
            if r["twice"]: problems.append(f"{name}: {r['twice']} cell(s) show the same picture twice")
            text = "\n".join(r["outputs"])
            if any(ch in text for ch in SPINNER) or re.search(r"^Output\(\)$", text, re.M):
                problems.append(f"{name}: an output keeps a progress spinner or an empty Output() widget")
            for k, s in enumerate(r["snaps"]):
                if not (s["controls"] and s["images"]):
                    problems.append(f"{name}: harness snapshot {k} shows {s['controls']} controls and "
                                    f"{s['images']} pictures")
        index, nav = seen["index.html"], seen["index.html"]["nav"]
        heads = [c["head"] for c in nav if c["head"] != "index.html"]
        missing = [h for h in heads if h not in index["links"]]
        if missing: problems.append(f"index.html: no link to the chapters {missing}")
        if not re.search(r"static-dist plan ", index["code"]): problems.append("index.html: no `static-dist plan`")
        if not re.search(r"torchrun [^\n]*(static-dist|-m static_dist\.app --) train --plan", index["code"]):
            problems.append("index.html: no torchrun ... static-dist train --plan command")
        if not index["images"]: problems.append("index.html: no plot on the front page")
        if "plan written to" not in "\n".join(index["outputs"]):
            problems.append("index.html: the front page's `plan` run shows no plan written (a budget nothing fits?)")
        for c in nav:
            lost = [s for s in c["stages"] if s not in seen[c["head"]]["links"]]
            if lost: problems.append(f"{c['head']}: the chapter overview does not link its stages {lost}")
        for name in SHOWN_PAGES:
            r = seen[name]
            if r["images"] < 1 or r["tables"] < 1:
                problems.append(f"{name}: {r['images']} plots and {r['tables']} tables in its outputs")
            raw = [o[:80] for o in r["outputs"] if re.search(RAW_DICT, o)]
            if raw: problems.append(f"{name}: results printed as raw dicts: {raw[:2]}")
        _load(drv, urljoin(base, "parallel_plan.html"))
        drv.execute_script("document.querySelector('main .jp-OutputArea-output img').scrollIntoView()")
        drv.save_screenshot(str(shots / "docs_parallel_plan.png"))
    if problems:
        raise AssertionError(f"{len(problems)} problem(s) on the reader's path:\n  " + "\n  ".join(problems[:40]))
    return dict(pages=len(pages), chapters=len(nav), snapshots=sum(len(r["snaps"]) for r in seen.values()),
                **{n: dict(images=seen[n]["images"], tables=seen[n]["tables"]) for n in SHOWN_PAGES})


# ---------------------------------------------------------------- 1b. docs features: offline, search, [source], sidebar

JS_REQUESTS = """
return {resources: performance.getEntriesByType('resource').map(e => e.name),
        scripts: [...document.scripts].map(s => s.src).filter(Boolean),
        styles: [...document.querySelectorAll('link[href]')].map(l => l.href)};
"""
JS_NAV = """
const l = document.querySelector('.docs-nav-list'), c = l && l.querySelector('a.current');
if (!c) return null;
const a = l.getBoundingClientRect(), b = c.getBoundingClientRect();
const clipped = [...l.querySelectorAll('a')].filter(x => x.offsetParent && x.scrollWidth > x.clientWidth + 1)
  .map(x => x.textContent);
return {list: [a.top, a.bottom], current: [b.top, b.bottom], href: c.getAttribute('href'), clipped,
        scrolled: l.scrollTop, last: [...l.querySelectorAll('a')].pop().getAttribute('href')};
"""


def _load(drv, url: str):
    drv.get(url)
    wait_for(lambda: drv.execute_script("return document.readyState") == "complete", 30, f"{url} to load")


def _only_local(drv, allowed: tuple[str, ...], what: str) -> list[str]:
    "Every request the page made, and every script and stylesheet it names, is under `allowed`; else the problems."
    r = drv.execute_script(JS_REQUESTS)
    far = [u for u in r["resources"] + r["scripts"] + r["styles"] if not u.startswith(allowed + ("data:",))]
    errs = [e["message"][:160] for e in drv.get_log("browser") if e.get("level") == "SEVERE"]
    return [f"{what}: requested from outside the site: {far[:3]}"] * bool(far) + [
        f"{what}: browser error: {e}" for e in errs
    ]


def _search(drv, query: str) -> list[dict]:
    "Type `query` into the search box; the results shown (kind, href, title)."
    from selenium.webdriver.common.by import By
    box = drv.find_element(By.ID, "docs-search")
    box.clear(); box.send_keys(query)
    js = """return [...document.querySelectorAll('#docs-search-results a')].map(a => ({kind: a.className.slice(3),
            href: a.getAttribute('href'), title: a.querySelector('.sr-title').textContent}))"""
    return wait_for(lambda: drv.execute_script(js), 10, f"search results for {query!r}", every=0.2)


def source_lines_ok(docs: Path) -> tuple[int, list[str]]:
    "Every API entry's exported-line link (`src/...py.html#L<n>`) lands on its definition: (links checked, problems)."
    import html as _html, re
    problems, n, cache = [], 0, {}
    for page in sorted(docs.glob("*.html")):
        for chunk in page.read_text(encoding="utf-8").split('<div class="api-entry')[1:]:
            head = chunk.split('class="highlight api-sig"', 1)[0]   # the entry's id, name and links
            m = re.search(r'id="([^"]+)".*?<a class="src-py" href="([^"#]+)#L(\d+)"', head, re.S)
            if not m: continue
            anchor, src, line = m.group(1), m.group(2), int(m.group(3))
            if src not in cache:
                text = (docs / src).read_text(encoding="utf-8") if (docs / src).is_file() else ""
                cache[src] = [
                    _html.unescape(re.sub(r"<[^>]+>", "", l))
                    for l in re.findall(r'<span class="line" id="L\d+"><a class="ln"[^>]*>\d+</a>(.*?)</span>', text)
                ]
            name, lines = anchor.rsplit(".", 1)[-1], cache[src]
            near = lines[line - 1: line + 12]   # the first line, then decorators, then the def
            n += 1
            if not any(
                re.search(rf"(def|class)\s+{re.escape(name)}\b|^\s*{re.escape(name)}\b|\b{re.escape(name)}\s*[,=:]", l)
                for l in near
            ):
                problems.append(f"{page.name}: {anchor} links to {src}#L{line}, which reads {near[:1]}")
    return n, problems


JS_ENTRY_SOURCE = """
const e = document.getElementById(decodeURIComponent(location.hash.slice(1)));
if (!e) return null;
const cell = e.querySelector('a.src-cell'), py = e.querySelector('a.src-py'), gh = e.querySelector('a.src-gh');
const target = cell && document.getElementById(cell.getAttribute('href').slice(1));
return {cell: cell && cell.getAttribute('href'), is_cell: !!target && target.classList.contains('jp-Cell'),
        above: !!target && !!(target.compareDocumentPosition(e) & Node.DOCUMENT_POSITION_FOLLOWING),
        code: target ? target.textContent : '', py: py && py.getAttribute('href'), gh: gh && gh.href};
"""
JS_LINES_AT_TARGET = """
let n = document.getElementById(location.hash.slice(1)), t = '';
for (let k = 0; n && k < 12; k++, n = n.nextElementSibling) t += n.textContent + '\\n';
return t;
"""


def _check_search(drv, root: str, api_query: str, page_query: str, page_file: str) -> tuple[list[str], dict]:
    "From file:// (no fetch() there): the first result for `api_query` is its API entry, for `page_query` the page."
    _load(drv, root + "index.html")
    api, page = _search(drv, api_query)[0], _search(drv, page_query)[0]
    problems = [] if api["kind"] == "api" and api["title"].split(".")[-1] == api_query else \
        [f"search {api_query!r}: first result is {api}, not the API entry"]
    if page["href"] != page_file: problems.append(f"search {page_query!r}: first result is {page}, not {page_file}")
    return problems + _only_local(drv, (root,), "search from file://"), dict(api=api["href"], page=page["href"])


def _check_source(drv, root: str, entry: str, name: str) -> tuple[list[str], dict]:
    """The entry's [source] is the cell above it that defines `name`; its line link opens the site's copy of the
    module at the definition; its GitHub link names the same line."""
    _load(drv, root + entry)
    src = drv.execute_script(JS_ENTRY_SOURCE)
    if not src: return [f"{entry}: no element with the entry's id"], {}
    problems = []
    if not (src["is_cell"] and src["above"] and f"def {name}" in src["code"]):
        problems.append(f"{entry}: [source] {src['cell']!r} is not the cell above that defines {name}")
    line = (src["py"] or "#").split("#")[1]
    if not ((src["gh"] or "").startswith("https://github.com/") and (src["gh"] or "").endswith("#" + line)):
        problems.append(f"{entry}: GitHub link {src['gh']!r} is not the line {src['py']!r} on GitHub")
    _load(drv, root + src["py"])
    if f"def {name}" not in drv.execute_script(JS_LINES_AT_TARGET):
        problems.append(f"{src['py']}: the lines it links to do not define {name}")
    return problems, dict(cell=src["cell"], py=src["py"])


def _check_sidebar(drv, root: str, shots: Path) -> tuple[list[str], dict]:
    "On the sidebar's last page (the deepest scroll), its entry is inside the sidebar's visible area, no title clipped."
    _load(drv, root + "index.html")
    last = drv.execute_script(JS_NAV)["last"]
    _load(drv, root + last)
    nav = drv.execute_script(JS_NAV)
    drv.save_screenshot(str(shots / "docs_sidebar_last_page.png"))
    problems = [] if nav["list"][0] <= nav["current"][0] and nav["current"][1] <= nav["list"][1] else \
        [f"{last}: its sidebar entry {nav['current']} is outside the sidebar's visible area {nav['list']}"]
    if nav["clipped"]: problems.append(f"{last}: sidebar titles clipped: {nav['clipped'][:3]}")
    return problems, dict(page=last, scrolled=nav["scrolled"])


def check_docs_features(docs: Path, shots: Path, api_query: str = "plan_fsdp", page_query: str = "model zoo",
                        page_file: str = "zoo.html") -> dict:
    """With the network off: pages load from file:// and localhost asking for nothing else; the search box finds
    `api_query` (an API entry) and `page_query` (the page `page_file`); that entry's [source] links resolve; the last
    page's sidebar entry is in view; every exported-line link of the site lands on its definition. Raises
    AssertionError listing the problems."""
    problems, out = [], {}
    with serve(docs) as (base, _missing), chrome(1400, 800, offline=True) as drv:
        root = docs.resolve().as_uri() + "/"
        for url, allowed in ((root, root), (base, base)):
            _load(drv, url + "index.html")
            problems += _only_local(drv, (allowed,), f"index.html from {url.split(':')[0]}")
        p, out["search"] = _check_search(drv, root, api_query, page_query, page_file); problems += p
        drv.save_screenshot(str(shots / "docs_search.png"))
        p, out["source"] = _check_source(drv, root, out["search"]["api"], api_query); problems += p
        p, out["sidebar"] = _check_sidebar(drv, root, shots); problems += p
    out["source_links"], bad = source_lines_ok(docs)
    problems += bad[:10]
    if problems: raise AssertionError(f"{len(problems)} problem(s) in the docs site:\n  " + "\n  ".join(problems[:40]))
    return out


# ---------------------------------------------------------------- 2 and 3. JupyterLab

@contextlib.contextmanager
def jupyterlab(root_dir: Path, python: str = sys.executable, timeout: float = 90, settings: dict | None = None):
    """JupyterLab on a free localhost port with a random token, its state in temp folders; yields (base url, token).
    `settings`: {"@jupyterlab/<extension>/<plugin>": {setting: value}} written as the user's settings."""
    port, token = free_port(), secrets.token_hex(16)
    state = Path(tempfile.mkdtemp(prefix="lab_state_"))
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(state / "config"), JUPYTER_RUNTIME_DIR=str(state / "runtime"),
               JUPYTERLAB_WORKSPACES_DIR=str(state / "workspaces"), JUPYTERLAB_SETTINGS_DIR=str(state / "settings"),
               PYTHONHASHSEED="0")
    env.pop("MPLBACKEND", None)   # as a kernel started from JupyterLab: matplotlib's inline backend
    if shutil.which("nvidia-smi") is None: env.setdefault("TRITON_INTERPRET", "1")
    news = state / "settings" / "@jupyterlab" / "apputils-extension"   # no "get notified about Jupyter news?" popup
    news.mkdir(parents=True); (news / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    for plugin, values in (settings or {}).items():
        ext, name = plugin.rsplit("/", 1)
        (state / "settings" / ext).mkdir(parents=True, exist_ok=True)
        (state / "settings" / ext / f"{name}.jupyterlab-settings").write_text(json.dumps(values))
    log = open(state / "lab.log", "w")
    proc = subprocess.Popen(
        [
            python,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            "--allow-root",
            "--ip=127.0.0.1",
            f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root_dir}",
            "--LabApp.expose_app_in_browser=True",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
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


JS_APP_READY = (
    "return !!(window.jupyterapp && window.jupyterapp.shell && window.jupyterapp.shell.currentWidget "
    "&& window.jupyterapp.shell.currentWidget.sessionContext && "
    "window.jupyterapp.shell.currentWidget.sessionContext.session "
    "&& window.jupyterapp.shell.currentWidget.sessionContext.session.kernel "
    "&& window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status === 'idle')"
)
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
const domErrors = [...nb.node.querySelectorAll(
  '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
  .map(e => e.textContent.slice(0, 200));
return {kernel, cells, domErrors};
"""


def open_notebook(drv, base: str, token: str, rel: str, timeout: float = 120):
    drv.get(f"{base}lab/tree/{rel}?token={token}")
    wait_for(
        lambda: drv.execute_script(JS_APP_READY), timeout, f"JupyterLab to open {rel} with an idle kernel", every=1
    )


def run_all(drv, timeout: float) -> dict:
    "Run > Run All Cells (JupyterLab's command), then wait until every code cell has run and the kernel is idle."
    drv.set_script_timeout(timeout)
    r = drv.execute_async_script(JS_RUN_ALL)
    assert r == "ok", f"notebook:run-all-cells failed: {r}"
    def finished():
        s = drv.execute_script(JS_STATE)
        return (
            s
            if s["kernel"] == "idle" and all(c["count"] is not None and not c["running"] for c in s["cells"])
            else None
        )
    return wait_for(finished, timeout, "Run All to finish", every=1)


def save(drv):
    drv.set_script_timeout(30)
    r = drv.execute_async_script("""const done = arguments[arguments.length - 1];
        window.jupyterapp.commands.execute('docmanager:save').then(() => done('ok'), e => done('error: ' + e));""")
    assert r == "ok", f"docmanager:save failed: {r}"


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _same_picture_twice(cell: dict) -> bool:
    "Does a saved cell show one PNG twice (a returned pyplot figure that the inline backend also flushed)?"
    pngs = ["".join(o["data"]["image/png"]) for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
    return len(set(pngs)) < len(pngs)


JS_LOG_ENTRIES = """const d = arguments[arguments.length - 1];
window.jupyterapp.commands.execute('logconsole:open').then(() => setTimeout(() => d(
  [...document.querySelectorAll('.jp-LogConsolePanel .jp-OutputArea-output')]
    .map(e => e.querySelector('img') ? '<image>' : e.textContent.trim().slice(0, 200))), 1000), e => d([String(e)]));"""


def log_console(drv) -> list[str]:
    "What JupyterLab's log console holds: outputs that landed outside any cell (a kernel warning, a stray plot)."
    drv.set_script_timeout(20)
    return drv.execute_async_script(JS_LOG_ENTRIES)


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
            time.sleep(2)   # widget echoes (an Output widget syncs what it captured back) arrive after the kernel idles
            log = log_console(drv)
            drv.save_screenshot(str(shots / f"lab_run_all_{nb.stem}.png"))
            save(drv)
        saved = json.loads((tmp / nb.name).read_text())
    errors = [f"cell {c['i']}: {e}" for c in state["cells"] for e in c["errors"]]
    file_errors = [f"cell {i}: {o.get('ename')}: {o.get('evalue')}" for i, c in enumerate(saved["cells"])
                   for o in c.get("outputs", []) if o.get("output_type") == "error"]
    widgets = [i for i, c in enumerate(saved["cells"]) for o in c.get("outputs", []) if WIDGET_VIEW in o.get("data", {})
               and not "".join(o["data"].get("text/plain", "")).startswith("Harness(")]
    assert not widgets, f"Run All of {nb.name} saved widget views that are not harnesses (a progress spinner?): " \
        f"cells {widgets}"
    twice = [i for i, c in enumerate(saved["cells"]) if _same_picture_twice(c)]
    assert not twice, f"Run All of {nb.name}: cells {twice} show the same picture twice"
    ran = sum(1 for c in saved["cells"] if c["cell_type"] == "code" and c.get("execution_count"))
    assert not log, f"Run All of {nb.name} left {len(log)} entr(ies) in JupyterLab's log console: {log[:3]}"
    assert not errors and not file_errors, (
        f"Run All of {nb.name} in JupyterLab left error outputs: {errors or file_errors}"
    )
    assert ran == sum(1 for c in saved["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()), \
        f"Run All of {nb.name}: only {ran} code cells have run"
    return dict(
        notebook=nb.name, seconds=round(secs, 1), code_cells=len(state["cells"]), stderr_outputs=len(state["domErrors"])
    )


def docs_dir() -> Path:
    "The built site: $BROWSER_DOCS, else _docs/ of the repo (build it first with python tools/build_docs.py)."
    d = Path(os.environ.get("BROWSER_DOCS") or ROOT / "_docs")
    return d


def _harness_check():
    "harness_check.py, next to this file (it imports this module, so it is imported when first needed)."
    sys.path.insert(0, str(Path(__file__).parent))
    import harness_check
    return harness_check


def main(argv=None) -> int:
    which = (argv if argv is not None else sys.argv[1:]) or ["docs", "docs-features", "reader", "lab", "harness",
                                                              "clone"]
    if MISSING_BROWSER: print(f"SKIP: {MISSING_BROWSER}"); return 0
    shots, rc = out_dir(), 0
    for w in which:
        t0 = time.time()
        try:
            if w.startswith("docs") or w == "reader":
                d = docs_dir()
                if not (d / "index.html").exists():
                    subprocess.run([sys.executable, str(ROOT / "tools" / "build_docs.py"), "--out", str(d)], check=True)
            if w == "docs":
                r = check_docs(d, shots); r = dict(pages=len(r), images=sum(v["images"] for v in r.values()))
            elif w == "docs-features": r = check_docs_features(d, shots)
            elif w == "reader": r = check_reader(d, shots)
            elif w == "lab": r = check_lab_run_all(shots)
            elif w == "harness": r = _harness_check().check_harnesses(shots)
            elif w == "clone": r = _harness_check().check_fresh_clone(shots)
            else: print(f"unknown check {w!r}: give docs, docs-features, reader, lab, harness or clone"); return 2
            print(f"ok   {w:13s} {time.time() - t0:5.1f} s  {r}")
        except AssertionError as e:
            print(f"FAIL {w:13s} {time.time() - t0:5.1f} s  {e}"); rc = 1
    print(f"screenshots in {shots}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
