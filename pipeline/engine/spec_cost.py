"""Engine stage: what speculative decoding costs on this machine and model, in tokens
produced (engine.spec_decode prices draft positions with it; docs/speculative.md).

Two decayed least-squares fits over the last ~50 steps:
- the forward: step seconds ~ a + b x tokens run, over decode and verify steps (their time
  less the proposals', and at most ``OUTLIER`` x what the line predicts: a step the process
  was descheduled in says nothing of a token's price); ``token_price`` is b in produced
  tokens (b x tokens produced a second of such steps): what one more token in a step costs;
- the proposals: seconds ~ alpha x requests + beta x drafts asked, over the steps that
  proposed. A suffix index's lookup costs per request (alpha), a draft model's forward per
  draft (beta; its catch-up over the tokens it missed, per request again). While every
  proposal asked as many drafts (the two not told apart) it all counts per request.

Owns / State: the decayed sums of both fits.
"""
from __future__ import annotations

COST_DECAY = 0.98  # per step: the fits follow the last ~50 steps
COLLINEAR = 0.999  # squared correlation of requests and drafts asked above which they are not told apart
# A step slower than this many times what the line predicts for its tokens counts as that:
# the process was descheduled (a shared machine), which is no price of a token. Only once
# the line has a few steps.
OUTLIER = 2.0


class StepCost:
    def __init__(self) -> None:
        self.w = self.x = self.xx = self.y = self.xy = self.out = 0.0
        self.propose_s = self.proposed = 0.0  # the worker's proposals: time and requests
        self.nn = self.nd = self.dd = self.ns = self.ds = 0.0  # requests (n), drafts (d), seconds (s)

    def add_proposals(self, seconds: float, requests: int, drafts: int = 0) -> None:
        """A step's proposals: ``seconds`` for ``requests`` requests, ``drafts`` drafts asked
        in all (0: unknown, one per request)."""
        d, n, k = COST_DECAY, float(requests), float(drafts or requests)
        self.propose_s = d * self.propose_s + seconds
        self.proposed = d * self.proposed + n
        self.nn = d * self.nn + n * n
        self.nd = d * self.nd + n * k
        self.dd = d * self.dd + k * k
        self.ns = d * self.ns + n * seconds
        self.ds = d * self.ds + k * seconds

    def proposal_price(self) -> float:
        """What proposing for one request has cost on average, in tokens produced."""
        if not self.proposed or self.y <= 0.0:
            return 0.0
        return self.propose_s / self.proposed * self.out / self.y

    def proposal_prices(self) -> tuple[float, float]:
        """(per request, per draft asked), in tokens produced."""
        if not self.proposed or self.y <= 0.0:
            return 0.0, 0.0
        tok = self.out / self.y
        det = self.nn * self.dd - self.nd * self.nd
        if det > (1.0 - COLLINEAR) * self.nn * self.dd:
            alpha = (self.dd * self.ns - self.nd * self.ds) / det
            beta = (self.nn * self.ds - self.nd * self.ns) / det
            if alpha >= 0.0 and beta >= 0.0:
                return alpha * tok, beta * tok
            if alpha < 0.0:  # all of it per draft
                return 0.0, max(self.ds / self.dd, 0.0) * tok
        return self.propose_s / self.proposed * tok, 0.0

    def add(self, tokens: int, seconds: float, produced: int) -> None:
        d = COST_DECAY
        if self.w >= 4.0:
            slope = self._slope()
            seconds = min(seconds, OUTLIER * ((self.y - slope * self.x) / self.w + slope * tokens))
        self.w = d * self.w + 1.0
        self.x = d * self.x + tokens
        self.xx = d * self.xx + tokens * tokens
        self.y = d * self.y + seconds
        self.xy = d * self.xy + tokens * seconds
        self.out = d * self.out + produced

    def token_price(self) -> float:
        """The share of a produced token one more token run costs (slope x tokens produced
        per second); 0 until the steps ran different token counts."""
        return self._slope() * self.out / self.y if self.y > 0.0 else 0.0

    def _slope(self) -> float:
        var = self.w * self.xx - self.x * self.x
        if var <= 1e-9 * self.w * self.w:
            return 0.0
        return max((self.w * self.xy - self.x * self.y) / var, 0.0)
