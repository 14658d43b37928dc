"""tpurl: JAX-native RL post-training of language models (rollout and update in one SPMD program)."""

__version__ = "0.1.0"
