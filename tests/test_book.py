"""The HTML book: it builds with no warning, loads nothing from another host, every internal
link resolves, and every page opens in headless Chromium with no error, its images loaded and
its math rendered. Screenshots go to test-artifacts/."""

import functools
import http.server
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import pytest

pytestmark = pytest.mark.book

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Attributes through which a page loads something (as opposed to linking to it).
RESOURCE_ATTRS = {
    "script": "src",
    "link": "href",
    "img": "src",
    "iframe": "src",
    "source": "src",
    "video": "src",
    "audio": "src",
    "embed": "src",
    "object": "data",
}
CSS_REMOTE = re.compile(r"""(?:url\(\s*['"]?|@import\s+['"])\s*(?:https?:)?//""", re.I)


@dataclass
class Book:
    html: Path
    returncode: int
    log: str

    def pages(self) -> list[Path]:
        return sorted(p for p in self.html.rglob("*.html") if not _is_asset(p, self.html))


def _is_asset(path: Path, root: Path) -> bool:
    return path.relative_to(root).parts[0] in ("_static", "_sources", "_images")


@pytest.fixture(scope="session")
def book(tmp_path_factory) -> Book:
    """The book, built once per session as `make book` builds it, into a fresh folder."""
    pytest.importorskip("myst_nb", reason="the book needs its extra: pip install -e '.[book]'")
    out = tmp_path_factory.mktemp("book")
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html"]
    command += ["-d", str(out / "doctrees"), str(ROOT / "book"), str(out / "html")]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    return Book(out / "html", proc.returncode, proc.stdout + proc.stderr)


class _PageParser(HTMLParser):
    """Collects a page's ids, its links (a href) and the resources it loads."""

    def __init__(self):
        super().__init__()
        self.ids, self.links, self.resources, self.styles = set(), [], [], []
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.ids.update(attrs[key] for key in ("id", "name") if attrs.get(key))
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])
        if attrs.get(RESOURCE_ATTRS.get(tag, "")):
            self.resources.append((tag, attrs[RESOURCE_ATTRS[tag]]))
        if attrs.get("srcset"):  # "url 1x, url 2x"
            self.resources += [(tag, c.split()[0]) for c in attrs["srcset"].split(",") if c.strip()]
        if attrs.get("style"):
            self.styles.append(attrs["style"])
        self._in_style = tag == "style"

    def handle_data(self, data):
        if self._in_style:
            self.styles.append(data)


@functools.cache
def _parse(path: Path) -> _PageParser:
    parser = _PageParser()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def _is_remote(url: str) -> bool:
    """True for a URL on another host: http(s)://..., or protocol-relative //host/..."""
    return bool(urlsplit(url.strip()).netloc)


def test_book_builds_without_warnings(book):
    assert book.returncode == 0, f"the book's build failed or warned:\n{book.log}"
    assert "WARNING" not in book.log and "ERROR" not in book.log, book.log
    assert (book.html / "index.html").is_file()


def test_every_chapter_and_lab_is_a_page_reachable_from_the_landing_page(book):
    landing = _parse(book.html / "index.html").links
    for folder in ("chapters", "labs"):
        for notebook in sorted((ROOT / folder).glob("*.ipynb")):
            page = f"{folder}/{notebook.stem}.html"
            assert (book.html / page).is_file(), f"{notebook.relative_to(ROOT)} has no page {page}"
            assert page in landing, f"the landing page does not link to {page}"
    assert not (book.html / "solutions").exists(), "the book must never show the solutions"
    for page in (book.html / "labs").glob("*.html"):
        assert "BEGIN SOLUTION" not in page.read_text(encoding="utf-8"), page.name


def test_nothing_is_loaded_from_another_host(book):
    remote = []
    for page in book.pages():
        name, parsed = page.relative_to(book.html), _parse(page)
        remote += [f"{name}: <{tag}> {url}" for tag, url in parsed.resources if _is_remote(url)]
        remote += [f"{name}: a style loads {s[:80]}" for s in parsed.styles if CSS_REMOTE.search(s)]
    for css in book.html.rglob("*.css"):
        if CSS_REMOTE.search(css.read_text(encoding="utf-8", errors="replace")):
            remote.append(f"{css.relative_to(book.html)} loads a remote url()")
    assert not remote, "the book loads from other hosts:\n" + "\n".join(remote)


def test_every_internal_link_resolves(book):
    broken = []
    for page in book.pages():
        base = page.relative_to(book.html).as_posix()
        for href in _parse(page).links:
            parts = urlsplit(urljoin("http://book.test/" + base, href))
            if parts.netloc != "book.test":
                continue  # external links (cited sources) are fine
            target = book.html / unquote(parts.path.lstrip("/"))
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                broken.append(f"{base}: {href} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                if unquote(parts.fragment) not in _parse(target).ids:
                    broken.append(f"{base}: {href} (no such anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_pages_show_no_test_markers_and_date_their_runs(book):
    """nbval's markers are for the test suite, and "measured now ... today" is false on a static
    page: each becomes the recorded run's date (book/_ext/static_page.py)."""
    for page in book.pages():
        text = page.read_text(encoding="utf-8")
        assert "NBVAL_" not in text, f"{page.name} shows an nbval marker"
        now = re.search(r"measured now on (this GPU|[^<\n]*triton [\d.]+, )", text)
        assert not now, f"{page.name}: {now.group(0)}"
    chapter = (book.html / "chapters" / "01_three_regimes.html").read_text(encoding="utf-8")
    assert re.search(
        r"measured on NVIDIA H200, torch [^,]+, triton [\d.]+, \d{4}-\d\d-\d\d", chapter
    )


@pytest.fixture(scope="session")
def served(book):
    """The built book over HTTP on 127.0.0.1; yields its base URL."""
    handler = functools.partial(QuietHandler, directory=str(book.html))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


# Run in each page after it loads: images decoded, MathJax and fonts done, then what is wrong.
CHECK_PAGE = """async () => {
  const images = Array.from(document.images);
  images.forEach(img => { img.loading = "eager"; });
  await Promise.all(images.map(img => img.decode().catch(() => null)));
  const maths = document.querySelectorAll(".math");
  if (maths.length && window.MathJax && MathJax.startup) await MathJax.startup.promise;
  await document.fonts.ready;  // MathJax's fonts: nothing left in flight when the page is left
  return {
    brokenImages: images.filter(img => !(img.complete && img.naturalWidth > 0)).map(i => i.src),
    maths: maths.length,
    mathJax: !!(window.MathJax && MathJax.startup),
    unrendered: Array.from(maths).filter(m => !m.querySelector("mjx-container")).length,
    mathErrors: document.querySelectorAll("mjx-merror").length,
  };
}"""


def test_every_page_opens_cleanly_in_chromium(book, served):
    if not Path(CHROMIUM).exists():
        pytest.skip("Chromium not found: install Debian's package (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install -e '.[book]'")
    assert book.returncode == 0, "the book did not build"
    host = urlsplit(served).netloc
    problems, current, math_pages = [], {"page": ""}, []

    def note(message):
        problems.append(f"{current['page']}: {message}")

    def route(route):
        if urlsplit(route.request.url).netloc == host or route.request.url.startswith("data:"):
            route.continue_()
        else:
            note(f"request to another host: {route.request.url}")
            route.abort()

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1280, "height": 800})
        context.route("**/*", route)
        page = context.new_page()
        page.set_default_timeout(20_000)
        page.on("console", lambda m: m.type == "error" and note(f"console error: {m.text}"))
        page.on("pageerror", lambda e: note(f"script error: {e}"))
        page.on("requestfailed", lambda r: note(f"failed request: {r.url} {r.failure}"))
        page.on("response", lambda r: r.status >= 400 and note(f"HTTP {r.status}: {r.url}"))
        for path in book.pages():
            current["page"] = path.relative_to(book.html).as_posix()
            page.goto(served + current["page"], wait_until="load")
            state = page.evaluate(CHECK_PAGE)
            for src in state["brokenImages"]:
                note(f"image did not load: {src}")
            if state["maths"] and not state["mathJax"]:
                note("has math but MathJax did not load")
            if state["maths"]:
                math_pages.append(current["page"])
            if state["unrendered"] or state["mathErrors"]:
                note(
                    f"{state['unrendered']} math elements unrendered, {state['mathErrors']} errors"
                )
        ARTIFACTS.mkdir(exist_ok=True)
        shots = {"book-landing.png": "index.html", "book-page.png": _sample_page(book)}
        for name, target in shots.items():
            page.goto(served + target, wait_until="load")
            page.evaluate(CHECK_PAGE)
            page.screenshot(path=str(ARTIFACTS / name))
        browser.close()
    assert not problems, "in the browser:\n" + "\n".join(problems)
    assert "glossary.html" in math_pages, "the glossary's math was not found: nothing checked it"


def _sample_page(book) -> str:
    chapters = sorted((book.html / "chapters").glob("*.html"))
    return chapters[0].relative_to(book.html).as_posix() if chapters else "glossary.html"
