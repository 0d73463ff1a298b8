"""Hybrid dense/sparse store: node-shared embedding tables with frequency-averaged sync."""

from lightning_hier.sparse.embedding import HybridEmbedding
from lightning_hier.sparse.table_file import TableFileError, map_table, read_header, save_table

__all__ = ["HybridEmbedding", "TableFileError", "map_table", "read_header", "save_table"]
