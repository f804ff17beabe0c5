"""Helpers the tests share: scripted engines and stacks, in-process workers, receivers, fault tools, waiting."""
