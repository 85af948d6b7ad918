"""Entry point of one I/O worker process: ``python -m kvcache.client.pool_worker FD``.

:class:`kvcache.client.pool.ClientPool` starts it with one end of a socket pair
as ``FD``, sends the client configuration, and then requests.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import sys

from kvcache.client.pool import worker_main

if __name__ == "__main__":
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    conn = multiprocessing.connection.Connection(int(sys.argv[1]))
    worker_main(conn, conn.recv())
