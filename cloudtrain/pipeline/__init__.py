"""The data path, one module per arrow: plan -> provision -> bootstrap -> sync -> run
(torchrun) -> logs -> teardown; ``job`` chains them for ``launch``."""
