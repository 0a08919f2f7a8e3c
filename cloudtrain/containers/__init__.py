"""Containers as the runtime (docs/containers.md): the task's ``container:`` section, the image
on every node (pulled with progress, its digest recorded), one long-lived container per node,
and the job run in it with ``docker exec`` from the host, so the host's guard, queue, logs and
stop work unchanged."""
