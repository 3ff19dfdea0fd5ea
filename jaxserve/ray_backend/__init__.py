"""The Ray backend: every prefill and decode instance of a plan as a Ray actor (see deployment.py)."""
