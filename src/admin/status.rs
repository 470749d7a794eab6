//! `GET /admin/v1/status`: what an operator (and the console's banner) needs to know before
//! trusting what the other routes show — which engine holds memory, whether the store is
//! there and writable, whether memory is degraded for new requests (the memory guard past its
//! high-water mark), and whether receipts are kept. Answered without a store, as the one
//! route that can say why there is none. Names no conversation and no secret.

use serde_json::{Value, json};

use crate::memory_guard;
use crate::state::AppState;

/// The status as JSON.
pub async fn status(state: &AppState) -> Value {
    let reason = state.memory_unready_reason().await;
    let available = reason.is_none();
    let guard = &state.memory_guard;
    let high_water = guard.budget().high_water;
    let resident = guard.resident_bytes();
    let pressed = memory_guard::decide(high_water, resident, guard.reserved_bytes(), 0).is_err();
    let memory = if !available {
        "unavailable"
    } else if pressed {
        "degraded"
    } else {
        "on"
    };
    json!({
        "version": env!("CARGO_PKG_VERSION"),
        "storage": state.config.backend.name(),
        "store": {"available": available, "reason": reason},
        "memory": memory,
        "memory_guard": {
            "resident_bytes": resident,
            "high_water_bytes": high_water,
        },
        "receipts": {
            "enabled": state.receipts.enabled(),
            "retention_seconds": state.config.receipts.retention.as_secs(),
        },
    })
}
