"""Hybrid dense/sparse store: node-shared embedding tables with frequency-averaged sync.

Entry point: :class:`lightning_hier.sparse.embedding.HybridEmbedding`, a drop-in for
``nn.Embedding`` / ``nn.EmbeddingBag`` inside a LightningModule. Tables live once per node in
shared memory (:mod:`.shared_store`, :mod:`.table_file`, hashed ids in :mod:`.id_index`), per-id
gradients are frequency-averaged hierarchically (:mod:`.sync`), one process per node applies the
row-wise optimizer (:mod:`.row_optim`), and tables are checkpointed beside the ``.ckpt``
(:mod:`.checkpoint`). A strategy drives all of a model's tables through
:class:`.node_tables.NodeTables`. No Lightning here.
"""

from lightning_hier.sparse.embedding import HybridEmbedding
from lightning_hier.sparse.table_file import TableFileError, map_table, read_header, save_table

__all__ = ["HybridEmbedding", "TableFileError", "map_table", "read_header", "save_table"]
