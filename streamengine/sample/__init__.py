"""Sampling and outputs: SamplingParams (torch-free), the sampler, beam search, stop rules, detokenizing, RequestOutput."""
