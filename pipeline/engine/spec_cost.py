"""Engine stage: what speculative decoding costs on this machine and model, in tokens
produced (engine.spec_decode prices draft positions with it; docs/speculative.md).

- A token: what one more token run in a decode step costs. Each step that verified drafts is
  paired with the steps of as many requests without drafts just before it (``base``: their
  seconds, averaged over the last few): (its seconds - base) / its drafts is one sample,
  the price follows the last ~10 samples, in produced tokens (x tokens produced a second).
  Pairing with the steps of the moment keeps the price honest while drafts are rare (no
  position pays: only probe steps verify one): a baseline that drifts (caches warming,
  contexts growing) does not move it, as it moved a line fitted over a long window.
  A step slower than ``OUTLIER`` x its base counts as that: the process was descheduled (a
  shared machine), which is no price of a token.
- The proposals: seconds ~ alpha x requests + beta x drafts asked, a decayed least-squares
  fit over the steps that proposed. A suffix index's lookup costs per request (alpha), a
  draft model's forward per draft (beta; its catch-up over the tokens it missed, per request
  again). While every proposal asked as many drafts (the two not told apart) it all counts
  per request.

Owns / State: the bases by requests per step, the token price's average, the decayed sums of
the proposals' fit and of the decode steps' seconds and produced tokens.
"""
from __future__ import annotations

COST_DECAY = 0.98  # per step: tokens a second and the proposals' fit follow the last ~50 steps
BASE_DECAY = 0.8  # per step without drafts: its base follows the last ~5 such steps
PRICE_DECAY = 0.9  # per step with drafts: the price follows the last ~10 of them
COLLINEAR = 0.999  # squared correlation of requests and drafts asked above which they are not told apart
OUTLIER = 2.0  # x the base: the most a step counts for


class StepCost:
    def __init__(self) -> None:
        self.y = self.out = 0.0  # decode steps' seconds and produced tokens (decayed sums)
        self.base: dict[int, float] = {}  # requests in a step without drafts -> its seconds
        self.slope = self.samples = 0.0  # seconds per extra token (decayed mean) and its weight
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

    def add(self, tokens: int, seconds: float, produced: int, drafts: int = 0) -> None:
        """A decode step of ``tokens`` tokens, ``drafts`` of them drafts (verified)."""
        reqs = tokens - drafts
        base = self.base.get(reqs)
        if base is not None:
            seconds = min(seconds, OUTLIER * base)
        if drafts == 0:
            self.base[reqs] = seconds if base is None else BASE_DECAY * base + (1.0 - BASE_DECAY) * seconds
        elif base is not None:
            sample = max(seconds - base, 0.0) / drafts
            self.samples = PRICE_DECAY * self.samples + 1.0
            self.slope += (sample - self.slope) / self.samples
        d = COST_DECAY
        self.y = d * self.y + seconds
        self.out = d * self.out + produced

    def token_price(self) -> float:
        """The share of a produced token one more token run costs (seconds per extra token x
        tokens produced per second); 0 until a step with drafts was paired with a base."""
        return self.slope * self.out / self.y if self.y > 0.0 else 0.0
