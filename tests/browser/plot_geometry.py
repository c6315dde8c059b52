"""Where a drawn matplotlib figure puts its legends and labels, against where its data is (display pixels).

A legend covers data when its window extent meets a data artist of an axes where that artist is drawn (inside the
axes, which clip it): a line's points and the segments between them (not the line's bounding box), a bar or patch
(its area if filled or hatched, else its outline), a filled area (stackplot, broken_barh) or a scatter marker's
centre; and, wherever they are, the texts placed on the data (`ax.texts`, annotations included). Shaded spans
(`axvspan`/`axhspan`: a patch placed in axes units one way) are background, not data. A legend beside the axes
(`bbox_to_anchor` past 1.0) meets none of it and passes; one that lands on a neighbouring axes' data does not.
Texts above and around the data (titles, fault labels, phase names) must not overlap one another either.
"""
from __future__ import annotations

import numpy as np
from matplotlib.collections import Collection, LineCollection, PathCollection
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.transforms import Bbox

PAD = 1.0   # pixels two boxes must share each way to count as overlapping (anti-aliasing touches do not)


def _renderer(fig):
    "Draw `fig` (on an Agg canvas if pyplot closed it and left a bare one) and return its renderer."
    if not hasattr(fig.canvas, "get_renderer"):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        FigureCanvasAgg(fig)
    fig.canvas.draw()
    return fig.canvas.get_renderer()


def _shrunk(b: Bbox) -> Bbox:
    return Bbox.from_extents(b.x0 + PAD / 2, b.y0 + PAD / 2, b.x1 - PAD / 2, b.y1 - PAD / 2)


def _meet(a: Bbox, b: Bbox) -> bool:
    "Do two boxes share more than PAD pixels each way?"
    return min(a.x1, b.x1) - max(a.x0, b.x0) > PAD and min(a.y1, b.y1) - max(a.y0, b.y0) > PAD


def _clip(region: Bbox, ax) -> Bbox | None:
    "The part of `region` inside the axes (where clipped data can be drawn), or None."
    got = Bbox.intersection(region, ax.bbox)
    return got if got is not None and got.width > PAD and got.height > PAD else None


def _is_span(p: Patch, ax) -> bool:
    "A shaded span (axvspan, axhspan): a patch placed in axes units one way, drawn across the whole axes that way."
    t = p.get_data_transform()
    return t == ax.get_xaxis_transform() or t == ax.get_yaxis_transform()


def _line_meets(line: Line2D, box: Bbox) -> str | None:
    xy = line.get_transform().transform(np.column_stack([line.get_xdata(orig=False), line.get_ydata(orig=False)]))
    xy = xy[np.isfinite(xy).all(axis=1)]
    if not len(xy): return None
    inside = (xy[:, 0] > box.x0) & (xy[:, 0] < box.x1) & (xy[:, 1] > box.y0) & (xy[:, 1] < box.y1)
    if inside.any(): return f"{int(inside.sum())} of its points"
    from matplotlib.path import Path
    if len(xy) > 1 and line.get_linestyle() not in ("None", " ", "") and Path(xy).intersects_bbox(box, filled=False):
        return "a segment"
    return None


def _patch_meets(p: Patch, box: Bbox) -> bool:
    path = p.get_transform().transform_path(p.get_path())
    return path.intersects_bbox(box, filled=p.get_fill() or bool(p.get_hatch()))   # a hatch is drawn inside too


def _collection_meets(c: Collection, box: Bbox) -> bool:
    "A scatter's marker centres, or the filled areas (stackplot, broken_barh) or segments of any other collection."
    if isinstance(c, PathCollection):
        off = c.get_offset_transform().transform(np.asarray(c.get_offsets(), float).reshape(-1, 2))
        off = off[np.isfinite(off).all(axis=1)]
        return bool(((off[:, 0] > box.x0) & (off[:, 0] < box.x1) & (off[:, 1] > box.y0) & (off[:, 1] < box.y1)).any())
    t, filled = c.get_transform(), not isinstance(c, LineCollection)
    return any(t.transform_path(p).intersects_bbox(box, filled=filled) for p in c.get_paths() if len(p.vertices))


def _name(a) -> str:
    "An artist as a reader would name it: its kind and its legend label, if it has one."
    lab = a.get_label()
    return type(a).__name__ + (f" {lab!r}" if lab and not lab.startswith("_") else "")


def data_hits(ax, region: Bbox) -> list[str]:
    "The data artists of `ax` that `region` (display pixels) meets, as 'kind label (how many)'."
    box, r = _clip(region, ax), ax.figure.canvas.get_renderer()
    hits = []
    if box is not None:
        box = _shrunk(box)
        hits += [f"{_name(l)} ({what})" for l in ax.lines if l.get_visible() and (what := _line_meets(l, box))]
        for p in ax.patches:
            e = p.get_window_extent()
            if p.get_visible() and e.width >= PAD and e.height >= PAD and not _is_span(p, ax) and _patch_meets(p, box):
                hits.append(_name(p))
        hits += [_name(c) for c in ax.collections if c.get_visible() and _collection_meets(c, box)]
    hits += [f"Text {t.get_text()!r}" for t in ax.texts
             if t.get_visible() and t.get_text().strip() and _meet(t.get_window_extent(r), region)]
    return [h + (f" x{hits.count(h)}" if hits.count(h) > 1 else "") for h in dict.fromkeys(hits)]


def legends_on_data(fig) -> list[str]:
    """Each legend of `fig` (of an axes or of the figure) that meets data of any of the figure's axes, as
    'axes K legend covers axes J: ...' (draws the figure). Empty when every legend is clear of the data."""
    r = _renderer(fig)
    legends = [(f"axes {k}", ax.get_legend()) for k, ax in enumerate(fig.axes)] + [("figure", g) for g in fig.legends]
    bad = []
    for who, leg in legends:
        if leg is None or not leg.get_visible(): continue
        ext = leg.get_window_extent(r)
        for j, ax in enumerate(fig.axes):
            if hits := data_hits(ax, ext): bad.append(f"{who} legend covers axes {j}: " + "; ".join(hits))
    return bad


def _labels(fig) -> list[tuple[str, object]]:
    "The texts set around and on the data: each axes' title, texts and annotations; the figure's texts."
    out = []
    for k, ax in enumerate(fig.axes):
        out += [(f"axes {k} title", ax.title)] + [(f"axes {k} text", t) for t in ax.texts]
    out += [("figure text", t) for t in fig.texts]
    return [(w, t) for w, t in out if t.get_visible() and t.get_text().strip()]


def overlapping_texts(fig, within: bool = True) -> list[str]:
    """Pairs of titles, texts and annotations of `fig` that overlap one another, as "'A' / 'B'" (draws the figure).
    `within=False` leaves out pairs of texts of one axes that both lie inside it (labels written on bars)."""
    r = _renderer(fig)
    labs = [(w, t, t.get_window_extent(r)) for w, t in _labels(fig)]
    bad = []
    for i, (wa, a, ea) in enumerate(labs):
        for wb, b, eb in labs[i + 1:]:
            if not _meet(ea, eb): continue
            if not within and wa == wb and wa.endswith("text") and all(
                    _inside(e, t.axes) for e, t in ((ea, a), (eb, b))): continue
            bad.append(f"{wa} {a.get_text()!r} / {wb} {b.get_text()!r}")
    return bad


def _inside(e: Bbox, ax) -> bool:
    return ax is not None and ax.bbox.x0 <= e.x0 and e.x1 <= ax.bbox.x1 and ax.bbox.y0 <= e.y0 and e.y1 <= ax.bbox.y1
