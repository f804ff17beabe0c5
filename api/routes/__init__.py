"""HTTP route handlers, one module per dialect plus jobs and health."""
