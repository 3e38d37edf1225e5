"""The start-up memory plan: what each pool takes, including the transient workspace of the largest prefill
chunk, measured by a dry run instead of guessed (FreeToken's #110/#401: an unbudgeted prefill workspace made
the first long request run out of memory). Logged as a table; `/v1/stats`-style numbers for tests.

On CUDA the KV pool gets what is left of ``memory_ratio x free-before-loading`` after the weights, the
recurrent-state pool, the measured workspace and ``--vram-reserve-mb``. On CPU nothing is measured (host memory
has no peak counter worth trusting); the table still says what each pool holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

GiB = 1024**3


@dataclass
class MemoryPlan:
    device: str
    free_before: int  # bytes free before loading
    memory_ratio: float
    weights: int
    state_bytes: int  # the recurrent-state pool (live slots, hybrid radix snapshots, the scratch slot)
    scratch_kv_bytes: int  # KV slots kept for forward_logits and the dry run
    workspace: Optional[int]  # measured peak transient bytes of one prefill chunk (None: not measured)
    workspace_tokens: int
    reserve: int  # --vram-reserve-mb
    # a step that ends many prompts at once samples a row for each: the filtered draw over the whole vocabulary at
    # up to --max-running-requests rows, measured on top of the one-row chunk (None: not measured)
    sampling_workspace: Optional[int] = None
    sampling_rows: int = 0
    kv_tokens: int = 0
    kv_bytes: int = 0
    free_after: Optional[int] = None
    # --moe-backend offload: the GPU expert cache (allocated after the dry run), the prefill stream buffers
    # (part of what loading used) and the banks in host memory (not device memory; listed for the operator)
    expert_slots: int = 0
    expert_cache_bytes: int = 0
    expert_stream_bytes: int = 0
    host_expert_bytes: int = 0
    expert_format: str = ""  # what one offloaded expert is stored as (nvfp4, bfloat16, ...)
    # decode CUDA graphs: planned from a dry decode step (None: no graphs), and the pool measured after capture
    graph_bytes: Optional[int] = None
    graph_pool_bytes: Optional[int] = None
    # hybrid models on CUDA: one sequence's GDN prefill from CUDA graphs (captured before the KV pool is sized)
    gdn_graph_bytes: int = 0
    gdn_graph_sizes: tuple = ()
    # resident MoE blocks on CUDA: prefill-sized steps from CUDA graphs (captured before the KV pool is sized)
    moe_graph_bytes: int = 0
    moe_graph_sizes: tuple = ()
    # hybrid models: live recurrent-state slots and snapshot slots; every model: output-token counts (penalties)
    live_state_slots: int = 0
    snapshot_slots: int = 0
    token_count_bytes: int = 0

    def kv_budget(self, used_by_loading: int) -> int:
        """Bytes left for the KV pool (CUDA): memory_ratio of what was free, minus everything else planned."""
        return int(
            self.memory_ratio * self.free_before
            - used_by_loading
            - self.state_bytes
            - self.token_count_bytes
            - self.scratch_kv_bytes
            - (self.workspace or 0)
            - (self.sampling_workspace or 0)
            - self.reserve
            - self.expert_cache_bytes
            - (self.graph_bytes or 0)
            - self.gdn_graph_bytes
            - self.moe_graph_bytes
        )

    def rows(self) -> list[tuple[str, str]]:
        def g(b: Optional[int]) -> str:
            return "not measured" if b is None else f"{b / GiB:.2f} GiB"

        offload = []
        if self.host_expert_bytes:
            offload = [
                (f"routed experts in host memory, {self.expert_format} (not device)", g(self.host_expert_bytes)),
                (f"expert cache ({self.expert_slots} slots)", g(self.expert_cache_bytes)),
                ("prefill expert stream buffers", g(self.expert_stream_bytes)),
            ]
        return [
            ("free before loading", g(self.free_before)),
            ("weights" + (" (without routed experts)" if offload else ""), g(self.weights)),
            *offload,
            (f"KV cache ({self.kv_tokens} tokens)", g(self.kv_bytes)),
            ("KV scratch (dry run, logits)", g(self.scratch_kv_bytes)),
            *(
                [
                    (
                        f"recurrent state ({self.live_state_slots} live + {self.snapshot_slots} snapshot slots)",
                        g(self.state_bytes),
                    )
                ]
                if self.state_bytes
                else []
            ),
            ("output token counts (penalties)", g(self.token_count_bytes)),
            (f"prefill workspace ({self.workspace_tokens}-token chunk)", g(self.workspace)),
            *(
                [(f"sampling workspace ({self.sampling_rows} rows)", g(self.sampling_workspace))]
                if self.sampling_rows
                else []
            ),
            *(
                [("decode CUDA graphs (planned / captured)", f"{g(self.graph_bytes)} / {g(self.graph_pool_bytes)}")]
                if self.graph_bytes is not None or self.graph_pool_bytes is not None
                else []
            ),
            *(
                [(f"GDN prefill CUDA graphs (up to {self.gdn_graph_sizes[-1]} tokens)", g(self.gdn_graph_bytes))]
                if self.gdn_graph_sizes
                else []
            ),
            *(
                [(f"MoE prefill CUDA graphs (up to {self.moe_graph_sizes[-1]} tokens)", g(self.moe_graph_bytes))]
                if self.moe_graph_sizes
                else []
            ),
            ("reserve (--vram-reserve-mb)", g(self.reserve)),
            (f"headroom (1 - memory_ratio {self.memory_ratio:g})", g(int((1 - self.memory_ratio) * self.free_before))),
            ("free after initialization", g(self.free_after)),
        ]

    def table(self) -> str:
        rows = self.rows()
        width = max(len(k) for k, _ in rows)
        lines = [f"Memory plan ({self.device}):"] + [f"  {k:<{width}}  {v:>14}" for k, v in rows]
        return "\n".join(lines)

    @property
    def step_workspace(self) -> Optional[int]:
        """The transient bytes a step may use: the chunk's workspace plus the sampling of many rows."""
        if self.workspace is None:
            return None
        return self.workspace + (self.sampling_workspace or 0)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


def measure_peak_bytes(device: torch.device, run: Callable[[], None], reserved: bool = False) -> Optional[int]:
    """Peak bytes allocated by ``run`` above what was allocated before it (CUDA only; None elsewhere). With
    ``reserved``, the allocator segments ``run`` needs when it allocates from a fresh private pool (a
    ``torch.cuda.MemPool``): what the CUDA graphs' private pool grows to, where every allocation of 1-10 MB takes a
    20 MiB segment and small ones 2 MiB blocks, none shared with memory allocated before (the graphs' pool measured
    ~2x the allocated peak on the H200)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    if reserved:
        before = torch.cuda.memory_reserved(device)
        pool = torch.cuda.MemPool()
        # use_mem_pool wants an indexed device; "cuda" alone raises
        index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.cuda.use_mem_pool(pool, index):
            run()
        torch.cuda.synchronize(device)
        grown = torch.cuda.memory_reserved(device) - before  # a pool keeps its segments until it is released
        del pool
        torch.cuda.empty_cache()
        return max(0, grown)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - base)
