"""Cache-directory trust for the kernels: `jaxserve.core.trust` (shared with the model registry), re-exported."""

from jaxserve.core.trust import UntrustedDirectoryError, check_private_dir, ensure_private_dir

__all__ = ["UntrustedDirectoryError", "check_private_dir", "ensure_private_dir"]
