"""The engine description: what the worker tells the Rust side about the loaded model, once, at start-up.

Every fact the server needs about the model and the pools comes from here and nowhere else (the Rust side is
``EngineDescription`` in crates/ft-server/src/backend.rs, which reads every key strictly: a missing or mistyped key
is a start-up error, never a silent default). It is versioned with the step contract (``STEP_CONTRACT_VERSION``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from .step_plan import STEP_CONTRACT_VERSION


@dataclass
class EngineDescription:
    served_model_name: str  # the id /v1/models lists
    model_aliases: list[str]  # other names requests may use (--served-model-name's further entries, `demo`)
    architecture: str
    max_context: int  # longest sequence (prompt + output) the engine runs
    vocab_size: int  # embedding rows: token ids at or past it are refused
    kv_capacity_tokens: int  # KV slots the scheduler owns
    num_state_slots: int  # recurrent-state slots the scheduler owns (0: not a hybrid model) ...
    num_snapshot_slots: int  # ... of which this many may hold prefix-cache snapshots (hybrid_radix)
    cache_types: list[str]  # prefix caches the model supports: `radix` (KV alone) or `hybrid_radix`, and `naive`
    tokenizer_path: str  # a tokenizer.json the HF `tokenizers` crate loads
    chat_template: Optional[str]
    bos_token: Optional[str]
    eos_token: Optional[str]
    bos_token_id: Optional[int]
    eos_token_ids: list[int]  # ids that end a turn
    tool_call_token_id: Optional[int]  # `<tool_call>`, where --enable-special-token-ckpt snapshots
    add_bos_token: bool  # raw completion prompts get BOS prepended
    planned_workspace_bytes: Optional[int]  # the memory plan's prefill workspace (CUDA)
    cuda_graph_sizes: list[int]  # decode batch sizes replayed from CUDA graphs
    dtype: str
    device: str
    # sampling defaults of the model's generation_config.json (temperature, top_p, top_k, min_p, ...)
    generation_config: dict = field(default_factory=dict)
    step_contract_version: int = STEP_CONTRACT_VERSION

    def to_dict(self) -> dict:
        return asdict(self)
