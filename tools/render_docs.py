#!/usr/bin/env python
"""Render notebooks to standalone HTML pages that work offline (no quarto, no network).

    python tools/render_docs.py [NB ...] [--out DIR]      (default: nbs/00_loss.ipynb -> _docs_offline/)

The notebooks are NOT executed: their saved outputs are used. What makes the pages work offline:
* math: nbconvert's MathJax script points at a local MathJax 2.7 copy (from the pinned pip package
  `jupyter-server-mathjax`), copied to OUT/mathjax/, with the STIX-Web web fonts it ships;
* figures: output bundles with both `application/vnd.plotly.v1+json` and `image/png` show the embedded PNG
  (images are preferred over HTML/JS renderers, which would need plotly.js from a CDN);
* nothing else loads from a CDN: the require.js, mermaid and widget loaders of nbconvert's lab template are dropped;
* links: notebooks link to each other as relative `.ipynb` (what JupyterLab follows); on the pages they point to the
  rendered `.html`, and every page starts with a link to `contents.html` (written next to the pages).
API reference: a module notebook (`#| default_exp`) goes through nbdev's own doc processors first (what
`nbdev_proc_nbs` runs before quarto): a `show_doc` cell after each exported definition, exported source and `#| hide`
cells removed. `show_doc` runs against the imported module (no notebook cell is executed) and renders the signature
and a table of the documented parameters (types, defaults, the docments comments) and return value.
Navigation: a sidebar of every page in the notebook order (start here, API reference, explanations), previous/next
links, a contents page with each page's title and one-line description, and a search box that works offline
(its index is `search_index.js`, loaded with a plain script tag, so no server is needed).
nbdev cell directives are honoured loosely: `#| hide` drops the cell, `#| echo: false` hides its code,
`#| output: false` its outputs, and the directive lines themselves are not shown; a code cell left empty after its
directives (the `default_exp` cell) is dropped.
"""
from __future__ import annotations

import argparse
import copy
import html
import importlib
import inspect
import json
import os
import re
import shutil
import sys
import warnings
from pathlib import Path

import nbformat
from jinja2 import DictLoader
from nbconvert import HTMLExporter

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "_docs_offline"
MATHJAX_DIR = "mathjax"  # inside OUT
MATHJAX_CONFIG = "TeX-AMS-MML_HTMLorMML-full,Safe"  # the combined configuration the pip package ships

# the pip package ships only the STIX-Web web fonts, so MathJax must be told to use them (its default is "TeX")
_TEMPLATE = r"""{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{% block jupyter_widgets %}{% endblock jupyter_widgets %}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block html_head_js_mathjax -%}
<script type="text/x-mathjax-config">
MathJax.Hub.Config({
  "HTML-CSS": {availableFonts: [], preferredFont: null, webFont: "STIX-Web", imageFont: null},
  MMLorHTML: {prefer: "HTML"},
  menuSettings: {zoom: "None"}
});
</script>
{{ super() }}
{%- endblock html_head_js_mathjax -%}
"""

# images first: a bundle that has a PNG next to an HTML/JS rendering (plotly) shows the PNG
DISPLAY_PRIORITY = ["image/png", "image/jpeg", "image/svg+xml", "image/gif", "text/html", "text/markdown",
                    "text/latex", "application/pdf", "text/plain"]

_DIRECTIVE = re.compile(r"^\s*#\|\s*([\w-]+)\s*:?\s*(.*?)\s*$")


def mathjax_source() -> Path:
    "The MathJax 2.7 static tree shipped by the `jupyter-server-mathjax` wheel."
    try:
        import jupyter_server_mathjax
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit("render_docs: needs the pip package jupyter-server-mathjax (see requirements-cpu.txt)") from e
    src = Path(jupyter_server_mathjax.__file__).parent / "static"
    if not (src / "MathJax.js").is_file():
        raise SystemExit(f"render_docs: no MathJax.js under {src}")
    return src


def copy_mathjax(out: Path) -> Path:
    "Copy MathJax next to the pages once (skipped when the copy is already there and the same size)."
    src, dst = mathjax_source(), out / MATHJAX_DIR
    same = (dst / "MathJax.js").is_file() and (dst / "MathJax.js").stat().st_size == (src / "MathJax.js").stat().st_size
    if not same:
        shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def _directives(src: str) -> tuple[dict, str]:
    "nbdev `#| key: value` lines at the top of a code cell, and the source without them."
    lines, d = src.splitlines(), {}
    i = 0
    while i < len(lines):
        m = _DIRECTIVE.match(lines[i])
        if not m:
            if lines[i].strip():
                break
            i += 1
            continue
        d[m.group(1).lower()] = m.group(2).lower()
        i += 1
    return d, "\n".join(lines[i:]) if d else src


def prepare(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    "A copy of `nb` with nbdev directives applied and nothing that needs the network (widget state)."
    nb = copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)
    cells = []
    for c in nb.cells:
        if c.cell_type == "code":
            d, src = _directives(c.source)
            if "hide" in d or d.get("include") == "false":
                continue
            c.source = src
            if not src.strip() and not c.get("outputs"):
                continue  # only directives (`#| default_exp`): an empty box on the page
            if d.get("echo") == "false":
                c.metadata["transient"] = {"remove_source": True}
            if d.get("output") == "false":
                c.outputs = []
        elif c.cell_type == "raw":
            continue  # quarto front matter and the like
        cells.append(c)
    nb.cells = cells
    return nb


# -- API reference: nbdev's doc processors, show_doc rendered against the imported module ------------------------

def _anno(a) -> str:
    if a is inspect.Parameter.empty or a is None:
        return ""
    return a if isinstance(a, str) else getattr(a, "__name__", None) or str(a).replace("typing.", "")


def _default(v) -> str:
    return "" if v is inspect.Parameter.empty else repr(v)


class OfflineDocRenderer:
    "show_doc's renderer for the offline pages: heading, signature, docstring, a table of parameters and return value."

    def __init__(self, sym, name=None, title_level=3):
        self.sym, self.name, self.level = sym, name or getattr(sym, "__qualname__", None) or str(sym), title_level

    def _sig(self) -> str:
        try:
            sig = inspect.signature(self.sym)
        except (TypeError, ValueError):
            return ""
        ps = [p for p in sig.parameters.values() if p.name != "self"]
        parts = []
        for p in ps:
            star = "*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else ""
            a, d = _anno(p.annotation), _default(p.default)
            parts.append(f"{star}{p.name}" + (f": {a}" if a else "") + (f" = {d}" if d else ""))
        ret = _anno(sig.return_annotation)
        tail = f" -> {ret}" if ret else ""
        one = f"{self.name}({', '.join(parts)}){tail}"
        return one if len(one) <= 100 else f"{self.name}(\n" + "".join(f"    {x},\n" for x in parts) + f"){tail}"

    def _table(self) -> str:
        from fastcore.docments import docments
        try:
            dm = docments(self.sym, full=True)
        except Exception:
            return ""
        rows = [(k, v) for k, v in dm.items() if k not in ("self", "return")]
        ret = dm.get("return")
        if not rows and not (ret and ret.get("docment")):
            return ""
        e = html.escape
        c = lambda x: f"<code>{e(x)}</code>" if x else ""
        out = ['<table class="opsd-params"><thead><tr><th>parameter</th><th>type</th><th>default</th>'
               '<th>details</th></tr></thead><tbody>']
        for k, v in rows:
            out.append(f"<tr><td>{c(k)}</td><td>{c(_anno(v.get('anno')))}</td>"
                       f"<td>{c(_default(v.get('default')))}</td><td>{e(v.get('docment') or '')}</td></tr>")
        if ret and (ret.get("docment") or _anno(ret.get("anno"))):
            out.append(f"<tr class=\"ret\"><td><b>returns</b></td><td>{c(_anno(ret.get('anno')))}</td>"
                       f"<td></td><td>{e(ret.get('docment') or '')}</td></tr>")
        return "".join(out) + "</tbody></table>"

    def _repr_html_(self) -> str:
        e = html.escape
        doc = inspect.getdoc(self.sym) or ""
        doc = doc if not isinstance(self.sym, type) or doc != inspect.getdoc(type) else ""
        anchor = re.sub(r"[^\w.-]", "-", self.name)
        sig = self._sig()
        return (f'<div class="opsd-doc" id="{e(anchor)}"><h{self.level} class="opsd-doc-name">{e(self.name)}'
                f'<a class="anchor-link" href="#{e(anchor)}">¶</a></h{self.level}>'
                + (f'<pre class="opsd-sig"><code>{e(sig)}</code></pre>' if sig else "")
                + (f'<p class="opsd-docstring">{e(doc)}</p>' if doc else "") + self._table() + "</div>")

    def __repr__(self):
        return f"{self.name}{self._sig()}"


def api_docs(nb_path: Path) -> nbformat.NotebookNode | None:
    """A module notebook after nbdev's doc processors (None for a notebook without `#| default_exp`): a show_doc cell
    after each exported definition, rendered against the imported module; exported and hidden cells removed."""
    from execnb.nbio import nb2dict, read_nb
    from execnb.shell import CaptureShell
    from nbdev.process import NBProcessor
    from nbdev.processors import (add_show_docs, clean_magics, clean_show_doc, filter_stream_, hide_, hide_line,
                                  mv_exports, populate_language, rm_export, rm_header_dash, strip_ansi,
                                  strip_hidden_metadata)
    from nbdev.showdoc import show_doc
    nb = read_nb(nb_path)
    m = re.search(r"^\s*#\|\s*default_exp\s+(\S+)", "\n".join(c.source for c in nb.cells if c.cell_type == "code"),
                  re.M)
    if m is None:
        return None
    mod = importlib.import_module(f"opsd.{m.group(1)}")

    class _exec_show_docs:
        "Run only the show_doc cells, in the imported module's namespace (no other cell is executed)."
        def __init__(self, nb):
            self.k = CaptureShell()
            self.k.user_ns.update(vars(mod))
            self.k.user_ns["show_doc"] = lambda sym, name=None, title_level=3, **kw: show_doc(
                sym, renderer=OfflineDocRenderer, name=name, title_level=title_level)

        def __call__(self, cell):
            if cell.cell_type == "code" and re.match(r"(?:#\|.*\n)*show_doc\(", cell.source or ""):
                self.k.cell(cell)
                if self.k.exc:
                    raise RuntimeError(f"render_docs: show_doc failed in {nb_path.name}: {cell.source!r}") from self.k.exc

    procs = [populate_language, add_show_docs, strip_ansi, hide_line, filter_stream_, rm_header_dash, clean_show_doc,
             _exec_show_docs, rm_export, clean_magics, hide_, mv_exports, strip_hidden_metadata]
    old = os.environ.get("IN_TEST")
    os.environ["IN_TEST"] = "1"   # what nbdev sets while it processes notebooks
    try:
        NBProcessor(nb=nb, procs=procs).process()
    finally:
        os.environ.pop("IN_TEST") if old is None else os.environ.__setitem__("IN_TEST", old)
    d = nb2dict(nb)
    for c in d["cells"]:
        c["source"] = "".join(c["source"]) if isinstance(c.get("source"), list) else c.get("source", "")
        c.setdefault("metadata", {})
        if c["cell_type"] == "code":
            c.setdefault("outputs", []), c.setdefault("execution_count", None)
            for o in c["outputs"]:   # execnb keeps multi-line values as lists of lines; nbconvert wants strings
                data = o.get("data", {})
                for k, v in data.items():
                    if isinstance(v, list): data[k] = "".join(v)
                if isinstance(o.get("text"), list): o["text"] = "".join(o["text"])
    return nbformat.from_dict(d)


# -- site: page order, titles, sidebar, previous/next, contents, search --------------------------------------------

SECTIONS = (("start", "Start here"), ("api", "API reference"), ("explanations", "Explanations"), ("other", "More"))
DOC_CSS = """
body{margin:0}
.opsd-side{position:fixed;top:0;left:0;bottom:0;width:250px;overflow-y:auto;background:#f7f7f9;
 border-right:1px solid #e3e3e3;padding:12px 12px 40px;font:13px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;
 box-sizing:border-box;z-index:50}
.opsd-side .brand{font-weight:700;font-size:16px;display:block;margin:0 0 8px;color:#222;text-decoration:none}
.opsd-side h4{margin:14px 0 4px;font-size:11px;text-transform:uppercase;letter-spacing:.05em;color:#777}
.opsd-side ul{list-style:none;margin:0;padding:0} .opsd-side li a{display:block;padding:2px 6px;border-radius:3px;
 color:#2a4d8f;text-decoration:none} .opsd-side li a:hover{background:#e8ecf5}
.opsd-side li a.here{background:#2a4d8f;color:#fff}
.opsd-search{position:relative;margin-bottom:6px} .opsd-search input{width:100%;box-sizing:border-box;padding:5px 7px;
 border:1px solid #bbb;border-radius:4px;font-size:13px}
.opsd-results{position:fixed;left:12px;top:72px;width:480px;max-height:75vh;overflow-y:auto;background:#fff;
 border:1px solid #999;border-radius:4px;box-shadow:0 4px 14px rgba(0,0,0,.2);display:none;z-index:60}
.opsd-results a{display:block;padding:6px 9px;border-bottom:1px solid #eee;color:#222;text-decoration:none}
.opsd-results a:hover,.opsd-results a.sel{background:#eef2fa} .opsd-results b{color:#2a4d8f}
.opsd-results small{display:block;color:#555}
.opsd-main{margin-left:250px} .opsd-main > .jp-Notebook, .opsd-main main{max-width:1100px}
.opsd-prevnext{display:flex;justify-content:space-between;gap:12px;max-width:1100px;margin:30px auto 40px;
 padding:12px 16px 0;border-top:1px solid #ddd;font:14px system-ui,sans-serif}
.opsd-prevnext a{color:#2a4d8f;text-decoration:none} .opsd-prevnext span{color:#777;font-size:12px;display:block}
.opsd-doc{border:1px solid #dde3ee;border-radius:6px;padding:4px 14px 10px;margin:10px 0 18px;background:#fbfcfe}
.opsd-doc .opsd-doc-name{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;margin:10px 0 6px}
.opsd-sig{background:#f1f3f7;padding:8px 10px;border-radius:4px;overflow-x:auto;font-size:13px;margin:4px 0 8px}
.opsd-docstring{font-style:italic;margin:4px 0 8px}
table.opsd-params{border-collapse:collapse;font-size:13px;margin:4px 0} table.opsd-params th,table.opsd-params td{
 border:1px solid #d5dbe5;padding:3px 7px;text-align:left !important;vertical-align:top} table.opsd-params th{background:#eef1f6}
table.opsd-params tr.ret td{background:#f6f8fb}
@media (max-width:900px){.opsd-side{position:static;width:auto;height:auto}.opsd-main{margin-left:0}}
"""
SEARCH_JS = r"""
(function(){
  var box=document.getElementById('opsd-q'), res=document.getElementById('opsd-res'), base=document.body.dataset.root||'';
  function esc(s){return s.replace(/[&<>"]/g,function(c){return {'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;'}[c];});}
  function run(){
    var q=box.value.toLowerCase().trim(), idx=window.OPSD_SEARCH||[];
    if(q.length<2){res.style.display='none';res.innerHTML='';return;}
    var words=q.split(/\s+/), hits=[];
    idx.forEach(function(r){
      var hay=(r.t+' '+r.h+' '+r.x).toLowerCase(), ok=words.every(function(w){return hay.indexOf(w)>=0;});
      if(!ok)return;
      var score=words.reduce(function(s,w){return s+((r.h+' '+r.t).toLowerCase().indexOf(w)>=0?10:1);},0);
      hits.push([score,r]);
    });
    hits.sort(function(a,b){return b[0]-a[0];});
    res.innerHTML='';
    hits.slice(0,15).forEach(function(h){var r=h[1], lx=r.x.toLowerCase(), i=Math.max(0,lx.indexOf(words[0])-60);
      var a=document.createElement('a'); a.setAttribute('href', base+r.p+(r.a?'#'+r.a:''));
      a.innerHTML='<b>'+esc(r.t)+'</b>'+(r.h&&r.h!==r.t?' › '+esc(r.h):'')+'<small>'+esc(r.x.substr(i,160))+'…</small>';
      res.appendChild(a);});
    if(!hits.length)res.innerHTML='<small style="padding:6px 9px;display:block">no match</small>';
    res.style.display='block';
  }
  box.addEventListener('input',run);
  var q0=new URLSearchParams(location.search).get('q'); if(q0){box.value=q0;run();}   // page.html?q=words
  box.addEventListener('keydown',function(e){if(e.key==='Enter'){var a=res.querySelector('a[href]');if(a)location.href=a.href;}
    if(e.key==='Escape'){res.style.display='none';}});
  document.addEventListener('click',function(e){if(!res.contains(e.target)&&e.target!==box)res.style.display='none';});
})();
"""


def page_info(nb_path: Path, rel: Path) -> dict:
    "Title, one-line description and section of a notebook (from its title cell: `# Title` and `> description`)."
    nb = json.loads(Path(nb_path).read_text(encoding="utf-8"))
    title, desc = None, []
    for c in nb.get("cells", []):
        if c.get("cell_type") != "markdown":
            continue
        for line in "".join(c.get("source", "")).splitlines():
            if title is None and line.startswith("# "):
                title = line[2:].strip()
            elif title is not None and line.startswith(">"):
                desc.append(line.lstrip("> ").strip())   # the subtitle, over as many lines as it takes
            elif desc:
                break
        if title:
            break
    desc = " ".join(desc)
    parts = rel.with_suffix("").parts
    api = any(re.match(r"^\s*#\|\s*default_exp\b", "".join(c.get("source", "")), re.M)
              for c in nb.get("cells", []) if c.get("cell_type") == "code")
    section = ("start" if parts in (("index",),) or parts[0] == "tutorials" else "explanations"
               if parts[0] == "explanations" else "api" if len(parts) == 1 and (api or re.match(r"\d", parts[0]))
               else "other")
    return dict(href=rel.with_suffix(".html").as_posix(), title=title or rel.stem, desc=desc or "", section=section)


def site_order(infos: list[dict]) -> list[dict]:
    "Pages in reading order: index and tutorials, then the API notebooks by number, explanations, the rest."
    rank = {k: i for i, (k, _) in enumerate(SECTIONS)}
    return sorted(infos, key=lambda p: (rank[p["section"]], p["href"] != "index.html", p["href"]))


def _inline_md(s: str) -> str:
    "A description's markdown code spans as <code>, the rest escaped."
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(s))


def sidebar(site: list[dict], here: str, root: str) -> str:
    e = html.escape
    out = [f'<aside class="opsd-side"><a class="brand" href="{e(root)}{CONTENTS}">opsd</a>'
           '<div class="opsd-search"><input id="opsd-q" type="search" placeholder="Search the docs (offline)" '
           'autocomplete="off" aria-label="search"><div class="opsd-results" id="opsd-res"></div></div>',
           f'<a href="{e(root)}{CONTENTS}">opsd: contents</a>']
    for key, name in SECTIONS:
        pages = [p for p in site if p["section"] == key]
        if not pages:
            continue
        out.append(f"<h4>{e(name)}</h4><ul>")
        for p in pages:
            cls = ' class="here"' if p["href"] == here else ""
            out.append(f'<li><a{cls} href="{e(root + p["href"])}" title="{e(p["desc"])}">{e(p["title"])}</a></li>')
        out.append("</ul>")
    return "".join(out) + "</aside>"


def prev_next(site: list[dict], here: str, root: str) -> str:
    hrefs = [p["href"] for p in site]
    if here not in hrefs:
        return ""
    i, e = hrefs.index(here), html.escape
    prv = (f'<a href="{e(root + site[i - 1]["href"])}"><span>previous</span>← {e(site[i - 1]["title"])}</a>'
           if i > 0 else "<a></a>")
    nxt = (f'<a style="text-align:right" href="{e(root + site[i + 1]["href"])}"><span>next</span>'
           f'{e(site[i + 1]["title"])} →</a>' if i + 1 < len(site) else "<a></a>")
    return f'<nav class="opsd-prevnext">{prv}{nxt}</nav>'


def add_layout(body: str, site: list[dict], here: str, root: str) -> str:
    "The sidebar (with the search box), the page in a main column, previous/next at its end."
    head = (f"<style>{DOC_CSS}</style>")
    body, n = re.subn(r"</head>", lambda m: head + "</head>", body, count=1)
    body, n2 = re.subn(r"(<body[^>]*)>", lambda m: f'{m.group(1)} data-root="{html.escape(root)}">'
                       + sidebar(site, here, root) + '<div class="opsd-main">', body, count=1)
    tail = (prev_next(site, here, root) + "</div>" + f'<script src="{html.escape(root)}search_index.js"></script>'
            + f"<script>{SEARCH_JS}</script>")
    body, n3 = re.subn(r"</body>", lambda m: tail + "</body>", body, count=1)
    if (n, n2, n3) != (1, 1, 1):
        raise ValueError("render_docs: the exported page lacks </head>, <body> or </body>")
    return body


_HEAD = re.compile(r'<h([1-3])[^>]*\bid="([^"]+)"[^>]*>(.*?)</h\1>', re.S)


def _text(fragment: str) -> str:
    fragment = re.sub(r"<(script|style)\b.*?</\1>", " ", fragment, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", fragment))).strip()


def search_records(page_html: str, info: dict) -> list[dict]:
    "One search record per section of a rendered page (heading, its anchor, the text up to the next heading)."
    main = page_html.split('<div class="opsd-main">', 1)[-1].split('<nav class="opsd-prevnext">', 1)[0]
    heads = list(_HEAD.finditer(main))
    recs, starts = [], [(0, "", info["title"])] + [(m.end(), m.group(2), _text(m.group(3)).rstrip("¶ ")) for m in heads]
    ends = [m.start() for m in heads] + [len(main)]
    for (s, anchor, head), end in zip(starts, ends):
        text = _text(main[s:end])[:1500]
        if text or anchor:
            recs.append(dict(p=info["href"], t=info["title"], h=head, a=anchor, x=text))
    return recs


def exporter(mathjax_url: str) -> HTMLExporter:
    e = HTMLExporter(template_name="lab", extra_loaders=[DictLoader({"opsd_offline.html.j2": _TEMPLATE})])
    e.template_file = "opsd_offline.html.j2"
    e.mathjax_url = mathjax_url
    e.require_js_url = ""
    e.embed_images = True  # markdown ![](images/..) becomes a data: URI, so pages can move
    e.exclude_input_prompt = True
    e.exclude_output_prompt = True
    e.display_data_priority = DISPLAY_PRIORITY
    return e


_NB_HREF = re.compile(r'(href=")(?![a-zA-Z][\w+.-]*:|/)([^"#?]+)\.ipynb((?:[#?][^"]*)?")')
CONTENTS = "contents.html"


def rewrite_links(body: str) -> str:
    "Relative links to notebooks (`x.ipynb`, `../tutorials/y.ipynb#part`) point to their rendered pages (`.html`)."
    return _NB_HREF.sub(lambda m: f"{m.group(1)}{m.group(2)}.html{m.group(3)}", body)


def add_nav(body: str, contents_href: str) -> str:
    "A link to the contents page at the top of the page body."
    nav = (f'<nav class="opsd-nav" style="max-width:1100px;margin:8px auto 0;padding:0 16px;font-size:14px">'
           f'<a href="{html.escape(contents_href)}">opsd: contents</a></nav>')
    body, n = re.subn(r"(<body[^>]*>)", lambda m: m.group(1) + nav, body, count=1)
    if n != 1:
        raise ValueError("render_docs: no <body> tag in the exported page")
    return body


def render(nb_path: Path, out: Path, base: Path | None = None, site: list[dict] | None = None) -> Path:
    "Render one notebook to OUT/<path relative to base>.html (in the navigation of `site`); returns the HTML path."
    nb_path = Path(nb_path).resolve()
    base = Path(base).resolve() if base else nb_path.parent
    try:
        rel = nb_path.relative_to(base)
    except ValueError:
        rel = Path(nb_path.name)
    dest = (out / rel).with_suffix(".html")
    dest.parent.mkdir(parents=True, exist_ok=True)
    mj = Path(os.path.relpath(out / MATHJAX_DIR / "MathJax.js", dest.parent)).as_posix()
    with warnings.catch_warnings():  # some notebooks lack cell ids; irrelevant for a render
        warnings.simplefilter("ignore", nbformat.validator.MissingIDFieldWarning)
        nb = prepare(api_docs(nb_path) or nbformat.read(nb_path, as_version=4))
    body, _ = exporter(f"{mj}?config={MATHJAX_CONFIG}").from_notebook_node(
        nb, resources={"metadata": {"name": nb_path.stem, "path": str(nb_path.parent)}})
    contents = Path(os.path.relpath(out / CONTENTS, dest.parent)).as_posix()
    here = dest.relative_to(out).as_posix()
    site = site or [page_info(nb_path, Path(here).with_suffix(".ipynb"))]
    root = "../" * (len(Path(here).parts) - 1)
    dest.write_text(add_layout(add_nav(rewrite_links(body), contents), site, here, root), encoding="utf-8")
    return dest


def write_contents(out: Path, pages: list[Path], name: str, site: list[dict] | None = None) -> Path:
    "The contents page: every page by section, in reading order, with its title and one-line description."
    e = html.escape
    site = site or [dict(href=p.relative_to(out).as_posix(), title=p.relative_to(out).with_suffix("").as_posix(),
                         desc="", section="other") for p in sorted(pages)]
    parts = []
    for key, sec in SECTIONS:
        rows = [p for p in site if p["section"] == key]
        if rows:
            parts.append(f"<h2>{e(sec)}</h2>\n<dl>" + "".join(
                f'<dt><a href="{e(p["href"])}">{e(p["title"])}</a> <small>{e(Path(p["href"]).stem)}</small></dt>'
                f'<dd>{_inline_md(p["desc"])}</dd>' for p in rows) + "</dl>")
    path = out / name
    head = ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>opsd (offline docs)</title>'
            '<style>body{font:15px/1.5 system-ui,sans-serif;max-width:900px;margin:0 auto;padding:0 20px 40px}'
            'dt{margin-top:.7em;font-weight:600} dt small{color:#888;font-weight:400} dd{margin:0 0 0 1.2em;color:#333}'
            'a{color:#2a4d8f}</style></head>\n')
    body = (f'<body data-root=""><h1>opsd: documentation</h1><p>Every page of the project, in reading order. '
            f'The search box on each page finds sections offline.</p>{"".join(parts)}</body></html>\n')
    path.write_text(head + body, encoding="utf-8")
    return path


def write_search_index(out: Path, records: list[dict]) -> Path:
    "search_index.js: the sections of every page, assigned to window.OPSD_SEARCH (a script tag loads it offline)."
    path = out / "search_index.js"
    path.write_text("window.OPSD_SEARCH = " + json.dumps(records, ensure_ascii=False) + ";\n", encoding="utf-8")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="*", type=Path, help="notebooks to render (default: nbs/00_loss.ipynb)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: _docs_offline/)")
    ap.add_argument("--base", type=Path, default=None,
                    help="folder the output layout is relative to (default: nbs/ when all notebooks are under it)")
    a = ap.parse_args(argv)
    nbs = a.notebooks or [ROOT / "nbs" / "00_loss.ipynb"]
    nbs = [p.resolve() for p in nbs]
    base = a.base
    if base is None:
        nbs_dir = (ROOT / "nbs").resolve()
        inside = all(p.is_relative_to(nbs_dir) for p in nbs)
        base = nbs_dir if inside else Path(os.path.commonpath([p.parent for p in nbs]))
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    copy_mathjax(out)
    def rel(p):
        try:
            return p.relative_to(base.resolve())
        except ValueError:
            return Path(p.name)
    site = site_order([page_info(p, rel(p)) for p in nbs])
    pages, records = [], []
    for p in nbs:
        dest = render(p, out, base, site)
        pages.append(dest)
        records += search_records(dest.read_text(encoding="utf-8"), page_info(p, rel(p)))
        print(dest)
    print(write_search_index(out, records))
    print(write_contents(out, pages, CONTENTS, site))  # every page links to it
    if (out / "index.html") not in pages and len(pages) > 1:
        print(write_contents(out, pages, "index.html", site))
    return 0


if __name__ == "__main__":
    sys.exit(main())
