"""Sphinx configuration of the tensorplay_mpi documentation (``make docs``)."""

project = "tensorplay_mpi"
author = "the tensorplay_mpi developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
napoleon_numpy_docstring = True
napoleon_google_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "none"
html_theme = "alabaster"
myst_heading_anchors = 3
