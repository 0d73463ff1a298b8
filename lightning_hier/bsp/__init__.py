"""Bulk-synchronous parameter server with asynchronous workers (no Lightning here).

Entry point: :class:`lightning_hier.bsp.engine.BSPEngine`, which the ``hier_bsp`` strategy drives.
Each worker folds every micro-step's gradient into an aggregate (:mod:`.aggregate`) held, with the
newest model, in its shared-memory module (:mod:`.shared_memory`); its local BSP module
(:mod:`.local_module`, a background thread) ticks with the others, follows the central controller's
decisions (:mod:`.controller`, global rank 0) and at each superstep pushes the aggregate to the
parameter server sharded over all ranks (:mod:`.server`, ``hier_sliced``'s slicing and sharded
optimizer) and pulls the new model. Settings: :mod:`.settings`.
"""
