//! ft-core: FreeToken's pure logic. Requests and their lifecycle, the scheduler that turns them into step
//! plans, the radix prefix cache and the slot allocators behind it. No I/O, no threads, no Python: every
//! piece is driven by explicit calls and tested to exhaustion with `cargo test`.

pub mod allocator;
pub mod config;
pub mod radix;
pub mod request;
pub mod scheduler;
pub mod step;
