"""Which provider a channel between two ranks uses. The bootstrap only walks the
registered providers: each one's ``can_connect(me, peer) -> (preference, why)``
(preference 0: cannot) judges the two ranks' descriptors, and the highest preference
wins (with the built-in ones: shm inside a host, verbs across hosts on a common fabric,
tcp otherwise). ``RDMAMW_PROVIDER`` forces one; then every pair of ranks must be able
to use it."""

from __future__ import annotations

from rdmamw.errors import ConfigError, ProtocolError, ProviderUnavailable
from rdmamw.providers import provider, providers, schemes


def choose(me: dict, peer: dict) -> tuple[str, str]:
    """(provider, why) for a channel between the ranks of descriptors ``me`` and
    ``peer``; the same answer on both sides. The reason also says why each better
    provider could not."""
    ranked = providers()
    answers = [(p.scheme, *p.can_connect(me, peer)) for p in ranked]
    best = max(answers, key=lambda a: a[1])
    if best[1] <= 0:
        raise ProviderUnavailable("no provider connects rank {} and rank {}: {}".format(
            me.get("rank"), peer.get("rank"), "; ".join(f"{s}: {w}" for s, _, w in answers)))
    why = best[2]
    passed = [f"{s}: {w}" for (s, p, w), prov in zip(answers, ranked, strict=True)
              if p <= 0 and prov.preference > best[1]]
    if passed:
        why += "; not " + "; not ".join(passed)
    return best[0], why


def check_forced(peers: dict[int, dict]) -> str:
    """The provider every rank's ``RDMAMW_PROVIDER`` forces ("" for none), after
    checking that all ranks agree and that every pair can use it; the same error on
    every rank (all judge the same table), naming the ranks and the reason."""
    said = {r: d.get("forced", "") for r, d in sorted(peers.items())}
    for r, v in said.items():
        if not isinstance(v, str):
            raise ProtocolError(f"rank {r}'s descriptor from the store is malformed: "
                                f"'forced' is {v!r}, not a string")
    if len(set(said.values())) > 1:
        raise ConfigError("ranks disagree on RDMAMW_PROVIDER: " + ", ".join(
            f"rank {r}: {v or '(unset)'}" for r, v in said.items()))
    forced = said[min(said)]
    if not forced:
        return ""
    if forced not in schemes():
        raise ConfigError(f"RDMAMW_PROVIDER={forced!r} is not a provider; use one of "
                          f"{', '.join(schemes())}")
    mod = provider(forced)
    ranks = sorted(peers)
    for i, a in enumerate(ranks):
        for b in ranks[i + 1:]:
            pref, why = mod.can_connect(peers[a], peers[b])
            if pref <= 0:
                raise ProviderUnavailable(f"RDMAMW_PROVIDER={forced}, but rank {a} and rank "
                                          f"{b} cannot connect over {forced}: {why}; unset "
                                          f"RDMAMW_PROVIDER to let the providers choose")
    return forced
