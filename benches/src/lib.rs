//! Criterion benchmarks across the edl crates live in `benches/`.
