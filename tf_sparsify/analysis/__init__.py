"""Offline analysis: the what-if step-time model, its command line, and the step-size theory.
Nothing here imports the training stack."""
