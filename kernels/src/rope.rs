//! RoPE's rotation for one step's positions ([`RopeTable`]): the cosines and sines every layer's queries and keys
//! are rotated by, computed once per forward pass instead of once per layer and projection.

/// Per position of a step, llama "normal" RoPE's rotation of each adjacent pair `(2i, 2i+1)` by the angle
/// `position · θ^(-2i/head_dim)` (computed in f64, rounded to f32), laid out per element:
/// `cc = [c0, c0, c1, c1, ..]` and `ss = [-s0, s0, -s1, s1, ..]`, so that a pair rotates as
/// `x' = x · cc + swap(x) · ss`. [`crate::Backend::rope`] applies it.
#[derive(Debug, Clone, Default)]
pub struct RopeTable {
    head_dim: usize,
    cc: Vec<f32>,
    ss: Vec<f32>,
}

impl RopeTable {
    /// An empty table; [`RopeTable::fill`] sizes it.
    pub fn new() -> RopeTable {
        RopeTable::default()
    }

    /// The table of `positions` for heads of `head_dim` (even) and base `theta`, in place (the buffers are reused).
    ///
    /// # Panics
    /// If `head_dim` is odd or zero.
    pub fn fill(&mut self, positions: &[u32], head_dim: usize, theta: f32) {
        assert!(head_dim > 0 && head_dim.is_multiple_of(2), "rope: head_dim must be even");
        let half = head_dim / 2;
        self.head_dim = head_dim;
        self.cc.resize(positions.len() * head_dim, 0.0);
        self.ss.resize(positions.len() * head_dim, 0.0);
        // Pair by pair, so that each pair's frequency is computed once for every position.
        for i in 0..half {
            let inv = f64::from(theta).powf(-2.0 * i as f64 / head_dim as f64);
            let rows = self.cc.chunks_exact_mut(head_dim).zip(self.ss.chunks_exact_mut(head_dim));
            for ((cc, ss), &p) in rows.zip(positions) {
                let (s, c) = (f64::from(p) * inv).sin_cos();
                let (s, c) = (s as f32, c as f32);
                cc[2 * i] = c;
                cc[2 * i + 1] = c;
                ss[2 * i] = -s;
                ss[2 * i + 1] = s;
            }
        }
    }

    /// Head dimension the table was filled for.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Positions in the table.
    pub fn len(&self) -> usize {
        self.cc.len().checked_div(self.head_dim).unwrap_or(0)
    }

    /// Whether the table holds no position.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Position `r`'s `cc` and `ss` rows (`head_dim` floats each).
    pub fn row(&self, r: usize) -> (&[f32], &[f32]) {
        let span = r * self.head_dim..(r + 1) * self.head_dim;
        (&self.cc[span.clone()], &self.ss[span])
    }
}
