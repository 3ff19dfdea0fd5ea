"""`serve`'s credentials: the inference key and the admin key, from their flags or the environment."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

API_KEY_ENV = "JAXSERVE_API_KEY"
ADMIN_KEY_ENV = "JAXSERVE_ADMIN_KEY"  # jaxserve.serving.admin.ADMIN_KEY_ENV (this module imports no server code)


def server_keys(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """(api_key, admin_key): each flag, else its environment variable, else None. A key that is set but empty
    (or edged with whitespace) is a ValueError, never "no authentication"; so is an admin key equal to the API key."""
    from jaxserve.serving.admin import check_key

    env = os.environ if environ is None else environ
    api_key = args.api_key if args.api_key is not None else env.get(API_KEY_ENV)
    admin_key = args.admin_key if args.admin_key is not None else env.get(ADMIN_KEY_ENV)
    check_key(api_key, f"--api-key / {API_KEY_ENV}")
    check_key(admin_key, f"--admin-key / {ADMIN_KEY_ENV}")
    if admin_key is not None and admin_key == api_key:
        raise ValueError("the admin key must differ from the API key: an inference key never grants admin")
    return api_key, admin_key
