#!/usr/bin/env python
"""Check notebooks against the project's output policy (what a committed notebook may store).

    python tools/nbpolicy.py [NB ...]          (default: every notebook under nbs/)
    python tools/nbpolicy.py --rules           the rules and their limits

Exit status 1 with one line per violation, `FILE: cell N (id ID): RULE: what`, else 0 and one summary line.
Why: outputs are what a reader (JupyterLab, the docs site, the offline pages) sees, and what git stores. They
should be small, shown once, free of this machine's paths and noise, and stable when a notebook is only read:
JupyterLab re-serialises a notebook on autosave with JavaScript number semantics (1.0 becomes 1), so a
notebook must come back byte-identical from that round trip followed by `nbdev_clean` (rule `jupyterlab-roundtrip`).
Duplicate figures are searched across every notebook under nbs/ (and the ones named), whichever are checked.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT / "nbs"

LIMITS = {
    "nb_bytes": 300_000,  # a notebook file on disk
    "image_bytes": 120_000,  # one decoded image (a compressed PNG of a figure is 20-100 KB)
    "text_lines": 40,  # one text output (a stream, a text/plain repr, a traceback)
    "text_chars": 5_000,
    "html_chars": 10_000,  # one text/html output (a polars frame's table is 2-4 KB)
}

RULES = {
    "size": f"the notebook file is over {LIMITS['nb_bytes']:,} bytes",
    "kernelspec": "metadata.kernelspec.name must be 'python3' (JupyterLab otherwise asks for a kernel)",
    "unexecuted": "an API notebook (#| default_exp) saved no output at all: its docs page has no examples",
    "figure-json": "plotly JSON in a saved output: store figures as one PNG (opsd.plots.notebook_figures)",
    "widget": "a widget (e.g. tqdm.notebook) in a saved output: it renders nowhere outside a live kernel",
    "html-script": "a text/html output carries a <script>: it needs the network or inlines a library",
    "image-twice": "one output holds more than one image format of the same figure",
    "image-size": f"an image over {LIMITS['image_bytes']:,} bytes (decoded)",
    "duplicate-figure": "the same image bytes are stored in another cell or notebook: keep one, link to it",
    "text-size": f"a text output over {LIMITS['text_lines']} lines or {LIMITS['text_chars']:,} characters",
    "html-size": f"a text/html output over {LIMITS['html_chars']:,} characters",
    "abs-path": "an absolute path (/work, /root, /home, /tmp, ...) or .venv/site-packages in a saved output",
    "progress-bar": "a progress bar (carriage return, tqdm bar characters) in a saved output",
    "warning": "a warning in a saved output (silence or fix it before saving)",
    "error-output": "a saved error/traceback output",
    "link-html": "a relative link to .html: write it as .ipynb (JupyterLab follows it; quarto/render_docs rewrite it)",
    "link-absolute": "a link to an absolute local path",
    "link-missing": "a relative link or image whose file does not exist",
    "cell-id": "a cell without an id, or an id used twice (nbformat and JupyterLab rewrite them)",
    "jupyterlab-roundtrip": "a JupyterLab open-and-autosave followed by nbdev_clean would change the file",
    "unreadable": "the file is not valid notebook JSON",
}

_ABS_PATH = re.compile(r"(?<![\w.~-])/(?:work|root|home|tmp|Users|usr|opt|var|mnt|private|srv)/"
                       r"|(?<![\w-])\.venv\b|site-packages|\b[A-Za-z]:\\(?:Users|Windows)\\")
_BAR = re.compile(r"[\u2588\u2589\u258a\u258b\u258c\u258d\u258e\u258f]|\d+%\|| \d+(?:\.\d+)?(?:it/s|s/it)\]")
_WARNING = re.compile(r"\b[A-Z]\w*Warning\b|warnings\.warn\(|^WARNING\b", re.M)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|(?:href|src)\s*=\s*[\"']([^\"']+)[\"']")
_EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//|#)", re.I)


@dataclass(frozen=True)
class Violation:
    path: str  # the notebook, relative to the project root when inside it
    cell: int | None  # 0-based cell index, None for the whole notebook
    cell_id: str | None
    rule: str
    msg: str

    def __str__(self):
        where = "notebook" if self.cell is None else f"cell {self.cell}"
        where += f" (id {self.cell_id})" if self.cell_id else ""
        return f"{self.path}: {where}: {self.rule}: {self.msg}"


def _rel(p: Path) -> str:
    p = Path(p).resolve()
    try:
        return p.relative_to(ROOT).as_posix()
    except ValueError:
        return p.as_posix()


def _text(v) -> str:
    return "".join(v) if isinstance(v, list) else str(v)


def all_notebooks(folder: Path = NBS) -> list[Path]:
    "Every notebook under `folder`, checkpoints and folders starting with `_` or `.` excluded, sorted."
    return sorted(p for p in Path(folder).rglob("*.ipynb")
                  if not any(part.startswith((".", "_")) for part in p.relative_to(folder).parts[:-1]))


def image_digests(nb: dict) -> list[tuple[int, str, str]]:
    "(cell index, mime type, sha1 of the decoded bytes) of every image output of `nb`."
    out = []
    for i, c in enumerate(nb.get("cells", [])):
        for o in c.get("outputs", []):
            for mime, v in o.get("data", {}).items():
                if mime.startswith("image/"):
                    raw = _text(v).encode() if mime == "image/svg+xml" else base64.b64decode(_text(v))
                    out.append((i, mime, hashlib.sha1(raw).hexdigest()))
    return out


def js_numbers(x):
    "`x` as JavaScript's JSON.parse would hold it: integral floats become ints (1.0 -> 1), big ints lose precision."
    if isinstance(x, dict):
        return {k: js_numbers(v) for k, v in x.items()}
    if isinstance(x, list):
        return [js_numbers(v) for v in x]
    if isinstance(x, bool):
        return x
    if isinstance(x, float) and x == x and abs(x) < 1e21 and x == int(x):
        return int(x)
    if isinstance(x, int) and abs(x) > 2**53:
        return int(float(x))
    return x


def _merge_streams(outputs: list) -> list:
    "JupyterLab's output area joins consecutive stream outputs of the same name into one."
    out = []
    for o in outputs:
        if (o.get("output_type") == "stream" and out and out[-1].get("output_type") == "stream"
                and out[-1].get("name") == o.get("name")):
            out[-1] = {**out[-1], "text": _text(out[-1]["text"]) + _text(o["text"])}
        else:
            out.append(o)
    return out


def nbdev_clean_text(text: str) -> str:
    "What `nbdev_clean` would write for notebook JSON `text`, with this project's settings.ini."
    from execnb.nbio import nb2str
    from nbdev.clean import clean_nb
    from nbdev.config import get_config
    cfg = get_config(path=ROOT)
    nb = json.loads(text)
    clean_nb(nb, cfg.clear_all, cfg.get("allowed_metadata_keys").split(),
             cfg.get("allowed_cell_metadata_keys").split(), cfg.clean_ids)
    return nb2str(nb)


def jupyterlab_roundtrip(text: str) -> str:
    "Notebook JSON `text` after JupyterLab opens and autosaves it, then nbdev_clean."
    import warnings
    import nbformat
    with warnings.catch_warnings():  # duplicate/missing cell ids: reported by the rule `cell-id`
        warnings.simplefilter("ignore")
        nb = nbformat.reads(text, as_version=nbformat.NO_CONVERT)  # the server reads (multi-line strings joined)
    model = js_numbers(json.loads(json.dumps(nb)))  # ... sends JSON to the browser, which parses it as JavaScript
    for c in model.get("cells", []):
        if "outputs" in c:
            c["outputs"] = _merge_streams(c["outputs"])
    saved = nbformat.writes(nbformat.from_dict(model), version=nbformat.NO_CONVERT)  # autosave: the server writes it
    return nbdev_clean_text(saved)


def _links(md: str) -> list[str]:
    return [a or b for a, b in _LINK.findall(md)]


def _check_links(nb_path: Path, i: int, cid, md: str, add) -> None:
    for target in _links(md):
        if _EXTERNAL.match(target):
            continue
        path = target.split("#")[0].split("?")[0]
        if not path:
            continue
        if path.startswith("/"):
            add(i, cid, "link-absolute", f"link {target!r}")
        elif path.endswith(".html"):
            add(i, cid, "link-html", f"link {target!r}: write {path[:-5]}.ipynb")
        elif not (nb_path.parent / path).exists():
            add(i, cid, "link-missing", f"link {target!r}: no such file next to the notebook")


def _check_text(i: int, cid, where: str, text: str, add, is_html: bool = False) -> None:
    if is_html:
        if len(text) > LIMITS["html_chars"]:
            add(i, cid, "html-size", f"{where}: {len(text):,} characters (limit {LIMITS['html_chars']:,})")
        if "<script" in text.lower():
            add(i, cid, "html-script", f"{where}: holds a <script>")
    else:
        n = text.count("\n") + (not text.endswith("\n"))
        if n > LIMITS["text_lines"] or len(text) > LIMITS["text_chars"]:
            add(i, cid, "text-size", f"{where}: {n} lines, {len(text):,} characters "
                f"(limits {LIMITS['text_lines']} lines, {LIMITS['text_chars']:,} characters)")
    for rule, rx in (("abs-path", _ABS_PATH), ("warning", _WARNING)):
        m = rx.search(text)
        if m:
            line = text[text.rfind("\n", 0, m.start()) + 1:].split("\n")[0].strip()
            add(i, cid, rule, f"{where}: {line[:100]!r}")
    if "\r" in text or _BAR.search(text):
        add(i, cid, "progress-bar", f"{where}: carriage return or progress-bar characters")


def check_notebook(path: Path, digests: dict[str, list[tuple[str, int]]] | None = None) -> list[Violation]:
    "Every policy violation of the notebook at `path`; `digests` maps image sha1 -> [(notebook, cell)] seen anywhere."
    path = Path(path)
    rel = _rel(path)
    found: list[Violation] = []

    def add(cell, cid, rule, msg):
        found.append(Violation(rel, cell, cid, rule, msg))

    try:
        text = path.read_text(encoding="utf-8")
        nb = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return [Violation(rel, None, None, "unreadable", f"{type(e).__name__}: {e}")]
    size = len(text.encode("utf-8"))
    if size > LIMITS["nb_bytes"]:
        add(None, None, "size", f"{size:,} bytes (limit {LIMITS['nb_bytes']:,})")
    ks = nb.get("metadata", {}).get("kernelspec") or {}
    if ks.get("name") != "python3":
        add(None, None, "kernelspec", f"kernelspec name is {ks.get('name')!r}, want 'python3'")
    cells = nb.get("cells", [])
    exp = re.compile(r"^\s*#\|\s*default_exp\b", re.M)
    is_api = any(c.get("cell_type") == "code" and exp.search(_text(c.get("source", ""))) for c in cells)
    if is_api and not any(c.get("outputs") for c in cells):
        add(None, None, "unexecuted", "no code cell has a saved output")

    seen_ids: dict[str, int] = {}
    for i, c in enumerate(cells):
        cid = c.get("id")
        if not cid:
            add(i, cid, "cell-id", "no cell id")
        elif cid in seen_ids:
            add(i, cid, "cell-id", f"id {cid!r} already used by cell {seen_ids[cid]}")
        else:
            seen_ids[cid] = i
        if c.get("cell_type") == "markdown":
            _check_links(path, i, cid, _text(c.get("source", "")), add)
            continue
        for k, o in enumerate(c.get("outputs", [])):
            kind = o.get("output_type")
            where = f"output {k}"
            if kind == "error":
                add(i, cid, "error-output", f"{where}: {o.get('ename')}: {str(o.get('evalue'))[:80]}")
                _check_text(i, cid, where + " traceback", "\n".join(o.get("traceback", [])), add)
                continue
            if kind == "stream":
                _check_text(i, cid, f"{where} ({o.get('name')})", _text(o.get("text", "")), add)
                continue
            data = o.get("data", {})
            images = [m for m in data if m.startswith("image/")]
            if len(images) > 1:
                add(i, cid, "image-twice", f"{where}: {images}")
            for mime, v in data.items():
                if "plotly" in mime:
                    add(i, cid, "figure-json", f"{where}: {mime} ({len(json.dumps(v)):,} characters)")
                elif "widget" in mime:
                    add(i, cid, "widget", f"{where}: {mime}")
                elif mime.startswith("image/"):
                    raw = _text(v).encode() if mime == "image/svg+xml" else base64.b64decode(_text(v))
                    if len(raw) > LIMITS["image_bytes"]:
                        add(i, cid, "image-size",
                            f"{where}: {mime} of {len(raw):,} bytes (limit {LIMITS['image_bytes']:,})")
                    others = [(n, j) for n, j in (digests or {}).get(hashlib.sha1(raw).hexdigest(), [])
                              if (n, j) != (rel, i)]
                    if others:
                        add(i, cid, "duplicate-figure",
                            f"{where}: same {mime} as " + ", ".join(f"{n} cell {j}" for n, j in others))
                elif mime.startswith("text/") or mime in ("application/json", "application/javascript"):
                    s = _text(v) if isinstance(v, (str, list)) else json.dumps(v)
                    _check_text(i, cid, f"{where} {mime}", s, add, is_html=mime == "text/html")
                    if mime == "application/javascript":
                        add(i, cid, "html-script", f"{where}: {mime}")
    if not found or all(v.rule != "unreadable" for v in found):
        try:
            after = jupyterlab_roundtrip(text)
            if after != text:
                old, new = text.splitlines(), after.splitlines()
                n = min(len(old), len(new))
                k = next((j for j, (x, y) in enumerate(zip(old, new)) if x != y), n)
                first = (f"line {k + 1}: {old[k].strip()[:50]!r} -> {new[k].strip()[:50]!r}" if k < n
                         else f"length {len(old)} -> {len(new)} lines")
                add(None, None, "jupyterlab-roundtrip", "open-and-autosave in JupyterLab then nbdev_clean changes the "
                    f"file (plotly JSON 1.0, split streams, duplicate ids, not nbdev_clean'ed); first change {first}")
        except Exception as e:  # an invalid notebook for nbformat
            add(None, None, "jupyterlab-roundtrip", f"nbformat cannot round-trip it: {type(e).__name__}: {str(e)[:99]}")
    return found


def digest_index(paths) -> dict[str, list[tuple[str, int]]]:
    "sha1 of image bytes -> [(notebook, cell)] over `paths` (each notebook counted once)."
    idx: dict[str, list[tuple[str, int]]] = {}
    for p in dict.fromkeys(Path(p).resolve() for p in paths):
        try:
            nb = json.loads(Path(p).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        for i, _, h in image_digests(nb):
            if (_rel(p), i) not in idx.setdefault(h, []):
                idx[h].append((_rel(p), i))
    return idx


def check(paths=None) -> list[Violation]:
    "Violations of the notebooks `paths` (default: all under nbs/); duplicates are looked for across nbs/ too."
    paths = [Path(p) for p in paths] if paths else all_notebooks()
    idx = digest_index(all_notebooks() + paths)
    return [v for p in paths for v in check_notebook(p, idx)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="*", type=Path, help="notebooks to check (default: all under nbs/)")
    ap.add_argument("--rules", action="store_true", help="print the rules and limits, then exit")
    a = ap.parse_args(argv)
    if a.rules:
        for k, v in RULES.items():
            print(f"{k:22s} {v}")
        return 0
    missing = [str(p) for p in a.notebooks if not p.is_file()]
    if missing:
        print(f"nbpolicy: no such notebook: {', '.join(missing)}", file=sys.stderr)
        return 2
    found = check(a.notebooks or None)
    for v in found:
        print(v)
    n = len(a.notebooks) if a.notebooks else len(all_notebooks())
    print(f"nbpolicy: {len(found)} violation(s) in {len({v.path for v in found})} of {n} notebook(s)",
          file=sys.stderr if found else sys.stdout)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
