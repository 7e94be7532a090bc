"""Structured output: grammars (JSON schema, any JSON, regex, choice, EBNF) compiled by xgrammar, one
matcher per request, and the per-step token bitmask the sampler applies (docs/architecture.md)."""
