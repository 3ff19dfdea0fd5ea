"""Subcommands of the `jaxserve` CLI; see `jaxserve/cli.py`."""
