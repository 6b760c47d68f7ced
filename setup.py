"""Build the Cython extensions with optimisation on.

`pip install .` works on any Linux with a C compiler; no RDMA library is needed
for the core, the bitmaps or the shm provider. The verbs provider's extension is
built only where <infiniband/verbs.h> is found (libibverbs-dev); without it
`verbs://` says why it is unavailable (RDMAMW_VERBS=0/1 forces the choice).
"""

import os
import sysconfig

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


def have_verbs_h() -> bool:
    forced = os.environ.get("RDMAMW_VERBS")
    if forced in ("0", "1"):
        return forced == "1"
    dirs = ["/usr/include", "/usr/local/include", sysconfig.get_config_var("INCLUDEDIR") or ""]
    dirs += os.environ.get("CPATH", "").split(os.pathsep)
    return any(os.path.exists(os.path.join(d, "infiniband", "verbs.h")) for d in dirs if d)


extensions = [
    ext("rdmamw.bitmap._phase", "rdmamw/bitmap/_phase.pyx"),
    ext("rdmamw.transport._base", "rdmamw/transport/_base.pyx"),
    ext("rdmamw._core", "rdmamw/_core.pyx"),
    ext("rdmamw.providers._shm", "rdmamw/providers/_shm.pyx"),
    ext("rdmamw.providers._tcp", "rdmamw/providers/_tcp.pyx"),
    ext("rdmamw.memory._span", "rdmamw/memory/_span.pyx"),
    ext("rdmamw.ps._sgd", "rdmamw/ps/_sgd.pyx"),
]
if have_verbs_h():
    verbs = ext("rdmamw.providers._verbs", "rdmamw/providers/_verbs.pyx")
    verbs.libraries = ["ibverbs"]
    extensions.append(verbs)

setup(ext_modules=cythonize(extensions, compiler_directives=DIRECTIVES, nthreads=0))
