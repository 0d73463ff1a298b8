"""Pipeline parallelism: trace a model into clusters, split them into stages, schedule micro-batches."""
