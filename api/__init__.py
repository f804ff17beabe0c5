"""The Litestar API: dialects in front, relay behind."""
