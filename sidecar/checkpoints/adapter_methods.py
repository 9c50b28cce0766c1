"""Which tensors of a saved adapter belong to its PEFT method, and what "never trained" means.

The sidecar and ``deadweight inspect`` read adapters without torch or PEFT (the sidecar image
stays free of the training stack), so this module carries, per ``peft_type`` of
``adapter_config.json``, the tensor names the method's layer classes save (their
``adapter_layer_names`` plus the shared buffers a few methods save, as in PEFT 0.21) and the
method's untrained identity: the values at which the adapter changes nothing.

An identity is a list of alternatives per adapted module; an alternative holds when every tensor
it names is present in the module and exactly at its value. LoRA's ``B = 0`` is one alternative;
BOFT's rotation needs ``R = 0`` and ``s = 1`` together. Methods whose initialisation is random
(prompt and prefix tuning) have no identity: only a comparison with the initial adapter or an
earlier checkpoint tells whether they trained.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..model.inspection import Value

#: One alternative of an identity: (tensor name segment, value) pairs that must all hold.
Alternative = tuple[tuple[str, Value], ...]


@dataclass(frozen=True)
class Method:
    """One PEFT method as its saved files show it."""

    peft_type: str
    #: Name segments (dot-separated parts) of the tensors the method saves.
    segments: frozenset[str]
    #: Alternatives, any of which makes an adapted module compute the identity.
    identity: tuple[Alternative, ...] = ()

    @property
    def identity_segments(self) -> frozenset[str]:
        return frozenset(seg for alt in self.identity for seg, _ in alt)

    def describe_identity(self) -> str:
        """Readable identity, e.g. ``lora_B=0`` or ``boft_R=0 and boft_s=1``."""
        if not self.identity:
            return "none (random initialisation)"
        return " or ".join(" and ".join(f"{s}={v.value}" for s, v in alt)
                           for alt in self.identity)


def _zero(*segments: str) -> tuple[Alternative, ...]:
    return tuple(((s, Value.ZERO),) for s in segments)


#: Tensors any PEFT adapter may carry besides its method's own (LoRA's trainable_token_indices).
COMMON_SEGMENTS = frozenset({"trainable_tokens_delta"})

_PROMPT = frozenset({"prompt_embeddings"})

#: The methods of PEFT 0.21 by ``peft_type`` (LoRA first: an adapter file without a config
#: that matches several methods is taken for the first one).
METHODS: tuple[Method, ...] = (
    Method("LORA", frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B",
                              "lora_magnitude_vector"}),
           _zero("lora_B", "lora_embedding_B")),
    Method("ADALORA", frozenset({"lora_A", "lora_B", "lora_E", "lora_embedding_A",
                                 "lora_embedding_B"}), _zero("lora_E")),
    Method("IA3", frozenset({"ia3_l"}), ((("ia3_l", Value.ONE),),)),
    Method("LOHA", frozenset({"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1",
                              "hada_t2"}),
           _zero("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")),
    Method("LOKR", frozenset({"lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a",
                              "lokr_w2_b", "lokr_t2"}),
           _zero("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")),
    Method("VERA", frozenset({"vera_lambda_b", "vera_lambda_d", "vera_A", "vera_B"}),
           _zero("vera_lambda_b", "vera_lambda_d")),
    Method("OFT", frozenset({"oft_R", "oft_embedding_R"}), _zero("oft_R", "oft_embedding_R")),
    Method("BOFT", frozenset({"boft_R", "boft_s"}),
           ((("boft_R", Value.ZERO), ("boft_s", Value.ONE)),)),
    Method("PROMPT_TUNING", _PROMPT),
    Method("PREFIX_TUNING", _PROMPT),
    Method("P_TUNING", _PROMPT),
    Method("MULTITASK_PROMPT_TUNING", _PROMPT | {"prefix_task_cols", "prefix_task_rows"}),
    Method("ADAPTION_PROMPT", frozenset({"adaption_prompt", "adaption_gate"}),
           _zero("adaption_gate")),
    Method("TRAINABLE_TOKENS", frozenset({"trainable_tokens_delta"}),
           _zero("trainable_tokens_delta")),
    Method("HRA", frozenset({"hra_u"})),
    Method("POLY", frozenset({"poly_lora_A", "poly_lora_B", "poly_router"})),
    Method("LN_TUNING", frozenset({"ln_tuning_layers"})),
    Method("FOURIERFT", frozenset({"fourierft_spectrum"})),
    Method("VBLORA", frozenset({"vblora_logits_A", "vblora_logits_B", "vblora_vector_bank"})),
    Method("BONE", frozenset({"bone_block"})),
    Method("MISS", frozenset({"miss_block"})),
    Method("RANDLORA", frozenset({"randlora_lambda", "randlora_gamma", "randlora_A",
                                  "randlora_B"})),
    Method("C3A", frozenset({"c3a_kernel"})),
    Method("SHIRA", frozenset({"shira_weight"})),
    Method("ROAD", frozenset({"road_theta", "road_alpha"})),
    Method("WAVEFT", frozenset({"waveft_spectrum"})),
    Method("DELORA", frozenset({"delora_A", "delora_B", "delora_lambda"})),
    Method("GRALORA", frozenset({"gralora_A", "gralora_B", "gralora_A_general",
                                 "gralora_B_general"})),
    Method("OSF", frozenset({"osf_svd_params"})),
    Method("BEFT", frozenset({"beft_bias"})),
    Method("LILY", frozenset({"lily_A", "lily_B", "lily_router"})),
    Method("FROD", frozenset({"frod_lambda_l", "frod_lambda_s_values"})),
    Method("PVERA", frozenset({"pvera_lambda_b", "pvera_lambda_d", "pvera_A", "pvera_B"})),
    Method("ADAMSS", frozenset({"adamss_A", "adamss_B"})),
    Method("UNILORA", frozenset({"unilora_theta_d"})),
    Method("TINYLORA", frozenset({"tinylora_v", "tinylora_A", "tinylora_B", "tinylora_P"})),
    Method("DEFT", frozenset({"deft_P", "deft_R"})),
    Method("GLORA", frozenset({"glora_A", "glora_B", "glora_C", "glora_D", "glora_E"})),
    Method("HIRA", frozenset({"hira_A", "hira_B", "hira_embedding_A", "hira_embedding_B"})),
    Method("PSOFT", frozenset({"psoft_R"})),
    Method("PEANUT", frozenset({"peanut_A", "peanut_B", "peanut_encoders", "peanut_decoders"})),
    Method("SUPERTUNING", frozenset({"supertuning_values", "supertuning_lora_A",
                                     "supertuning_lora_B"})),
    Method("SHADOW", frozenset({"shadow_down", "shadow_up", "shadow_update_transform",
                                "shadow_update_gate"})),
)

BY_TYPE: dict[str, Method] = {m.peft_type: m for m in METHODS}

#: An adapter of a method this table does not know: every known segment counts as adapter,
#: and nothing is judged untrained.
UNKNOWN = Method("UNKNOWN", frozenset().union(*(m.segments for m in METHODS)))

CONFIG_FILE = "adapter_config.json"


def _read_small_regular(path: Path, limit: int = 1024 * 1024) -> bytes:
    """A client-written file's bytes, only if it is a regular file of at most limit bytes:
    a FIFO or symlink swapped in never blocks or redirects the sidecar's read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            raise OSError(f"{path}: not a regular file of at most {limit} bytes")
        return os.read(fd, limit)
    finally:
        os.close(fd)


def configured_type(folder: Path) -> str:
    """``peft_type`` from the folder's adapter_config.json, "" when absent or unreadable."""
    try:
        data = json.loads(_read_small_regular(folder / CONFIG_FILE))
    except (OSError, ValueError, RecursionError):
        return ""
    value = data.get("peft_type") if isinstance(data, dict) else None
    return str(value).split(".")[-1].upper() if value else ""


def segment_of(name: str, method: Method) -> str | None:
    """The part of a saved tensor name that marks it as the method's tensor, if any."""
    for part in name.split("."):
        if part in method.segments or part in COMMON_SEGMENTS:
            return part
    return None


def module_of(name: str, segment: str) -> str:
    """The adapted module a tensor belongs to: its name up to the method's segment."""
    parts = name.split(".")
    return ".".join(parts[: parts.index(segment)])


def infer(names: Iterable[str]) -> Method:
    """The method a bare adapter file was saved by, from its tensor names."""
    parts = {p for n in names for p in n.split(".")}
    if "lora_E" in parts:
        return BY_TYPE["ADALORA"]
    for method in METHODS:
        if parts & method.segments:
            return method
    return UNKNOWN


def resolve(peft_type: str, names: Iterable[str]) -> Method:
    """The method named by the config, else the one the tensor names show."""
    return BY_TYPE.get(peft_type.upper()) or infer(names)
