"""Builds the compiled core ``lockmgr._core`` from ``src/lockmgr/_core.pyx``
(with ``_core.pxd`` and ``src/lockmgr/_c/``: the included ``.pxi`` files and the C headers).

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

    core = Extension("lockmgr._core", ["src/lockmgr/_core.pyx"])
    return cythonize([core], compiler_directives={"language_level": "3"})


setup(ext_modules=extensions())
