"""Flax OPT models, sharding rules and checkpoint loading. `models.config` imports no JAX."""
