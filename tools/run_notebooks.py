"""Execute notebooks the way JupyterLab's Run All does: a real ipykernel, every cell, no nbdev flags honoured.

    python tools/run_notebooks.py --check [NB ...]          # run in memory; exit 1 listing every cell with an error
output
    python tools/run_notebooks.py --write [NB ...]          # run, then save outputs into the .ipynb (paths stripped,
nbdev_clean'd)
    python tools/run_notebooks.py --write --out DIR [NB ...] # save the executed copies under DIR instead (nbs/
untouched)
    options: -j N (parallel notebooks), --timeout S (per notebook), --timing FILE (JSON), --diff (run twice, report
             outputs that differ), --harness NB [NB ...] (notebooks that must show a widget, and a picture of it beside
             it), --fail-on-stderr, --keep-errors (--write saves a notebook even when it has an error; by default it is
             left as it was)

Every cell runs even after an error (nbclient allow_errors), so one run lists every failing cell; JupyterLab's Run All
would stop at the first one, and later errors are marked as such.

With no NB the notebooks are index.ipynb and nbs/**/*.ipynb (folders starting with `.` or `_` skipped). Each notebook
runs
in its own worker process with its own kernel (`python3`, i.e. the ipykernel of the interpreter running this script),
with
the notebook's folder as working directory and the kernel environment Jupyter would give: MPLBACKEND removed (so the
kernel picks matplotlib's inline backend), PYTHONHASHSEED=0, and TRITON_INTERPRET=1 when there is no GPU (no
nvidia-smi).
"""
from __future__ import annotations

import argparse, concurrent.futures as cf, copy, difflib, hashlib, json, os, re, shutil, signal, subprocess, sys
import tempfile, time, uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HARNESS_DEFAULT = ["nbs/30_placement", "nbs/40_fsdp", "nbs/45_parallel", "nbs/50_offload", "nbs/60_stability"]
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class RunError(Exception):
    "A bad argument to this tool (one line, printed without a traceback)."


# ---------------------------------------------------------------- which notebooks

def default_notebooks(root: Path = ROOT) -> list[Path]:
    "index.ipynb and every notebook under nbs/ (skipping `.`/`_` folders and checkpoints), sorted."
    nbs = [root / "index.ipynb"] if (root / "index.ipynb").exists() else []
    for p in sorted((root / "nbs").rglob("*.ipynb")):
        rel = p.relative_to(root / "nbs")
        if any(part.startswith((".", "_")) for part in rel.parts): continue
        nbs.append(p)
    return nbs


def resolve(names: list[str], root: Path = ROOT) -> list[Path]:
    "Notebook paths from command-line names (`nbs/01_zoo.ipynb`, `nbs/01_zoo`); InputError-style RunError if missing."
    out = []
    for n in names:
        p = Path(n)
        if not p.is_absolute(): p = (Path.cwd() / p)
        if p.suffix != ".ipynb" and not p.exists(): p = p.with_name(p.name + ".ipynb")
        if p.is_dir(): out += sorted(q for q in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in q.parts); continue
        if not p.exists(): raise RunError(f"no notebook {n!r}: give a path to an .ipynb file or a folder of them")
        out.append(p.resolve())
    return out


def harness_matches(harness: list[str], nb: Path, root: Path = ROOT) -> bool:
    "Is `nb` one of the harness notebooks (given as paths with or without `.ipynb`, relative to the repo root)?"
    for h in harness:
        hp = Path(h)
        hp = hp if hp.is_absolute() else root / hp
        if hp.suffix != ".ipynb": hp = hp.with_name(hp.name + ".ipynb")
        if hp.resolve() == nb.resolve(): return True
    return False


# ---------------------------------------------------------------- the kernel's environment

def kernel_env(base: dict | None = None) -> dict:
    "Environment a kernel started by JupyterLab would see, made deterministic where it costs nothing."
    env = dict(os.environ if base is None else base)
    env.pop("MPLBACKEND", None)              # ipykernel then selects module://matplotlib_inline.backend_inline
    env["PYTHONHASHSEED"] = "0"
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # silences the debugger's frozen-modules warning
    if shutil.which("nvidia-smi") is None: env.setdefault("TRITON_INTERPRET", "1")
    return env


# ---------------------------------------------------------------- worker: one notebook, one kernel

def _worker(src: str, dst: str, timeout: int) -> int:
    "Execute notebook `src` (cwd = its folder) and write the executed notebook to `dst`. Runs in a child process."
    import nbformat
    from nbclient import NotebookClient
    def _term(signum, frame): raise KeyboardInterrupt(f"stopped by signal {signum}")
    signal.signal(signal.SIGTERM, _term)
    nb = nbformat.read(src, as_version=4)
    client = NotebookClient(
        nb,
        kernel_name="python3",
        allow_errors=True,
        timeout=min(timeout, CELL_TIMEOUT),
        record_timing=True,
        store_widget_state=True,
        resources={"metadata": {"path": str(Path(src).parent)}},
    )
    status = 0
    try:
        _start_kernel(client)
        client.execute()
    except KeyboardInterrupt: status = 3
    except Exception as e:  # CellTimeoutError, DeadKernelError: keep what ran, say what happened (and in which cell)
        at = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code"
                   and "shell.execute_reply" not in c.get("metadata", {}).get("execution", {})), None)
        where = "" if at is None else f" (at cell {at})"
        nb.metadata["run_notebooks_error"] = f"{type(e).__name__}{where}: {str(e).splitlines()[0] if str(e) else ''}"
        status = 2
    nbformat.write(nb, dst)
    return status


def _start_kernel(client) -> None:
    """Start the notebook's kernel while no other worker starts one: jupyter_client picks free ports before the kernel
    binds them, so kernels started side by side can get the same ports; the loser dies, or worse, its client gets no
    reply and waits out a whole cell timeout (seen: a 6 s notebook taking 405 s in CI). A file lock around the start,
    held until the kernel answers, serialises only the starts."""
    import fcntl
    import tempfile
    with open(Path(tempfile.gettempdir()) / "static_dist_kernel_start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            client.km = client.create_kernel_manager()
            client.start_new_kernel(env=kernel_env())
            client.start_new_kernel_client()          # waits until the kernel is ready: its ports are bound
        finally: fcntl.flock(lock, fcntl.LOCK_UN)


CELL_TIMEOUT = 120   # seconds one cell may run: the slowest takes ~22 s at -j 2 on 2 cores; a lost reply costs this


def run_one(nb_path: Path, timeout: int, python: str = sys.executable) -> dict:
    """`_run_one`, and once more if a cell timed out (under load nbclient has been seen to wait out a cell whose kernel
    had gone idle: a reply it never received) or the kernel died; a second failure is reported as such."""
    r = _run_one(nb_path, timeout, python)
    # and once more if its kernel died: kernels started side by side can pick the same free port (jupyter_client
    # chooses ports before binding them), and the loser dies at once
    if r["problem"] and any(s in r["problem"] for s in ("Timeout", "timed out", "DeadKernel", "Kernel died")):
        again = _run_one(nb_path, timeout, python)
        again["problem"] = again["problem"] and f"{again['problem']} (twice; first: {r['problem']})"
        again["retried"] = r["problem"]
        return again
    return r


def _run_one(nb_path: Path, timeout: int, python: str = sys.executable) -> dict:
    """Run `nb_path` in a worker process; return {"path", "seconds", "nb" (executed notebook dict or None), "problem"}.
    The worker is stopped (its kernel shut down, then killed) when it runs past `timeout` seconds in all."""
    with tempfile.TemporaryDirectory(prefix="run_nb_") as tmp:
        dst = Path(tmp) / "out.ipynb"
        t0 = time.perf_counter()
        proc = subprocess.Popen([python, str(Path(__file__).resolve()), "--_worker", str(nb_path), str(dst),
                                 "--timeout", str(timeout)], start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        problem = None
        try: log, _ = proc.communicate(timeout=timeout + 30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try: log, _ = proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL); log, _ = proc.communicate()
            problem = f"timed out after {timeout} s"
        secs = time.perf_counter() - t0
        nb = json.loads(dst.read_text()) if dst.exists() else None
        if nb is None and problem is None:
            problem = (f"worker failed (exit {proc.returncode}): "
                       f"{log.strip().splitlines()[-1] if log.strip() else 'no output'}")
        if nb is not None and nb.get("metadata", {}).get("run_notebooks_error"):
            err = nb["metadata"].pop("run_notebooks_error")
            problem = f"{problem} ({err})" if problem else err
        return dict(path=nb_path, seconds=secs, nb=nb, problem=problem)


# ---------------------------------------------------------------- reading outputs

def _text(x) -> str: return "".join(x) if isinstance(x, list) else (x or "")


def cell_errors(nb: dict) -> list[dict]:
    "Every error output: cell index (0-based, all cells counted), exception name and value, first traceback lines."
    errs = []
    for i, c in enumerate(nb.get("cells", [])):
        for o in c.get("outputs", []) if c.get("cell_type") == "code" else []:
            if o.get("output_type") != "error": continue
            tb = [ANSI.sub("", l) for l in o.get("traceback", [])]
            tb = [l for t in tb for l in t.splitlines() if l.strip()]
            first_src = next(
                (l for l in _text(c.get("source")).splitlines() if l.strip() and not l.startswith("#|")), ""
            )
            errs.append(
                dict(
                    cell=i,
                    ename=o.get("ename", ""),
                    evalue=ANSI.sub("", o.get("evalue", "")).splitlines()[:1],
                    source=first_src[:100],
                    traceback=tb[:6] + (["..."] + tb[-3:] if len(tb) > 9 else tb[6:]),
                )
            )
    return errs


def _widget_outputs(nb: dict, model_id: str) -> list[dict]:
    "Outputs held by the Output widgets inside the widget `model_id` (from the widget state nbclient saved)."
    state = nb.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    outs, seen, todo = [], set(), [model_id]
    while todo:
        mid = todo.pop()
        if mid in seen or mid not in state: continue
        seen.add(mid)
        m = state[mid].get("state", {})
        if m.get("_model_name") == "OutputModel": outs += m.get("outputs", [])
        for v in m.values():
            for x in v if isinstance(v, list) else [v]:
                if isinstance(x, str) and x.startswith("IPY_MODEL_"): todo.append(x[len("IPY_MODEL_"):])
    return outs


def widget_errors(nb: dict) -> list[dict]:
    """Errors a displayed widget caught in its Output area (a harness whose callback raised): these are not cell error
    outputs, so Run All looks clean while the reader sees a traceback inside the widget."""
    errs = []
    for i, c in enumerate(nb.get("cells", [])):
        for o in c.get("outputs", []):
            mid = o.get("data", {}).get(WIDGET_MIME, {}).get("model_id")
            if not mid: continue
            for wo in _widget_outputs(nb, mid):
                if wo.get("output_type") != "error": continue
                tb = [l for t in wo.get("traceback", []) for l in ANSI.sub("", t).splitlines() if l.strip()]
                errs.append(
                    dict(
                        cell=i,
                        ename=wo.get("ename", ""),
                        evalue=ANSI.sub("", wo.get("evalue", "")).splitlines()[:1],
                        source="(inside the displayed widget)",
                        traceback=tb[-4:],
                    )
                )
    return errs


def stderr_cells(nb: dict) -> list[tuple[int, str]]:
    "Cells that wrote to stderr (warnings, log lines): (cell index, first line)."
    out = []
    for i, c in enumerate(nb.get("cells", [])):
        for o in c.get("outputs", []) if c.get("cell_type") == "code" else []:
            if o.get("output_type") == "stream" and o.get("name") == "stderr":
                first = next((l for l in _text(o.get("text")).splitlines() if l.strip()), "")
                out.append((i, ANSI.sub("", first)[:160])); break
    return out


def has_widget(nb: dict) -> bool:
    return any(WIDGET_MIME in o.get("data", {}) for c in nb.get("cells", []) for o in c.get("outputs", []))


def widgets_without_picture(nb: dict) -> list[int]:
    """Cells displaying a widget whose output carries no image/png beside it: an untrusted notebook (a fresh clone) or a
    viewer without live widgets shows that widget's text/plain, `interactive(children=(...`, instead of a picture."""
    return [i for i, c in enumerate(nb.get("cells", [])) for o in c.get("outputs", [])
            if WIDGET_MIME in o.get("data", {}) and "image/png" not in o["data"]]


def slowest_cells(nb: dict, n: int = 3) -> list[dict]:
    "The `n` slowest cells from nbclient's timing metadata: cell index, seconds, first source line."
    from datetime import datetime
    rows = []
    for i, c in enumerate(nb.get("cells", [])):
        ex = c.get("metadata", {}).get("execution", {})
        a, b = ex.get("iopub.execute_input"), ex.get("shell.execute_reply")
        if not (a and b): continue
        secs = (
            datetime.fromisoformat(b.replace("Z", "+00:00")) - datetime.fromisoformat(a.replace("Z", "+00:00"))
        ).total_seconds()
        first = next((l for l in _text(c.get("source")).splitlines() if l.strip() and not l.startswith("#|")), "")
        rows.append(dict(cell=i, seconds=round(secs, 2), source=first[:80]))
    return sorted(rows, key=lambda r: -r["seconds"])[:n]


# ---------------------------------------------------------------- making outputs fit to commit

def _path_rules(root: Path) -> list[tuple[re.Pattern, object]]:
    home = str(Path.home())
    rules = [
        (re.compile(re.escape(str(root)) + r"/?"), ""),  # /work/main/nbs/x -> nbs/x
        (
            re.compile(r"(?:/private)?/tmp/[^\s'\"<>)\]:,]*"),
            lambda m: "<tmp>/" + m.group(0).rstrip("/").rsplit("/", 1)[-1],
        ),
        (re.compile(re.escape(sys.prefix) + r"/"), "<venv>/"),
        (re.compile(re.escape(sys.base_prefix) + r"/"), "<python>/"),
    ]
    if home not in ("/", ""): rules.append((re.compile(re.escape(home) + r"(?=/|\b)"), "~"))
    return rules


def scrub_text(s: str, rules) -> str:
    for pat, rep in rules: s = pat.sub(rep, s)
    return s


def _scrub(x, rules):
    if isinstance(x, str): return scrub_text(x, rules)
    if isinstance(x, list): return [_scrub(v, rules) for v in x]
    return x


def clean_outputs(nb: dict, name: str, root: Path = ROOT) -> dict:
    """Strip machine paths from text outputs (repo path -> relative, /tmp/... -> <tmp>/NAME, venv and home), and replace
    the random widget model ids by ids derived from `name` and their order, so reruns give the same file."""
    rules = _path_rules(root)
    state = nb.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    widget_outs = [o for m in state.values() if m.get("state", {}).get("_model_name") == "OutputModel"
                   for o in m["state"].get("outputs", [])]
    for o in [o for c in nb.get("cells", []) for o in c.get("outputs", [])] + widget_outs:
        if "text" in o: o["text"] = _scrub(o["text"], rules)
        if o.get("output_type") == "error":
            o["evalue"] = scrub_text(o.get("evalue", ""), rules); o["traceback"] = _scrub(o.get("traceback", []), rules)
        for k, v in o.get("data", {}).items():
            if k.startswith("text/") or k in ("application/json",): o["data"][k] = _scrub(v, rules)
    # widget model ids: uuid4 hex from the kernel; rename consistently through outputs and the saved widget state
    text = json.dumps(nb)
    ids = list(dict.fromkeys(re.findall(r'"model_id": "([0-9a-f]{32})"', text) +
                             re.findall(r'"IPY_MODEL_([0-9a-f]{32})"', text) +
                             list(nb.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {}).get("state", {}))))
    for k, mid in enumerate(ids):
        new = hashlib.md5(f"{name}:{k}".encode()).hexdigest()
        text = text.replace(mid, new)
    return json.loads(text)


def write_back(nb: dict, dest: Path, name: str, root: Path = ROOT, nbdev_clean: str | None = None) -> None:
    """Save executed `nb` to `dest` (indent=1, as nbdev writes), then run `nbdev_clean --fname dest` for nbdev's
    cleaning."""
    nb = clean_outputs(copy.deepcopy(nb), name, root)
    dest.write_text(json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")
    exe = (
        nbdev_clean or shutil.which("nbdev_clean", path=str(Path(sys.executable).parent)) or shutil.which("nbdev_clean")
    )
    if exe is None: raise RunError("nbdev_clean not found: install the dev extras (pip install -e '.[dev]')")
    r = subprocess.run([exe, "--fname", str(dest)], cwd=root, capture_output=True, text=True)
    if r.returncode != 0 or "Warning" in r.stderr or "warn" in r.stderr.lower():
        raise RunError(f"nbdev_clean failed on {dest}: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")


# ---------------------------------------------------------------- comparing two runs

def _norm_outputs(nb: dict, name: str) -> list[list[str]]:
    "Per cell, the outputs as comparable text lines (timing metadata and ids removed; images by hash)."
    nb = clean_outputs(copy.deepcopy(nb), name)
    cells = []
    for c in nb.get("cells", []):
        lines = []
        for o in c.get("outputs", []):
            if "text" in o: lines += _text(o["text"]).splitlines()
            if o.get("output_type") == "error": lines += [f"{o.get('ename')}: {o.get('evalue')}"]
            for k, v in sorted(o.get("data", {}).items()):
                if k.startswith("image/"):
                    lines.append(f"<{k} sha1={hashlib.sha1(_text(v).encode()).hexdigest()[:12]}>")
                elif k.startswith("text/"): lines += [f"{k}: {l}" for l in _text(v).splitlines()]
                else: lines.append(f"<{k}> {json.dumps(v, sort_keys=True)[:200]}")
        cells.append(lines)
    return cells


def diff_runs(a: dict, b: dict, name: str, max_lines: int = 8) -> list[str]:
    "Human-readable report of the cells whose outputs differ between two executions of one notebook."
    A, B = _norm_outputs(a, name), _norm_outputs(b, name)
    rep = []
    for i, (x, y) in enumerate(zip(A, B)):
        if x == y: continue
        d = [l for l in difflib.unified_diff(x, y, lineterm="", n=0) if not l.startswith(("---", "+++", "@@"))]
        rep.append(f"  cell {i}: " + ("; ".join(d[:max_lines]) + (" ..." if len(d) > max_lines else ""))[:600])
    return rep


# ---------------------------------------------------------------- main

def _rel(p: Path, root: Path = ROOT) -> str:
    try: return str(p.resolve().relative_to(root))
    except ValueError: return str(p)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="execute in memory; fail on any error output (default)")
    mode.add_argument(
        "--write", action="store_true", help="execute and save outputs into the notebooks (or under --out)"
    )
    ap.add_argument("notebooks", nargs="*", help="notebooks or folders (default: index.ipynb and nbs/)")
    ap.add_argument("--out", type=Path, help="with --write: save executed copies under this folder, keeping names")
    ap.add_argument("-j", "--jobs", type=int, default=1, help="notebooks run at once (default 1)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds allowed per notebook (default 900)")
    ap.add_argument("--timing", type=Path, help="write per-notebook seconds, errors and slowest cells as JSON here")
    ap.add_argument("--diff", action="store_true", help="run each notebook twice and report outputs that differ")
    ap.add_argument("--harness", nargs="*", default=HARNESS_DEFAULT,
                    help="notebooks that must display a widget with a picture of it beside it (default: %(default)s); "
                         "give none to skip the check")
    ap.add_argument("--keep-errors", action="store_true", help="with --write: save a notebook even if it has problems")
    ap.add_argument("--fail-on-stderr", action="store_true", help="also fail when a cell writes to stderr")
    ap.add_argument("--_worker", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._worker: return _worker(a._worker[0], a._worker[1], a.timeout)
    try: return _main(a)
    except RunError as e:
        print(f"run_notebooks: {e}", file=sys.stderr); return 2


def _main(a) -> int:
    if a.jobs < 1: raise RunError(f"-j {a.jobs}: give at least 1")
    if a.timeout < 1: raise RunError(f"--timeout {a.timeout}: give a positive number of seconds")
    if a.out and not a.write: raise RunError("--out is for --write; --check keeps nothing")
    nbs = resolve(a.notebooks) if a.notebooks else default_notebooks()
    if not nbs: raise RunError("no notebooks to run")
    for h in a.harness or []:
        hp = (ROOT / h) if not Path(h).is_absolute() else Path(h)
        if not (hp.exists() or hp.with_name(hp.name + ".ipynb").exists()):
            raise RunError(f"--harness {h}: no such notebook; name the notebooks that display a widget harness")
    runs = 2 if a.diff else 1
    jobs = [(nb, k) for nb in nbs for k in range(runs)]
    # kernels side by side share the cores: torch's default of one thread per core each makes small ops spin for
    # cores the other kernel holds (the zoo's 300-step training: 74 s at -j 2 on 2 cores, ~20 s with one thread each)
    if a.jobs > 1: os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // a.jobs)))
    print(f"running {len(nbs)} notebook(s){' twice' if a.diff else ''}, {a.jobs} at a time, timeout {a.timeout} s each",
          flush=True)
    results: dict[tuple[Path, int], dict] = {}
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(max_workers=a.jobs) as ex:
        futs = {ex.submit(run_one, nb, a.timeout): (nb, k) for nb, k in jobs}
        for f in cf.as_completed(futs):
            nb, k = futs[f]
            r = results[(nb, k)] = f.result()
            nerr = len(cell_errors(r["nb"]) + widget_errors(r["nb"])) if r["nb"] else 0
            state = r["problem"] or (f"{nerr} error cell(s)" if nerr else "ok")
            again = f"  (ran again after: {r['retried']})" if r.get("retried") else ""
            print(f"{r['seconds']:7.1f} s  {_rel(nb)}{' (run 2)' if k else ''}  {state}{again}", flush=True)
    failures, timing = [], {}
    for nb in nbs:
        r = results[(nb, 0)]; ex_nb = r["nb"]; name = _rel(nb); n_before = len(failures)
        errs = sorted(cell_errors(ex_nb) + widget_errors(ex_nb), key=lambda e: e["cell"]) if ex_nb else []
        entry = timing[name] = dict(
            seconds=round(r["seconds"], 1),
            errors=len(errs),
            problem=r["problem"],
            retried=r.get("retried"),
            first_error=(f"cell {errs[0]['cell']}: {errs[0]['ename']}: {''.join(errs[0]['evalue'])}" if errs else None),
            slowest=slowest_cells(ex_nb) if ex_nb else [],
        )
        if r["problem"]: failures.append(f"{name}: {r['problem']}")
        for k, e in enumerate(errs):
            later = " [after an earlier error: JupyterLab's Run All stops at the first]" if k else ""
            failures.append(
                f"{name} cell {e['cell']} ({e['source']!r}): {e['ename']}: {''.join(e['evalue'])}{later}\n"
                + "\n".join("      " + l for l in e["traceback"])
            )
        if ex_nb and a.harness and harness_matches(a.harness, nb) and not has_widget(ex_nb):
            failures.append(f"{name}: harness notebook shows no widget (no {WIDGET_MIME} output): end the harness cell "
                            "with the widget or call display(w)")
        elif ex_nb and a.harness and harness_matches(a.harness, nb) and widgets_without_picture(ex_nb):
            failures.append(
                f"{name}: cell(s) {widgets_without_picture(ex_nb)} display a widget with no picture beside it "
                "(no image/png in its output): build it with static_dist.harness.harness"
            )
        warn = stderr_cells(ex_nb) if ex_nb else []
        entry["stderr_cells"] = [i for i, _ in warn]
        for i, line in warn:
            msg = f"{name} cell {i} writes to stderr: {line}"
            (failures.append if a.fail_on_stderr else print)(("" if a.fail_on_stderr else "note: ") + msg)
        if a.diff and ex_nb and results[(nb, 1)]["nb"]:
            d = diff_runs(ex_nb, results[(nb, 1)]["nb"], name)
            entry["differs"] = len(d)
            if d: print(f"{name}: outputs differ between two runs in {len(d)} cell(s):\n" + "\n".join(d))
        if a.write and ex_nb:
            inside = nb.resolve().is_relative_to(ROOT)
            dest = (a.out / (nb.resolve().relative_to(ROOT) if inside else nb.name)) if a.out else nb
            if len(failures) > n_before and not a.keep_errors:
                print(
                    f"not written: {name} has the problems listed below; fix them, or pass --keep-errors to save anyway"
                )
            else:
                dest.parent.mkdir(parents=True, exist_ok=True)
                write_back(ex_nb, dest, name)
    total = time.perf_counter() - t0
    print(f"total {total:.1f} s wall; per notebook: " +
          ", ".join(f"{Path(n).stem} {v['seconds']:.0f}s" for n, v in timing.items()))
    if a.timing:
        a.timing.write_text(json.dumps(dict(total_seconds=round(total, 1), notebooks=timing), indent=1) + "\n")
    if failures:
        print(f"\nFAIL: {len(failures)} problem(s) in a Jupyter kernel (Run All):")
        for f in failures: print("  " + f)
        return 1
    print(f"OK: {len(nbs)} notebook(s) ran top to bottom with no error output")
    return 0


if __name__ == "__main__":
    sys.exit(main())
