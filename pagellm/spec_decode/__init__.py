"""Speculative decoding: proposers guess a request's next tokens, the target model checks them all in one
step, and the rejection sampler keeps the longest run the target agrees with (docs/architecture.md)."""
