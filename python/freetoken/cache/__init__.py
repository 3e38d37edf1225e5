"""Device memory the Rust side hands out by index: the paged KV pool, the page table, recurrent-state slots."""
