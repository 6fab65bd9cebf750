"""The offline render (tools/render_docs.py): 00_loss shows formulas and its figure with the network off; links work;
API pages show each exported definition's signature and parameter table; sidebar, previous/next, contents, search.

Static checks on the HTML (no remote script/stylesheet, MathJax is a local file, the figure is an embedded PNG), then,
where Debian's `chromium` is installed, the page is loaded headless with every network request refused and the DOM
after MathJax ran is checked: typeset math, no raw `$` left in the prose. A control page that loads MathJax from the
CDN instead must come out untypeset, which shows the network really is off and the DOM check can fail.
"""
import html
import importlib.util
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NB = ROOT / "nbs" / "00_loss.ipynb"
CDN_MATHJAX = "https://cdnjs.cloudflare.com/ajax/libs/mathjax/2.7.7/latest.js?config=TeX-AMS_CHTML-full,Safe"


def _tool():
    spec = importlib.util.spec_from_file_location("render_docs", ROOT / "tools" / "render_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Page(HTMLParser):
    "Script/stylesheet/image references, the text of rendered markdown (outside code) and MathJax's elements."
    SKIP = {"script", "style", "code", "pre"}
    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.scripts, self.styles, self.imgs, self.classes, self.math_scripts = [], [], [], [], 0
        self.md_text, self._stack = [], []  # stack of (tag, in_markdown, skipping)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        cls = (a.get("class") or "").split()
        self.classes += cls
        if tag == "script":
            if a.get("src") is not None:
                self.scripts.append(a["src"])
            if (a.get("type") or "").startswith("math/tex"):
                self.math_scripts += 1
        if tag == "link" and "stylesheet" in (a.get("rel") or ""):
            self.styles.append(a.get("href") or "")
        if tag == "img":
            self.imgs.append(a.get("src") or "")
        if tag in self.VOID:
            return
        md, skip = self._stack[-1][1:] if self._stack else (False, False)
        self._stack.append((tag, md or "jp-RenderedMarkdown" in cls, skip or tag in self.SKIP))

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        while self._stack:
            if self._stack.pop()[0] == tag:
                break

    def handle_data(self, data):
        if self._stack and self._stack[-1][1] and not self._stack[-1][2]:
            self.md_text.append(data)


def _parse(text):
    p = _Page()
    p.feed(text)
    return p


def _dom(chromium, html_path: Path, profile: Path) -> str:
    "The DOM after load (and MathJax), every network request refused (dead proxy, no name resolution)."
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={profile}",
           "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>", "--host-resolver-rules=MAP * ~NOTFOUND",
           "--virtual-time-budget=10000", "--dump-dom", html_path.as_uri()]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert r.returncode == 0 and "<html" in r.stdout, r.stderr[-2000:]
    return r.stdout


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("docs")
    rd = _tool()
    rd.copy_mathjax(out)
    return out, rd.render(NB, out)


def _expected():
    "What the notebook holds: PNG figures (in shown cells) and display math."
    nb = json.loads(NB.read_text())
    pngs = sum("image/png" in o.get("data", {}) for c in nb["cells"] if c["cell_type"] == "code"
               and not re.search(r"^\s*#\|\s*hide", "".join(c["source"]), re.M) for o in c.get("outputs", []))
    md = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    return pngs, md.count("$$") // 2, md


def test_html_is_self_contained(rendered):
    out, page = rendered
    text = page.read_text()
    p = _parse(text)
    remote = [u for u in p.scripts + p.styles if re.match(r"(https?:)?//", u)]
    assert not remote, f"page loads remote scripts/styles: {remote}"
    assert "import(\"http" not in text and "cdn.plot.ly" not in text and "Plotly.newPlot" not in text
    mj = [s for s in p.scripts if "MathJax.js" in s]
    assert len(mj) == 1, p.scripts
    assert (page.parent / mj[0].split("?")[0]).is_file(), f"MathJax not copied next to the page: {mj[0]}"
    pngs, _, md = _expected()
    assert pngs >= 1 and "$" in md  # the notebook has a figure and formulas to show
    embedded = [s for s in p.imgs if s.startswith("data:image/png;base64,")]
    assert len(embedded) >= pngs, f"{len(embedded)} embedded PNGs, the notebook has {pngs}"
    assert all(not re.match(r"(https?:)?//", s) for s in p.imgs)


def test_math_typesets_offline_in_chromium(rendered, tmp_path):
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no chromium binary")
    out, page = rendered
    _, n_display, _ = _expected()

    dom = _parse(_dom(chromium, page, tmp_path / "profile"))
    n_math = dom.classes.count("MathJax")  # MathJax 2 HTML-CSS output: one span.MathJax per formula
    assert dom.math_scripts > 20 and n_math == dom.math_scripts, (n_math, dom.math_scripts)
    assert dom.classes.count("MathJax_Display") >= n_display >= 1
    assert "merror" not in dom.classes and "MathJax_Error" not in dom.classes
    prose = " ".join(dom.md_text)
    assert len(prose) > 1000 and "$" not in prose, "raw TeX delimiters left in the rendered markdown"

    # control: the same page with MathJax from the CDN must stay untypeset (the network is off, the check can fail)
    control = page.with_name("control_cdn.html")
    text = page.read_text()
    src = re.search(r'<script src="([^"]*MathJax\.js[^"]*)"', text).group(1)
    control.write_text(text.replace(src, CDN_MATHJAX))
    bad = _parse(_dom(chromium, control, tmp_path / "profile2"))
    assert bad.classes.count("MathJax") == 0 and "$" in " ".join(bad.md_text)


def test_rewrite_links_only_touches_relative_notebook_links():
    rd = _tool()
    body = ('<a href="00_loss.ipynb">a</a> <a href="../tutorials/gpu_qwen3.ipynb#setup">b</a> '
            '<a href="https://nbviewer.org/x.ipynb">c</a> <a href="//host/y.ipynb">d</a> <a href="#sec">e</a> '
            '<img src="k.ipynb">')
    assert rd.rewrite_links(body) == (
        '<a href="00_loss.html">a</a> <a href="../tutorials/gpu_qwen3.html#setup">b</a> '
        '<a href="https://nbviewer.org/x.ipynb">c</a> <a href="//host/y.ipynb">d</a> <a href="#sec">e</a> '
        '<img src="k.ipynb">')


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    "Index, two API notebooks and two explanations rendered together, as `bash dev.sh docs` does."
    rd = _tool()
    nbs = ROOT / "nbs"
    chosen = [nbs / "explanations" / "kl_drift.ipynb", nbs / "01_diagnostics.ipynb", nbs / "index.ipynb",
              nbs / "explanations" / "findings.ipynb", nbs / "00_loss.ipynb"]   # not in reading order on purpose
    out = tmp_path_factory.mktemp("site")
    assert rd.main(["--out", str(out), *map(str, chosen)]) == 0
    return out


def test_api_page_shows_signatures_and_parameter_tables(rendered):
    """Every function and class `opsd.loss` exports has a block with its signature and a table of its parameters, built
    from the module (reference: inspect.signature and the docments comments read here); no directive-only cell shows.
    Break seen failing: render() without api_docs (no blocks)."""
    import inspect
    from fastcore.docments import docments
    import opsd.loss as mod
    _, page = rendered
    text = page.read_text()
    names = [n for n in mod.__all__ if inspect.isfunction(getattr(mod, n)) or inspect.isclass(getattr(mod, n))]
    blocks = dict(re.findall(r'<div class="opsd-doc" id="([^"]+)">(.*?)</table></div>', text, re.S))
    assert len(names) > 10 and set(names) <= set(blocks), sorted(set(names) - set(blocks))
    for n in names:
        params = [p for p in inspect.signature(getattr(mod, n)).parameters if p != "self"]
        rows = re.findall(r"<tr><td><code>([^<]+)</code>", blocks[n])
        assert rows == params, (n, rows, params)
        assert f"{n}(" in blocks[n]   # the signature line
        shown = html.unescape(re.sub(r"<[^>]+>", "", blocks[n]))
        for p, d in docments(getattr(mod, n), full=True).items():
            if p != "return" and d["docment"]:
                assert d["docment"] in shown, (n, p)
    assert "default_exp" not in text and "#| export" not in text


def test_navigation_contents_and_offline_search(site, tmp_path):
    """Sidebar with every page (the current one marked), previous/next in the notebook order, a contents page with titles
    and one-line descriptions, and the search box finding a section in Chromium with the network off.
    Breaks seen failing: add_layout without the sidebar; prev_next from the unsorted list."""
    out = site
    page = (out / "00_loss.html").read_text()
    side = re.search(r'<aside class="opsd-side">(.*?)</aside>', page, re.S).group(1)
    hrefs = re.findall(r'<li><a(?: class="here")? href="([^"]+)"', side)
    assert hrefs == ["index.html", "00_loss.html", "01_diagnostics.html", "explanations/findings.html",
                     "explanations/kl_drift.html"], hrefs
    assert '<a class="here" href="00_loss.html"' in side
    nav = re.search(r'<nav class="opsd-prevnext">(.*?)</nav>', page, re.S).group(1)
    assert re.findall(r'href="([^"]+)"', nav) == ["index.html", "01_diagnostics.html"]
    sub = (out / "explanations" / "kl_drift.html").read_text()
    assert 'href="../00_loss.html"' in sub and 'src="../search_index.js"' in sub
    contents = (out / "contents.html").read_text()
    nb = json.loads(NB.read_text())
    title_cell = "".join(nb["cells"][1]["source"])
    title, desc = re.search(r"^# (.+)$", title_cell, re.M).group(1), re.search(r"^> (.+)$", title_cell, re.M).group(1)
    assert f">{html.escape(title)}</a>" in contents and html.escape(desc) in contents
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no chromium binary")
    url = (out / "00_loss.html").as_uri() + "?q=clipped%20teacher%20mass"
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={tmp_path}",
           "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND", "--virtual-time-budget=5000",
           "--dump-dom", url]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=90).stdout
    res = re.search(r'<div class="opsd-results" id="opsd-res"[^>]*>(.*?)</div>', dom, re.S).group(1)
    found = re.findall(r'<a href="([^"]+)"', res)
    assert found and any(f.startswith("01_diagnostics.html#") for f in found), found


def test_rendered_links_resolve_and_every_page_links_to_contents(site, tmp_path):
    """Index, a notebook and explanations rendered as `bash dev.sh docs` does: every relative link reaches a page.

    Breaks seen failing: render() without rewrite_links (links stay `.ipynb`); without add_nav (no contents link);
    main() writing contents.html only for an index-less set."""
    rd = _tool()
    nbs = ROOT / "nbs"
    out = site
    pages = [out / "index.html", out / "00_loss.html", out / "01_diagnostics.html", out / "explanations" / "findings.html",
             out / "explanations" / "kl_drift.html"]
    contents = (out / "contents.html").read_text()
    for page in pages:
        assert f'href="{page.relative_to(out).as_posix()}"' in contents, page
        links = [a for a in re.findall(r'<a\s[^>]*href="([^"]+)"', page.read_text())
                 if not re.match(r"([a-z][\w+.-]*:|//|#)", a)]
        assert any((page.parent / a).resolve() == (out / "contents.html").resolve() for a in links), page
        for a in links:
            target = a.split("#")[0].split("?")[0]
            assert not target.endswith(".ipynb"), f"{page.name}: link {a} not rewritten to .html"
            dest = (page.parent / target).resolve()
            source = (nbs / dest.relative_to(out.resolve())).with_suffix(".ipynb")
            assert dest.exists() or (target.endswith(".html") and source.exists()), f"{page.name}: dead link {a}"
    index_links = re.findall(r'href="([^"]+\.html)"', (out / "index.html").read_text())
    assert "00_loss.html" in index_links and "explanations/findings.html" in index_links
    # one page alone still gets its contents page
    single = tmp_path / "one"
    assert rd.main(["--out", str(single), str(nbs / "04_collate.ipynb")]) == 0
    assert 'href="04_collate.html"' in (single / "contents.html").read_text()


def test_readme_library_follows_the_getting_started_tutorial():
    """The README's "As a library" walks the tutorial's path (which nbdev_test runs top to bottom): the same calls, in
    the same order. Catches a README example drifting to an API the tutorial no longer shows."""
    readme = (ROOT / "README.md").read_text().split("## As a library", 1)[1].split("\n## ", 1)[0]
    nb = json.loads((ROOT / "nbs" / "tutorials" / "getting_started.ipynb").read_text())
    tut = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    calls = ['load_world("toy")', "loss_and_diagnostics(", "summarize_diagnostics(", "analyze((toy.model, toy.tokenizer)",
             "token_view_html(", 'load_world("smollm2")']
    for text in (readme, tut):
        at = [text.find(c) for c in calls]
        assert all(i >= 0 for i in at) and at[:-1] == sorted(at[:-1]), [c for c, i in zip(calls, at) if i < 0]
    assert "getting_started.ipynb" in readme
