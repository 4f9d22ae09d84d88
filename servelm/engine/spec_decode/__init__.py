"""Speculative decoding: proposers (n-gram prompt lookup, a draft model) and the rejection sampler that
verifies their proposals against the target model in one batched step."""
