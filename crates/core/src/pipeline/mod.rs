//! The memory pipeline, one stage per file, with nothing of HTTP: the edge (`memproxy::proxy`)
//! reads the request, calls [`plan::plan`] before forwarding and [`commit::Exchange::commit`]
//! after. [`plan::plan`] runs the stages in order under the conversation's lock, each file
//! named as the stage's function there:
//!
//! 1. [`reconcile`] — which of the request's messages are new;
//! 2. [`window`] — the recent window; [`summarized`] — the summary slot of the prompt, and a
//!    new summary when due; [`recalled`] — relevant older turns; [`budget`] — the token budget;
//! 3. [`assemble`] — the forwarded `messages`;
//! 4. [`commit`] — new messages and the reply, stored atomically and durably.
//!
//! [`catch_up`] brings a cached conversation to the stored version when other replicas share
//! the store (before planning, and after a commit found it stale).
//!
//! Invariant: a memory failure never fails the chat request. Every function here returns a
//! typed error; the edge decides what the client sees (the request goes upstream with its own
//! messages and `X-Memory-Status: degraded`).

pub mod assemble;
pub mod budget;
pub mod catch_up;
pub mod commit;
pub mod plan;
pub mod recalled;
pub mod reconcile;
pub mod summarized;
pub mod window;

/// What a panic caught in the pipeline said (a plan or a commit made where its request
/// arrived, under `catch_unwind`), for the error that stands in for it.
pub fn panic_said(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("no message")
}

#[cfg(test)]
mod tests {
    use super::panic_said;

    #[test]
    fn a_caught_panic_says_its_message_or_that_it_had_none() {
        let caught = |f: fn()| std::panic::catch_unwind(f).unwrap_err();
        assert_eq!(
            panic_said(caught(|| panic!("a static message")).as_ref()),
            "a static message"
        );
        assert_eq!(
            panic_said(caught(|| panic!("made {}", 2)).as_ref()),
            "made 2"
        );
        assert_eq!(
            panic_said(caught(|| std::panic::panic_any(7)).as_ref()),
            "no message"
        );
    }
}
