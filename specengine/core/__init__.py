"""Engine core: the persistent device-side batch, host↔device transfers and the static
(CUDA-graph) verify pass. See ``docs/design.md`` for how a decode step uses them."""
