"""Code both the API and the workers import: settings, keys, schemas, codec, errors, queue ops."""
