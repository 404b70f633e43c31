//! The engine's KV connector: finds, loads and saves KV blocks in the
//! warehouse.

mod spec;

pub use spec::{SpecError, WarehouseSpec};
