"""Build the Cython extensions with optimisation on.

`pip install .` works on any Linux with a C compiler; no RDMA library or header is
needed. The verbs provider's extension is always built, from the project's own
declarations of libibverbs' ABI (rdmamw/include/rm_ibverbs.h), and does not link
libibverbs: it dlopen()s libibverbs.so.1 on first use, so one build works on
machines with and without rdma-core (without it, `verbs://` says why).
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
    ext("rdmamw.transport._base", "rdmamw/transport/_base.pyx"),
    *(ext(f"rdmamw.engine.{unit}", f"rdmamw/engine/{unit}.pyx") for unit in (
        "_link", "_leases", "_batch", "_rndv_send", "_eager_send", "_eager_recv",
        "_messages", "_rndv_recv", "_waits", "_engine")),
    ext("rdmamw.providers._shm", "rdmamw/providers/_shm.pyx"),
    ext("rdmamw.providers._tcp", "rdmamw/providers/_tcp.pyx"),
    ext("rdmamw.memory._span", "rdmamw/memory/_span.pyx"),
    ext("rdmamw.ps._sgd", "rdmamw/ps/_sgd.pyx"),
    ext("rdmamw.providers._verbs", "rdmamw/providers/_verbs.pyx"),
    ext("rdmamw.providers._verbs_dev", "rdmamw/providers/_verbs_dev.pyx"),
]
for e in extensions[-2:]:   # rm_ibverbs.h: dlopen/dlvsym (in libc itself since glibc 2.34)
    e.libraries = ["dl"]

setup(ext_modules=cythonize(extensions, compiler_directives=DIRECTIVES, nthreads=0))
