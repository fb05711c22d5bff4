"""Builds the compiled core ``lockmgr._core`` from ``lockmgr_core.pyx`` at the repository's
root, with its declarations in ``src/lockmgr/_core.pxd`` (found as ``lockmgr._core``'s own
``.pxd`` through the include path ``src``) and ``src/lockmgr/_c/``: the ``.pxi`` files the
``.pyx`` includes by their paths from the root, and the C headers the ``.pxd`` names from
``src/lockmgr`` (the C compiler's include path). Neither the ``.pyx`` nor the ``.pxd`` is
installed: a wheel carries only the module built from them.

Set LOCKMGR_NO_EXTENSIONS to a non-empty value to install the pure-Python twin only
(no compiler needed); PyPy always gets the pure twin.
"""

import os
import platform

from setuptools import Extension, setup

PURE = bool(os.environ.get("LOCKMGR_NO_EXTENSIONS")) or platform.python_implementation() != "CPython"


def extensions():
    if PURE:
        return []
    from Cython.Build import cythonize

    core = Extension("lockmgr._core", ["lockmgr_core.pyx"], include_dirs=["src/lockmgr"])
    return cythonize([core], include_path=["src"], compiler_directives={"language_level": "3"})


setup(ext_modules=extensions())
