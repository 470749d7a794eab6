//! memproxy's vocabulary, the leaves every other layer reads: the one message model
//! ([`message`]), who a request belongs to ([`identity`]), the three request formats memory
//! serves read into and written from it ([`wire`]), token counts ([`tokens`]), the model-call
//! trait ([`model`]), what cached values really take ([`heap`]) and the caches that give memory
//! back under pressure ([`cache`]). Nothing here knows of
//! storage, memory or HTTP.

pub mod cache;
pub mod heap;
pub mod identity;
pub mod message;
pub mod model;
pub mod tokens;
pub mod wire;
