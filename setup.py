"""Build the Cython extensions with optimisation on.

`pip install .` works on any Linux with a C compiler; no RDMA library is needed
for the core, the bitmaps or the shm provider.
"""

import os

from Cython.Build import cythonize
from setuptools import Extension, setup

CFLAGS = ["-O3", "-fno-strict-aliasing", "-Wno-unused-function", "-Wno-unreachable-code"]
if os.environ.get("RDMAMW_NATIVE") == "1":
    CFLAGS.append("-march=native")

DIRECTIVES = {
    "language_level": "3",
    "boundscheck": False,
    "wraparound": False,
    "cdivision": True,
    "initializedcheck": False,
    "embedsignature": True,
}


def ext(name: str, *sources: str) -> Extension:
    return Extension(name, list(sources), include_dirs=["rdmamw/include"],
                     extra_compile_args=CFLAGS)


extensions = [
    ext("rdmamw.bitmap._phase", "rdmamw/bitmap/_phase.pyx"),
    ext("rdmamw._core", "rdmamw/_core.pyx"),
    ext("rdmamw.providers._shm", "rdmamw/providers/_shm.pyx"),
    ext("rdmamw.providers._tcp", "rdmamw/providers/_tcp.pyx"),
]

setup(ext_modules=cythonize(extensions, compiler_directives=DIRECTIVES, nthreads=0))
