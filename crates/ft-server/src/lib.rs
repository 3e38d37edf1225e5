//! ft-server: everything between the socket and the engine thread.

pub mod backend;
