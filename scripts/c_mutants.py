"""Hand-made mutants of the C/Cython bounds checks (`make mutate-c`).

Each mutant below plants one small bug in a check that keeps a peer inside the memory
it may touch (exposure table, tcp frames, slot headers, bitmap spans) and names the
test(s) that must catch it. The script applies them one at a time to a copy of the
tree (never the working tree), rebuilds the copy's extensions and runs the named tests:
"killed" when they fail, "SURVIVED" when they pass (a hole in the suite: the named test
no longer tests what it claims). Exit status 1 when any survived.

    scripts/c_mutants.py [--only NAME ...] [--list]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutate import ROOT, copy_tree, run_tests  # noqa: E402


@dataclass(frozen=True)
class CMutant:
    name: str
    path: str
    original: str          # must occur exactly once in the file
    replacement: str
    tests: tuple[str, ...]
    why: str


EXPOSE, TCP = "rdmamw/include/rm_expose.h", "rdmamw/providers/tcp/rm_tcp.h"
CORE, PHASE = "rdmamw/engine/_eager_recv.pyx", "rdmamw/bitmap/_phase.pyx"
RNDV = "tests/channel/test_rendezvous.py"
HOSTILE = "tests/providers/test_shm_hostile.py"
ASSIST = "tests/providers/test_shm_assist.py"
TCPT = "tests/providers/test_tcp.py::test_malformed_frame_drops_the_connection"
ERRS = "tests/channel/test_channel_errors.py"
BITS = "tests/unit/test_bitmap_unit.py"

MUTANTS: list[CMutant] = [
    CMutant("expose-len-plus-one", EXPOSE,
            "len > out->len ||", "len > out->len + 1 ||",
            (f"{RNDV}::test_bad_descriptor_is_protocol_error_and_reads_nothing",
             f"{RNDV}::test_fuzz_descriptor_bounds"),
            "a READ one byte longer than the exposure is served"),
    CMutant("expose-end-plus-one", EXPOSE,
            "addr - out->addr > out->len - len)", "addr - out->addr > out->len - len + 1)",
            (f"{RNDV}::test_fuzz_descriptor_bounds",
             f"{ASSIST}::test_a_job_outside_what_was_exposed_copies_nothing"),
            "a range ending one byte past the exposure is served"),
    CMutant("expose-no-access-check", EXPOSE,
            "if (!(out->access & access) || addr", "if (addr",
            (f"{ASSIST}::test_a_write_job_into_a_read_only_exposure_copies_nothing",
             f"{ASSIST}::test_a_job_outside_what_was_exposed_copies_nothing"),
            "a read-only exposure can be written (and a write-only one read)"),
    CMutant("tcp-region-offset-past-end", TCP,
            "off <= c->len[region] &&", "off <= c->len[region] + 8 &&",
            (TCPT, "tests/providers/test_fuzz_tcp.py::test_fuzz_frame_decoder_near_the_edges"),
            "an offset just past a region wraps the length check: any length is taken"),
    CMutant("tcp-region-length-plus-one", TCP,
            "length <= c->len[region] - off;", "length <= c->len[region] - off + 1;",
            (TCPT, "tests/providers/test_fuzz_tcp.py::test_fuzz_frame_decoder_near_the_edges"),
            "a WRITE one byte past the end of a region lands"),
    CMutant("tcp-publish-unaligned", TCP,
            "((f->offset | f->length) & 7))", "((f->offset | f->length) & 0))",
            (TCPT,), "a PUBLISH of unaligned words is applied"),
    CMutant("tcp-publish-over-pubcap", TCP,
            "|| f->length > c->pubcap ||", "||", (TCPT,),
            "a PUBLISH larger than the publish buffer overruns it"),
    CMutant("tcp-heartbeat-junk", TCP,
            "    case RT_HEARTBEAT:\n        if (f->length || f->offset || f->region) "
            "return -RT_WHY_FRAME;",
            "    case RT_HEARTBEAT:\n        if (f->length) return -RT_WHY_FRAME;",
            (TCPT,), "an empty frame with junk fields is taken"),
    CMutant("tcp-read-req-unchecked", TCP,
            "    case RT_READ_REQ:\n        if (!rt_in_region(c, f->region, f->offset, "
            "f->length)) return -RT_WHY_FRAME;",
            "    case RT_READ_REQ:\n        if (f->region >= RT_NREG) return -RT_WHY_FRAME;",
            (TCPT,),
            "a READ of any offset of a region is served"),
    CMutant("slot-used-past-slot", CORE,
            "if h.used > self.slot_size or", "if h.used > self.slot_size + 64 or",
            (f"{ERRS}::test_corrupted_header_is_protocol_error",
             "tests/channel/test_fuzz.py::test_fuzz_slot_decoder"),
            "a header claiming a few bytes more than the slot is delivered"),
    CMutant("slot-count-zero", CORE,
            "h.count == 0 or not (", "not (",
            (f"{ERRS}::test_corrupted_header_is_protocol_error",),
            "a slot of zero messages is opened"),
    CMutant("slot-records-fit", CORE,
            "<uint64_t>h.count * REC_HDR <= h.used", "<uint64_t>h.count <= h.used",
            (f"{ERRS}::test_corrupted_header_is_protocol_error",),
            "more record headers than bytes"),
    CMutant("slot-torn-check", CORE,
            "check != <uint32_t>~(<uint32_t>seq) or ", "",
            (f"{ERRS}::test_corrupted_header_is_protocol_error",),
            "a torn header (check word does not match) is taken"),
    CMutant("slot-duplicate-seq", CORE,
            " or self.order[d] != RM_NO_SLOT:", ":",
            (f"{ERRS}::test_duplicate_sequence_number_is_protocol_error",),
            "two slots with one sequence number"),
    CMutant("record-overrun-by-header", CORE,
            "if L > self.cur_used - self.cur_off - REC_HDR:",
            "if L > self.cur_used - self.cur_off:",
            (f"{ERRS}::test_record_overrun_is_protocol_error_not_a_wrong_message",
             "tests/channel/test_fuzz.py::test_fuzz_slot_decoder"),
            "a record whose bytes run REC_HDR past the used bytes"),
    CMutant("bitmap-release-span-short", PHASE,
            "        if w + 1 > self.dirty_hi:\n            self.dirty_hi = w + 1",
            "        if w + 1 > self.dirty_hi:\n            self.dirty_hi = w",
            (f"{BITS}::test_dirty_spans", "tests/unit/test_bitmap_properties.py"),
            "the reclaim span written back misses the last word released"),
    CMutant("bitmap-alloc-span-short", PHASE,
            "                        self.dirty_count = d + 1",
            "                        self.dirty_count = d",
            (f"{BITS}::test_dirty_spans", "tests/unit/test_bitmap_properties.py"),
            "the arrival span published misses the last word allocated"),
    CMutant("bitmap-last-word-mask", PHASE,
            "if w == self.nwords - 1:\n                free_bits &= self.last_mask\n"
            "            if free_bits:",
            "if w == self.nwords:\n                free_bits &= self.last_mask\n"
            "            if free_bits:",
            (f"{BITS}::test_full_ring_then_alloc_returns_fewer",),
            "slots past nslots in the last word are handed out"),
]


def copy_with_generated(dest: Path) -> Path:
    """copy_tree plus the generated .c files (mtimes kept): only what a mutant touches
    is rebuilt."""
    copy_tree(dest)
    for c in [*(ROOT / "rdmamw").rglob("*.c"), *(ROOT / "tests" / "support").glob("*.c")]:
        shutil.copy2(c, dest / c.relative_to(ROOT))
    return dest


def touch_includers(tree: Path, path: str) -> None:
    """Cython sees a header named in ``cdef extern from``, not one a header includes
    (rm_tcp.h includes rm_expose.h): touch the .pyx files that name the mutated header
    or a header that includes it, so their extensions are rebuilt."""
    name = Path(path).name
    if not name.endswith(".h"):
        return
    names = {name} | {h.name for h in (tree / "rdmamw").rglob("*.h")
                      if f'#include "{name}"' in h.read_text()}
    naming = [f for f in (tree / "rdmamw").rglob("*.p[yx][xd]")
              if any(f'extern from "{n}"' in f.read_text() for n in names)]
    # a .pxd that names it: its own .pyx and every .pyx that cimports it (the hooks)
    modules = {".".join(f.relative_to(tree).with_suffix("").parts) for f in naming
               if f.suffix == ".pxd"}
    for pyx in [*(tree / "rdmamw").rglob("*.pyx"), tree / "tests" / "support" / "_hooks.pyx"]:
        if pyx in naming or pyx.with_suffix(".pxd") in naming or any(
                f"from {m} cimport" in pyx.read_text() for m in modules):
            pyx.touch()


def build(tree: Path) -> tuple[bool, str]:
    p = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                       cwd=tree, capture_output=True, text=True)
    if p.returncode == 0:       # the test-only hooks cimport the providers' .pxd files
        p = subprocess.run([sys.executable, "tests/support/build_hooks.py", "-q"],
                           cwd=tree, capture_output=True, text=True)
    return p.returncode == 0, (p.stdout + p.stderr)[-400:]


def locate(m: CMutant) -> str:
    """The file the mutant applies to: its ``path`` when the original text is there
    once, else the one Cython/C source of rdmamw that holds it once (code moves between
    the engine's units and the providers' files). Exits when it is nowhere or ambiguous."""
    if (ROOT / m.path).read_text().count(m.original) == 1:
        return m.path
    found = [str(p.relative_to(ROOT)) for ext in ("pyx", "pxd", "pxi", "h")
             for p in sorted((ROOT / "rdmamw").rglob(f"*.{ext}"))
             if p.read_text().count(m.original) == 1]
    if len(found) != 1:
        sys.exit(f"{m.name}: the original text occurs once in {found or 'no file'}, "
                 f"not once in {m.path}")
    print(f"{m.name}: moved from {m.path} to {found[0]}", file=sys.stderr)
    return found[0]


def sos(tree: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for d in ("rdmamw", "tests/support")
            for p in (tree / d).rglob("*.so")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    # every mutant still applies to today's code, wherever its text moved
    chosen = [replace(m, path=locate(m)) for m in chosen]
    if args.list:
        for m in chosen:
            print(f"{m.name:28} {m.path}: {m.why}\n{'':28} killed by {' '.join(m.tests)}")
        return 0
    survived = []
    with tempfile.TemporaryDirectory(prefix="rdmamw-cmut-") as tmp:
        tree = copy_with_generated(Path(tmp) / "tree")
        ok, out = build(tree)
        if not ok:
            sys.exit(f"the copy does not build:\n{out}")
        for m in chosen:
            target = tree / m.path
            text = target.read_text()
            before = sos(tree)
            target.write_text(text.replace(m.original, m.replacement))
            touch_includers(tree, m.path)
            t0 = time.monotonic()
            try:
                ok, out = build(tree)
                if not ok:
                    status, why = "error", f"does not build: {out}"
                elif sos(tree) == before:
                    status, why = "error", "the rebuild changed no extension"
                else:
                    st, why, _ = run_tests(tree, list(m.tests), timeout=900)
                    status = {"passed": "SURVIVED", "failed": "killed",
                              "error": "crashed"}.get(st, st)
            finally:
                target.write_text(text)
            if status not in ("killed", "crashed"):      # a crash fails the suite too
                survived.append(m.name)
            print(f"{status:8} {m.name:28} ({time.monotonic() - t0:.0f} s) {why[:150]}",
                  flush=True)
    print(f"\n{len(chosen) - len(survived)} of {len(chosen)} killed"
          + (f"; not killed: {' '.join(survived)}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
