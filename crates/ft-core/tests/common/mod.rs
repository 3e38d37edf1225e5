//! Shared test support: the KV cache reference model and the fake worker for scheduler runs.
#![allow(dead_code)]

pub mod kv_model;
pub mod sim;
