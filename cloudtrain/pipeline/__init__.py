"""The data path, one module per arrow, each callable alone: plan -> provision -> bootstrap ->
sync -> run (torchrun; the fan-out to every node in remote_job) -> logs -> teardown. ``job``
chains them for ``up`` and ``launch``; ``signals`` is how a command stops (Ctrl-C, SIGTERM,
SIGHUP) and what no signal may cut off half-way."""
