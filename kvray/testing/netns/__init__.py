"""A Ray cluster of several "hosts" on one machine, each in its own network namespace.

Each node is a network namespace (own IP on a private test subnet, joined by veth pairs to
a bridge the harness creates), its own PID namespace (so ``ray stop`` or a crash there
touches only that node's processes, and killing the namespace's init kills the whole
"host"), its own UTS namespace (own hostname, which — as on Debian — resolves to
``127.0.1.1`` through the node's private ``/etc/hosts``) and its own mount namespace with a
private ``/tmp``, ``/dev/shm`` and ``$HOME``. Ray, gloo and the object store therefore talk
over a network between processes that cannot see each other's files. One directory,
:attr:`NetnsCluster.shared`, is visible to every node (as an NFS mount would be): put the
model there.

The subnet is ``10.213.7.0/24`` unless ``KVRAY_NETNS_SUBNET`` names another ``/24`` prefix
(``10.213.7``): the bridge is ``.1`` (the host's address on it), node ``i`` is ``.(10+i)``.
The namespaces get no default route, so nothing but these addresses and loopback can be
reached from a node; :meth:`NetnsCluster.routes` lets a test check it.

Needs root, ``ip`` (iproute2), ``unshare`` and ``nsenter`` (util-linux). Used by the tests
(``tests/test_multinode.py``, ``tests/test_ray_up.py``) and by hand::

    sudo python -m kvray.testing.netns up --nodes 3     # prints the head address; Ctrl-C ends it
    sudo python -m kvray.testing.netns cleanup          # removes what a killed run left behind

Teardown kills every node, deletes the namespaces, links and bridge and the directories,
even when a test fails; :meth:`NetnsCluster.leftovers` lists anything that survived.

It ships inside the package, like ``ray.cluster_utils``, rather than under ``tests/``: each
node's init is this package run again (``python -m kvray.testing.netns init``) by the
interpreter the nodes share, and the by-hand tool must work from an installed kvray.
:mod:`.cluster` holds the cluster, :mod:`.node_init` the node's PID 1, :mod:`.host` the host
checks and stale-run cleanup, :mod:`.ssh` sshd for ``ray up``.
"""

from kvray.testing.netns.cluster import FAST_HEALTH_CHECKS, RAY_PORT, NetnsCluster, Node
from kvray.testing.netns.host import DEFAULT_SUBNET, available, cleanup_stale

__all__ = ["DEFAULT_SUBNET", "FAST_HEALTH_CHECKS", "RAY_PORT", "NetnsCluster", "Node",
           "available", "cleanup_stale"]
