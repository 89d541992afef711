"""What tests and benchmarks check against: NumPy models of the kernels. Not imported by the
runtime."""
