"""libibverbs is loaded at run time: the verbs extension is always built from the
project's declarations (rdmamw/providers/verbs/rm_ibverbs.h), does not link libibverbs, and
dlopen()s it on first use; no library or a missing symbol is a ProviderUnavailable
naming it. Where <infiniband/verbs.h> exists, our ABI declarations are compared with
it field by field."""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VERBS_H = "/usr/include/infiniband/verbs.h"
CC = shutil.which("cc") or shutil.which("gcc")


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=ROOT, **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("module", [
    *(f"rdmamw.providers.verbs.{unit}" for unit in (
        "_lib", "_device", "_memory", "_block", "_qp", "_transport")),
    "tests.support._hooks"])
def test_extension_does_not_link_libibverbs(module):
    """No extension of the provider does, nor the test hooks, which drive a verbs
    endpoint (they load the library the provider loaded, on first use)."""
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) not installed")
    out = subprocess.run([readelf, "-d", importlib.import_module(module).__file__],
                         capture_output=True, text=True, check=True).stdout
    needed = [line.split("[", 1)[1].rstrip("]") for line in out.splitlines()
              if "(NEEDED)" in line]
    assert needed, out          # the parse works: libc at least
    assert not [n for n in needed if "ibverbs" in n], needed


def test_loaded_on_first_use_not_at_import():
    r = _run("""
        import os, rdmamw, rdmamw.providers.verbs._lib as v
        maps = lambda: "libibverbs" in open("/proc/self/maps").read()
        before = maps()
        rdmamw.listen(f"shm://load{os.getpid()}").close()
        print(before, maps(), v.load(), maps())
    """)
    assert r.returncode == 0, r.stderr
    before, after_shm, path, after = r.stdout.split()
    assert (before, after_shm, after) == ("False", "False", "True")
    assert os.path.basename(path).startswith("libibverbs.so"), path


def test_no_library_is_provider_unavailable_with_the_reason():
    r = _run("""
        import rdmamw
        from rdmamw import cli
        from rdmamw.providers.verbs import probe as verbs_device
        print(verbs_device.library())
        try:
            rdmamw.listen("verbs://127.0.0.1:0")
        except rdmamw.ProviderUnavailable as e:
            print("unavailable:", e)
        cli.main(["info"])
    """, RDMAMW_VERBS_LIBRARY="/nonexistent/libibverbs.so.1")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("(False, 'cannot load /nonexistent/libibverbs.so.1 ("), lines
    assert lines[1].startswith("unavailable: verbs:// is unavailable here: cannot load "
                               "/nonexistent/libibverbs.so.1"), lines
    assert "libibverbs: not loaded: cannot load /nonexistent/libibverbs.so.1" in r.stdout


def test_the_test_hooks_work_without_libibverbs():
    """The test hooks (tests/support/hooks.py) import, and their verbs hooks say what is
    wrong on a host where the library cannot be loaded (the host suite uses the others
    there)."""
    r = _run("""
        import tests.support.hooks as hooks
        from rdmamw.providers.verbs._transport import VerbsTransport
        print("libibverbs" in open("/proc/self/maps").read())
        for hook in (hooks.qp_error, lambda tp: hooks.expose_churn(tp, 0, 0, 1)):
            try:
                hook(VerbsTransport())
            except ValueError as e:
                print(e)
    """, RDMAMW_VERBS_LIBRARY="/nonexistent/libibverbs.so.1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["False"] + [
        "the verbs transport is not connected (or closed)"] * 2


def test_load_fills_the_device_extensions_table():
    """_device keeps its own table of libibverbs calls: load() fills it too, so a
    device is asked (and refused here: none of that name), not called through NULL."""
    r = _run("""
        import rdmamw.providers.verbs._lib as v
        from rdmamw.providers.verbs._device import VerbsDevice
        try:
            v.load()
        except OSError as e:
            raise SystemExit(f"skip: {e}")
        try:
            VerbsDevice("rdmamw-no-such-device")
        except OSError as e:
            print(e.strerror)
    """)
    if r.returncode and "skip: " in r.stderr:
        pytest.skip(r.stderr.strip())
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(("ibv_get_device_list: ", "cannot open RDMA device "
                                "'rdmamw-no-such-device'")), r.stdout


def test_the_collectors_clear_leaves_the_transports_units():
    """The transport's __dealloc__ destroys the QP before the device's CQs and PD go:
    the garbage collector's clear (tp_clear, run on a cycle before deallocation) must
    not drop its units first (no_gc_clear), or the device closes under a live QP."""
    from rdmamw.providers.verbs._transport import VerbsTransport
    get_slot = ctypes.pythonapi.PyType_GetSlot
    get_slot.restype, get_slot.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_int]
    tp = VerbsTransport()
    assert tp.failure is not None
    clear = get_slot(VerbsTransport, 51)            # Py_tp_clear
    if clear:
        ctypes.CFUNCTYPE(ctypes.c_int, ctypes.py_object)(clear)(tp)
    assert tp.failure is not None


FAKE = """
#include <stddef.h>
#define F(name) void *name(void) { return NULL; }
F(ibv_get_device_list) F(ibv_free_device_list) F(ibv_get_device_name)
F(ibv_open_device) F(ibv_close_device) F(ibv_query_device) F(ibv_query_port)
F(ibv_query_gid) F(ibv_alloc_pd) F(ibv_dealloc_pd) F(ibv_reg_mr) F(ibv_dereg_mr)
F(ibv_create_comp_channel) F(ibv_destroy_comp_channel) F(ibv_create_cq)
F(ibv_destroy_cq) F(ibv_get_cq_event) F(ibv_ack_cq_events) F(ibv_create_qp)
F(ibv_destroy_qp) F(ibv_wc_status_str) F(ibv_fork_init)
"""     # no ibv_modify_qp; no ibv_is_fork_initialized (optional: old rdma-core)
VERSIONS = "IBVERBS_1.0 { global: ibv_create_comp_channel; ibv_destroy_comp_channel; };\n" \
           "IBVERBS_1.1 { global: ibv_*; local: *; } IBVERBS_1.0;\n"


LACKS = ("lacks ibv_modify_qp@IBVERBS_1.1 (not libibverbs, or older than rdma-core's "
         "libibverbs 1.1)")


def _fake_lib(tmp_path, source: str, versions: str | None) -> None:
    """tmp_path/libibverbs.so.1 from `source`, with a version script if given."""
    (tmp_path / "fake.c").write_text(source)
    cmd = [CC, "-shared", "-fPIC", "-o", str(tmp_path / "libibverbs.so.1"),
           str(tmp_path / "fake.c")]
    if versions is not None:
        (tmp_path / "fake.map").write_text(versions)
        cmd.append(f"-Wl,--version-script={tmp_path / 'fake.map'}")
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.mark.skipif(CC is None, reason="no C compiler")
@pytest.mark.parametrize("versioned", [True, False], ids=["versioned", "unversioned"])
def test_a_library_missing_a_symbol_is_named(tmp_path, versioned):
    _fake_lib(tmp_path, FAKE, VERSIONS if versioned else None)
    r = _run("""
        import rdmamw
        try:
            rdmamw.Channel.open("verbs://127.0.0.1:1", timeout=0.1)
        except rdmamw.ProviderUnavailable as e:
            print(e)
    """, LD_LIBRARY_PATH=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"verbs:// is unavailable here: {tmp_path}/libibverbs.so.1 {LACKS}"


@pytest.mark.skipif(CC is None, reason="no C compiler")
def test_only_an_old_version_of_a_symbol_is_not_enough(tmp_path):
    """The versioned lookup: ibv_modify_qp exported only at IBVERBS_1.0 (the layout of
    rdma-core's compat symbols, which plain dlsym may return) does not satisfy it."""
    _fake_lib(tmp_path, FAKE + "F(ibv_modify_qp)\n",
              "IBVERBS_1.0 { global: ibv_create_comp_channel; ibv_destroy_comp_channel; "
              "ibv_modify_qp; };\nIBVERBS_1.1 { global: ibv_*; local: *; } IBVERBS_1.0;\n")
    r = _run("""
        from rdmamw.providers.verbs import probe as verbs_device
        print(verbs_device.library())
    """, LD_LIBRARY_PATH=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == repr((False, f"{tmp_path}/libibverbs.so.1 {LACKS}"))


# ---- the ABI: our declarations against rdma-core's header -------------------------

#: struct -> members whose offsets must match (sizeof is compared for every struct)
MEMBERS = {
    "ibv_device_attr": ["max_qp_wr", "device_cap_flags", "max_sge", "max_cqe",
                        "phys_port_cnt"],
    "ibv_port_attr": ["state", "max_mtu", "active_mtu", "gid_tbl_len", "lid", "link_layer",
                      "port_cap_flags2"],
    "ibv_context_ops": ["alloc_mw", "dealloc_mw", "poll_cq", "req_notify_cq", "post_send",
                        "post_recv"],
    "ibv_context": ["device", "ops", "cmd_fd", "mutex", "abi_compat"],
    "ibv_comp_channel": ["context", "fd", "refcnt"],
    "ibv_cq": ["context", "channel", "cq_context", "cqe", "async_events_completed"],
    "ibv_qp": ["context", "qp_num", "state", "events_completed"],
    "ibv_mr": ["addr", "length", "lkey", "rkey"],
    "ibv_pd": ["context", "handle"],
    "ibv_mw": ["context", "pd", "rkey", "handle", "type"],
    "ibv_qp_cap": ["max_send_wr", "max_recv_wr", "max_send_sge", "max_recv_sge",
                   "max_inline_data"],
    "ibv_qp_init_attr": ["qp_context", "send_cq", "recv_cq", "srq", "cap", "qp_type",
                         "sq_sig_all"],
    "ibv_global_route": ["dgid", "flow_label", "sgid_index", "hop_limit", "traffic_class"],
    "ibv_ah_attr": ["grh", "dlid", "sl", "src_path_bits", "static_rate", "is_global",
                    "port_num"],
    "ibv_qp_attr": ["qp_state", "path_mtu", "rq_psn", "sq_psn", "dest_qp_num",
                    "qp_access_flags", "ah_attr", "pkey_index", "max_rd_atomic",
                    "max_dest_rd_atomic", "min_rnr_timer", "port_num", "timeout",
                    "retry_cnt", "rnr_retry", "rate_limit"],
    "ibv_sge": ["addr", "length", "lkey"],
    "ibv_send_wr": ["wr_id", "next", "sg_list", "num_sge", "opcode", "send_flags",
                    "imm_data", "wr.rdma.remote_addr", "wr.rdma.rkey", "qp_type",
                    "bind_mw.mw", "bind_mw.rkey", "bind_mw.bind_info.mr",
                    "bind_mw.bind_info.addr", "bind_mw.bind_info.length",
                    "bind_mw.bind_info.mw_access_flags"],
    "ibv_recv_wr": ["wr_id", "next", "sg_list", "num_sge"],
    "ibv_wc": ["wr_id", "status", "opcode", "vendor_err", "byte_len", "imm_data", "qp_num",
               "wc_flags", "dlid_path_bits"],
}
UNIONS = {"ibv_gid": ["raw"]}
CONSTANTS = """IBV_QPT_RC IBV_QPS_RESET IBV_QPS_INIT IBV_QPS_RTR IBV_QPS_RTS IBV_QPS_ERR
IBV_MTU_256 IBV_MTU_1024 IBV_MTU_4096 IBV_WR_RDMA_WRITE IBV_WR_RDMA_WRITE_WITH_IMM
IBV_WR_SEND IBV_WR_RDMA_READ IBV_FORK_DISABLED IBV_FORK_ENABLED IBV_FORK_UNNEEDED
IBV_QP_STATE IBV_QP_ACCESS_FLAGS IBV_QP_PKEY_INDEX IBV_QP_PORT IBV_QP_AV IBV_QP_PATH_MTU
IBV_QP_TIMEOUT IBV_QP_RETRY_CNT IBV_QP_RNR_RETRY IBV_QP_RQ_PSN IBV_QP_MAX_QP_RD_ATOMIC
IBV_QP_MIN_RNR_TIMER IBV_QP_SQ_PSN IBV_QP_MAX_DEST_RD_ATOMIC IBV_QP_DEST_QPN
IBV_ACCESS_LOCAL_WRITE IBV_ACCESS_REMOTE_WRITE IBV_ACCESS_REMOTE_READ IBV_SEND_SIGNALED
IBV_SEND_INLINE IBV_WC_SUCCESS IBV_WC_WR_FLUSH_ERR IBV_PORT_ACTIVE IBV_LINK_LAYER_INFINIBAND
IBV_LINK_LAYER_ETHERNET IBV_WR_BIND_MW IBV_WR_LOCAL_INV IBV_MW_TYPE_1 IBV_MW_TYPE_2
IBV_ACCESS_MW_BIND IBV_DEVICE_MEM_WINDOW_TYPE_2B""".split()


def _layout(tmp_path, header: str) -> dict:
    lines = ['#define _GNU_SOURCE', f'#include {header}', '#include <stdio.h>',
             '#include <stddef.h>', 'int main(void) {', 'printf("{");']
    for kind, table in (("struct", MEMBERS), ("union", UNIONS)):
        for name, members in table.items():
            lines.append(f'printf("\\"{name}\\": %zu, ", sizeof({kind} {name}));')
            for m in members:
                lines.append(f'printf("\\"{name}.{m}\\": %zu, ", offsetof({kind} {name}, {m}));')
    for c in CONSTANTS:
        lines.append(f'printf("\\"{c}\\": %lld, ", (long long){c});')
    lines += ['printf("\\"end\\": 0}");', 'return 0; }']
    tag = "ours" if "rm_" in header else "theirs"
    (tmp_path / f"{tag}.c").write_text("\n".join(lines))
    exe = tmp_path / tag
    subprocess.run([CC, "-o", str(exe), str(tmp_path / f"{tag}.c"),
                    f"-I{ROOT}/rdmamw/providers/verbs", "-ldl"], check=True, capture_output=True)
    return json.loads(subprocess.run([str(exe)], capture_output=True, text=True,
                                     check=True).stdout)


@pytest.mark.skipif(CC is None or not os.path.exists(VERBS_H),
                    reason="needs a C compiler and <infiniband/verbs.h> (libibverbs-dev)")
def test_abi_declarations_match_rdma_core(tmp_path):
    ours = _layout(tmp_path, '"rm_ibverbs.h"')
    theirs = _layout(tmp_path, "<infiniband/verbs.h>")
    assert len(ours) == sum(1 + len(m) for m in (*MEMBERS.values(), *UNIONS.values())) \
        + len(CONSTANTS) + 1
    assert ours == theirs


def test_info_names_the_library_it_loaded(capsys):
    from rdmamw import cli
    from rdmamw.providers.verbs import probe as verbs_device
    loaded, path = verbs_device.library()
    if not loaded:
        pytest.skip(f"no libibverbs here: {path}")
    assert os.path.isabs(path) and os.path.exists(path), path
    assert cli.main(["info"]) == 0
    assert f"  libibverbs: loaded from {path}\n" in capsys.readouterr().out
