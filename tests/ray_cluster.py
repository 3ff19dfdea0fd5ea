"""One local Ray cluster for a Ray test module: 127.0.0.1 only, its own short temp dir, no auth, no dashboard.

`local_cluster(...)` starts a head node (and any extra nodes, e.g. a second simulated machine with its own
custom resource), connects this process to it, and on exit disconnects, stops exactly these nodes (never
`ray stop`: other Ray clusters on the machine live on) and removes the temp dir; the environment variables it
set are restored. A module fixture wraps it:

    @pytest.fixture(scope="module")
    def cluster():
        with local_cluster(num_cpus=4) as c:
            yield c

Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when it is imported: a test module sets it to "0" before its first
`import ray` (as `jaxserve.runtime.ray_backend.deployment.loopback_only` does after it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

# what each cluster sets (and restores): a short socket dir (paths must stay under 108 characters), loopback
# binding, no token auth (the local nodes and this driver are one test)
_ENV = ("RAY_TMPDIR", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE")


@contextlib.contextmanager
def local_cluster(
    num_cpus: int,
    *,
    resources: Mapping[str, float] | None = None,
    extra_nodes: Sequence[Mapping[str, Any]] = (),
    prefix: str = "rt",
) -> Iterator[Any]:
    """A head node with `num_cpus` (and custom `resources`) plus one node per `extra_nodes` entry (the keyword
    arguments of `Cluster.add_node`, bound to 127.0.0.1); yields the `ray.cluster_utils.Cluster`."""
    import ray
    from ray.cluster_utils import Cluster

    from jaxserve.runtime.ray_backend.deployment import loopback_only

    root = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    saved = {k: os.environ.get(k) for k in _ENV}
    os.environ.update(RAY_TMPDIR=root, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled")
    loopback_only()
    ray_dir = os.path.join(root, "ray")
    os.makedirs(ray_dir)
    head: dict[str, Any] = {
        "num_cpus": num_cpus, "node_ip_address": "127.0.0.1", "include_dashboard": False, "temp_dir": ray_dir,
    }  # fmt: skip
    if resources:
        head["resources"] = dict(resources)
    c = Cluster(initialize_head=True, head_node_args=head)
    try:
        for node in extra_nodes:
            c.add_node(**{"node_ip_address": "127.0.0.1", **node})
        ray.init(address=c.address, _node_ip_address="127.0.0.1", log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        shutil.rmtree(root, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
