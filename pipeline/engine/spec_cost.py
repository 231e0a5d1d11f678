"""Engine stage: what speculative decoding costs on this machine and model, in tokens
produced (engine.spec_decode prices draft positions with it; docs/speculative.md).

Two costs, each split into a part per request and a part per draft (``PerRequestAndDraft``:
seconds ~ per_request x requests + per_draft x drafts, a decayed least-squares fit):
- verifying: each step that verified drafts is paired with the steps of as many requests
  without drafts just before it (``base``: their seconds, averaged over the last few); its
  excess over them is fitted over the requests that verified and their drafts. A verify step
  costs something per request whatever its drafts (a multi-token forward instead of the
  one-token decode path) and something per draft. Pairing with the steps of the moment keeps
  the price honest while drafts are rare (only probe steps verify one): a baseline that
  drifts (caches warming, contexts growing) does not move it. A step slower than
  ``OUTLIER`` x its base counts as that: the process was descheduled (a shared machine);
- proposing: the worker's proposal seconds over the requests it proposed for and the drafts
  asked. A suffix index's lookup costs per request, a draft model's forward per draft (its
  catch-up over the tokens it missed per request again).
While every sample had as many drafts per request (the two not told apart) it all counts
per request: the optimistic reading for deeper drafts, which the keep shares then test.
Prices are in produced tokens: seconds x tokens produced a second of decode steps.

Owns / State: the bases by requests per step, the two fits, decode steps' decayed seconds
and produced tokens.
"""
from __future__ import annotations

COST_DECAY = 0.98  # per step: tokens a second and the proposals' fit follow the last ~50 steps
BASE_DECAY = 0.8  # per step without drafts: its base follows the last ~5 such steps
VERIFY_DECAY = 0.9  # per step with drafts: the verify fit follows the last ~10 of them
COLLINEAR = 0.999  # squared correlation of requests and drafts above which they are not told apart
OUTLIER = 2.0  # x the base: the most a step counts for


class PerRequestAndDraft:
    """seconds ~ a x requests + b x drafts (a, b >= 0), decayed least squares."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.n = self.k = self.nn = self.nd = self.dd = self.ns = self.ds = self.s = 0.0

    def add(self, seconds: float, requests: int, drafts: int) -> None:
        d, n, k = self.decay, float(requests), float(drafts)
        self.n = d * self.n + n
        self.k = d * self.k + k
        self.s = d * self.s + seconds
        self.nn = d * self.nn + n * n
        self.nd = d * self.nd + n * k
        self.dd = d * self.dd + k * k
        self.ns = d * self.ns + n * seconds
        self.ds = d * self.ds + k * seconds

    def fit(self) -> tuple[float, float]:
        """(a, b) in seconds; (0, 0) before any sample."""
        if self.nn <= 0.0:
            return 0.0, 0.0
        det = self.nn * self.dd - self.nd * self.nd
        if det > (1.0 - COLLINEAR) * self.nn * self.dd:
            a = (self.dd * self.ns - self.nd * self.ds) / det
            b = (self.nn * self.ds - self.nd * self.ns) / det
            if a >= 0.0 and b >= 0.0:
                return a, b
            if a < 0.0:
                return 0.0, max(self.ds / self.dd, 0.0)
        return max(self.ns / self.nn, 0.0), 0.0

    def mean(self) -> float:
        """Seconds per request on average."""
        return self.s / self.n if self.n else 0.0

    def mean_per_draft(self) -> float:
        """Seconds per draft on average, the part per request included."""
        return self.s / self.k if self.k else 0.0


class StepCost:
    def __init__(self) -> None:
        self.y = self.out = 0.0  # decode steps' seconds and produced tokens (decayed sums)
        self.base: dict[int, float] = {}  # requests in a step without drafts -> its seconds
        self.verify = PerRequestAndDraft(VERIFY_DECAY)
        self.proposals = PerRequestAndDraft(COST_DECAY)

    def add_proposals(self, seconds: float, requests: int, drafts: int = 0) -> None:
        """A step's proposals: ``seconds`` for ``requests`` requests, ``drafts`` drafts asked
        in all (0: unknown, one per request)."""
        self.proposals.add(seconds, requests, drafts or requests)

    def add(self, tokens: int, seconds: float, produced: int, drafts: int = 0, verifying: int = 0) -> None:
        """A decode step of ``tokens`` tokens, ``drafts`` of them drafts of ``verifying``
        requests (one each if not given)."""
        reqs = tokens - drafts
        base = self.base.get(reqs)
        if base is not None:
            seconds = min(seconds, OUTLIER * base)
        if drafts == 0:
            self.base[reqs] = seconds if base is None else BASE_DECAY * base + (1.0 - BASE_DECAY) * seconds
        elif base is not None:
            self.verify.add(max(seconds - base, 0.0), verifying or min(reqs, drafts), drafts)
        d = COST_DECAY
        self.y = d * self.y + seconds
        self.out = d * self.out + produced

    def _tok(self) -> float:
        return self.out / self.y if self.y > 0.0 else 0.0

    def prices(self) -> tuple[float, float]:
        """(per request, per draft) of drafting: verifying and proposing, in tokens produced."""
        tok = self._tok()
        va, vb = self.verify.fit()
        pa, pb = self.proposals.fit()
        return (va + pa) * tok, (vb + pb) * tok

    def token_price(self) -> float:
        """What a draft verified has cost on average, its request's part included (stats)."""
        return self.verify.mean_per_draft() * self._tok()

    def proposal_price(self) -> float:
        """What proposing for one request has cost on average (stats)."""
        return self.proposals.mean() * self._tok()
