"""Every control of the four chapter harnesses (placement, FSDP, offload, stability), driven in JupyterLab with headless
Chromium, and the harness notebooks as a fresh clone shows them (untrusted, not run).

    python tests/browser/harness_check.py [harness] [clone]              # both when none is named
    BROWSER_HARNESS_FULL=1 ...                                           # the full sweep (every option, every strategy)

harness: one notebook displays the four harnesses (Run All). For each harness, the controls are driven in the order of
its plan (`PLANS`): `*` moves every enabled control not yet moved one notch (a dropdown or toggle to its next option, a
slider one step with the arrow keys), `name=value` picks an option, `name=each` picks every option in turn. After each
change: the widget's output differs from before; every plot image in it is not blank (variance of its grey levels
above `MIN_VARIANCE`); the widget shows no stderr or error; and JupyterLab's log console counter (outputs that landed
outside any cell or widget) is still 0; no element carries title="null" (a tooltip of None), and no slider reads out in
scientific notation (`1.18e+3`). A control that is disabled must say why in its tooltip; every control must have
been moved at least once. The default plans move each control once (about 20 changes); the full sweep adds every
option of every dropdown and every stability strategy with every control it enables.
clone: copies of the four chapter notebooks, opened without running and untrusted as in a fresh clone, show a picture
(not blank) where the harness is, beside a table of its controls' values, and no `interactive(...)` text; with their
kernels started and autosave every 2 s, each file is saved unchanged but for the kernelspec's display name (nbdev_clean
writes the kernel's name there, JupyterLab the kernel's display name; `language_info` is kept by settings.ini's
allowed_metadata_keys).

Screenshots of each harness as first drawn and after its last change go to $BROWSER_OUT (default /tmp/browser-shots).
"""
from __future__ import annotations

import json, os, re, shutil, sys, tempfile, time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import browser_check as bc  # noqa: E402

MIN_VARIANCE = 50.0   # grey-level variance (0-255 scale) of a plot; a blank white image has 0, a sparse line plot ~1500
FULL = bool(os.environ.get("BROWSER_HARNESS_FULL"))

SETUP = """import warnings
warnings.filterwarnings("ignore", message="(FSDP2-wrapped module|Full backward hook)")"""
HARNESS_CELLS = {  # name -> the cell that displays it, as a reader would write it
    "placement": "from static_dist.placement import placement_widget\nplacement_widget()",
    "fsdp": """from static_dist.fsdp import fsdp_widget, profile_graph
from static_dist.graph import capture
from static_dist.zoo import get_model
zm = get_model("small"); (x,), y = zm.batch(2, 128, seed=0)
fsdp_widget(profile_graph(capture(zm.build(), (x,), loss_fn=zm.loss, targets=y, optimizer="adamw")))""",
    "offload": "from static_dist.offload import offload_widget\noffload_widget()",
    "stability": "from static_dist.stability import stability_widget\nstability_widget(steps=80)   # shorter runs than "
                 "the chapter's 120: the same code, less CI time",
}
PLANS = {   # the CI sweep: every control moved at least once
    "placement": ["*"],
    "fsdp": ["*"],
    "offload": ["*"],
    "stability": ["*", "strategy=seed_window", "*"],
}
FULL_PLANS = {
    "placement": ["*", "model=each", "topology=each", "mesh=each"],
    "fsdp": ["*", "world=each", "replicas=each", "precision=each"],
    "offload": ["*", "seq len=each"],
    "stability": ["*", "fault=each", "strategy=each+*"],
}
CHAPTERS = {"placement": "30_placement", "fsdp": "40_fsdp", "offload": "50_offload", "stability": "60_stability"}

# ---------------------------------------------------------------- reading the page

JS_WIDGET = r"""
const w = document.querySelectorAll('.widget-interact')[arguments[0]];
if (!w) return null;
const out = w.querySelector('.widget-output');
const controls = [...w.children].filter(c => !c.classList.contains('widget-output')).map(c => {
  const label = c.querySelector('.widget-label'), sel = c.querySelector('select');
  const slider = c.querySelector('.noUi-target');
  const handle = c.querySelector('.noUi-handle'), buttons = [...c.querySelectorAll('button')];
  const kind = sel ? 'dropdown' : slider ? 'slider' : buttons.length ? 'toggle' : 'other';
  const disabled = sel ? sel.disabled : slider ? slider.hasAttribute('disabled')
    : buttons.length ? buttons.every(b => b.disabled) : false;
  const tip = [c.title, label && label.title].filter(t => t && t !== 'null').join(' ');
  const value = sel ? sel.value
    : handle ? handle.getAttribute('aria-valuenow') + '/' + handle.getAttribute('aria-valuemax')
              : (buttons.find(b => b.classList.contains('mod-active')) || {}).textContent;
  return {name: label ? label.textContent : '', kind, disabled, tip, value,
          options: sel ? [...sel.options].map(o => o.value) : buttons.map(b => b.textContent)};
});
const imgs = out ? [...out.querySelectorAll('img')] : [];
const stats = imgs.map(i => {
  if (!(i.complete && i.naturalWidth > 0)) return null;
  const c = document.createElement('canvas'); c.width = i.naturalWidth; c.height = i.naturalHeight;
  const x = c.getContext('2d'); x.drawImage(i, 0, 0);
  const d = x.getImageData(0, 0, c.width, c.height).data;
  let s = 0, s2 = 0; const n = d.length / 4;
  for (let k = 0; k < d.length; k += 4) { const v = (d[k] + d[k + 1] + d[k + 2]) / 3; s += v; s2 += v * v; }
  return {w: i.naturalWidth, h: i.naturalHeight, variance: s2 / n - (s / n) * (s / n)};
});
const errs = out ? [...out.querySelectorAll(
  '[data-mime-type="application/vnd.jupyter.stderr"], .jp-RenderedText[data-mime-type*="error"]')]
  .map(e => e.textContent.slice(0, 300)) : [];
const runs = w.className.match(/harness-runs-(\d+)/);
const nullTitles = [...w.querySelectorAll('[title="null"]')].length;
const readouts = [...w.querySelectorAll('.widget-readout')].map(r => r.textContent.trim());
return {controls, html: out ? out.innerHTML : '', images: stats, errors: errs, nullTitles, readouts,
        text: out ? out.innerText.slice(0, 400) : '',
        runs: runs ? parseInt(runs[1]) : null};
"""
JS_LOG_COUNT = """const e = document.querySelector('.jp-LogConsoleStatusItem');
const m = e && e.textContent.match(/\\d+/); return m ? parseInt(m[0]) : 0;"""
JS_KERNEL_IDLE = "return window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status === 'idle'"


def _sig(s: dict) -> str:
    import hashlib
    return hashlib.sha1(s["html"].encode()).hexdigest()


def widget_state(drv, k: int) -> dict | None:
    return drv.execute_script(JS_WIDGET, k)


def log_count(drv) -> int:
    return drv.execute_script(JS_LOG_COUNT)


def log_text(drv) -> str:
    "What the log console holds (opened for the message, then closed again)."
    drv.set_script_timeout(20)
    drv.execute_async_script(
        "const d = arguments[arguments.length - 1];"
        "window.jupyterapp.commands.execute('logconsole:open').then(() => d(1), e => d(String(e)))"
    )
    time.sleep(1)
    t = drv.execute_script("return [...document.querySelectorAll('.jp-LogConsolePanel .jp-OutputArea-output')]"
                           ".map(e => e.querySelector('img') ? '<image>' : e.textContent.slice(0, 200)).join(' | ')")
    return t


def settled(drv, k: int, before: dict | None, timeout: float) -> dict | None:
    """The widget's state once the change after `before` is fully drawn, else None after `timeout` seconds. A harness
    tags itself `harness-runs-N` after each run (its outputs reach the page before the tag): the change is drawn when N
    has grown and every image has loaded. Without the tag, when the output differs from `before` and has not changed
    for 1 s with the kernel idle."""
    t0, last, since = time.time(), None, time.time()
    while time.time() - t0 < timeout:
        s = widget_state(drv, k)
        if s is not None and s["runs"] is not None:
            if (before is None or s["runs"] > (before["runs"] or 0)) and all(s["images"]): return s
        elif s is not None and s["html"] and (before is None or _sig(s) != _sig(before)) and all(s["images"]):
            sig = _sig(s)
            if sig != last: last, since = sig, time.time()
            elif time.time() - since >= 1.0 and drv.execute_script(JS_KERNEL_IDLE): return s
        time.sleep(0.2)
    return None


# ---------------------------------------------------------------- moving one control

def _control_el(drv, k: int, i: int):
    return drv.execute_script("return [...document.querySelectorAll('.widget-interact')[arguments[0]].children]"
                              ".filter(c => !c.classList.contains('widget-output'))[arguments[1]]", k, i)


def move(drv, k: int, i: int, c: dict, option: str | None = None) -> str:
    "Change control `i` of harness `k` (to `option`, or one notch); a description of the change."
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select
    el = _control_el(drv, k, i)
    drv.execute_script("arguments[0].scrollIntoView({block: 'center'})", el)
    if c["kind"] == "dropdown":
        sel = Select(el.find_element(By.TAG_NAME, "select"))
        opts = [o.get_attribute("value") for o in sel.options]
        cur = opts.index(c["value"])
        new = option if option is not None else opts[(cur + 1) % len(opts)]
        sel.select_by_value(new); return f"{c['name']}: {c['value']} -> {new}"
    if c["kind"] == "toggle":
        bs = el.find_elements(By.TAG_NAME, "button")
        names = [b.text for b in bs]
        new = option if option is not None else names[(names.index(c["value"]) + 1) % len(names)]
        bs[names.index(new)].click(); return f"{c['name']}: {c['value']} -> {new}"
    if c["kind"] == "slider":
        h = el.find_element(By.CSS_SELECTOR, ".noUi-handle")
        now, top = (float(v) for v in c["value"].split("/"))
        key, word = (Keys.ARROW_LEFT, "left") if now >= top else (Keys.ARROW_RIGHT, "right")
        h.send_keys(key); return f"{c['name']}: one step {word} from {now:g}"
    raise AssertionError(f"control {c['name']!r}: a {c['kind']} control the check cannot move")


# ---------------------------------------------------------------- one harness

@dataclass
class Result:
    name: str
    changes: list = field(default_factory=list)      # (what, ok, problem)
    moved: set = field(default_factory=set)
    disabled_seen: dict = field(default_factory=dict)  # control -> tooltip
    problems: list = field(default_factory=list)
    blank: int = 0
    log_entries: int = 0
    seconds: float = 0.0

    def summary(self) -> dict:
        return dict(changes=len(self.changes), controls_moved=len(self.moved), blank_plots=self.blank,
                    log_console=self.log_entries, disabled=sorted(self.disabled_seen), seconds=round(self.seconds, 1))


def _check_state(r: Result, s: dict, what: str, log0: int, drv) -> None:
    blank = [im for im in s["images"] if im["variance"] <= MIN_VARIANCE]
    if not s["images"] and "not a valid" not in s["text"].lower():
        r.problems.append(f"{r.name}: after {what}: no plot and no reason given"); r.blank += 1
    if blank: r.blank += len(blank); r.problems.append(f"{r.name}: after {what}: blank plot {blank}")
    if s["errors"]: r.problems.append(f"{r.name}: after {what}: the widget shows stderr/error: {s['errors'][:2]}")
    n = log_count(drv)
    if n > log0:
        r.problems.append(f"{r.name}: after {what}: {n - log0} output(s) in the log console: {log_text(drv)[:300]}")
    r.log_entries = max(r.log_entries, n - log0)
    if s["nullTitles"]: r.problems.append(f"{r.name}: after {what}: {s['nullTitles']} element(s) with title=\"null\"")
    sci = [x for x in s["readouts"] if re.search(r"\de[+-]?\d", x)]
    if sci: r.problems.append(f"{r.name}: after {what}: slider readouts in scientific notation: {sci}")
    for c in s["controls"]:
        if c["disabled"]:
            r.disabled_seen[c["name"]] = c["tip"]
            if not c["tip"]:
                r.problems.append(
                    f"{r.name}: after {what}: control {c['name']!r} is disabled with no tooltip saying why"
                )


def drive(drv, k: int, name: str, plan: list[str], timeout: float, shots: Path) -> Result:
    r, t0 = Result(name), time.time()
    s = settled(drv, k, None, timeout)
    if s is None: r.problems.append(f"{name}: never drew its output"); return r
    log0 = 0   # every output outside a cell counts, including one from the first drawing
    _check_state(r, s, "the first drawing", log0, drv)
    el = drv.execute_script("return document.querySelectorAll('.widget-interact')[arguments[0]]", k)
    drv.execute_script("arguments[0].scrollIntoView()", el); el.screenshot(str(shots / f"harness_{name}_first.png"))

    def change(i: int, c: dict, option: str | None):
        nonlocal s
        before = s
        what = move(drv, k, i, c, option)
        new = settled(drv, k, before, timeout)
        if new is None or _sig(new) == _sig(before):
            r.changes.append((what, False)); r.problems.append(f"{name}: {what}: the output did not change")
            s = new or widget_state(drv, k); return
        r.changes.append((what, True)); r.moved.add(c["name"]); s = new
        _check_state(r, s, what, log0, drv)

    def index(cname: str) -> tuple[int, dict]:
        for i, c in enumerate(s["controls"]):
            if c["name"] == cname: return i, c
        raise AssertionError(f"{name}: no control named {cname!r}: {[c['name'] for c in s['controls']]}")

    def sweep():
        for i in range(len(s["controls"])):
            c = s["controls"][i]
            if c["disabled"] or c["name"] in r.moved: continue
            change(i, c, None)

    for step in plan:
        if step == "*": sweep(); continue
        cname, _, opt = step.partition("=")
        if opt in ("each", "each+*"):
            i, c = index(cname)
            for o in [o for o in c["options"] if o != c["value"]] + [c["value"]]:
                i, c = index(cname)
                if c["disabled"]: break
                change(i, c, o)
                if opt == "each+*":
                    for j, d in enumerate(s["controls"]):
                        if j != i and not d["disabled"]: change(j, d, None)
            continue
        i, c = index(cname)
        if c["value"] != opt: change(i, c, opt)
    never = [c["name"] for c in s["controls"] if c["name"] not in r.moved]
    if never: r.problems.append(f"{name}: controls never moved (disabled in every state the plan reached): {never}")
    drv.execute_script("arguments[0].scrollIntoView()", el); el.screenshot(str(shots / f"harness_{name}_last.png"))
    r.seconds = time.time() - t0
    return r


def harness_notebook(names: list[str]) -> dict:
    cells = [SETUP] + [HARNESS_CELLS[n] for n in names]
    return dict(cells=[dict(cell_type="code", id=f"c{i}", metadata={}, execution_count=None, outputs=[], source=s)
                       for i, s in enumerate(cells)],
                metadata=dict(kernelspec=dict(name="python3", display_name="python3", language="python")),
                nbformat=4, nbformat_minor=5)


def check_harnesses(shots: Path, names: list[str] | None = None, full: bool = FULL, timeout: float = 120) -> dict:
    """Display the harnesses in JupyterLab and drive every control (see the module's docstring); AssertionError listing
    every problem, else {harness: summary}."""
    names = names or list(HARNESS_CELLS)
    plans = FULL_PLANS if full else PLANS
    out, problems = {}, []
    with tempfile.TemporaryDirectory(prefix="lab_harness_") as tmp:
        (Path(tmp) / "harnesses.ipynb").write_text(json.dumps(harness_notebook(names), indent=1))
        with bc.jupyterlab(Path(tmp)) as (base, token), bc.chrome(1200, 2400) as drv:
            t0 = time.time()
            bc.open_notebook(drv, base, token, "harnesses.ipynb")
            state = bc.run_all(drv, 600)
            errs = [e for c in state["cells"] for e in c["errors"]]
            assert not errs, f"a harness cell raised: {errs}"
            out["run_all_seconds"] = round(time.time() - t0, 1)
            for k, n in enumerate(names):
                r = drive(drv, k, n, plans[n], timeout, shots)
                out[n] = r.summary(); problems += r.problems
    if problems: raise AssertionError(f"{len(problems)} problem(s) in the harnesses:\n  " + "\n  ".join(problems[:40]) +
                                      f"\n  (summary: {out})")
    return out


# ---------------------------------------------------------------- a fresh clone: untrusted, not run

def _json_diff(a, b, path="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in
                (_json_diff(a.get(k), b.get(k), f"{path}.{k}") if k in a and k in b else [f"{path}.{k}"])]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _json_diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [path or "."]



JS_ALL_IDLE = """return [...window.jupyterapp.shell.widgets('main')].filter(w => w.sessionContext).every(w =>
  w.sessionContext.session && w.sessionContext.session.kernel && w.sessionContext.session.kernel.status === 'idle')"""
JS_HARNESS_OUTPUT = """
const nb = window.__nb || window.jupyterapp.shell.currentWidget;
const W = 'application/vnd.jupyter.widget-view+json';
const found = [];
nb.content.widgets.forEach((c, i) => {
  if (c.model.type !== 'code') return;
  const outs = c.model.outputs.toJSON();
  if (!outs.some(o => o.data && o.data[W])) return;
  const area = c.node.querySelector('.jp-OutputArea');
  const imgs = [...area.querySelectorAll('img')].map(im => {
    if (!(im.complete && im.naturalWidth > 0)) return null;
    const cv = document.createElement('canvas'); cv.width = im.naturalWidth; cv.height = im.naturalHeight;
    const x = cv.getContext('2d'); x.drawImage(im, 0, 0); const d = x.getImageData(0, 0, cv.width, cv.height).data;
    let s = 0, s2 = 0; const n = d.length / 4;
    for (let k = 0; k < d.length; k += 4) { const v = (d[k] + d[k + 1] + d[k + 2]) / 3; s += v; s2 += v * v; }
    return s2 / n - (s / n) * (s / n);
  });
  const controls = [...area.querySelectorAll('table')].filter(t => [...t.querySelectorAll('th')]
    .map(h => h.textContent.trim()).join(' ') === 'control value')
    .map(t => t.querySelectorAll('tbody tr').length);
  found.push({cell: i, imgs, controls, text: area.innerText.slice(0, 300), trusted: c.model.trusted});
});
return found;
"""


def _open(drv, path: str, timeout: float):
    "Open `path` in the running JupyterLab page (no reload), once the app has restored its layout; make it current."
    drv.set_script_timeout(timeout)
    r = drv.execute_async_script("""const d = arguments[arguments.length - 1], app = window.jupyterapp;
        app.restored.then(() => app.commands.execute('docmanager:open', {path: arguments[0]}))
           .then(w => { window.__nb = w; app.shell.activateById(w.id); d('ok'); }, e => d(String(e)));""", path)
    assert r == "ok", f"could not open {path}: {r}"
    bc.wait_for(lambda: drv.execute_script("const w = window.__nb; return w.content.widgets.length > 0 && "
                                           "w.context.isReady && w.isVisible"), timeout, f"{path} to open")


ALLOWED_ON_OPEN = {
    ".metadata.kernelspec.display_name"
}  # nbdev_clean writes the kernel's name there, JupyterLab its display name


def check_fresh_clone(shots: Path, names: list[str] | None = None, timeout: float = 120, settle: float = 6,
                      folder: Path | None = None) -> dict:
    """The chapter notebooks as a fresh clone shows them: copies (from `folder`, $BROWSER_CLONE_NBS, else nbs/) opened
    untrusted, not run, autosave every 2 s. Each harness output is a picture (not blank) beside a table of its controls'
    values, not `interactive(...)` text; and once their kernels have started and
    autosave has had time to run, each file differs from the repo's at most in `ALLOWED_ON_OPEN`."""
    names = names or list(CHAPTERS)
    out, problems = {}, []
    with tempfile.TemporaryDirectory(prefix="lab_pictures_") as tmp:
        tmp = Path(tmp)
        folder = Path(folder or os.environ.get("BROWSER_CLONE_NBS") or bc.ROOT / "nbs")
        for n in names: shutil.copy2(folder / f"{CHAPTERS[n]}.ipynb", tmp)
        autosave = {"@jupyterlab/docmanager-extension/plugin": {"autosaveInterval": 2}}
        with bc.jupyterlab(tmp, settings=autosave) as (base, token), bc.chrome(1200, 1000) as drv:
            drv.get(f"{base}lab?token={token}")
            bc.wait_for(lambda: drv.execute_script("return !!(window.jupyterapp && window.jupyterapp.shell)"), timeout,
                        "JupyterLab to load")
            for n in names:
                _open(drv, f"{CHAPTERS[n]}.ipynb", timeout)
                found = bc.wait_for(lambda: (f := drv.execute_script(JS_HARNESS_OUTPUT)) and all(
                    all(v is not None for v in h["imgs"]) for h in f) and f, timeout, f"{n}'s harness output to render")
                for h in found:
                    ok = h["imgs"] and all(v > MIN_VARIANCE for v in h["imgs"]) and "interactive(" not in h["text"]
                    if not (h["controls"] and h["controls"][0] > 0):
                        problems.append(f"{CHAPTERS[n]}: cell {h['cell']} shows no table of its controls' values "
                                        "beside the picture")
                    if h["trusted"]:
                        problems.append(
                            f"{CHAPTERS[n]}: cell {h['cell']} opened trusted; the check needs an untrusted copy"
                        )
                    if not ok:
                        problems.append(
                            f"{CHAPTERS[n]}: cell {h['cell']} shows {h['text'][:80]!r} and images {h['imgs']}, not a "
                            "picture"
                        )
                cell = drv.execute_script("return window.__nb.content.widgets[arguments[0]].node",
                                          found[0]["cell"])
                drv.execute_script("arguments[0].scrollIntoView()", cell)
                time.sleep(0.3); cell.screenshot(str(shots / f"untrusted_{n}.png"))
                out[n] = dict(harness_cells=len(found), pictures=sum(len(h["imgs"]) for h in found),
                              controls=sum(sum(h["controls"]) for h in found))
            bc.wait_for(lambda: drv.execute_script(JS_ALL_IDLE), timeout, "every notebook's kernel to start")
            time.sleep(settle)
            dirty = drv.execute_script(
                "return window.jupyterapp.shell.widgets ? [...window.jupyterapp.shell.widgets('main')]"
                ".filter(w => w.context && w.context.model.dirty).map(w => w.context.path) : []"
            )
        for n in names:
            f = f"{CHAPTERS[n]}.ipynb"
            diff = _json_diff(json.loads((folder / f).read_text()), json.loads((tmp / f).read_text()))
            out[n]["changed_on_open"] = diff
            if set(diff) - ALLOWED_ON_OPEN:
                problems.append(f"{f}: opening it in JupyterLab changed {sorted(set(diff) - ALLOWED_ON_OPEN)[:8]}")
        out["dirty_after_autosave"] = dirty
    if problems: raise AssertionError(f"{len(problems)} problem(s):\n  " + "\n  ".join(problems))
    return out


def main(argv=None) -> int:
    which = (argv if argv is not None else sys.argv[1:]) or ["harness", "clone"]
    if bc.MISSING_BROWSER: print(f"SKIP: {bc.MISSING_BROWSER}"); return 0
    shots, rc = bc.out_dir(), 0
    checks = {"harness": lambda: check_harnesses(shots), "clone": lambda: check_fresh_clone(shots)}
    for w in which:
        if w not in checks: print(f"unknown check {w!r}: give harness or clone"); return 2
    for w in which:
        t0 = time.time()
        try:
            r = checks[w]()
            print(f"ok   {w:9s} {time.time() - t0:5.1f} s  {r}")
        except AssertionError as e:
            print(f"FAIL {w:9s} {time.time() - t0:5.1f} s  {e}"); rc = 1
    print(f"screenshots in {shots}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
