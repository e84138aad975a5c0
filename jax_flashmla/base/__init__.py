"""Floor 0: shape and dtype checks (validation), value checks (checks), and the pytrees only the
library makes (trusted). Imports nothing else of jax_flashmla."""
