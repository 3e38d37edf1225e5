//! Shared test support: the KV cache and hybrid cache reference models and the fake worker for scheduler
//! runs.
#![allow(dead_code)]

pub mod hybrid_model;
pub mod kv_model;
pub mod sim;
