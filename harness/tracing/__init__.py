"""Tracing: a model and its loss into the graph IR every strategy reads. ``trace`` is the entry point; ``tracer``
records the program at layer granularity, ``attention`` traces attention as the device runs it, ``probe`` runs the
program on meta and groups layers by the storage they write, ``backward_profile`` measures the backward and the
loss, ``cost_models`` weighs each layer, ``state`` finds the state a layer writes, and ``traced`` holds the
record the executor runs."""
