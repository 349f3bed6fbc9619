"""What a vLLM hook is (kvpush.vllm.hooks holds them all): what it reaches for, the
vLLM releases it was verified on, and whether the installed vLLM is one of them."""

from __future__ import annotations

from dataclasses import dataclass, field

# What "verified" means for each release a hook names: read here is its source, read
# from its wheel by kvpush.vllm.contract; run is the e2e suite on vLLM's CPU build.
VERIFIED_ON = {"0.32.0": "run", "0.33.0": "read", "0.34.0": "read"}


@dataclass(frozen=True)
class Target:
    """One thing a hook reaches for, as kvpush.vllm.contract finds it in a vLLM's
    source without importing it. By `kind`:
    "has": each of `names` defined, assigned or used in module `path` (inside its
        class `owner`, when named);
    "fields": each of `names` a field of class `owner`;
    "near": names[1] written in the lines before the call names[0](...) in `path`;
    "order": in method names[0] of `owner`, names[1] comes before names[2]."""

    path: str
    owner: str | None
    names: tuple[str, ...]
    kind: str = "has"


@dataclass(frozen=True)
class Hook:
    name: str
    reaches: str  # the private thing it touches
    verified: tuple[str, ...]  # vLLM releases it was read or run against (VERIFIED_ON)
    risky: bool  # it changes vLLM's state: off on a vLLM it was not verified on
    cost: str  # what a deployment pays where it is absent
    # What it reaches for, by a label the contract records name (kvpush.vllm.contract).
    targets: dict[str, Target] = field(default_factory=dict)


def vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:
        return "unknown"


def matched(hook: Hook, version: str | None = None) -> str | None:
    """The release among the hook's verified ones that this vLLM is (a local label
    such as +cpu aside), or None: parsed, so "0.3" and "0.330" match nothing."""
    from packaging.version import InvalidVersion, Version

    try:
        public = Version(Version(version or vllm_version()).public)  # 0.32.0+cpu: 0.32.0
    except InvalidVersion:
        return None
    return next((v for v in hook.verified if Version(v) == public), None)


def verified(hook: Hook, version: str | None = None) -> bool:
    return matched(hook, version) is not None
