"""Native kernels behind `models.paged_attention`, built on the machine that runs them (`models.kernels.cpu`)."""
