"""Fixtures of the Python binding's tests.

The library comes from $KVXFER_LIBRARY (ctest sets it to the built
libkvxfer.so).  Two-process tests run this process as rank 0 (it makes the
unique id) and peer.py as rank 1 in a subprocess; every subprocess is killed
and reaped when its test ends, pass or fail.  Everything binds to 127.0.0.1.
"""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PYROOT = os.path.dirname(HERE)
for p in (PYROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

# Loopback only, for this process and (through the environment) its peers.
os.environ["KVXFER_BOOTSTRAP_ADDR"] = "127.0.0.1"
os.environ["KVXFER_BIND_ADDR"] = "127.0.0.1"
os.environ.setdefault("KVXFER_CODEC_THREADS", "1")

PEER = os.path.join(HERE, "peer.py")


def child_env(extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([PYROOT, HERE] + [p for p in [env.get("PYTHONPATH")]
                                                          if p])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if env.get("KVXFER_LIBRARY") and os.sep in env["KVXFER_LIBRARY"]:
        # A path relative to where pytest started: children may run elsewhere.
        env["KVXFER_LIBRARY"] = os.path.abspath(env["KVXFER_LIBRARY"])
    if extra:
        env.update(extra)
    return env


class Peer:
    def __init__(self, proc):
        self.proc = proc

    def result(self, timeout=60):
        """Waits for the peer to exit; its RESULT dict (asserts it printed one)."""
        out, err = self.proc.communicate(timeout=timeout)
        for line in reversed(out.splitlines()):
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        raise AssertionError("peer exited %s without a result\nstdout:\n%s\nstderr:\n%s" %
                             (self.proc.returncode, out, err))

    def readline(self, timeout=30):
        """Next stdout line (for READY handshakes)."""
        import selectors
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError("peer said nothing within %s s" % timeout)
        return self.proc.stdout.readline()


@pytest.fixture
def spawn_peer():
    """spawn_peer(role=..., uid=UniqueId, **spec) -> Peer; killed at teardown."""
    procs = []

    def start(**spec):
        spec = dict(spec)
        spec["uid"] = spec["uid"].hex()
        p = subprocess.Popen([sys.executable, PEER, json.dumps(spec)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=child_env())
        procs.append(p)
        return Peer(p)

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        try:
            p.communicate(timeout=10)
        except Exception:  # noqa: BLE001
            pass
