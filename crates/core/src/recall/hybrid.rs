//! Hybrid recall: each older turn scored by its words (BM25, `index.rs`) and by its meaning
//! (the cosine of its vector with the new message's, `vectors.rs`), the two fused into one
//! score on an absolute scale, so that a floor can tell "nothing here answers this" from "this
//! is the best of a poor lot"; candidates are ranked on each score's range among them
//! (min-max), as the two scales spread differently from query to query.
//!
//! - lexical: the turn's BM25 score over the query's weight (every distinct query term matched
//!   once in a turn of average length; a query word the conversation never used counts
//!   against every turn): 1 or more when the turn holds the whole question, capped at 1 in
//!   the fused score;
//! - semantic, in 0..1: the cosine, each turn's mixed with its neighbours' (a question and its
//!   answer describe each other; images and short replies carry their context), as BM25's
//!   documents carry their neighbours' words;
//! - fused = `lexical_weight` × lexical + (1 − `lexical_weight`) × semantic. A turn without a
//!   vector yet (a model's or the provider's, made after its commit off the request path) is
//!   fused from its words alone, at the lexical weight;
//! - with vectors and `relevance_feedback`, the fusion runs twice: the second time with the
//!   query's vector moved towards the vectors of the first's best turns ([`feedback`]);
//! - a question that names a period ("in July 2022", "last week": `when.rs`) adds
//!   [`TIME_BONUS`] to the scores of the turns stored in it.

use super::index::Hit;

/// Weights of a turn's own similarity and of its neighbours' one and two places away (the
/// proportions of BM25's neighbour terms, `index.rs`).
const SMOOTHING: [f32; 3] = [1.0, 0.75, 0.375];

/// How the two scores are fused.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fusion {
    /// The share of the lexical score, 0..1.
    pub lexical_weight: f32,
    /// Turns whose fused score is below this are not recalled (0: none is dropped). Applies
    /// when vectors take part: by words alone, every turn that shares a word competes.
    pub floor: f32,
    /// Turns whose fused score is below this share of the best candidate's are not recalled
    /// either (0: none is dropped); when vectors take part, as `floor`.
    pub relative_floor: f32,
    /// Score the turns a second time with the query's vector moved towards the best turns'
    /// ([`feedback`]; `relevance_feedback`).
    pub feedback: bool,
}

impl Default for Fusion {
    fn default() -> Fusion {
        Fusion {
            lexical_weight: DEFAULT_LEXICAL_WEIGHT,
            floor: 0.0,
            relative_floor: 0.0,
            feedback: false,
        }
    }
}

/// The lexical share when vectors take part: measured on LoCoMo's dev file with the static
/// embedder, 0.3 → 0.774, 0.5 → 0.800, 0.7 → 0.817 recall_any@10 (words alone 0.812).
pub const DEFAULT_LEXICAL_WEIGHT: f32 = 0.7;

/// What a turn stored in the period the question names (`when.rs`) adds to its ranking score
/// (each part min-max scaled to 0..1 among the candidates, so a fifth of the range) and to its
/// fused score: enough to lift a turn of that time over better worded ones of other times,
/// not enough to bring one in that shares nothing with the question.
pub const TIME_BONUS: f32 = 0.2;

/// Feedback (`relevance_feedback`, off by default): the query's vector is moved towards the
/// vectors of the turns the first fusion ranked best, and the turns are scored again
/// (pseudo-relevance feedback, Rocchio's): what the question means is often said better by the
/// turns it found than by its own few words. The second pass costs as much as the first:
/// about 0.1 ms at 10,000 stored messages with the static table (loadbench, p50 2,081 against
/// 2,000 µs; 0.9 ms before the scoring's SIMD products), little next to the full model's
/// 1.5–3 ms question. This many turns…
pub const FEEDBACK_TURNS: usize = 3;
/// …weigh this much, together, against the query's own vector. Measured on LoCoMo's dev file:
/// recall_any@10 +0.004 with the static table and with the full model, the same at weights
/// 0.3 to 1.5 and with 1 to 5 turns.
pub const FEEDBACK_WEIGHT: f32 = 0.7;

/// The query's vector moved towards `rows` (the best turns' vectors): `query` +
/// [`FEEDBACK_WEIGHT`] × their mean, L2 normalised. `None` when there is no row.
pub fn feedback(query: &[f32], rows: &[Vec<f32>]) -> Option<Vec<f32>> {
    let rows: Vec<&Vec<f32>> = rows.iter().filter(|r| r.len() == query.len()).collect();
    if rows.is_empty() {
        return None;
    }
    let share = FEEDBACK_WEIGHT / rows.len() as f32;
    let mut moved = query.to_vec();
    for row in rows {
        for (m, r) in moved.iter_mut().zip(row) {
            *m += share * r;
        }
    }
    let norm = moved.iter().map(|x| x * x).sum::<f32>().sqrt();
    (norm > 0.0).then(|| moved.iter().map(|x| x / norm).collect())
}

/// Runs `ranked` (a [`fuse`] over one set of candidates, given the meaning's similarities and
/// how many turns to keep) once, and with `fusion.feedback` a second time, after `moved` has
/// replaced the similarities with those of the query moved towards the first run's best turns
/// ([`feedback`]; `None`: no vector to move towards, and they are left as they were). The
/// first run keeps at least [`FEEDBACK_TURNS`] for that. The best `k`, best first, and those
/// under the floor.
pub fn fuse_with_feedback(
    semantic: Option<&mut Vec<(u64, f32)>>,
    fusion: Fusion,
    k: usize,
    ranked: impl Fn(Option<&[(u64, f32)]>, usize) -> (Vec<Scored>, Vec<Scored>),
    moved: impl FnOnce(&[Scored], &mut Vec<(u64, f32)>) -> Option<()>,
) -> (Vec<Scored>, Vec<Scored>) {
    let Some(semantic) = semantic else {
        return ranked(None, k);
    };
    if !fusion.feedback {
        return ranked(Some(semantic), k);
    }
    let (mut hits, under_floor) = ranked(Some(semantic), k.max(FEEDBACK_TURNS));
    if moved(&hits, semantic).is_some() {
        return ranked(Some(semantic), k);
    }
    hits.truncate(k);
    (hits, under_floor)
}

/// The default relevance floor, chosen on the project's own paraphrase set
/// (`tests/it/recall_meaning.rs`, the static embedder): a turn found by meaning alone needs a
/// cosine of about 0.17 at the default weights (paraphrased facts scored 0.17–0.42 there,
/// turns unrelated to the question 0.10–0.15); one that shares a word with the question
/// passes.
pub const DEFAULT_FLOOR: f32 = 0.05;

/// The default relative floor: a turn under two fifths of the best candidate's fused score is
/// left out. Measured on LoCoMo's dev file (static embedder): recall_any@10 0.820 → 0.818,
/// recalled tokens per unanswerable question (category 5) 610.6 → 569.0; at 0.3 / 0.5: 0.818 /
/// 0.817, 600.0 / 525.2 tokens. The tail it cuts is turns that share a word or two with the
/// question where another turn answers it squarely.
pub const DEFAULT_RELATIVE_FLOOR: f32 = 0.4;

/// A turn as hybrid recall scored it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scored {
    pub turn: u64,
    /// The fused score, 0..1.
    pub score: f32,
    /// The lexical score: 0 for no query word, 1 or more for the whole question.
    pub lexical: f32,
    /// The semantic score, 0..1 (`None`: the turn or the query has no vector).
    pub semantic: Option<f32>,
    /// Stored in the period the question names (`when.rs`).
    pub when: bool,
}

/// Mixes each turn's similarity with its neighbours' (by position in `similarities`, which is
/// by turn ascending), as weighted means over the whole reach (a neighbour past either end
/// counts as 0), so no turn scores above the one that made its neighbours score. In place:
/// the turns behind are remembered as they were.
pub fn smooth(similarities: &mut [(u64, f32)]) {
    const REACH: usize = SMOOTHING.len() - 1;
    let n = similarities.len();
    let weights: f32 = SMOOTHING[0] + 2.0 * SMOOTHING[1..].iter().sum::<f32>();
    // The similarities 1, 2, … places behind, before they were mixed.
    let mut behind: [Option<f32>; REACH] = [None; REACH];
    for i in 0..n {
        let own = similarities[i].1;
        let mut sum = SMOOTHING[0] * own;
        for (distance, &w) in SMOOTHING.iter().enumerate().skip(1) {
            if let Some(before) = behind[distance - 1] {
                sum += w * before;
            }
            if i + distance < n {
                sum += w * similarities[i + distance].1;
            }
        }
        similarities[i].1 = sum / weights;
        behind.rotate_right(1);
        behind[0] = Some(own);
    }
}

/// Fuses `lexical` hits (raw BM25 scores; `query_weight` is the query's best possible score)
/// with the smoothed `semantic` similarities (by turn ascending; `None`: no query vector) of
/// the turns `in_pool` accepts: the best `k`, best first, split into those at or above the
/// floor and those under it. A turn with neither a query word nor a vector is never a
/// candidate. `in_period` tells the turns stored in the period the question names (`None`: it
/// names none): they gain [`TIME_BONUS`].
///
/// Every candidate is visited twice and only the best `k` are kept (at most twice `k`, or 64,
/// between selections; every candidate with `k` at 0): a conversation of 10,000 turns is ranked without a list of 10,000
/// (which would be pages of its own, mapped and cleared on every request).
pub fn fuse(
    lexical: &[Hit],
    query_weight: f32,
    semantic: Option<&[(u64, f32)]>,
    in_pool: impl Fn(u64) -> bool,
    in_period: Option<&dyn Fn(u64) -> bool>,
    fusion: Fusion,
    k: usize,
) -> (Vec<Scored>, Vec<Scored>) {
    let w = fusion.lexical_weight.clamp(0.0, 1.0);
    let candidates = Candidates {
        lexical: if semantic.is_none() || lexical.is_sorted_by_key(|h| h.turn) {
            std::borrow::Cow::Borrowed(lexical)
        } else {
            let mut sorted = lexical.to_vec();
            sorted.sort_unstable_by_key(|h| h.turn);
            std::borrow::Cow::Owned(sorted)
        },
        query_weight,
        semantic,
        in_pool,
        in_period,
    };
    // Ranked on each score's range among the candidates (min-max): the two scales differ in
    // spread from query to query, so neither drowns the other; the floor reads the absolute
    // fused score.
    let mut ranges = Ranges::default();
    candidates.visit(|c| ranges.add(&c));
    let keep = if k == 0 { usize::MAX } else { k };
    let mut best = Best {
        keep,
        ranked: Vec::new(),
        worst: None,
    };
    candidates.visit(|c| {
        let candidate = (ranges.rank(&c, w), c);
        if best
            .worst
            .is_none_or(|worst| by_rank(&candidate, &worst).is_le())
        {
            best.push(candidate);
        }
    });
    let mut ranked = best.ranked;
    if ranked.len() > keep {
        ranked.select_nth_unstable_by(keep - 1, by_rank);
        ranked.truncate(keep);
    }
    ranked.sort_by(by_rank);
    // The floors read the fused score: by words alone (no query vector) every turn sharing a
    // word competes, as it always has.
    let ranked: Vec<Scored> = ranked
        .into_iter()
        .map(|(_, c)| c.scored(w, semantic.is_some()))
        .collect();
    let floor = if semantic.is_some() {
        let best = ranked.iter().map(|s| s.score).fold(0.0, f32::max);
        fusion
            .floor
            .max(fusion.relative_floor.clamp(0.0, 1.0) * best)
    } else {
        0.0
    };
    let (kept, under): (Vec<Scored>, Vec<Scored>) = ranked
        .into_iter()
        .partition(|s| s.score >= floor && s.score > 0.0);
    (kept, under)
}

/// Best first: by ranking score, then the newer turn.
fn by_rank(a: &(f32, Found), b: &(f32, Found)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(b.1.turn.cmp(&a.1.turn))
}

/// The best `keep` candidates seen so far, and some more.
struct Best {
    keep: usize,
    ranked: Vec<(f32, Found)>,
    /// The worst of the best `keep` at the last selection: a candidate ranked after it can
    /// never be among the best `keep`, as those only get better.
    worst: Option<(f32, Found)>,
}

impl Best {
    /// Holds `candidate` (not ranked after `worst`). Only the best `keep` are ever used:
    /// whenever twice that many are held, the best half is selected. Out of the walk's loop,
    /// which most candidates leave at the comparison with `worst`.
    #[inline(never)]
    fn push(&mut self, candidate: (f32, Found)) {
        self.ranked.push(candidate);
        let keep = self.keep;
        if self.ranked.len() >= keep.saturating_mul(2).max(64) {
            self.ranked.select_nth_unstable_by(keep - 1, by_rank);
            self.ranked.truncate(keep);
            self.worst = Some(self.ranked[keep - 1]);
        }
    }
}

/// [`fuse`]'s candidates: the inputs that make them, walked as often as needed.
struct Candidates<'a, P> {
    /// By turn ascending when `semantic` is given.
    lexical: std::borrow::Cow<'a, [Hit]>,
    query_weight: f32,
    semantic: Option<&'a [(u64, f32)]>,
    in_pool: P,
    in_period: Option<&'a dyn Fn(u64) -> bool>,
}

impl<P: Fn(u64) -> bool> Candidates<'_, P> {
    /// The turn's BM25 score on the query's scale.
    fn lexical_score(&self, bm25: f32) -> f32 {
        if self.query_weight > 0.0 {
            (bm25 / self.query_weight).max(0.0)
        } else {
            0.0
        }
    }

    /// Calls `visit` with every candidate once: by words alone in `lexical`'s order; with
    /// meaning, the two walked together by turn.
    fn visit(&self, mut visit: impl FnMut(Found)) {
        let mut visit = |mut c: Found| {
            if let Some(in_period) = self.in_period {
                c.when = in_period(c.turn);
            }
            visit(c);
        };
        // By words alone, or a turn whose vector is not made yet.
        let words = |hit: &Hit| Found {
            turn: hit.turn,
            lexical: self.lexical_score(hit.score),
            semantic: None,
            when: false,
        };
        let Some(semantic) = self.semantic else {
            self.lexical.iter().for_each(|hit| visit(words(hit)));
            return;
        };
        let mut next_word = self.lexical.iter().peekable();
        for &(turn, similarity) in semantic {
            let mut lexical = 0.0;
            while let Some(&hit) = next_word.peek() {
                if hit.turn > turn {
                    break;
                }
                if hit.turn == turn {
                    lexical = self.lexical_score(hit.score);
                } else {
                    visit(words(hit));
                }
                next_word.next();
            }
            if !(self.in_pool)(turn) {
                continue;
            }
            visit(Found {
                turn,
                lexical,
                semantic: Some(similarity.clamp(0.0, 1.0)),
                when: false,
            });
        }
        next_word.for_each(|hit| visit(words(hit)));
    }
}

/// A candidate as [`Candidates::visit`] finds it; its fused score is made only for the best.
#[derive(Debug, Clone, Copy)]
struct Found {
    turn: u64,
    lexical: f32,
    semantic: Option<f32>,
    when: bool,
}

impl Found {
    /// As [`Scored`], with the lexical share `w`; `meaning`: the query has a vector.
    fn scored(self, w: f32, meaning: bool) -> Scored {
        let mut score = match self.semantic {
            Some(semantic) => w * self.lexical.min(1.0) + (1.0 - w) * semantic,
            // A turn whose vector is not made yet: its words alone, at their weight.
            None if meaning => w * self.lexical.min(1.0),
            None => self.lexical.min(1.0),
        };
        if self.when {
            score = (score + TIME_BONUS).min(1.0);
        }
        Scored {
            turn: self.turn,
            score,
            lexical: self.lexical,
            semantic: self.semantic,
            when: self.when,
        }
    }
}

/// The range of the candidates' lexical scores and of their semantic ones.
struct Ranges {
    lexical: (f32, f32),
    semantic: (f32, f32),
}

impl Default for Ranges {
    fn default() -> Ranges {
        Ranges {
            lexical: (f32::MAX, f32::MIN),
            semantic: (f32::MAX, f32::MIN),
        }
    }
}

impl Ranges {
    #[inline(always)]
    fn add(&mut self, s: &Found) {
        // As `lo.min(v), hi.max(v)`, without the code for a NaN on either side: the bounds
        // start as numbers and a NaN `v` leaves them as they are, as `min` and `max` do.
        let widen = |(lo, hi): (f32, f32), v: f32| {
            (if v < lo { v } else { lo }, if v > hi { v } else { hi })
        };
        self.lexical = widen(self.lexical, s.lexical);
        if let Some(semantic) = s.semantic {
            self.semantic = widen(self.semantic, semantic);
        }
    }

    /// A candidate's ranking score: its lexical and semantic scores each scaled to their
    /// range among the candidates, then weighed as the fused score is (with no semantic score
    /// anywhere, the lexical order), plus [`TIME_BONUS`] for a turn of the period the question
    /// names.
    #[inline(always)]
    fn rank(&self, s: &Found, lexical_weight: f32) -> f32 {
        let lexical = scale(s.lexical, self.lexical);
        let bonus = if s.when { TIME_BONUS } else { 0.0 };
        let any_semantic = self.semantic.1 >= self.semantic.0;
        bonus
            + match s.semantic {
                Some(semantic) => {
                    lexical_weight * lexical
                        + (1.0 - lexical_weight) * scale(semantic, self.semantic)
                }
                None if any_semantic => lexical_weight * lexical,
                None => lexical,
            }
    }
}

/// `v` on the range `(lo, hi)`, 0..1 (0 for a range of one value).
#[inline(always)]
fn scale(v: f32, (lo, hi): (f32, f32)) -> f32 {
    if hi > lo { (v - lo) / (hi - lo) } else { 0.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hit(turn: u64, score: f32) -> Hit {
        Hit { turn, score }
    }

    /// In place, smoothing gives exactly what the weighted mean over the original values
    /// gives.
    #[test]
    fn smoothing_in_place_is_the_mean_of_the_original_values() {
        let original: Vec<(u64, f32)> = (0..50u64)
            .map(|t| (t * 3, ((t * 7919 % 101) as f32) / 101.0))
            .collect();
        let weights: f32 = SMOOTHING[0] + 2.0 * SMOOTHING[1..].iter().sum::<f32>();
        let want: Vec<(u64, f32)> = (0..original.len())
            .map(|i| {
                let mut sum = SMOOTHING[0] * original[i].1;
                for (distance, &w) in SMOOTHING.iter().enumerate().skip(1) {
                    if let Some(j) = i.checked_sub(distance) {
                        sum += w * original[j].1;
                    }
                    if let Some(after) = original.get(i + distance) {
                        sum += w * after.1;
                    }
                }
                (original[i].0, sum / weights)
            })
            .collect();
        let mut smoothed = original;
        smooth(&mut smoothed);
        assert_eq!(smoothed, want);
    }

    /// The best `k` kept while walking (selected whenever twice `k` are held) are the first
    /// `k` of all the candidates ranked.
    #[test]
    fn the_best_k_kept_while_walking_are_the_first_of_all_ranked() {
        let semantic: Vec<(u64, f32)> = (0..3000u64)
            .map(|t| (t, ((t * 7919 % 1009) as f32) / 1009.0))
            .collect();
        let hits: Vec<Hit> = (0..3000u64)
            .filter(|t| t % 3 == 0)
            .map(|t| hit(t, ((t * 104_729 % 997) as f32) / 100.0))
            .chain((3000..3100).map(|t| hit(t, 1.0)))
            .collect();
        let fusion = Fusion {
            floor: 0.0,
            relative_floor: 0.0,
            ..Fusion::default()
        };
        let all = fuse(&hits, 8.0, Some(&semantic), |_| true, None, fusion, 0).0;
        // All but the three turns of similarity 0 and no lexical score (turn 0's words score
        // 0 on the query's scale; 1009 and 2018 share none).
        assert_eq!(all.len(), 3097);
        for k in [1, 10, 40] {
            let (kept, under) = fuse(&hits, 8.0, Some(&semantic), |_| true, None, fusion, k);
            assert!(under.is_empty());
            assert_eq!(kept, all[..k], "k = {k}");
        }
    }

    #[test]
    fn smoothing_mixes_neighbours_and_keeps_order() {
        let mut smoothed = vec![(1, 0.0), (2, 1.0), (3, 0.0), (4, 0.0), (5, 0.0)];
        smooth(&mut smoothed);
        assert_eq!(
            smoothed.iter().map(|s| s.0).collect::<Vec<_>>(),
            [1, 2, 3, 4, 5]
        );
        // Turn 2 keeps the most; its neighbours get some of it, the farther less.
        assert!(smoothed[1].1 > smoothed[0].1 && smoothed[1].1 > smoothed[2].1);
        assert!(smoothed[2].1 > smoothed[3].1 && smoothed[3].1 > smoothed[4].1);
        assert_eq!(smoothed[4].1, 0.0);
    }

    #[test]
    fn lexical_alone_is_on_the_query_scale() {
        let (kept, under) = fuse(
            &[hit(3, 2.0), hit(5, 4.0)],
            8.0,
            None,
            |_| true,
            None,
            Fusion::default(),
            10,
        );
        assert!(under.is_empty());
        assert_eq!(kept[0].turn, 5);
        assert!((kept[0].score - 0.5).abs() < 1e-6);
        assert!((kept[1].score - 0.25).abs() < 1e-6);
    }

    #[test]
    fn a_turn_found_by_meaning_alone_ranks_and_the_floor_drops_the_weak() {
        let semantic = [(1, 0.9), (2, 0.1), (3, 0.2), (9, 0.95)];
        let fusion = Fusion {
            lexical_weight: 0.3,
            floor: 0.2,
            relative_floor: 0.0,
            feedback: false,
        };
        let (kept, under) = fuse(
            &[hit(3, 4.0)],
            8.0,
            Some(&semantic),
            |t| t < 9,
            None,
            fusion,
            10,
        );
        let turns: Vec<u64> = kept.iter().map(|s| s.turn).collect();
        // Turn 1 shares no word and ranks first; turn 9 is outside the pool.
        assert_eq!(turns, [1, 3]);
        assert_eq!(kept[1].lexical, 0.5);
        assert_eq!(kept[1].semantic, Some(0.2));
        assert_eq!(under.iter().map(|s| s.turn).collect::<Vec<_>>(), [2]);
    }

    #[test]
    fn the_relative_floor_drops_turns_far_under_the_best_and_not_by_words_alone() {
        // Fused at weight 0.7: turn 1 0.7 + 0.3·0.8 = 0.94, turn 2 0.35 + 0.06 = 0.41,
        // turn 3 0.0875 + 0.06 = 0.1475.
        let hits = [hit(1, 8.0), hit(2, 4.0), hit(3, 1.0)];
        let semantic = [(1, 0.8), (2, 0.2), (3, 0.2)];
        let turns = |relative_floor: f32, semantic: Option<&[(u64, f32)]>| {
            let fusion = Fusion {
                relative_floor,
                ..Fusion::default()
            };
            let (kept, under) = fuse(&hits, 8.0, semantic, |_| true, None, fusion, 10);
            let ids = |v: &[Scored]| v.iter().map(|s| s.turn).collect::<Vec<_>>();
            (ids(&kept), ids(&under))
        };
        assert_eq!(turns(0.0, Some(&semantic)), (vec![1, 2, 3], vec![]));
        // 0.4 × 0.94 = 0.376: turn 3 is under it, turn 2 over it.
        assert_eq!(turns(0.4, Some(&semantic)), (vec![1, 2], vec![3]));
        // 0.5 × 0.94 = 0.47: turn 2 too.
        assert_eq!(turns(0.5, Some(&semantic)), (vec![1], vec![2, 3]));
        // By words alone no floor applies, as with the absolute one.
        assert_eq!(turns(0.5, None), (vec![1, 2, 3], vec![]));
    }

    #[test]
    fn lexical_hits_in_any_order_meet_their_turns_vectors() {
        // Best first, as the index gives them; one turn (8) has no vector.
        let hits = [hit(7, 8.0), hit(2, 4.0), hit(8, 2.0), hit(5, 1.0)];
        let semantic = [(1, 0.1), (2, 0.2), (5, 0.5), (7, 0.7), (9, 0.9)];
        let (kept, _) = fuse(
            &hits,
            8.0,
            Some(&semantic),
            |_| true,
            None,
            Fusion::default(),
            10,
        );
        let mut found: Vec<(u64, f32, Option<f32>)> = kept
            .iter()
            .map(|s| (s.turn, s.lexical, s.semantic))
            .collect();
        found.sort_by_key(|f| f.0);
        assert_eq!(
            found,
            [
                (1, 0.0, Some(0.1)),
                (2, 0.5, Some(0.2)),
                (5, 0.125, Some(0.5)),
                (7, 1.0, Some(0.7)),
                (8, 0.25, None),
                (9, 0.0, Some(0.9)),
            ]
        );
    }

    #[test]
    fn a_turn_without_a_vector_keeps_its_words() {
        let (kept, _) = fuse(
            &[hit(4, 8.0)],
            8.0,
            Some(&[(1, 0.3)]),
            |_| true,
            None,
            Fusion::default(),
            10,
        );
        let four = kept
            .iter()
            .find(|s| s.turn == 4)
            .map(|s| (s.score, s.semantic));
        assert_eq!(four, Some((DEFAULT_LEXICAL_WEIGHT, None)));
    }

    #[test]
    fn a_turn_of_the_named_period_outranks_better_worded_ones_of_other_times_but_not_far_better() {
        // Turn 2 is of the period; 1 words the question slightly better, 3 far better.
        let hits = [hit(1, 5.0), hit(2, 4.0), hit(3, 8.0), hit(4, 0.5)];
        let semantic = [(1, 0.3), (2, 0.3), (3, 0.6), (4, 0.0)];
        let in_period = |turn: u64| turn == 2;
        let order = |when: Option<&dyn Fn(u64) -> bool>| {
            let (kept, _) = fuse(
                &hits,
                8.0,
                Some(&semantic),
                |_| true,
                when,
                Fusion::default(),
                10,
            );
            kept.iter().map(|s| (s.turn, s.when)).collect::<Vec<_>>()
        };
        assert_eq!(
            order(None),
            [(3, false), (1, false), (2, false), (4, false)]
        );
        assert_eq!(
            order(Some(&in_period)),
            [(3, false), (2, true), (1, false), (4, false)]
        );
        // Its fused score carries the bonus too (turns of other conversations compete on it).
        let (kept, _) = fuse(
            &hits,
            8.0,
            Some(&semantic),
            |_| true,
            Some(&in_period),
            Fusion::default(),
            10,
        );
        let two = kept.iter().find(|s| s.turn == 2).unwrap();
        let plain = DEFAULT_LEXICAL_WEIGHT * 0.5 + (1.0 - DEFAULT_LEXICAL_WEIGHT) * 0.3;
        assert!((two.score - (plain + TIME_BONUS)).abs() < 1e-6, "{two:?}");
    }

    #[test]
    fn by_words_alone_a_turn_of_the_named_period_gains_too() {
        let hits = [hit(1, 5.0), hit(2, 4.8), hit(3, 1.0)];
        let in_period = |turn: u64| turn == 2 || turn == 3;
        let (kept, _) = fuse(
            &hits,
            8.0,
            None,
            |_| true,
            Some(&in_period),
            Fusion::default(),
            10,
        );
        // Ranked on the words' range among the candidates: 2 is close to 1 and passes it; 3 is
        // far under and stays there.
        assert_eq!(kept.iter().map(|s| s.turn).collect::<Vec<_>>(), [2, 1, 3]);
    }

    #[test]
    fn feedback_fuses_a_second_time_on_the_moved_similarities_only_when_asked() {
        let hits = [hit(1, 8.0), hit(2, 4.0), hit(3, 2.0), hit(4, 1.0)];
        let first = [(1, 0.9), (2, 0.1), (3, 0.1), (4, 0.1)];
        let again = vec![(1, 0.0), (2, 0.0), (3, 0.0), (4, 1.0)];
        let run = |feedback: bool, moved: Option<Vec<(u64, f32)>>, k: usize| {
            let fusion = Fusion {
                feedback,
                ..Fusion::default()
            };
            let calls = std::cell::RefCell::new(Vec::new());
            let ranked = |semantic: Option<&[(u64, f32)]>, k: usize| {
                calls.borrow_mut().push(k);
                fuse(&hits, 8.0, semantic, |_| true, None, fusion, k)
            };
            let mut similarities = first.to_vec();
            let (kept, _) = fuse_with_feedback(
                Some(&mut similarities),
                fusion,
                k,
                ranked,
                |best, similarities| {
                    assert_eq!(best.len(), k.max(FEEDBACK_TURNS));
                    *similarities = moved?;
                    Some(())
                },
            );
            let turns: Vec<u64> = kept.iter().map(|s| s.turn).collect();
            (turns, calls.into_inner())
        };
        // Off: one fusion of the best k.
        assert_eq!(run(false, Some(again.clone()), 2), (vec![1, 2], vec![2]));
        // On: the first keeps at least three, the second ranks on the moved similarities.
        assert_eq!(run(true, Some(again), 2), (vec![1, 4], vec![3, 2]));
        // On, but nothing to move towards: the first's best k.
        assert_eq!(run(true, None, 2), (vec![1, 2], vec![3]));
    }

    #[test]
    fn feedback_moves_the_query_towards_the_best_turns_and_stays_a_unit_vector() {
        let query = [1.0, 0.0, 0.0];
        let moved = feedback(&query, &[vec![0.0, 1.0, 0.0], vec![0.0, 1.0, 0.0]]).unwrap();
        let norm: f32 = moved.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-6);
        // Towards the rows, the query's own direction still the larger.
        assert!(moved[1] > 0.0 && moved[0] > moved[1], "{moved:?}");
        let expected = FEEDBACK_WEIGHT / (1.0 + FEEDBACK_WEIGHT * FEEDBACK_WEIGHT).sqrt();
        assert!((moved[1] - expected).abs() < 1e-6, "{moved:?}");
        // Rows of another dimension are ignored; none at all: no feedback.
        assert_eq!(feedback(&query, &[vec![1.0, 2.0]]), None);
        assert_eq!(feedback(&query, &[]), None);
    }
}
