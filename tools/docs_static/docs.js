// The docs site's behaviour (tools/build_docs.py): keep the current page in view in the sidebar, mark the section
// being read in "On this page", and search pages, sections and API entries. Nothing leaves the page: the search
// index is a script next to the pages (search_index.js sets window.DOCS_SEARCH), because a page opened from file://
// may load a script but may not fetch() a JSON file.
(function () {
  "use strict";
  const nav = document.querySelector("nav.docs-nav");
  if (!nav) return;

  // An element by the id a link's #fragment names: as written (nbconvert's ids keep %-escapes), else decoded.
  function byHash(hash) {
    const id = hash.replace(/^#/, "");
    let el = document.getElementById(id);
    try { el = el || document.getElementById(decodeURIComponent(id)); } catch (e) { /* a lone % */ }
    return el;
  }

  // ---- sidebar: scroll the chapter list (not the page) so the current page's entry is in view
  function revealCurrent() {
    const list = nav.querySelector(".docs-nav-list"), cur = list && list.querySelector("a.current");
    if (!cur) return;
    const l = list.getBoundingClientRect(), c = cur.getBoundingClientRect();
    if (c.top < l.top || c.bottom > l.bottom) list.scrollTop += c.top - l.top - (l.height - c.height) / 3;
  }

  // ---- "On this page": the last heading above the top third of the window is the one being read
  function tocSpy() {
    const links = [...document.querySelectorAll("aside.docs-toc a")];
    const heads = links.map(a => byHash(a.hash));
    if (!links.length) return;
    let queued = false;
    function mark() {
      queued = false;
      let k = -1;
      heads.forEach((h, i) => { if (h && h.getBoundingClientRect().top < window.innerHeight / 3) k = i; });
      links.forEach((a, i) => a.classList.toggle("active", i === k));
    }
    window.addEventListener("scroll", () => { if (!queued) { queued = true; requestAnimationFrame(mark); } }, {passive: true});
    mark();
  }

  // ---- search
  const box = document.getElementById("docs-search"), panel = document.getElementById("docs-search-results");
  let index = null, loading = null, sel = -1;

  function loadIndex() {
    if (index) return Promise.resolve(index);
    if (!loading) loading = new Promise((resolve) => {
      const s = document.createElement("script");
      s.src = "search_index.js";
      s.onload = () => resolve(index = window.DOCS_SEARCH || []);
      s.onerror = () => resolve(index = []);
      document.head.appendChild(s);
    });
    return loading;
  }

  // Every word of the query must appear in the entry; a name equal to / starting with / containing the query
  // ranks first, then API entries, then pages, then sections; shorter titles first among equals.
  const KIND_RANK = {api: 3, page: 2, section: 1};
  function score(r, q, words) {
    const t = r.t.toLowerCase(), hay = (r.t + " " + r.c + " " + r.d).toLowerCase();
    if (!words.every(w => hay.includes(w))) return 0;
    let s = KIND_RANK[r.k] || 0;
    if (t === q || t.endsWith("." + q)) s += 100;
    else if (t.startsWith(q)) s += 50;
    else if (t.includes(q)) s += 25;
    else if (words.every(w => t.includes(w))) s += 10;
    return s;
  }

  function search(q) {
    q = q.trim().toLowerCase();
    if (!q) return [];
    const words = q.split(/\s+/);
    return index.map((r, i) => [score(r, q, words), r, i]).filter(x => x[0] > 0)
      .sort((a, b) => b[0] - a[0] || a[1].t.length - b[1].t.length || a[2] - b[2]).slice(0, 30).map(x => x[1]);
  }

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text) e.textContent = text;
    return e;
  }

  function show(results) {
    panel.replaceChildren();
    sel = -1;
    if (!box.value.trim()) { panel.hidden = true; return; }
    if (!results.length) panel.append(el("div", "none", "No match."));
    for (const r of results) {
      const a = el("a", "sr-" + r.k);
      a.href = r.u;
      a.setAttribute("role", "option");
      a.append(el("span", "sr-kind", {api: "API", page: "page", section: "section"}[r.k] || r.k),
               el("span", "sr-title", r.t), el("span", "sr-ctx", r.c));
      if (r.d) a.append(el("span", "sr-doc", r.d));
      a.addEventListener("click", () => { panel.hidden = true; });
      panel.append(a);
    }
    panel.hidden = false;
  }

  function move(step) {
    const items = panel.querySelectorAll("a");
    if (!items.length) return;
    if (sel >= 0) items[sel].classList.remove("sel");
    sel = (sel + step + items.length) % items.length;
    items[sel].classList.add("sel");
    items[sel].scrollIntoView({block: "nearest"});
  }

  if (box && panel) {
    const update = () => loadIndex().then(() => show(search(box.value)));
    box.addEventListener("input", update);
    box.addEventListener("focus", () => { loadIndex(); if (box.value.trim()) update(); });
    box.addEventListener("keydown", (e) => {
      if (e.key === "ArrowDown" || e.key === "ArrowUp") { e.preventDefault(); move(e.key === "ArrowDown" ? 1 : -1); }
      else if (e.key === "Enter") {
        const items = panel.querySelectorAll("a"), a = items[Math.max(sel, 0)];
        if (a) { e.preventDefault(); panel.hidden = true; window.location.href = a.href; }
      } else if (e.key === "Escape") { box.value = ""; show([]); box.blur(); }
    });
    document.addEventListener("keydown", (e) => {
      const t = document.activeElement, typing = t && /^(INPUT|TEXTAREA|SELECT)$/.test(t.tagName);
      if (e.key === "/" && !typing) { e.preventDefault(); box.focus(); }
    });
    document.addEventListener("click", (e) => { if (!nav.contains(e.target)) panel.hidden = true; });
  }

  revealCurrent();
  tocSpy();
})();
