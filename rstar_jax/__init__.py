"""rstar_jax: rStar2-Agent (agentic RL for math reasoning with a Python tool) in JAX/Flax."""

__version__ = "0.1.0"
