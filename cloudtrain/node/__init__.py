"""Code that runs on the nodes (standard library only)."""
