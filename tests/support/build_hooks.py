"""Build the test-only hooks (tests/support/_hooks.pyx) in place, for the suite only:
``python tests/support/build_hooks.py`` from anywhere (the Makefile's install step runs
it after the package's own build). They are not in the package, so a user's wheel has
no module that can put a queue pair in error (tests/unit/test_hooks_not_in_wheel.py).

The extension is built with setup.py's own compiler flags, include directories and
Cython directives (its ``ext()`` and ``DIRECTIVES``, read from setup.py, not copied),
and cimports the package's ``.pxd`` files from this tree. The generated ``_hooks.c``
and the ``.so`` beside it are build products (.gitignore); the objects go to
build/test-hooks/, not to the build/lib.* that a wheel of the package is made from."""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAME = "tests.support._hooks"


def setup_py_helpers() -> dict:
    """setup.py's top level up to its extension list: CFLAGS, DIRECTIVES and ext()."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    body = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "extensions"
                                                for t in node.targets):
            break
        body.append(node)
    ns: dict = {"__name__": "setup_helpers"}
    exec(compile(ast.Module(body, []), str(ROOT / "setup.py"), "exec"), ns)
    return ns


def main() -> None:
    os.chdir(ROOT)
    ns = setup_py_helpers()
    from Cython.Build import cythonize
    from setuptools import setup
    hooks = ns["ext"](NAME, *ns["TEST_HOOKS"])     # its headers and libdl, as setup.py's
    # a build directory of its own: setup.py's (build/lib.*) is what bdist_wheel packs
    args = ["-q", "build_ext", "--inplace", "--build-lib", "build/test-hooks/lib",
            "--build-temp", "build/test-hooks/temp", *sys.argv[1:]]
    setup(name="rdmamw-test-hooks", script_args=args,
          ext_modules=cythonize([hooks], compiler_directives=ns["DIRECTIVES"],
                                include_path=[str(ROOT)], quiet=True))


if __name__ == "__main__":
    main()
