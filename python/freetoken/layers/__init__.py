"""Building blocks shared by the models: attention over the paged KV pool, norms, rotary embeddings, MoE,
Gated DeltaNet, sampling."""
