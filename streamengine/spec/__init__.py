"""Speculative decoding: proposing a request's next tokens, and verifying them exactly."""
