"""A vLLM prefill instance for test_vllm_core.py, driven in vLLM's call
order through kvxfer.vllm_core with fake KV caches:
    python vllm_prefill.py '<json spec>'
Prints "PARAMS <json>" (request id -> kv_transfer_params, what the proxy
forwards to the decode), then "RESULT <json>" with the requests reported
finished_sending, once all are or `wait_s` passed; exits when stdin closes
or gets a line.
"""

import json
import pickle
import sys
import time

import vllm_fakes
from kvxfer import vllm_core


def main(spec):
    kv = vllm_fakes.caches(spec["layers"], spec["blocks"], spec["heads"], spec["bs"], spec["hd"])
    worker = vllm_core.WorkerCore(spec.get("extra", {}), tp_rank=0)
    worker.register(kv)
    sched = vllm_core.SchedulerCore(spec["bs"])
    sched.set_endpoints({0: worker.address})  # the workers' handshake metadata
    params = {}
    for r in spec["requests"]:
        vllm_fakes.fill(kv, r["blocks"], r["tokens"], r["seed"])
        keep, p = sched.request_finished(r["id"], {"do_remote_decode": True}, r["blocks"],
                                         r["tokens"], True)
        assert keep, r
        params[r["id"]] = p
    print("PARAMS " + json.dumps(params), flush=True)
    # The metadata crosses from the scheduler process to the workers pickled.
    worker.start(pickle.loads(pickle.dumps(sched.build_meta())))
    sent, deadline = [], time.monotonic() + spec.get("wait_s", 60)
    while len(sent) < len(spec["requests"]) and time.monotonic() < deadline:
        s, r, f = worker.finished()
        assert not r and not f
        sent += sorted(s)
        time.sleep(0.005)
    print("RESULT " + json.dumps({"sent": sent}), flush=True)
    sys.stdin.readline()
    worker.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
