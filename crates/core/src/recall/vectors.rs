//! A conversation's message vectors as its recall index holds them: one per stored turn, of
//! one embedder's space, quantised to a byte per dimension with a scale, so a conversation of
//! 1,000 messages at 256 dimensions costs about 260 KB of cache (and 16 KB more for the
//! similarities' buffer its index keeps, `recall/mod.rs`).
//!
//! With a model or the provider's embeddings, vectors arrive after their messages (they are
//! made off the request path), so some turns may have none yet: those are found by their words
//! only. The static table's come with their messages (made in the commit).

use memproxy_base::heap;
use memproxy_store::Quantised;

/// Vectors by turn, ascending.
#[derive(Debug, Clone, Default)]
pub struct DocVectors {
    dims: usize,
    turns: Vec<u64>,
    /// `dims` bytes per turn, in the order of `turns`.
    values: Vec<i8>,
    scales: Vec<f32>,
    /// The rows before this one are of turns trimmed from the front, left in place until they
    /// are an eighth of the live ones, or until a new row would need more room than the
    /// vectors have: a trim then moves nothing (moving every vector down at each trimmed round
    /// was a quarter of a megabyte at 1,000 turns, the default `max_messages`), and trimmed
    /// rows never make the vectors grow.
    first: usize,
}

/// Quantises `vector` as the store does (`memproxy_store::quantise`); all zeros for one that
/// cannot be (empty, or not finite).
pub fn quantise(vector: &[f32]) -> Quantised {
    memproxy_store::quantise(vector).unwrap_or_else(|| Quantised {
        scale: 0.0,
        values: vec![0; vector.len()],
    })
}

impl DocVectors {
    pub fn new(dims: usize) -> DocVectors {
        DocVectors {
            dims,
            ..DocVectors::default()
        }
    }

    pub fn dims(&self) -> usize {
        self.dims
    }

    pub fn len(&self) -> usize {
        self.turns.len() - self.first
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops the trimmed rows for good.
    fn compact(&mut self) {
        if self.first == 0 {
            return;
        }
        self.turns.drain(..self.first);
        self.scales.drain(..self.first);
        self.values.drain(..self.first * self.dims);
        self.first = 0;
    }

    /// Sets `turn`'s vector (a vector of another length is ignored). Vectors of dimension 0
    /// (an embedder that learns its width from its first answer, the provider's) take the
    /// first vector's.
    pub fn insert(&mut self, turn: u64, vector: &[f32]) {
        self.insert_quantised(turn, &quantise(vector));
    }

    /// As [`DocVectors::insert`], a vector already quantised (the store's, or one quantised
    /// once for the store and the index).
    pub fn insert_quantised(&mut self, turn: u64, vector: &Quantised) {
        if self.dims == 0 && self.turns.is_empty() {
            self.dims = vector.values.len();
        }
        if vector.values.len() != self.dims || self.dims == 0 {
            return;
        }
        let (bytes, scale) = (&vector.values, vector.scale);
        if self.first > 0 && self.values.len() + self.dims > self.values.capacity() {
            self.compact();
        }
        let found = self.turns[self.first..]
            .binary_search(&turn)
            .map(|at| at + self.first)
            .map_err(|at| at + self.first);
        match found {
            Ok(at) => {
                self.values[at * self.dims..(at + 1) * self.dims].copy_from_slice(bytes);
                self.scales[at] = scale;
            }
            Err(at) if at == self.turns.len() => {
                self.turns.push(turn);
                self.values.extend_from_slice(bytes);
                self.scales.push(scale);
            }
            Err(at) => {
                self.turns.insert(at, turn);
                self.values
                    .splice(at * self.dims..at * self.dims, bytes.iter().copied());
                self.scales.insert(at, scale);
            }
        }
    }

    /// Drops the vectors of `turns`. The oldest (trimmed rounds) are only passed over.
    pub fn remove(&mut self, turns: &[u64]) {
        if turns.is_empty() || self.is_empty() {
            return;
        }
        let oldest = self.turns[self.first..]
            .iter()
            .take_while(|turn| turns.contains(turn))
            .count();
        self.first += oldest;
        if self.first > 16 && self.first * 8 > self.len() {
            self.compact();
        }
        if oldest == turns.len() {
            return;
        }
        self.compact();
        let dims = self.dims;
        let mut keep = 0;
        for i in 0..self.turns.len() {
            if turns.contains(&self.turns[i]) {
                continue;
            }
            if keep != i {
                self.turns[keep] = self.turns[i];
                self.scales[keep] = self.scales[i];
                self.values
                    .copy_within(i * dims..(i + 1) * dims, keep * dims);
            }
            keep += 1;
        }
        self.turns.truncate(keep);
        self.scales.truncate(keep);
        self.values.truncate(keep * dims);
    }

    /// Keeps only the vectors of turns `keep` accepts.
    pub fn retain(&mut self, keep: impl Fn(u64) -> bool) {
        let gone: Vec<u64> = self.turns[self.first..]
            .iter()
            .copied()
            .filter(|&t| !keep(t))
            .collect();
        self.remove(&gone);
    }

    /// The turns that have a vector.
    pub fn turns(&self) -> &[u64] {
        &self.turns[self.first..]
    }

    /// The cosine similarity of `query` (unit length) with every vector, by turn ascending.
    /// The query is quantised as the vectors are, so each product is of bytes summed in
    /// integers (`memproxy_embed::vector::dots_i8`, on the CPU's widest vectors): a
    /// conversation of 10,000 messages at 256 dimensions is scored in about a tenth of a
    /// millisecond.
    pub fn similarities(&self, query: &[f32]) -> Vec<(u64, f32)> {
        let mut out = Vec::new();
        self.similarities_into(query, &mut out);
        out
    }

    /// As [`DocVectors::similarities`], into `out` (cleared first): a buffer kept from one
    /// search to the next is not allocated again (a conversation of 10,000 messages' would be
    /// pages of its own, mapped and cleared on every request).
    pub fn similarities_into(&self, query: &[f32], out: &mut Vec<(u64, f32)>) {
        out.clear();
        if query.len() != self.dims || self.dims == 0 {
            return;
        }
        let query = quantise(query);
        let query_scale = query.scale;
        let mut dots = Vec::with_capacity(self.len());
        memproxy_embed::vector::dots_i8(
            &self.values[self.first * self.dims..],
            &query.values,
            &mut dots,
        );
        out.extend(
            self.turns[self.first..]
                .iter()
                .zip(dots)
                .zip(&self.scales[self.first..])
                .map(|((&turn, dot), &scale)| (turn, dot as f32 * scale * query_scale)),
        );
    }

    /// As [`DocVectors::similarities_into`], each then mixed with its neighbours'
    /// (`hybrid::smooth`): what hybrid recall ranks on.
    pub fn smoothed_into(&self, query: &[f32], out: &mut Vec<(u64, f32)>) {
        self.similarities_into(query, out);
        super::hybrid::smooth(out);
    }

    /// Feedback's similarities into `out` ([`DocVectors::smoothed_into`] of `query` moved
    /// towards the best of `ranked`, [`DocVectors::feedback`]); `None`, `out` left as it was,
    /// when none of them has a vector.
    pub fn feedback_into(
        &self,
        query: &[f32],
        ranked: &[super::hybrid::Scored],
        out: &mut Vec<(u64, f32)>,
    ) -> Option<()> {
        let moved = self.feedback(query, ranked)?;
        self.smoothed_into(&moved, out);
        Some(())
    }

    /// `query` moved towards the vectors of the best of `ranked` (best first;
    /// `hybrid::feedback`): `None` when none of them has a vector.
    pub fn feedback(&self, query: &[f32], ranked: &[super::hybrid::Scored]) -> Option<Vec<f32>> {
        let best: Vec<Vec<f32>> = ranked
            .iter()
            .take(super::hybrid::FEEDBACK_TURNS)
            .filter_map(|hit| self.row(hit.turn))
            .collect();
        super::hybrid::feedback(query, &best)
    }

    /// The vector of `turn`, as held (int8, scaled back).
    pub fn row(&self, turn: u64) -> Option<Vec<f32>> {
        let at = self.turns[self.first..].binary_search(&turn).ok()? + self.first;
        let scale = self.scales[at];
        Some(
            self.values[at * self.dims..(at + 1) * self.dims]
                .iter()
                .map(|&b| f32::from(b) * scale)
                .collect(),
        )
    }

    /// Heap bytes held.
    pub fn heap_bytes(&self) -> usize {
        heap::vec::<u64>(self.turns.capacity())
            + heap::vec::<i8>(self.values.capacity())
            + heap::vec::<f32>(self.scales.capacity())
    }

    pub fn shrink_to_fit(&mut self) {
        self.compact();
        self.turns.shrink_to_fit();
        self.values.shrink_to_fit();
        self.scales.shrink_to_fit();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(v: &[f32]) -> Vec<f32> {
        let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        v.iter().map(|x| x / n).collect()
    }

    #[test]
    fn similarities_survive_quantisation() {
        let a = unit(&[0.3, -0.2, 0.9, 0.1]);
        let b = unit(&[-0.5, 0.4, 0.1, 0.7]);
        let mut vectors = DocVectors::new(4);
        vectors.insert(7, &b);
        vectors.insert(3, &a);
        let sims = vectors.similarities(&a);
        assert_eq!(sims.iter().map(|s| s.0).collect::<Vec<_>>(), vec![3, 7]);
        assert!((sims[0].1 - 1.0).abs() < 0.01, "{sims:?}");
        let exact: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((sims[1].1 - exact).abs() < 0.01, "{sims:?} vs {exact}");
    }

    /// A vector quantised once (for the store and the index, or read back from the store) is
    /// the row inserting its floats makes: the same bytes, the same similarities.
    #[test]
    fn a_vector_quantised_once_is_the_row_its_floats_make() {
        let rows = [
            unit(&[0.3, -0.2, 0.9, 0.1]),
            unit(&[-0.5, 0.4, 0.1, 0.7]),
            vec![0.0; 4],
        ];
        let mut from_floats = DocVectors::new(4);
        let mut quantised = DocVectors::new(4);
        for (turn, row) in (1..).zip(&rows) {
            from_floats.insert(turn, row);
            quantised.insert_quantised(turn, &memproxy_store::quantise(row).unwrap());
        }
        // Not quantisable (not finite): all zeros either way.
        from_floats.insert(9, &[f32::NAN; 4]);
        quantised.insert_quantised(9, &quantise(&[f32::NAN; 4]));
        assert_eq!(from_floats.values, quantised.values);
        assert_eq!(from_floats.scales, quantised.scales);
        let query = unit(&[0.2, 0.1, 0.8, -0.3]);
        assert_eq!(
            from_floats.similarities(&query),
            quantised.similarities(&query)
        );
        assert_eq!(quantised.turns(), &[1, 2, 3, 9]);
    }

    #[test]
    fn an_unknown_width_is_the_first_vectors() {
        let mut vectors = DocVectors::new(0);
        vectors.insert(1, &[0.6, 0.8]);
        vectors.insert(2, &[1.0, 0.0, 0.0]);
        assert_eq!(vectors.dims(), 2);
        assert_eq!(vectors.turns(), &[1]);
    }

    #[test]
    fn insert_replaces_and_remove_keeps_order() {
        let mut vectors = DocVectors::new(2);
        for turn in [1, 2, 3, 4] {
            vectors.insert(turn, &[turn as f32, 1.0]);
        }
        vectors.insert(2, &[0.0, 1.0]);
        vectors.remove(&[1, 3]);
        assert_eq!(vectors.turns(), &[2, 4]);
        let sims = vectors.similarities(&[0.0, 1.0]);
        assert!((sims[0].1 - 1.0).abs() < 0.01);
        assert!((sims[1].1 - 1.0).abs() < 0.01);
        vectors.retain(|t| t > 2);
        assert_eq!(vectors.turns(), &[4]);
        // Another length is not this space's.
        vectors.insert(9, &[1.0, 0.0, 0.0]);
        assert_eq!(vectors.turns(), &[4]);
    }

    /// A conversation at its `max_messages`: each round trimmed from the front and a new one
    /// added. The trimmed rows wait in the room the vectors had; they never make them grow.
    #[test]
    fn trimmed_rows_never_make_the_vectors_grow() {
        let mut vectors = DocVectors::new(4);
        for turn in 0..100 {
            vectors.insert(turn, &unit(&[1.0, turn as f32, 0.5, 2.0]));
        }
        vectors.shrink_to_fit();
        let held = vectors.heap_bytes();
        for turn in (100..1100).step_by(2) {
            let oldest: Vec<u64> = vectors.turns()[..2].to_vec();
            vectors.remove(&oldest);
            vectors.insert(turn, &unit(&[1.0, turn as f32, 0.5, 2.0]));
            vectors.insert(turn + 1, &unit(&[2.0, turn as f32, 0.5, 1.0]));
            assert_eq!(vectors.len(), 100);
            assert!(vectors.heap_bytes() <= held, "at turn {turn}");
        }
        assert_eq!(vectors.turns().first(), Some(&1000));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64),
        /// The `n` oldest removed (trimmed rounds), with the newest `k` (a replaced reply).
        Trim(usize, usize),
        Remove(Vec<u64>),
        Retain(u64),
        Shrink,
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            4 => (0u64..400).prop_map(Op::Insert),
            3 => (0usize..40, 0usize..2).prop_map(|(n, k)| Op::Trim(n, k)),
            1 => proptest::collection::vec(0u64..400, 0..4).prop_map(Op::Remove),
            1 => (0u64..400).prop_map(Op::Retain),
            1 => Just(Op::Shrink),
        ]
    }

    proptest::proptest! {
        /// Whatever is inserted and removed, in whatever order, the vectors held are those of
        /// a map by turn that saw the same: the rows trimmed from the front and left in place
        /// are never seen.
        #[test]
        fn the_vectors_held_are_those_of_a_map_by_turn(ops in proptest::collection::vec(op(), 0..120)) {
            use std::collections::BTreeMap;
            let vector = |turn: u64| unit(&[1.0 + turn as f32, (turn % 7) as f32, 3.0]);
            let mut vectors = DocVectors::new(3);
            let mut map: BTreeMap<u64, Vec<f32>> = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Insert(turn) => {
                        vectors.insert(turn, &vector(turn));
                        map.insert(turn, vector(turn));
                    }
                    Op::Trim(n, k) => {
                        let turns: Vec<u64> = map.keys().copied().collect();
                        let mut gone: Vec<u64> = turns.iter().take(n).copied().collect();
                        gone.extend(turns.iter().rev().take(k));
                        gone.sort_unstable();
                        gone.dedup();
                        vectors.remove(&gone);
                        map.retain(|t, _| !gone.contains(t));
                    }
                    Op::Remove(gone) => {
                        vectors.remove(&gone);
                        map.retain(|t, _| !gone.contains(t));
                    }
                    Op::Retain(from) => {
                        vectors.retain(|t| t >= from);
                        map.retain(|&t, _| t >= from);
                    }
                    Op::Shrink => vectors.shrink_to_fit(),
                }
                let turns: Vec<u64> = map.keys().copied().collect();
                proptest::prop_assert_eq!(vectors.turns(), &turns[..]);
                proptest::prop_assert_eq!(vectors.len(), map.len());
            }
            let query = unit(&[0.2, 1.0, 0.5]);
            let sims = vectors.similarities(&query);
            proptest::prop_assert_eq!(sims.len(), map.len());
            for ((turn, sim), (mapped, v)) in sims.iter().zip(&map) {
                proptest::prop_assert_eq!(turn, mapped);
                let exact: f32 = query.iter().zip(v).map(|(a, b)| a * b).sum();
                proptest::prop_assert!((sim - exact).abs() < 0.02, "{} vs {}", sim, exact);
                let row = vectors.row(*turn).unwrap();
                proptest::prop_assert!(row.iter().zip(v).all(|(a, b)| (a - b).abs() < 0.02));
            }
        }
    }
}
