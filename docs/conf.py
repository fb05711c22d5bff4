"""Sphinx configuration: the docs site (``make docs``; Read the Docs reads this file too).

Pages are Markdown (MyST), moved from the README as they were; the API reference is
autodoc over the installed package, so it documents the compiled core's classes as
imported (``lockmgr.implementation`` says which engine the build saw).
"""

from __future__ import annotations

import os
import sys

try:  # the installed package (Read the Docs installs it, compiled core included)
    import lockmgr
except ImportError:  # a checkout without an install: its own src/
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    import lockmgr

# The API reference documents whichever engine this build imported.
print(f"lockmgr {lockmgr.__file__}: {lockmgr.implementation} ({lockmgr.implementation_reason})")

project = "lockmgr"
author = "lockmgr developers"
copyright = "lockmgr developers"  # noqa: A001 - Sphinx's name for it

try:
    from importlib.metadata import version as _version

    release = _version("lockmgr")
except Exception:  # pragma: no cover - not installed: the source tree's version
    release = "0.2.0"
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# Headings get anchors, so a page can link a section of another page (``page.md#anchor``).
myst_heading_anchors = 3

autodoc_member_order = "bysource"
# Signatures as the code writes them; no type hints (the engines' classes are C types
# without annotations, the twin's are generic in type variables the docs do not define).
autodoc_typehints = "none"
autodoc_default_options = {"members": True}

# No intersphinx (a build must not need the network): references to the standard library
# stay plain text instead of warnings.
nitpick_ignore_regex = [
    ("py:(class|exc|obj)", r"(builtins\.)?(Exception|RuntimeError|TimeoutError|RuntimeWarning|"
     r"tuple|int|float|str|object|NamedTuple)"),
]

html_theme = "furo"
html_title = f"lockmgr {release}"



# The compiled core's methods carry no signature Python can read (Cython, without
# embedsignature), so autodoc would show ``acquire()``. The pure twin has the same classes
# and methods name for name, with the same arguments (the tests hold both to one body): where
# a compiled object has no signature, its twin's stands in (annotations are not shown).
# Sphinx 9 cannot take a signature from autodoc-process-signature for an object that had
# none, so this wraps the introspection autodoc calls; if that helper moves, the compiled
# methods are shown without arguments again, and nothing else changes.
def _twin_of(subject):  # type: ignore[no-untyped-def]
    from lockmgr import _pure

    owner = getattr(subject, "__objclass__", None)
    if owner is not None and getattr(owner, "__module__", None) == "lockmgr._core":
        return getattr(getattr(_pure, owner.__name__, None), subject.__name__, None)
    return None


def _with_twin_signatures():  # type: ignore[no-untyped-def]
    from sphinx.util import inspect as sphinx_inspect

    introspect = getattr(sphinx_inspect, "signature", None)
    if introspect is None:
        return

    def signature(subject, *args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return introspect(subject, *args, **kwargs)
        except ValueError:
            twin = _twin_of(subject)
            if twin is None:
                raise
            return introspect(twin, *args, **kwargs)

    sphinx_inspect.signature = signature


_with_twin_signatures()
