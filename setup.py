"""Build the Cython extensions with optimisation on.

`pip install .` works on any Linux with a C compiler; no RDMA library or header is
needed. The verbs provider's extension is always built, from the project's own
declarations of libibverbs' ABI (rdmamw/providers/verbs/rm_ibverbs.h), and does not link
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


SHARED = "rdmamw/include"          # headers more than one extension includes
VERBS = "rdmamw/providers/verbs"    # rm_ibverbs.h: dlopen/dlvsym (in libc since glibc 2.34)

#: extension -> (its headers' folders besides SHARED, libraries); the source is the
#: module's .pyx
EXTENSIONS = {
    "rdmamw.bitmap._phase": ((), ()),
    "rdmamw.transport._base": ((), ()),
    **{f"rdmamw.engine.{unit}": ((), ()) for unit in (
        "_link", "_leases", "_batch", "_rndv_send", "_eager_send", "_eager_recv",
        "_messages", "_rndv_recv", "_waits", "_engine", "_many")},
    **{f"rdmamw.providers.shm.{unit}": (("rdmamw/providers/shm",), ())
       for unit in ("_endpoint", "_transport")},
    "rdmamw.providers.tcp._transport": (("rdmamw/providers/tcp",), ()),
    "rdmamw.channel._remote": ((), ()),
    "rdmamw.memory._span": ((), ()),
    "rdmamw.ps._sgd": ((), ()),
    "rdmamw.ps._seqlock": ((), ()),
    **{f"rdmamw.providers.verbs.{unit}": ((VERBS,), ("dl",)) for unit in (
        "_lib", "_device", "_memory", "_block", "_qp", "_transport", "_regions")},
}
#: the test-only hooks (tests/support/_hooks.pyx): not in the package; built in place by
#: tests/support/build_hooks.py with these, for the suite only
TEST_HOOKS = (("rdmamw/providers/shm", "rdmamw/providers/tcp", VERBS), ("dl",))


def ext(name: str, include_dirs: tuple, libraries: tuple) -> Extension:
    return Extension(name, [name.replace(".", "/") + ".pyx"],
                     include_dirs=[SHARED, *include_dirs], libraries=list(libraries),
                     extra_compile_args=CFLAGS)


extensions = [ext(name, *how) for name, how in EXTENSIONS.items()]

setup(ext_modules=cythonize(extensions, compiler_directives=DIRECTIVES, nthreads=0))
