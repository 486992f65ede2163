"""A local Ray cluster for tests/test_ray.py: started here, stopped when stdin closes.

Usage: ``ray_head.py NUM_CPUS``. Prints ``address <GCS address>`` once the cluster is up, then
waits for stdin to close (the test session's end) and shuts the cluster down, which stops the
processes Ray started. It listens on 127.0.0.1 only.
"""

from __future__ import annotations

import sys

import ray

if __name__ == "__main__":
    context = ray.init(
        num_cpus=int(sys.argv[1]), include_dashboard=False, _node_ip_address="127.0.0.1"
    )
    print("address", context.address_info["gcs_address"], flush=True)
    sys.stdin.read()
    ray.shutdown()
