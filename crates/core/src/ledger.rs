//! The token ledger's background side: the tokens memproxy's own model calls (summaries, memory
//! extraction) spend on behalf of each conversation and each agent, and the daily budget per
//! agent (`compression.max_tokens_per_day`, `[agents.NAME] compression_max_tokens_per_day`)
//! that stops them for the rest of the UTC day once it is spent.
//!
//! Agents are counted under a closed set of labels: the agents named in the config, and
//! `other` for every other agent (which share one budget). The day's spend is counted per
//! replica, in memory: with several replicas each spends up to the budget, and a restart
//! starts the day's count again.
//!
//! What a conversation spent is added to its ledger in the store by its next commit
//! (`pipeline/commit.rs` takes it with [`Ledger::take_pending`]): a conversation that never
//! commits again, or a restart before it does, loses that part.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::BackgroundBudget;
use memproxy_base::identity::ConversationKey;

/// The label of every agent the config does not name.
pub const OTHER_AGENT: &str = "other";

/// Conversations whose background spend waits for their next commit, at most; past it the
/// newest spend of a conversation not already waiting is counted in metrics only.
const MAX_PENDING: usize = 100_000;

const DAY_MS: i64 = 86_400_000;

/// A background task that spends tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    Summary,
    Extraction,
}

impl Task {
    pub const ALL: [Task; 2] = [Task::Summary, Task::Extraction];

    pub fn as_str(self) -> &'static str {
        match self {
            Task::Summary => "summary",
            Task::Extraction => "extraction",
        }
    }
}

/// One agent label's counters.
#[derive(Debug, Default)]
pub struct AgentCounters {
    /// Tokens spent, by task (prompt and completion).
    pub summary_tokens: AtomicU64,
    pub extraction_tokens: AtomicU64,
    /// Background calls not made because the day's budget was spent, by task.
    pub summary_skipped: AtomicU64,
    pub extraction_skipped: AtomicU64,
}

impl AgentCounters {
    fn tokens(&self, task: Task) -> &AtomicU64 {
        match task {
            Task::Summary => &self.summary_tokens,
            Task::Extraction => &self.extraction_tokens,
        }
    }

    fn skipped(&self, task: Task) -> &AtomicU64 {
        match task {
            Task::Summary => &self.summary_skipped,
            Task::Extraction => &self.extraction_skipped,
        }
    }
}

/// The background ledger of one process.
#[derive(Debug)]
pub struct Ledger {
    budget: BackgroundBudget,
    /// One entry per label: the named agents and `other`.
    counters: BTreeMap<String, AgentCounters>,
    /// Per label: the UTC day (days since the epoch) and what it spent so far.
    days: Mutex<HashMap<String, (i64, u64)>>,
    /// Background tokens per conversation not yet added to its stored ledger.
    pending: Mutex<HashMap<ConversationKey, u64>>,
}

fn guard<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Ledger {
    pub fn new(budget: BackgroundBudget) -> Ledger {
        let mut counters: BTreeMap<String, AgentCounters> = budget
            .agents
            .keys()
            .map(|name| (name.clone(), AgentCounters::default()))
            .collect();
        counters.insert(OTHER_AGENT.to_string(), AgentCounters::default());
        Ledger {
            budget,
            counters,
            days: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
        }
    }

    /// The label `agent` is counted under.
    pub fn label<'a>(&'a self, agent: &str) -> &'a str {
        self.counters
            .get_key_value(agent)
            .map_or(OTHER_AGENT, |(name, _)| name.as_str())
    }

    /// The labels, in order.
    pub fn labels(&self) -> impl Iterator<Item = (&str, &AgentCounters)> {
        self.counters.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// True when `agent` may make a background call of `task` now (`now_ms`: UTC); false once
    /// its label's budget for the day is spent, and then the call not made is counted.
    pub fn allow(&self, agent: &str, task: Task, now_ms: i64) -> bool {
        let (spent, Some(limit)) = self.today(agent, now_ms) else {
            return true;
        };
        if spent < limit {
            return true;
        }
        if let Some(counters) = self.counters.get(self.label(agent)) {
            counters.skipped(task).fetch_add(1, Ordering::Relaxed);
        }
        false
    }

    /// Records `tokens` spent by `task` on behalf of `key` at `now_ms`.
    pub fn spent(&self, key: &ConversationKey, task: Task, tokens: u64, now_ms: i64) {
        let label = self.label(&key.agent);
        if let Some(counters) = self.counters.get(label) {
            counters.tokens(task).fetch_add(tokens, Ordering::Relaxed);
        }
        let day = now_ms.div_euclid(DAY_MS);
        {
            let mut days = guard(&self.days);
            let entry = days.entry(label.to_string()).or_insert((day, 0));
            if entry.0 != day {
                *entry = (day, 0);
            }
            entry.1 += tokens;
        }
        let mut pending = guard(&self.pending);
        if pending.len() < MAX_PENDING || pending.contains_key(key) {
            *pending.entry(key.clone()).or_default() += tokens;
        }
    }

    /// Takes the background tokens spent for `key` since its last commit.
    pub fn take_pending(&self, key: &ConversationKey) -> u64 {
        guard(&self.pending).remove(key).unwrap_or(0)
    }

    /// Puts back what [`Ledger::take_pending`] took, when the commit did not store it.
    pub fn give_back(&self, key: &ConversationKey, tokens: u64) {
        if tokens > 0 {
            *guard(&self.pending).entry(key.clone()).or_default() += tokens;
        }
    }

    /// Forgets what `key` spent and was not committed (the conversation was deleted).
    pub fn forget(&self, key: &ConversationKey) {
        guard(&self.pending).remove(key);
    }

    /// What `agent`'s label spent today so far, and its budget.
    pub fn today(&self, agent: &str, now_ms: i64) -> (u64, Option<u64>) {
        let label = self.label(agent);
        let day = now_ms.div_euclid(DAY_MS);
        let spent = match guard(&self.days).get(label) {
            Some((d, spent)) if *d == day => *spent,
            _ => 0,
        };
        (spent, self.budget.limit(label))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memproxy_base::identity::TenantId;

    fn key(agent: &str) -> ConversationKey {
        ConversationKey {
            tenant: TenantId::from_token(Some("t")),
            agent: agent.to_string(),
            conversation: "c".to_string(),
        }
    }

    #[test]
    fn a_spent_budget_stops_background_calls_until_the_next_utc_day() {
        let budget = BackgroundBudget {
            default: Some(100),
            agents: BTreeMap::from([
                ("support".to_string(), Some(10)),
                ("free".to_string(), None),
            ]),
        };
        let ledger = Ledger::new(budget);
        let noon = 20_000 * DAY_MS + DAY_MS / 2;
        assert!(ledger.allow("support", Task::Summary, noon));
        ledger.spent(&key("support"), Task::Summary, 10, noon);
        assert!(!ledger.allow("support", Task::Summary, noon + 1));
        assert!(!ledger.allow("support", Task::Extraction, noon + 2));
        let counters = &ledger.counters["support"];
        assert_eq!(counters.summary_skipped.load(Ordering::Relaxed), 1);
        assert_eq!(counters.extraction_skipped.load(Ordering::Relaxed), 1);
        // The next UTC day starts afresh.
        assert!(ledger.allow("support", Task::Summary, noon + DAY_MS / 2));
        // An agent with no limit, and unnamed agents sharing `other`'s.
        ledger.spent(&key("free"), Task::Summary, 1_000, noon);
        assert!(ledger.allow("free", Task::Summary, noon));
        ledger.spent(&key("a"), Task::Extraction, 60, noon);
        ledger.spent(&key("b"), Task::Extraction, 40, noon);
        assert!(!ledger.allow("c", Task::Summary, noon));
        assert_eq!(ledger.label("c"), OTHER_AGENT);
        assert_eq!(ledger.today("zzz", noon), (100, Some(100)));
        // What a conversation spent waits for its next commit, once.
        assert_eq!(ledger.take_pending(&key("a")), 60);
        assert_eq!(ledger.take_pending(&key("a")), 0);
    }
}
