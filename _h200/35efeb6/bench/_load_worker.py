"""One client process of ``engine_gpu.py --scaling``: loads a stored prompt, reports JSON.

Reads a JSON spec on stdin (client file, namespace, layout, tokens, repeat) and
prints {"gb", "seconds", "cpu_s"} for the loads after one warm-up.
"""

from __future__ import annotations

import json
import resource
import sys
import time

import numpy as np

from kvcache.client import Client, ClientConfig
from kvcache.keys import Namespace
from kvcache.layout import DType, KVLayout


def main() -> None:
    spec = json.loads(sys.stdin.read())
    layout = KVLayout(dtype=DType.BFLOAT16, **spec["layout"])
    space = Namespace(layout=layout, **spec["namespace"])
    tokens = np.array(spec["tokens"], np.uint32)
    with Client(ClientConfig.load(spec["client_file"], overrides={"timeout_s": 30.0})) as client:
        match = client.match_prefix(space, tokens)
        out = np.empty((match.hit_blocks, layout.payload_bytes), np.uint8)
        client.load(space, match, out=out)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu0 = usage.ru_utime + usage.ru_stime
        started = time.perf_counter()
        loaded = 0
        for _ in range(spec["repeat"]):
            match = client.match_prefix(space, tokens)
            loaded += client.load(space, match, out=out).bytes_loaded
        seconds = time.perf_counter() - started
        usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"gb": loaded / 1e9, "seconds": seconds,
                      "cpu_s": usage.ru_utime + usage.ru_stime - cpu0}))  # fmt: skip


if __name__ == "__main__":
    main()
