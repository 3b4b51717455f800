"""Failures surface as KvxferError with the code, its name and the library's
message; a missing library says how to point at it."""

import os
import shutil
import subprocess
import sys
import time

import pytest

import kvxfer
from kvxfer import Result, Stage

import conftest
import kvdata


def test_error_carries_code_name_and_message():
    with pytest.raises(kvxfer.KvxferError) as e:
        kvxfer.page_max_size(64, 128, kvxfer.CodecConfig(chunk_tokens=33))
    err = e.value
    assert err.code == Result.ERR_INVALID_ARGUMENT and err.code == -1
    assert err.name == "KVXFER_ERR_INVALID_ARGUMENT"
    assert err.description == kvxfer.error_string(-1) == "invalid argument"
    assert "chunk_tokens 33" in err.message
    assert err.function == "kvxfer_page_max_size"
    assert "KVXFER_ERR_INVALID_ARGUMENT" in str(err) and "chunk_tokens 33" in str(err)
    # The next successful call leaves nothing behind.
    assert kvxfer.page_max_size(64, 128)[0] > 0


def test_comm_init_argument_errors():
    with pytest.raises(kvxfer.KvxferError) as e:
        kvxfer.Communicator(kvxfer.UniqueId(bytes(128)), 0, 2)
    assert e.value.code == Result.ERR_INVALID_ARGUMENT
    assert "malformed" in e.value.message
    with pytest.raises(kvxfer.KvxferError) as e:
        kvxfer.Communicator(kvxfer.UniqueId(bytes(128)), 0, 1)
    assert "nranks 1" in e.value.message
    with pytest.raises(ValueError):
        kvxfer.UniqueId(b"short")


def test_unique_id_serialises():
    uid = kvxfer.UniqueId.create()
    raw = bytes(uid)
    assert len(raw) == kvxfer.UNIQUE_ID_BYTES == 128
    assert kvxfer.UniqueId.from_bytes(raw) == uid
    assert kvxfer.UniqueId.from_hex(uid.hex()) == uid
    import pickle
    assert pickle.loads(pickle.dumps(uid)) == uid
    assert raw.hex() not in repr(uid)  # the secret stays out of logs


def test_mismatched_descriptors_fail_both_sides_naming_the_field(spawn_peer):
    uid = kvxfer.UniqueId.create()
    peer = spawn_peer(role="send", uid=uid, L=2, heads=2, hd=32, T=200, block_size=16, seed=1)
    with kvxfer.Communicator(uid, 0, 2, timeout_ms=10000, bind_address="127.0.0.1") as comm:
        dst = kvdata.HostKV(2, 2, 32, 201, 16)  # one token more than the sender
        req = comm.recv(1, dst.descriptor())
        with pytest.raises(kvxfer.KvxferError) as e:
            req.wait(timeout=30)
        assert e.value.code == Result.ERR_MISMATCH
        assert e.value.name == "KVXFER_ERR_MISMATCH"
        assert "num_tokens is 200 on the sender and 201 on the receiver" in e.value.message
        assert req.stage == Stage.ERROR
        assert req.info().t_error_ns > 0 and req.info().t_complete_ns == 0
        with pytest.raises(kvxfer.KvxferError):
            req.test()
        req.free()
    rep = peer.result()
    assert rep["error"]["code"] == Result.ERR_MISMATCH
    assert "num_tokens" in rep["error"]["message"]


def test_wrong_secret_is_refused_and_root_times_out(spawn_peer):
    uid = kvxfer.UniqueId.create()
    forged = bytearray(bytes(uid))
    forged[40] ^= 0x55  # inside the 32-byte secret (bytes 32..63)
    peer = spawn_peer(role="init", uid=kvxfer.UniqueId(bytes(forged)), timeout_ms=6000)
    assert peer.readline().strip() == "JOINING"
    t0 = time.monotonic()
    with pytest.raises(kvxfer.KvxferError) as e:
        kvxfer.Communicator(uid, 0, 2, timeout_ms=2000, bind_address="127.0.0.1")
    assert e.value.code == Result.ERR_TIMEOUT
    assert time.monotonic() - t0 < 2.0 + 5.0
    rep = peer.result()
    assert rep["error"]["code"] == Result.ERR_SYSTEM
    assert "refused" in rep["error"]["message"]


def test_receive_without_sender_times_out_and_post_errors(spawn_peer):
    uid = kvxfer.UniqueId.create()
    peer = spawn_peer(role="idle", uid=uid, timeout_ms=1500)
    assert peer.readline().strip() == "JOINING"
    with kvxfer.Communicator(uid, 0, 2, timeout_ms=1500, bind_address="127.0.0.1") as comm:
        assert comm.rank == 0 and comm.nranks == 2
        dst = kvdata.HostKV(1, 1, 8, 10, 16)
        # Errors at post: nothing is created.
        with pytest.raises(kvxfer.KvxferError) as e:
            comm.send(1, dst.descriptor(), kvxfer.CodecConfig(chunk_tokens=33))
        assert e.value.code == Result.ERR_INVALID_ARGUMENT and "chunk_tokens" in e.value.message
        with pytest.raises(kvxfer.KvxferError) as e:
            comm.send(0, dst.descriptor())
        assert "peer 0 is not another rank" in e.value.message
        ro = kvxfer.KVDescriptor([bytes(16 * 8 * 2)], [bytes(16 * 8 * 2)], num_layers=1,
                                 kv_heads=1, head_dim=8, block_size=16, num_tokens=10)
        with pytest.raises(ValueError):
            comm.recv(1, ro)
        # The receive itself: the sender never posts.
        req = comm.recv(1, dst.descriptor())
        assert req.wait(Stage.ANCHOR_READY, timeout=0.1) is False
        assert req.test() is False and req.stage == Stage.POSTED
        with pytest.raises(kvxfer.KvxferError) as e:
            req.free()  # in flight
        assert e.value.code == Result.ERR_INVALID_USAGE
        t0 = time.monotonic()
        with pytest.raises(kvxfer.KvxferError) as e:
            req.wait(timeout=20)
        assert e.value.code == Result.ERR_TIMEOUT
        assert e.value.name == "KVXFER_ERR_TIMEOUT"
        assert "never posted the matching kvxfer_send" in e.value.message
        assert time.monotonic() - t0 < 1.5 + 5.0
        req.free()
        peer.proc.stdin.write("bye\n")
        peer.proc.stdin.flush()
    assert peer.result().get("ok")


def test_abort_fails_requests_in_flight(spawn_peer):
    uid = kvxfer.UniqueId.create()
    peer = spawn_peer(role="idle", uid=uid, timeout_ms=5000)
    comm = kvxfer.Communicator(uid, 0, 2, timeout_ms=5000, bind_address="127.0.0.1")
    dst = kvdata.HostKV(1, 1, 8, 10, 16)
    req = comm.recv(1, dst.descriptor())
    comm.abort()
    with pytest.raises(kvxfer.KvxferError) as e:
        req.wait(timeout=5)
    assert e.value.code == Result.ERR_INVALID_USAGE and "abort" in e.value.message
    with pytest.raises(kvxfer.KvxferError):
        comm.recv(1, dst.descriptor())  # aborted: nothing more is accepted
    comm.destroy()
    comm.destroy()  # idempotent
    with pytest.raises(RuntimeError):
        comm.recv(1, dst.descriptor())
    req.free()
    peer.proc.stdin.write("bye\n")
    peer.proc.stdin.flush()
    assert peer.result().get("ok")


def _import_in_subprocess(env_updates, cwd=None, pythonpath=None):
    env = conftest.child_env()
    env.pop("KVXFER_LIBRARY", None)
    env.update(env_updates)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", "import kvxfer"], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=30)


def test_library_named_by_env_that_does_not_exist():
    r = _import_in_subprocess({"KVXFER_LIBRARY": "/nonexistent/libkvxfer.so"})
    assert r.returncode != 0
    assert "LibraryNotFoundError" in r.stderr
    assert "KVXFER_LIBRARY" in r.stderr and "/nonexistent/libkvxfer.so" in r.stderr


def test_library_not_found_anywhere(tmp_path):
    import ctypes.util
    if ctypes.util.find_library("kvxfer"):
        pytest.skip("a libkvxfer is installed on the loader path")
    shutil.copytree(os.path.join(conftest.PYROOT, "kvxfer"), str(tmp_path / "kvxfer"),
                    ignore=shutil.ignore_patterns("*.so*", "__pycache__"))
    r = _import_in_subprocess({"LD_LIBRARY_PATH": ""}, cwd=str(tmp_path),
                              pythonpath=str(tmp_path))
    assert r.returncode != 0
    assert "libkvxfer.so not found" in r.stderr
    assert "KVXFER_LIBRARY" in r.stderr


def test_library_next_to_the_package(tmp_path):
    lib = os.environ.get("KVXFER_LIBRARY")
    if not lib:
        pytest.skip("KVXFER_LIBRARY not set")
    shutil.copytree(os.path.join(conftest.PYROOT, "kvxfer"), str(tmp_path / "kvxfer"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(lib, str(tmp_path / "kvxfer" / "libkvxfer.so"))
    env = conftest.child_env()
    env.pop("KVXFER_LIBRARY", None)
    env["PYTHONPATH"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-c", "import kvxfer; print(kvxfer.library_path())"],
                       env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / "kvxfer" / "libkvxfer.so")


_CRASH_CHILD = r"""
import ctypes, os, signal, sys
import kvxfer
assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, signal.getsignal(signal.SIGINT)
if sys.argv[1] == "sigint":
    try:
        os.kill(os.getpid(), signal.SIGINT)
    except KeyboardInterrupt:
        sys.exit(7)
    sys.exit(8)
ctypes.c_int.from_address(8).value  # a read of page 0: SIGSEGV
"""


@pytest.mark.parametrize("what", ["segv", "sigint"])
def test_a_crash_dies_by_its_signal_and_ctrl_c_stays_keyboard_interrupt(tmp_path, what):
    # libinfinipath (pulled in by Debian's libfabric) would turn both into a
    # backtrace, a .btr file in the working directory and exit status 1.
    r = subprocess.run([sys.executable, "-c", _CRASH_CHILD, what], cwd=tmp_path,
                       env=conftest.child_env(), capture_output=True, text=True, timeout=60)
    if what == "segv":
        assert r.returncode == -11, r.stderr[-2000:]
    else:
        assert r.returncode == 7, r.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []
