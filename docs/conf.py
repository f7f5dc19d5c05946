"""Sphinx configuration of the tensorplay_mpi documentation (``make docs``)."""

from importlib.metadata import version as _version

project = "tensorplay_mpi"
author = "the tensorplay_mpi developers"
release = _version("tensorplay-mpi")
version = release
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
napoleon_numpy_docstring = True
napoleon_google_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
html_theme = "alabaster"
html_theme_options = {"description": f"version {release}"}
myst_heading_anchors = 3
