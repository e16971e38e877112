//! Balanced entity sharding (BESS) for knowledge-graph embeddings on SparseCores.
