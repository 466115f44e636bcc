"""Sphinx configuration of the course's HTML book (`make book`).

The book's own pages live here (index, grading, glossary, provenance). The chapters and labs
are gathered at build time from `chapters/*.ipynb` and `labs/*.ipynb` into `book/chapters/`
and `book/labs/` (git-ignored copies: edit the notebooks at the repository root), because
Sphinx reads only inside its source folder; `kernels/` is copied beside them for links to the
course's code; `solutions/` is never read. See `_ext/coursebook.py`.

The book is built offline and never executes a notebook: it shows the outputs stored by the
course's recorded run.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the course's `kernels`

project = "Going Brrr From First Principles"
author = "the course's authors"

extensions = [
    "myst_nb",
    "sphinx-mathjax-offline",  # MathJax 3 and its fonts, copied into the build
    "coursebook",
]

root_doc = "index"
# Pages: the book's own top-level pages and the gathered notebooks, nothing else.
include_patterns = ["*.md", "chapters/*.ipynb", "labs/*.ipynb"]
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]

# Never execute: the stored outputs come from the recorded (GPU) run.
nb_execution_mode = "off"
# Widgets cannot run in a static page: load no widget scripts (they would come from a CDN).
# A widget's output stays an inert JSON script; chapters put a static figure beside each widget.
nb_ipywidgets_js = {}
nb_merge_streams = True

myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

html_theme = "sphinx_book_theme"
html_title = project
html_show_copyright = False
html_theme_options = {
    "home_page_in_toc": True,
    "show_toc_level": 2,
    "use_download_button": True,
    "use_fullscreen_button": False,
    "navigation_with_keys": False,
    "navbar_persistent": [],  # the sidebar has the search field already
    "footer_content_items": [],
}
# Light unless the reader picks another mode: notebook figures have white backgrounds.
html_context = {"default_mode": "light"}
