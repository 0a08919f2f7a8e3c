"""The ``local`` provider: N nodes on this machine, each a real OpenSSH ``sshd``.

Two network modes:

``loopback`` (default)
    Each node listens on its own 127.x.y.z address and port; nodes share this machine's
    network stack (the interface carrying their address is ``lo``).
``netns`` (root and ``ip netns`` needed)
    Each node lives in its own network namespace with its own address on a bridge cloudtrain
    creates, so multi-node networking behaves as on separate machines.

The nodes' files live under ``$CLOUDTRAIN_HOME/clusters/<name>/nodes/<rank>``. ``terminate``
stops every process started through the nodes' sshd (found by a marker variable that sshd
puts in each session's environment), removes namespaces, veths, the bridge and the node
directories, then checks that nothing is left.
"""

from __future__ import annotations

from .provider import LocalOptions, LocalProvider

__all__ = ["LocalOptions", "LocalProvider"]
