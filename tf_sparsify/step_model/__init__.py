"""The step-time model: links and collectives (alpha-beta), exchange methods' bytes, and a step's
timeline with backprop overlap and late buckets. Pure arithmetic over shapes and measured times,
so both the offline what-if (``analysis/``) and the runtime may use it."""
