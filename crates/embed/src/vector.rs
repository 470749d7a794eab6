//! The arithmetic the embedders share: L2 normalisation and the dot product. Owns no state.

/// Scales `vector` to length 1 in place; a vector of length 0 (nothing to embed) stays zero.
pub fn normalize(vector: &mut [f32]) {
    let norm = vector.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        for x in vector.iter_mut() {
            *x /= norm;
        }
    }
}

/// The dot product: the cosine of two unit-length vectors.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_normalised_vector_has_length_one() {
        let mut v = vec![3.0, 4.0];
        normalize(&mut v);
        assert_eq!(v, vec![0.6, 0.8]);
        assert!((dot(&v, &v) - 1.0).abs() < 1e-6);
    }

    #[test]
    fn a_zero_vector_stays_zero() {
        let mut v = vec![0.0; 3];
        normalize(&mut v);
        assert_eq!(v, vec![0.0; 3]);
    }
}
