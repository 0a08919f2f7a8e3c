"""GPU offers and prices (see model.py for the records)."""
