//! Principal component analysis for the static table: the mean of the rows, and the directions
//! of most variance, from the eigenvectors of the covariance matrix (cyclic Jacobi rotations,
//! in f64: the matrix is the model's width, 384 × 384, so this takes a fraction of a second).
//! Owns no model; the distillation calls it once.

/// The rows' mean and their principal axes, largest variance first.
#[derive(Debug, Clone)]
pub struct Pca {
    mean: Vec<f64>,
    /// `keep` unit vectors of the input's width, one after the other.
    axes: Vec<f64>,
    width: usize,
    keep: usize,
}

impl Pca {
    /// Fits `keep` axes to the rows (each `width` long, one after the other).
    pub fn fit<'a>(
        rows: impl Iterator<Item = &'a [f32]> + Clone,
        width: usize,
        keep: usize,
    ) -> Self {
        let keep = keep.min(width);
        let mut mean = vec![0.0f64; width];
        let mut count = 0usize;
        for row in rows.clone() {
            for (m, &x) in mean.iter_mut().zip(row) {
                *m += f64::from(x);
            }
            count += 1;
        }
        let n = count.max(1) as f64;
        for m in &mut mean {
            *m /= n;
        }
        // The covariance's upper triangle, summed row by row.
        let mut cov = vec![0.0f64; width * width];
        let mut centred = vec![0.0f64; width];
        for row in rows {
            for ((c, &x), m) in centred.iter_mut().zip(row).zip(&mean) {
                *c = f64::from(x) - m;
            }
            for i in 0..width {
                let ci = centred[i];
                let line = &mut cov[i * width..(i + 1) * width];
                for (slot, cj) in line[i..].iter_mut().zip(&centred[i..]) {
                    *slot += ci * cj;
                }
            }
        }
        for i in 0..width {
            for j in i..width {
                let value = cov[i * width + j] / n;
                cov[i * width + j] = value;
                cov[j * width + i] = value;
            }
        }
        let (values, vectors) = symmetric_eigen(cov, width);
        let mut order: Vec<usize> = (0..width).collect();
        order.sort_by(|&a, &b| values[b].total_cmp(&values[a]));
        let mut axes = Vec::with_capacity(keep * width);
        for &j in order.iter().take(keep) {
            axes.extend((0..width).map(|i| vectors[i * width + j]));
        }
        Self {
            mean,
            axes,
            width,
            keep,
        }
    }

    /// `row` centred and projected onto the axes: `keep` coordinates.
    pub fn project(&self, row: &[f32]) -> Vec<f32> {
        let centred: Vec<f64> = row
            .iter()
            .zip(&self.mean)
            .map(|(&x, m)| f64::from(x) - m)
            .collect();
        self.axes
            .chunks_exact(self.width)
            .take(self.keep)
            .map(|axis| axis.iter().zip(&centred).map(|(a, c)| a * c).sum::<f64>() as f32)
            .collect()
    }
}

/// The eigenvalues and eigenvectors (column `j` of the row-major result is the `j`th vector) of
/// a symmetric `n × n` matrix, by cyclic Jacobi rotations until the off-diagonal part is
/// negligible.
fn symmetric_eigen(mut a: Vec<f64>, n: usize) -> (Vec<f64>, Vec<f64>) {
    let mut v = vec![0.0f64; n * n];
    for i in 0..n {
        v[i * n + i] = 1.0;
    }
    let total: f64 = a.iter().map(|x| x * x).sum();
    for _sweep in 0..64 {
        let off: f64 = (0..n)
            .flat_map(|i| (0..n).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| a[i * n + j] * a[i * n + j])
            .sum();
        if off <= total * 1e-24 || off == 0.0 {
            break;
        }
        for p in 0..n {
            for q in p + 1..n {
                let apq = a[p * n + q];
                if apq.abs() <= f64::MIN_POSITIVE {
                    continue;
                }
                let theta = (a[q * n + q] - a[p * n + p]) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for k in 0..n {
                    let (akp, akq) = (a[k * n + p], a[k * n + q]);
                    a[k * n + p] = c * akp - s * akq;
                    a[k * n + q] = s * akp + c * akq;
                }
                for k in 0..n {
                    let (apk, aqk) = (a[p * n + k], a[q * n + k]);
                    a[p * n + k] = c * apk - s * aqk;
                    a[q * n + k] = s * apk + c * aqk;
                }
                for k in 0..n {
                    let (vkp, vkq) = (v[k * n + p], v[k * n + q]);
                    v[k * n + p] = c * vkp - s * vkq;
                    v[k * n + q] = s * vkp + c * vkq;
                }
            }
        }
    }
    let values = (0..n).map(|i| a[i * n + i]).collect();
    (values, v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eigenvectors_satisfy_the_eigen_equation() {
        let n = 6;
        // A symmetric matrix from a fixed, uneven pattern.
        let mut m = vec![0.0; n * n];
        for i in 0..n {
            for j in 0..n {
                m[i * n + j] = ((i * 7 + j * 7 + i * j) % 11) as f64 - 5.0;
            }
        }
        let (values, vectors) = symmetric_eigen(m.clone(), n);
        for (j, lambda) in values.iter().enumerate() {
            for i in 0..n {
                let mv: f64 = (0..n).map(|k| m[i * n + k] * vectors[k * n + j]).sum();
                assert!(
                    (mv - lambda * vectors[i * n + j]).abs() < 1e-9,
                    "{mv} {lambda}"
                );
            }
        }
    }

    #[test]
    fn the_first_axis_follows_the_spread() {
        // Points along (1, 1) with a little noise across it.
        let rows: Vec<[f32; 2]> = (0..50)
            .map(|i| {
                let t = i as f32 - 25.0;
                let e = if i % 2 == 0 { 0.1 } else { -0.1 };
                [t + e + 3.0, t - e - 1.0]
            })
            .collect();
        let pca = Pca::fit(rows.iter().map(|r| r.as_slice()), 2, 1);
        let axis = &pca.axes[..2];
        assert!((axis[0].abs() - 0.5f64.sqrt()).abs() < 1e-3, "{axis:?}");
        assert!((axis[0] - axis[1]).abs() < 1e-3, "{axis:?}");
        assert!((pca.mean[0] - 2.5).abs() < 1e-6 && (pca.mean[1] + 1.5).abs() < 1e-6);
        assert_eq!(pca.project(&[2.5, -1.5]), vec![0.0]);
    }
}
