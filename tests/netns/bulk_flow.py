# bulk_flow.py sink ADDR PORT [OUT_FILE] | bulk_flow.py source ADDR PORT FLOWS
# The competing, unmarked (DSCP 0) bulk TCP flow of the two-namespace QoS tests
# (tests/netns/run.sh, tests/net_plugin/netns_qos.sh).  Both sides stop on
# SIGTERM or after 120 s; the sink writes the bytes it received to OUT_FILE
# when one is given.  They
# leave through os._exit: a normal exit can hang in the interpreter's
# finalisation while daemon threads sit in recv/send.
import os, signal, socket, sys, threading, time

role, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
deadline = time.monotonic() + 120
total = [0]
lock = threading.Lock()

def stop(*_):
    if role == "sink" and len(sys.argv) > 4:
        with open(sys.argv[4], "w") as f:
            f.write("%d\n" % total[0])
    os._exit(0)

signal.signal(signal.SIGTERM, stop)

def drain(c):
    while time.monotonic() < deadline:
        b = c.recv(1 << 16)
        if not b:
            return
        with lock:
            total[0] += len(b)

def pump():
    buf = b"\0" * (1 << 16)
    while time.monotonic() < deadline:
        try:
            c = socket.create_connection((addr, port), timeout=2)
            break
        except OSError:
            time.sleep(0.1)
    else:
        return
    c.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, 0)  # unmarked: DSCP 0
    c.settimeout(None)
    try:
        while time.monotonic() < deadline:
            c.sendall(buf)
    except OSError:
        pass

if role == "sink":
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    s.listen(64)
    s.settimeout(0.5)
    while time.monotonic() < deadline:
        try:
            c, _ = s.accept()
        except socket.timeout:
            continue
        threading.Thread(target=drain, args=(c,), daemon=True).start()
    stop()
else:
    for _ in range(int(sys.argv[4])):
        threading.Thread(target=pump, daemon=True).start()
    while time.monotonic() < deadline:
        time.sleep(0.2)
    stop()