"""Which agent may report which rank's exit: a report is believed only from the rank's own supervisor.

Theory of operation
-------------------
An agent's ``rank_exited`` ends a rank at once (faster than any heartbeat), so a forged
one would kill a live rank. Anyone who knows the session (with CURVE: any allowlisted
host) can send an agent hello naming any ranks. So a *claim* is not enough; the rank
itself vouches for its supervisor:

1. The agent draws a random token at start, puts it in every rank's environment
   (``FLODL_AGENT_TOKEN``) and sends it in its ``hello`` and in every ``rank_exited``.
2. A rank's hello carries the token it was given (``RankHello.agent_token``). When the
   hello is admitted on its route, the book notes the token's digest for that rank.
3. A report about rank ``r`` is believed only when all of these hold:
   - it comes on the route of an agent hello that claimed ``r`` (routes stack: an agent is
     its own DEALER, one hop), with CURVE from the same client key as that hello;
   - it carries that agent's token;
   - ``r``'s own admitted hello carried the same token (the rank vouched for it).
   Otherwise it is refused by name (``route_mismatch``) and ``r`` lives on until its own
   frames stop (liveness) or its own ``RankExiting`` arrives. One exception: a rank that
   holds no slot and never vouched for anyone (a script that failed at import) is
   believed from the only agent that claims it: it ends no live rank, and before the
   world forms it is what says the slot will never come (so a peer holding the session,
   and with CURVE an allowed key, that claims a slot first can end a forming run early --
   as it could by refusing to train once admitted).
4. An agent hello claiming a rank that has already vouched for *another* agent, while
   the run still holds that rank, is refused for that rank (logged); claims nobody vouched
   for yet may coexist (first-come claims would let an early forger lock the real agent
   out). A rank that is gone (dead, left) is claimable again: a new host takes the slots
   of one that left. And once a rank's own hello vouches for an agent that asked for it,
   it is that agent's (an agent restarted before its old ranks were declared dead gets
   them back as they say hello). A hello naming a rank out of range, a rank twice, or a
   host name over 255 characters is refused whole.

Only digests (sha256) of tokens are kept and journaled (``_agent`` and ``_rank_agent``
records, mode 0600 journal), so a restarted coordinator still believes the same agent
(``recovery``) and nothing in the journal or ``/status`` is a usable token.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from .recovery import agent_record

__all__ = ["AgentBook", "AgentClaim", "token_digest", "MAX_TOKEN_BYTES"]

MAX_TOKEN_BYTES = 64
MAX_AGENT_HOST_CHARS = 255


def token_digest(token: bytes) -> str:
    """Hex sha256 of a token; '' for no token (which nothing can match)."""
    return hashlib.sha256(token).hexdigest() if token else ""


@dataclass
class AgentClaim:
    ranks: set[int] = field(default_factory=set)
    digest: str = ""  # token_digest of the agent's token
    key: str = ""  # CURVE client key (User-Id) its hello came with; "" without CURVE
    host: str = ""
    asked: set[int] = field(default_factory=set)  # the ranks its hello named (``ranks`` less those taken)


class AgentBook:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.claims: dict[tuple, AgentClaim] = {}  # agent route -> its claim
        self.vouched: dict[int, str] = {}  # rank -> digest of the token its own hello carried

    # -- journal ----------------------------------------------------------------------

    def restore(self, record: dict) -> None:
        """Apply a journaled ``_agent`` / ``_rank_agent`` record (``recovery``)."""
        if record.get("type") == "_agent":
            route = tuple(bytes.fromhex(h) for h in record["route"])
            ranks = set(record["ranks"])
            asked = set(record.get("asked", ranks))
            self.claims[route] = AgentClaim(ranks, record.get("token", ""), record.get("key", ""),
                                            record.get("host", ""), asked)  # fmt: skip
        elif record.get("type") == "_rank_agent":
            self._vouch(int(record["rank"]), record["token"])

    @property
    def agent_ranks(self) -> dict[tuple, set[int]]:
        return {route: set(c.ranks) for route, c in self.claims.items()}

    # -- events -----------------------------------------------------------------------

    def hello(self, route: tuple, hello, key: str, held=None) -> tuple[dict | None, str]:
        """An agent's hello: (its journal record, or None if refused whole; a note to log).
        ``held``: the ranks the run holds now (None: every rank that vouched)."""
        ranks = list(hello.ranks)
        if len(hello.host) > MAX_AGENT_HOST_CHARS:
            return None, f"agent hello refused: host name of {len(hello.host)} characters exceeds {MAX_AGENT_HOST_CHARS}"
        if len(hello.token) > MAX_TOKEN_BYTES:
            return None, f"agent hello refused: token of {len(hello.token)} bytes exceeds {MAX_TOKEN_BYTES}"
        if len(set(ranks)) != len(ranks) or any(not 0 <= r < self.world_size for r in ranks):
            return None, f"agent hello refused: ranks {ranks[:16]} are not distinct ranks in [0, {self.world_size})"
        digest = token_digest(bytes(hello.token))
        taken = sorted(r for r in ranks if self.vouched.get(r) and self.vouched[r] != digest
                       and (held is None or r in held))  # fmt: skip
        note = ""
        if taken:
            note = f"agent on {hello.host!r} claims rank(s) {taken} that vouched for another agent: not theirs"
        if not digest:
            note = (note + "; " if note else "") + f"agent on {hello.host!r} sent no token: its exit reports are not believed"
        claim = AgentClaim({r for r in ranks if r not in taken}, digest, key, hello.host, set(ranks))
        self.claims[route] = claim
        record = agent_record(route, hello, ranks=claim.ranks, token=digest, key=key)
        if taken:
            record["asked"] = sorted(ranks)
        return record, note

    def rank_admitted(self, rank: int, token: bytes) -> dict | None:
        """A rank's admitted hello: remember which agent it vouches for (its journal record)."""
        digest = token_digest(bytes(token[:MAX_TOKEN_BYTES]))
        if not digest or self.vouched.get(rank) == digest:
            return None
        self._vouch(rank, digest)
        return {"type": "_rank_agent", "rank": rank, "token": digest}

    def _vouch(self, rank: int, digest: str) -> None:
        """The rank's own hello names the agent of ``digest``: an agent that asked for it has it."""
        self.vouched[rank] = digest
        for claim in self.claims.values():
            if claim.digest == digest and rank in claim.asked:
                claim.ranks.add(rank)

    def agent_refusal(self, route: tuple, token: bytes, key: str, what: str) -> str:
        """Why a report (``what``) on ``route`` is not this agent's, or '' (its hello, key, token)."""
        claim = self.claims.get(route)
        if claim is None:
            return f"{what} from a route that sent no agent hello"
        if claim.key != key:
            return f"{what} from another CURVE key than the agent's hello"
        if not claim.digest or token_digest(bytes(token)) != claim.digest:
            return f"{what} without the agent's token"
        return ""

    def report_refusal(self, route: tuple, rank: int, token: bytes, key: str, admitted: bool = True) -> str:
        """Why an exit report about ``rank`` on ``route`` is not believed, or ''.

        ``admitted`` False: the rank holds no slot now. A rank nobody vouched for yet (a
        script that failed at import never says hello) is then believed from the one
        agent that claims it -- before the world forms that report is what tells the
        coordinator the slot will never come (``flodl.core._formation``); a second claim
        of it (a forger's or the real agent's) makes neither believed."""
        claim = self.claims.get(route)
        why = self.agent_refusal(route, token, key, f"exit report for rank {rank}")
        if why or claim is None:
            return why or f"exit report for rank {rank} from a route that sent no agent hello"
        if rank not in claim.ranks:
            return f"agent on {claim.host!r} reports rank {rank} it did not announce"
        vouched = self.vouched.get(rank)
        if vouched == claim.digest:
            return ""
        named = f"rank {rank} did not name the agent on {claim.host!r} as its launcher in its own hello"
        if vouched or admitted:
            return named
        if any(rank in c.ranks for r, c in self.claims.items() if r != route):
            return f"{named}, and another agent claims it too"
        return ""

    def before_hello(self, route: tuple, rank: int, token: bytes, key: str) -> bool:
        """Whether a refused report is the agent's own about a rank that never said hello
        (it died starting, or its host left first): nothing to forget, and no forgery."""
        claim = self.claims.get(route)
        return (claim is not None and rank in claim.ranks and claim.key == key and bool(claim.digest)
                and token_digest(bytes(token)) == claim.digest and rank not in self.vouched)  # fmt: skip
