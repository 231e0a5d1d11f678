"""Router, disaggregated pools: one client request split over a decode and a prefill instance.

Owns (per request, ``PDState``): which phase it is in (waiting for the decode instance's
KV reservation, prefill asked, prefill done, fell back), whether the client asked to abort,
and what of the first token the client already has, so that the decode instance's copy of it
is not sent twice. Also builds the two upstream requests (``decode_request``,
``prefill_request``). Pure: no socket, no clock; ``server`` does the sending and the aborts.

The flow (docs/router.md, "Disaggregated pools"): the decode instance D gets the request
with ``kv_transfer`` role "decode" and answers a delta carrying its ``KVReservation``; the
prefill instance P then gets it with the client's own sampling params and the reservation's
blocks (P's engine ends it after its first token); P's first token goes to a streaming client
at once; D's deltas follow with that token stripped from the front; D's final is the client's
final. P's final is only forwarded when it failed.

Fallback (P with ``--pd-fallback local``): P could not ship the KV and decodes the request
itself. The router learns it from P sending tokens after its first, or from D's final with
error code "kv_fallback" (``fell_back``): from then on P's deltas go to the client as they
come, D's answers are dropped, and P's final (kept if it came first) is the client's final.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
from msgspec import UNSET

from pipeline.frontend import protocol as P
from pipeline.messages import RequestDelta, RequestResult
from pipeline.messages.kv import KVReservation, KVTransferParams

# Suffixes of the router's ids on the instances: "r12.d" on the decode instance, "r12.p" on
# the prefill one; a split request run again (``table.MAX_TRIES``) has its try in them,
# "r12.2.d" and "r12.2.p", so the legs of the try before, aborted but maybe still running
# there, never clash with the new ones. A request that runs whole on one instance keeps "r12".
DECODE = ".d"
PREFILL = ".p"


def runs_plain(msg: P.Generate) -> bool:
    """Whether a request runs whole on one decode instance (a full engine) rather than split:
    n > 1 and prompt_logprobs need the prompt computed where the request runs; with
    max_tokens == 1 the prefill instance's one token is the whole answer anyway; and with
    logprobs the decode instance has none for the first token (it did not sample it), so
    its final would lack them; an embedding (task "embed") is a prefill with no decode."""
    return (msg.task == "embed" or (msg.n is not UNSET and msg.n > 1)
            or (msg.prompt_logprobs is not UNSET and msg.prompt_logprobs is not None)
            or (msg.logprobs is not UNSET and msg.logprobs is not None)
            or (msg.max_tokens is not UNSET and msg.max_tokens == 1))


def decode_request(msg: P.Generate, uid: str) -> P.Generate:
    """What the decode instance gets: the client's request, streamed (the reservation comes
    back in a delta), reserving KV for the prompt instead of computing it."""
    return msgspec.structs.replace(msg, id=uid, stream=True,
                                   kv_transfer=KVTransferParams(role="decode"))


def prefill_request(msg: P.Generate, uid: str, kv: KVReservation) -> P.Generate:
    """What the prefill instance gets: the client's request, streamed, its KV shipped into
    ``kv``. Its engine ends it after the first token (unless it falls back and decodes it:
    hence the client's own max_tokens, min_tokens and stops)."""
    return msgspec.structs.replace(
        msg, id=uid, stream=True,
        kv_transfer=KVTransferParams(role="prefill", peer=kv.endpoint,
                                     remote_req_id=kv.engine_req_id,
                                     remote_block_ids=list(kv.block_ids),
                                     remote_num_cached_tokens=kv.num_cached_tokens,
        deadline_s=kv.timeout_s))


@dataclass(slots=True)
class PDState:
    """One split request. ``stream`` is the client's flag; ``show_text`` is False when the
    request has stop strings: the prefill instance, done after one token, flushes text the
    decode instance may still hold back (or drop, on a match), so only its ids go ahead
    (its text is kept in ``held_text``, the client's should P's stream become the answer)."""
    stream: bool
    show_text: bool
    reserved: bool = False  # D's reservation came: P was (or is being) asked
    prefill_done: bool = False  # P's final came
    decoding: bool = False  # D produced a token: the KV arrived, P's loss no longer matters
    aborting: bool = False  # the client (or the drain) aborted: the final is D's
    first_sent: bool = False  # the client has the first token (from P, or from D if first)
    strip_ids: list[int] = field(default_factory=list)  # of P's first token, still to drop from D's
    strip_text: str = ""
    prefill_tokens: int = 0  # P's tokens so far: more than one means it decodes (fell back)
    fell_back: bool = False  # P decodes the request itself: its answers are the client's
    held_text: str = ""  # P's first delta's text, not shown (stop strings) while D may answer
    prefill_final: RequestResult | None = None  # P's final, kept until D says who answers
    tag: str = ""  # "" on the first try, ".2" on the second: in the legs' ids

    @classmethod
    def of(cls, msg: P.Generate, tries: int = 0) -> PDState:
        """A fresh state for the request's try after ``tries`` tries."""
        stops = msg.stop if msg.stop is not UNSET else None
        return cls(stream=msg.stream, show_text=not stops, tag=f".{tries + 1}" if tries else "")

    def leg(self, rid: str, suffix: str) -> str:
        """The id of this try's leg (``DECODE`` or ``PREFILL``) on its instance."""
        return f"{rid}{self.tag}{suffix}"

    def on_decode_delta(self, d: RequestDelta) -> tuple[KVReservation | None, RequestDelta | None]:
        """A delta of D: (the reservation to hand to a prefill instance, the delta to forward
        to the client); either may be None."""
        if d.kv is not None:  # never forwarded
            if self.reserved or self.aborting:
                return None, None
            self.reserved = True
            return d.kv, None
        if not self.stream:
            return None, None
        if d.index == 0:
            stripped = self._strip(d)
            if stripped is None:
                return None, None
            d = stripped
            self.first_sent = self.first_sent or bool(d.token_ids)
        return None, d

    def on_prefill_delta(self, d: RequestDelta) -> RequestDelta | None:
        """A delta of P (its first token, or any once it fell back): forwarded at once unless
        D's first token came first. More than one token from P: it fell back (check
        ``fell_back`` after the call)."""
        if d.index != 0:
            return None
        self.prefill_tokens += len(d.token_ids)
        if self.prefill_tokens > 1 and not self.decoding:
            self.fell_back = True
        if self.fell_back:
            if not self.stream:
                return None
            text, self.held_text = self.held_text + d.text, ""
            if not d.token_ids and not text:
                return None
            self.first_sent = True
            return d if text is d.text else msgspec.structs.replace(d, text=text)
        if not self.stream or self.first_sent or not d.token_ids:
            return None
        self.first_sent = True
        text = d.text if self.show_text else ""
        self.held_text = "" if self.show_text else d.text
        self.strip_ids, self.strip_text = list(d.token_ids), text
        return msgspec.structs.replace(d, text=text)

    def on_prefill_final(self, res: RequestResult) -> RequestResult | None:
        """P's final: the client's final when P failed (D is then aborted) or it fell back,
        else None (kept in ``prefill_final``: the client's final should D say it fell back)."""
        self.prefill_done = True
        if self.fell_back:
            return res
        if res.error is None or self.aborting:
            self.prefill_final = res
            return None
        return res

    def on_decode_final(self, res: RequestResult) -> bool:
        """D's final: True when it is the client's (else P's answer is: it fell back)."""
        if not self.fell_back and res.error is not None and res.error.code == "kv_fallback":
            self.fell_back = True
        return not self.fell_back

    def _strip(self, d: RequestDelta) -> RequestDelta | None:
        """D's delta minus what the client already has from P; None if nothing is left."""
        ids, text, logprobs = d.token_ids, d.text, d.logprobs
        if self.strip_ids:
            k = 0
            while k < min(len(ids), len(self.strip_ids)) and ids[k] == self.strip_ids[k]:
                k += 1
            if k < len(ids) and k < len(self.strip_ids):  # they disagree: stop stripping
                self.strip_ids, self.strip_text = [], ""
            else:
                self.strip_ids = self.strip_ids[k:]
            if logprobs is not None and len(logprobs) == len(ids):
                logprobs = logprobs[k:]
            ids = ids[k:]
        if self.strip_text:
            if text.startswith(self.strip_text):
                text, self.strip_text = text[len(self.strip_text):], ""
            elif self.strip_text.startswith(text):  # D still holds part of it back
                self.strip_text, text = self.strip_text[len(text):], ""
            else:  # the texts disagree: stop stripping, the client gets D's as is
                self.strip_text = ""
        if not ids and not text:
            return None
        if ids is d.token_ids and text is d.text:
            return d
        return msgspec.structs.replace(d, token_ids=ids, text=text, logprobs=logprobs)
