"""cloudtrain's built-in providers. Each registers through the ``cloudtrain.providers``
entry-point group, the same door a third-party provider uses."""
