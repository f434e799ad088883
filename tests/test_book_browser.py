"""The built book in a real browser: every chapter page opened in headless Chromium.

Fails on a page that shows an error output (a traceback or text on stderr), an image that did not
load, an internal link whose target page or anchor does not exist, or math that MathJax did not typeset
(the book ships its own MathJax: the browser runs with every host name unresolvable, so nothing comes
from a network). Keeps screenshots of the pages a reviewer looks at in ``_build/screenshots``. Runs after
``jupyter-book build`` (``make test`` orders it so).
"""
import pathlib
import shutil
import urllib.parse

import pytest
from conftest import require, require_module

ROOT = pathlib.Path(__file__).resolve().parents[1]
HTML = ROOT / "_build" / "html"
SHOTS = ROOT / "_build" / "screenshots"
pytestmark = pytest.mark.book


def _toc_pages():
    """The pages of _toc.yml, a chapter's further pages (``sections: - glob:``) after it. Runs at
    collection, also where PyYAML (a jupyter-book dependency) is not installed: then the pages are read
    from the ``root:``, ``file:`` and ``glob:`` lines."""
    text = (ROOT / "_toc.yml").read_text()

    def expand(pattern):
        return sorted(str(p.relative_to(ROOT).with_suffix("")) for p in ROOT.glob(pattern + ".ipynb"))
    try:
        import yaml
    except ImportError:
        import re
        pages = []
        for kind, name in re.findall(r"^\s*(?:-\s*)?(root|file|glob):\s*(\S+)\s*$", text, flags=re.M):
            pages += expand(name) if kind == "glob" else [name]
        return pages
    toc = yaml.safe_load(text)
    pages = [toc["root"]]
    for part in toc.get("parts", []):
        for c in part["chapters"]:
            pages.append(c["file"])
            for sec in c.get("sections", []):
                pages += expand(sec["glob"]) if "glob" in sec else [sec["file"]]
    return pages


@pytest.fixture(scope="module")
def browser():
    require(HTML.joinpath("index.html").exists(), "the book is not built: run `make book` first")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    require(chromium and driver_path, "headless Chromium and chromedriver are not installed "
                                    "(Debian: apt-get install chromium chromium-driver)")
    require_module("selenium")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1600", "--allow-file-access-from-files",
                "--host-resolver-rules=MAP * ~NOTFOUND"):      # no network: the book must not need one
        opts.add_argument(arg)
    drv = webdriver.Chrome(service=Service(executable_path=driver_path), options=opts)
    drv.set_page_load_timeout(60)
    yield drv
    drv.quit()


def _ids_of(page: pathlib.Path, cache={}) -> set[str]:
    if page not in cache:
        import re
        cache[page] = set(re.findall(r'\bid="([^"]+)"', page.read_text(errors="replace")))
    return cache[page]


@pytest.mark.parametrize("page", _toc_pages())
def test_page_renders_without_errors(browser, page):
    html = HTML / f"{page}.html"
    assert html.exists(), f"{page} is in _toc.yml but was not built to {html}"
    browser.get(html.as_uri())
    errors = browser.execute_script("""
        return Array.from(document.querySelectorAll(
            '.cell_output .output.traceback, .cell_output .output.error, .cell_output .output.stderr'))
            .map(e => e.innerText.slice(0, 300));""")
    assert not errors, f"{page}: error output shown to the reader: {errors}"
    browser.execute_script("return Promise.all(Array.from(document.images).map(i => i.decode()"
                           ".catch(() => null)))")
    broken = browser.execute_script("""
        return Array.from(document.images)
            .filter(i => !i.complete || i.naturalWidth === 0).map(i => i.getAttribute('src'));""")
    assert not broken, f"{page}: images that did not load: {broken}"
    hrefs = browser.execute_script(
        "return Array.from(document.querySelectorAll('a[href]')).map(a => a.href);")
    bad = []
    for href in hrefs:
        url = urllib.parse.urlparse(href)
        if url.scheme != "file":
            continue
        target = pathlib.Path(urllib.parse.unquote(url.path))
        if not target.exists():
            bad.append(href)
        elif url.fragment and target.suffix == ".html" and url.fragment not in _ids_of(target):
            bad.append(href)
    assert not bad, f"{page}: broken internal links: {bad}"


# The pages a reviewer looks at: the landing page (roadmap), a ladder chapter scrolled to its first puzzle with
# the solution opened, chapter 7's whole forward kernel, chapter 8's v3, a numbered figure, the References.
_SHOW_FIRST_SOLUTION = """
    const d = document.querySelector('div.cell.tag_hide-cell details');
    d.querySelector('summary').click();
    Array.from(document.querySelectorAll('h2')).find(h => h.innerText.startsWith('Puzzles')).scrollIntoView();"""


def _scroll_to(tag, start):
    return (f"Array.from(document.querySelectorAll('{tag}')).find(h => h.innerText.startsWith('{start}'))"
            ".scrollIntoView();")


@pytest.mark.parametrize("page,script", [
    ("book/intro", "document.querySelector('img[src*=roadmap]').scrollIntoView();"),
    ("notebooks/02_online_softmax", _SHOW_FIRST_SOLUTION),
    ("notebooks/03_flashattention1", None),
    ("notebooks/04_flashattention2", "document.getElementById('fig-04-warp-partition').scrollIntoView();"),
    ("notebooks/07_triton", _scroll_to("h2", "The forward kernel")),
    ("notebooks/08b_v3_registers", _scroll_to("h2", "The algorithm")),
    ("book/references", None)])
def test_screenshots_are_kept(browser, page, script):
    SHOTS.mkdir(parents=True, exist_ok=True)
    browser.get((HTML / f"{page}.html").as_uri())
    if script:
        browser.execute_script(script)
    out = SHOTS / (page.replace("/", "_") + ".png")
    assert browser.save_screenshot(str(out))
    assert out.stat().st_size > 10_000      # a real rendering, not a blank page


# Raw TeX that would show if MathJax did not run: display environments, $$ and \( \[ delimiters.
RAW_TEX = ("\\begin{", "$$", "\\(", "\\[")


@pytest.mark.parametrize("page", ["book/notation", "notebooks/03_flashattention1",
                                  "notebooks/04_flashattention2"])
def test_math_is_typeset_by_the_books_own_mathjax(browser, page):
    browser.get((HTML / f"{page}.html").as_uri())
    browser.set_script_timeout(60)
    typeset = browser.execute_async_script("""
        const done = arguments[arguments.length - 1];
        if (!window.MathJax || !MathJax.startup || !MathJax.startup.promise) { done('MathJax did not load'); }
        else { MathJax.startup.promise.then(() => done('ok'), e => done('MathJax failed: ' + e)); }""")
    assert typeset == "ok", f"{page}: {typeset}"
    sources = browser.execute_script("""
        return Array.from(document.scripts).map(s => s.src).filter(s => /mathjax/i.test(s));""")
    assert sources, f"{page}: no MathJax script"
    for src in sources:
        url = urllib.parse.urlparse(src)
        assert url.scheme == "file" and pathlib.Path(urllib.parse.unquote(url.path)).is_file(), \
            f"{page}: MathJax is loaded from {src}, not from a file inside the built book"
    counts = browser.execute_script("""
        const math = Array.from(document.querySelectorAll('.math'));
        return [math.length, math.filter(m => !m.querySelector('mjx-container')).length,
                document.querySelectorAll('mjx-container').length,
                document.querySelectorAll('mjx-merror').length];""")
    n_math, untypeset, containers, errors = counts
    assert n_math and containers >= n_math, f"{page}: {n_math} formulas, {containers} typeset"
    assert untypeset == 0, f"{page}: {untypeset} of {n_math} formulas were not typeset"
    assert errors == 0, f"{page}: {errors} formulas show a TeX error"
    text = browser.execute_script("""
        const body = document.body.cloneNode(true);         // the prose as read: no code, no typeset math
        body.querySelectorAll('pre, code, script, style, mjx-container').forEach(e => e.remove());
        return body.innerText;""")
    raw = {d: text[max(0, text.index(d) - 60):text.index(d) + 60] for d in RAW_TEX if d in text}
    assert not raw, f"{page}: raw TeX left in the text: {raw}"


@pytest.mark.parametrize("width", [1280, 1920])
@pytest.mark.parametrize("page", _toc_pages())
def test_shown_code_outputs_and_math_fit_the_page(browser, page, width):
    """Nothing a page shows wraps or leaves its column: code never wraps (book/_static/flashbook.css sets
    ``white-space: pre`` and 80-character lines at 13 px fit the column at 1280 px), so a longer line
    overflows and fails here; a display formula wider than its column fails too, as do tables."""
    browser.set_window_size(width, 1600)
    try:
        browser.get((HTML / f"{page}.html").as_uri())
        wide = browser.execute_script("""
            const shown = e => e.offsetParent !== null;
            const over = e => e.scrollWidth > e.clientWidth + 1;
            const longest = e => e.textContent.split('\\n').sort((a, b) => b.length - a.length)[0];
            const code = [...document.querySelectorAll('article pre')].filter(shown).filter(over)
                .map(e => 'code: ' + longest(e).slice(0, 90));
            const math = [...document.querySelectorAll('article mjx-container[display="true"]')]
                .filter(shown).filter(over).map(e => 'math: ' + e.textContent.slice(0, 60));
            const tables = [...document.querySelectorAll('article table')].filter(shown)
                .filter(t => t.getBoundingClientRect().right >
                             t.closest('article').getBoundingClientRect().right + 1)
                .map(t => 'table: ' + t.textContent.slice(0, 60));
            return code.concat(math, tables);""")
    finally:
        browser.set_window_size(1280, 1600)
    assert not wide, f"{page} at {width} px: {len(wide)} blocks do not fit, e.g. {wide[:4]}"


@pytest.mark.parametrize("page", [f"notebooks/{p.stem}" for p in sorted((ROOT / "notebooks").glob("0[1-7]_*.ipynb"))])
def test_puzzle_solutions_are_hidden_until_asked_for(browser, page):
    """Each ladder chapter and the Triton chapter end with puzzles whose solutions sit in closed dropdowns
    (cells tagged hide-cell); a click opens one. Also the page opens with its chapter number and its
    "Before you start" box rendered as an admonition, not as raw ::: text."""
    browser.get((HTML / f"{page}.html").as_uri())
    title = browser.execute_script("return document.querySelector('h1').innerText;")
    assert title.startswith(f"{int(page.split('/')[1][:2])}. "), f"{page}: title {title!r}"
    boxes = browser.execute_script("""
        return Array.from(document.querySelectorAll('.admonition')).map(a => a.innerText.slice(0, 40));""")
    assert any(b.startswith("Before you start") for b in boxes), f"{page}: admonitions {boxes}"
    assert ":::" not in browser.execute_script("return document.body.innerText;"), f"{page}: raw ::: shown"
    hidden = browser.execute_script("""
        return Array.from(document.querySelectorAll('div.cell.tag_hide-cell details'))
            .map(d => [d.open, d.innerText.length]);""")
    assert len(hidden) >= 2, f"{page}: {len(hidden)} hidden solutions (expected one per puzzle, at least 2)"
    assert not any(is_open for is_open, _ in hidden), f"{page}: a solution is open on load"
    opened = browser.execute_script("""
        const d = document.querySelector('div.cell.tag_hide-cell details');
        d.querySelector('summary').click();
        return [d.open, d.querySelector('pre') !== null && d.querySelector('pre').offsetParent !== null];""")
    assert opened == [True, True], f"{page}: clicking the first solution's summary did not show its code"


@pytest.mark.parametrize("page", ["notebooks/02_online_softmax", "notebooks/12_beyond_one_gpu"])
def test_animations_play_in_the_page_without_a_network(browser, page):
    """The online-softmax and ring-schedule animations are matplotlib's to_jshtml players: their frames are
    embedded, so stepping to the next frame shows a different, loaded image with no network."""
    browser.get((HTML / f"{page}.html").as_uri())
    frames = browser.execute_script("""
        const a = document.querySelector('div.animation');
        if (!a) return null;
        const img = a.querySelector('img');
        const first = img.src;
        a.querySelector('button[onclick$="next_frame()"]').click();
        return [first.slice(0, 30), img.src !== first, img.complete && img.naturalWidth > 0];""")
    assert frames is not None, f"{page}: no animation player"
    assert frames[0].startswith("data:image/"), f"{page}: frames are not embedded: {frames[0]}"
    assert frames[1] and frames[2], f"{page}: the next frame did not show ({frames})"
