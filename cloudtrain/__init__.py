"""cloudtrain: from a laptop to N rented GPU machines and back.

Kept import-light on purpose: ``cloudtrain --help`` must start fast and import no cloud SDK.
"""

__version__ = "0.1.0"
