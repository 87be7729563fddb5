"""When a sample stops: end of sequence, a stop token, a stop string, or a length limit.

Checked once per generated token, in this order; the first rule that fires gives the finish
reason ("stop" or "length") and, for stop tokens and stop strings, the stop reason. A
structured output's grammar that is complete (its matcher stopped) ends the sample with "stop"
whatever min_tokens and ignore_eos say: nothing but the end of sequence could follow.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamengine.sample.request import Request, Sample


@dataclass(frozen=True, slots=True)
class StopRules:
    eos_token_ids: frozenset[int]
    max_model_len: int

    def check(self, req: Request, sample: Sample, token: int, stop_str: str | None) -> tuple[str | None, int | str | None]:
        """(finish reason, stop reason) after `token` was appended to `sample`; `stop_str` is
        the stop string the detokenizer found in the text it completed, if any."""
        params, seq = req.params, sample.seq
        num_out = len(sample.token_ids)
        past_min = num_out >= params.min_tokens
        if past_min and not params.ignore_eos and token in self.eos_token_ids:
            return "stop", None
        if past_min and token in req.stop_ids:
            return "stop", token
        if stop_str is not None:
            return "stop", stop_str
        if sample.matcher is not None and sample.matcher.is_stopped:
            return "stop", None
        if num_out >= req.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length", None
        return None, None
