//! ckpt's benchmarks live beside this crate: `criterion/` (run with
//! `cargo bench -p ckpt-benches`) and `e2e_vs_criu.py` (ckpt against raw CRIU on a real MPI
//! job). Results are kept in `docs/performance.md`.
