"""How tensors travel between replicas: the collectives. They move tensors and know nothing
else (no plan, no pipeline, no state)."""
