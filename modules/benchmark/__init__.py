"""Speed and memory benchmarks (DESIGN.md section 8): `scripts/benchmark.py` is the command line, the logic is here.

- `architectures`: the full-size Wan transformer configs (and a `tiny` one for tests), built with random weights.
- `flops`: an analytic FLOP count of one training step of a Wan transformer at a given shape.
- `train_bench`: seconds per training step, peak memory and FLOP utilisation through the real `BaseWanSetup`.
- `data_bench`: decode / resample / resize throughput against bare PyAV, and a warm cached epoch of the loader.

See docs/benchmarks.md for what each number means and the measured results.
"""
