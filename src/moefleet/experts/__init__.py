"""Seam 1, the expert stack: everything that computes a layer's routed experts.

An ``ExpertFn(layer, x_ND, ids_NK, w_NK) -> y_ND`` (:mod:`moefleet.models.base`) is what the
adapter's one layer loop calls. Every system is a composition of the pieces here:

- :mod:`.kernels`: the in-process kernels (loop, stacked; fused on GPUs);
- :mod:`.split`: Remoe's split between the main function's local experts and remote ones;
- :mod:`.brownout`: BrownoutServe's routing to united experts around any inner ExpertFn;
- :mod:`.retry`: retries of transient failures (outermost);
- :mod:`.faults`: emulated fault injection at the seam;
- :mod:`.remote`: remote dispatch to expert functions with a layer's scatter-gather method.

:mod:`.stack` holds the base class every piece derives from; :func:`.nest.compose` nests
the pieces in their one order.
"""
